"""Precise prefix routing over real processes: two `plimsoll serve` replicas publishing vLLM's KV
events and sharing a real Valkey/Redis server, and the router following those events.

Shows: the index follows stored and removed events (blocks moving from the primary cache to the
host tier) and a replica's restart; a multi-turn conversation goes to the replica that holds it;
a prompt computed on replica A is a hit on replica B through the shared tier; with a replica's
events absent the router falls back to the approximate policy and says so (metric, log, reason).
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from router_harness import eventually, run_router

from plimsoll.router.proxy import REPLICA_HEADER
from plimsoll.runtime.testing import KeyValueServer, ServerProcess, free_port, write_tiny_model

pytestmark = pytest.mark.slow

SERVE = ("--served-model-name", "tiny", "--kv-cache-memory", "160KiB", "--max-model-len", "256", "--block-size",
         "16", "--max-num-seqs", "4", "--drain-timeout", "2", "--kv-offloading-size", "0.01",
         "--enable-prompt-tokens-details")  # fmt: skip


class Replica:
    def __init__(self, model: str, kv_url: str) -> None:
        self.events_port = free_port()
        self.kv_url = kv_url
        self.model = model
        self.server = self._server(None)

    def _server(self, port: int | None) -> ServerProcess:
        # vLLM's rule: a wildcard endpoint binds (the router connects to it); any other connects.
        events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                             "endpoint": f"tcp://*:{self.events_port}"})  # fmt: skip
        return ServerProcess(["--model", self.model, *SERVE, "--kv-shared-url", self.kv_url,
                              "--kv-events-config", events], port=port, startup_timeout=300)  # fmt: skip

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def events(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    def restart(self) -> None:
        self.server.stop(timeout=10)
        self.server = self._server(self.server.port).start()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[Replica]]]:
    model = str(write_tiny_model(tmp_path_factory.mktemp("precise") / "tiny"))
    with KeyValueServer() as kv:
        replicas = [Replica(model, kv.url) for _ in range(2)]
        for r in replicas:
            r.server.start()
        try:
            yield model, replicas
        finally:
            for r in replicas:
                r.server.stop(timeout=10)


def text(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return "".join(chr(rng.randrange(97, 123)) for _ in range(n))


async def complete(client: httpx.AsyncClient, url: str, prompt: str) -> httpx.Response:
    r = await client.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 4,
                                                          "temperature": 0})  # fmt: skip
    assert r.status_code == 200, r.text
    return r


async def test_conversation_follows_its_blocks_and_index_follows_events(fleet: Any) -> None:
    model, replicas = fleet
    endpoints = {r.url: r.events for r in replicas}
    async with run_router(backends=tuple(endpoints), policy="precise-prefix", kv_tokenizer=model,
                          kv_events_endpoints=endpoints, kv_events_stale_after_s=10.0) as router:  # fmt: skip
        index = router.state.kv_events.index
        async with httpx.AsyncClient(timeout=60) as client:
            history = text(1, 100)
            first = await complete(client, router.url, history)
            holder = first.headers[REPLICA_HEADER]
            await eventually(
                lambda: holder in index.slot_of and len(index) >= 6, "the first turn's BlockStored events"
            )
            for turn in range(2, 5):
                history += " " + first.json()["choices"][0]["text"] + text(turn, 30)
                reply = await complete(client, router.url, history)
                assert reply.headers[REPLICA_HEADER] == holder, f"turn {turn} left the replica holding it"
                assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            assert router.metric("plimsoll_router_routing_decisions_total", policy="precise_prefix",
                                 reason="precise_hit", lane="all") >= 3  # fmt: skip

            # Evict the conversation from the holder's primary cache (two unrelated long prompts sent to it
            # directly): its BlockRemoved(GPU) and BlockStored(CPU) events move the blocks to the host tier.
            slot = index.slot_of[holder]
            hashes = router.state.prompt_tokens.block_hashes({"prompt": history}, 16)
            gpu_bit, cpu_bit = 1 << slot, 1 << (index.stride + slot)
            for seed in (50, 51):
                await complete(client, holder, text(seed, 220))
            await eventually(lambda: all(index.entries.get(h, 0) & cpu_bit for h in hashes[:4])
                             and not any(index.entries.get(h, 0) & gpu_bit for h in hashes[:4]),
                             "the conversation's blocks to move from GPU to CPU in the index")  # fmt: skip
            reply = await complete(client, router.url, history + " more")
            assert reply.headers[REPLICA_HEADER] == holder  # the host tier still holds it there

            # A restart: its events keep flowing to the router (the subscription reconnects) and the
            # new process's sequence numbers start again, which clears the entries of the old one.
            other = next(r for r in replicas if r.url != holder)
            await complete(client, other.url, text(60, 120))
            feed = router.state.kv_events.feeds[other.url]
            await eventually(lambda: feed.batches > 0, "events from the other replica")
            before = (feed.batches, feed.restarts + feed.gaps)
            other.restart()
            await complete(client, other.url, text(61, 120))
            await eventually(
                lambda: feed.batches > before[0], "events from the restarted replica", timeout=90
            )
            print(
                f"restart: batches {before[0]} -> {feed.batches}, resyncs {before[1]} -> {feed.restarts + feed.gaps}"
            )
            assert feed.restarts + feed.gaps > before[1]


async def test_shared_tier_serves_a_prefix_computed_elsewhere(fleet: Any) -> None:
    _, replicas = fleet
    a, b = replicas
    prompt = text(70, 200)
    async with httpx.AsyncClient(timeout=60) as client:
        first = await complete(client, a.url, prompt)
        assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

        async def hit_on_b() -> int:
            r = await complete(client, b.url, prompt + text(71, 5))
            return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

        cached = await hit_on_b()
        metrics = (await client.get(f"{b.url}/metrics")).text
    assert cached >= 192, f"B recomputed the prefix A had computed (cached_tokens={cached})"
    assert 'plimsoll_kv_tier_hits_total{medium="SHARED",model_name="tiny"}' in metrics


async def test_events_absent_fall_back_and_say_so(fleet: Any, caplog: pytest.LogCaptureFixture) -> None:
    model, replicas = fleet
    # The second replica's events are looked for where nothing publishes: absent.
    endpoints = {replicas[0].url: replicas[0].events, replicas[1].url: f"tcp://127.0.0.1:{free_port()}"}
    caplog.set_level(logging.WARNING, logger="plimsoll.router.kv_events")
    async with run_router(backends=tuple(endpoints), policy="precise-prefix", kv_tokenizer=model,
                          kv_events_endpoints=endpoints, kv_events_stale_after_s=0.5) as router:  # fmt: skip
        silent = replicas[1].url
        async with httpx.AsyncClient(timeout=60) as client:
            for i in range(12):
                await complete(client, router.url, text(200 + i, 40))
                feed = router.state.kv_events.feeds[silent]
                if feed.stale:
                    break
                await __import__("asyncio").sleep(0.2)
            metrics = (await client.get(f"{router.url}/metrics")).text
        assert router.state.kv_events.feeds[silent].stale
        assert router.metric("plimsoll_router_routing_decisions_total", policy="precise_prefix",
                             reason="precise_fallback_stale", lane="all") >= 1  # fmt: skip
        assert f'plimsoll_router_kv_events_stale{{replica="{silent}"}} 1.0' in metrics
        assert any("falls back to the approximate prefix policy" in r.message for r in caplog.records)
