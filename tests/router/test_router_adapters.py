"""LoRA adapter affinity: a request for an adapter goes to a replica serving it, preferring one where it is active.

The policy half on hand-set replica state; the whole path over real HTTP with real plimsoll
engines (LoRA on, random PEFT adapters loaded through ``/v1/load_lora_adapter``): the router
reads what the runtime says, its ``/v1/models`` parents and ``plimsoll_lora_requests_info``.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterator

import httpx
import openai
import pytest
from router_harness import eventually, run_router

from plimsoll.prometheus import parse
from plimsoll.router.backends import ReplicaSet
from plimsoll.router.config import RouterConfig
from plimsoll.router.policy import RequestFeatures, Router
from plimsoll.router.proxy import REPLICA_HEADER
from plimsoll.router.scrape import active_adapters, served_adapters
from plimsoll.runtime.testing import ThreadedServer, write_random_lora, write_tiny_model

URLS = ("http://r0", "http://r1", "http://r2")


def router_over(policy: str) -> tuple[Router, ReplicaSet]:
    replica_set = ReplicaSet.static(URLS)
    for r in replica_set.replicas.values():
        r.reachable = True
    return Router(RouterConfig(backends=URLS, policy=policy), replica_set), replica_set


def ask(model: str, prompt: str = "hello") -> RequestFeatures:
    return RequestFeatures.from_body({"model": model, "prompt": prompt}, prefix_chars=64)


def test_adapter_requests_go_where_the_adapter_is_served_and_active_first() -> None:
    router, replicas = router_over("least-in-flight")
    r0, r1, r2 = (replicas.replicas[u] for u in URLS)
    r0.adapters, r1.adapters, r2.adapters = frozenset({"sql"}), frozenset({"sql", "fr"}), frozenset()
    r1.active_adapters = frozenset({"sql"})
    r0.inflight, r1.inflight = 0, 1  # r0 is lighter, but sql is active on r1 (no swap) within bounds
    decision = router.choose(ask("sql"))
    assert (decision.replica.url, decision.reason) == ("http://r1", "adapter_active")
    r1.inflight = 5  # now r1 would carry far above the mean: fall back by load among the servers
    decision = router.choose(ask("sql"))
    assert (decision.replica.url, decision.reason) == ("http://r0", "adapter_loaded")
    assert router.choose(ask("fr")).replica.url == "http://r1"  # only r1 has it, whatever its load
    # The base model (no replica lists it as an adapter) and unknown names: the plain policy.
    r0.inflight = 2
    base = router.choose(ask("base"))
    assert (base.replica.url, base.reason) == ("http://r2", "least_inflight")
    assert router.choose(ask("unknown")).replica.url == "http://r2"


def test_the_adapter_is_part_of_the_prefix_affinity_key() -> None:
    assert ask("a", "same prompt").prefix_key != ask("b", "same prompt").prefix_key
    assert ask("a", "same prompt").prefix_key == ask("a", "same prompt").prefix_key
    router, _ = router_over("prefix-affinity")
    homes = {router.choose(ask(f"adapter-{i}", "one shared system prompt")).replica.url for i in range(12)}
    assert len(homes) > 1, "one prompt under twelve adapters must not hash to a single replica"


def test_scrape_parsers_read_either_gauge_name_and_the_newest_label_set() -> None:
    text = (
        '# TYPE vllm:lora_requests_info gauge\n'
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="old",waiting_lora_adapters=""} 100.0\n'
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,b",waiting_lora_adapters="c"} 200.0\n'
    )
    assert active_adapters(parse(text)) == frozenset({"a", "b", "c"})
    plimsoll = 'plimsoll_lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 5\n'
    assert active_adapters(parse(plimsoll)) == frozenset()
    assert active_adapters(parse("plimsoll_num_requests_running 0\n")) is None
    cards = {"data": [{"id": "base", "parent": None}, {"id": "a", "parent": "base"}]}
    assert served_adapters(cards) == frozenset({"a"})


@pytest.fixture(scope="module")
def lora_replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ThreadedServer]]:
    """Three real engines on one tiny random Llama with LoRA on: sql loaded on the first, fr on the
    second (through /v1/load_lora_adapter, as the operator loads them), none on the third."""
    root = tmp_path_factory.mktemp("router-lora")
    model = write_tiny_model(root / "tiny")
    paths = {
        "sql": write_random_lora(model, root / "sql", r=8, target_modules=("q_proj", "v_proj"), seed=1),
        "fr": write_random_lora(model, root / "fr", r=4, target_modules=("o_proj",), seed=2),
    }
    servers: list[ThreadedServer] = []
    try:
        for _ in range(3):
            servers.append(
                ThreadedServer(model, enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=8,
                               server={"allow_runtime_lora_updating": True,
                                       "lora_allowed_roots": (str(root),)}).start()
            )
        for server, name in zip(servers, paths, strict=False):
            answer = httpx.post(f"{server.url}/v1/load_lora_adapter",
                                json={"lora_name": name, "lora_path": str(paths[name])}, timeout=60)  # fmt: skip
            assert answer.status_code == 200, answer.text
        yield servers
    finally:
        for server in servers:
            server.stop()


@pytest.mark.slow
async def test_router_sends_each_adapter_to_the_real_replicas_holding_it(lora_replicas: list[ThreadedServer]) -> None:
    """The runtime's /v1/models parents and plimsoll_lora_requests_info, read by the router's scrape."""
    urls = tuple(r.url for r in lora_replicas)
    base = lora_replicas[0].ctx.settings.served_model_name
    async with run_router(backends=urls, policy="prefix-affinity", scrape_interval_s=0.1) as router:
        await eventually(
            lambda: all(r.adapters is not None for r in router.state.replica_set.replicas.values()),
            "the first scrape of every replica's adapters",
        )
        held = {u: router.state.replica_set.replicas[u].adapters for u in urls}
        assert held == {urls[0]: {"sql"}, urls[1]: {"fr"}, urls[2]: frozenset()}, held
        api = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=60)
        served: dict[str, collections.Counter[str]] = {m: collections.Counter() for m in ("sql", "fr", base)}

        async def one(model: str, i: int) -> None:
            raw = await api.completions.with_raw_response.create(model=model, prompt=f"p{i} x", max_tokens=3)
            assert raw.parse().model == model
            served[model][raw.headers[REPLICA_HEADER]] += 1

        await asyncio.gather(*(one(m, i) for i in range(6) for m in served))
        await api.close()
        assert served["sql"] == {urls[0]: 6}, served
        assert served["fr"] == {urls[1]: 6}, served
        assert sum(served[base].values()) == 6 and len(served[base]) > 1, "the base model spreads"
        adapter_decisions = sum(
            router.metric("plimsoll_router_routing_decisions_total", policy="prefix_affinity", reason=reason, lane="all")
            for reason in ("adapter_active", "adapter_loaded")
        )
        assert adapter_decisions == 12
