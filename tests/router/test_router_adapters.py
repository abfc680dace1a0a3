"""LoRA adapter affinity: a request for an adapter goes to a replica serving it, preferring one where it is active.

The policy half on hand-set replica state; the whole path over real HTTP with bench-simulator
replicas that speak vLLM's adapter API (``/v1/models`` parents, ``lora_requests_info``).
"""

from __future__ import annotations

import asyncio
import collections
import json
from pathlib import Path

import openai
from router_harness import eventually, run_router

from plimsoll.prometheus import parse
from plimsoll.router.backends import ReplicaSet
from plimsoll.router.config import RouterConfig
from plimsoll.router.policy import RequestFeatures, Router
from plimsoll.router.proxy import REPLICA_HEADER
from plimsoll.router.scrape import active_adapters, served_adapters

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


def adapter_dir(root: Path, name: str) -> str:
    folder = root / name
    folder.mkdir(exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    return str(folder)


async def test_router_sends_each_adapter_to_its_replicas_over_http(fake_replicas, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    sql, fr = f"sql={adapter_dir(tmp_path, 'sql')}", f"fr={adapter_dir(tmp_path, 'fr')}"
    lora = {"enable_lora": True, "step_t0_s": 0.002}
    replicas = fake_replicas([{**lora, "lora_modules": [sql]}, {**lora, "lora_modules": [fr]}, lora])
    urls = tuple(r.url for r in replicas)
    async with run_router(backends=urls, policy="prefix-affinity", scrape_interval_s=0.1) as router:
        await eventually(
            lambda: all(r.adapters is not None for r in router.state.replica_set.replicas.values()),
            "the first scrape of every replica's adapters",
        )
        api = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=30)
        served: dict[str, collections.Counter[str]] = {m: collections.Counter() for m in ("sql", "fr", "fake")}

        async def one(model: str, i: int) -> None:
            raw = await api.completions.with_raw_response.create(model=model, prompt=f"p{i} x", max_tokens=3)
            assert raw.parse().model == model
            served[model][raw.headers[REPLICA_HEADER]] += 1

        await asyncio.gather(*(one(m, i) for i in range(10) for m in served))
        await api.close()
        assert served["sql"] == {urls[0]: 10}, served
        assert served["fr"] == {urls[1]: 10}, served
        assert sum(served["fake"].values()) == 10 and len(served["fake"]) > 1, "the base model spreads"
        adapter_decisions = sum(
            router.metric("plimsoll_router_routing_decisions_total", policy="prefix_affinity", reason=reason, lane="all")
            for reason in ("adapter_active", "adapter_loaded")
        )
        assert adapter_decisions == 20
