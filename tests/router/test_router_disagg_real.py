"""Prefill/decode disaggregation over real processes: a `plimsoll serve` producer and consumer, the
router's two-hop path in front, and one aggregated replica as the reference.

Shows: greedy output through the split path equals the aggregated replica's for 32 mixed prompts
(short, long, streamed, chat, and a family sharing a prefix, which the decode replica already holds
and so pulls only the rest of); and every fault still answers each request with the same output
and leaves no block held on either side: the transfer timing out (the producer stopped mid-pull),
a decode replica gone (the request runs whole on the prefill pool), the prefill replica killed
between the hops (the decode replica prefills locally).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from router_harness import eventually, run_router

from plimsoll.prometheus import parse
from plimsoll.router.prefill_decode import PREFILL_HEADER, prefill_body
from plimsoll.router.proxy import REPLICA_HEADER
from plimsoll.runtime.testing import ServerProcess, ThreadedServer, free_port, write_tiny_model

pytestmark = pytest.mark.slow

ENGINE = {"max_model_len": 256, "kv_cache_memory": "1MiB", "block_size": 16, "max_num_seqs": 8}
SERVE = ("--served-model-name", "tiny", "--kv-cache-memory", "1MiB", "--max-model-len", "256", "--block-size", "16",
         "--max-num-seqs", "8", "--drain-timeout", "2")  # fmt: skip
HOLD_S = 3  # the producers' abort_request_timeout: an unpulled hold is freed this long after the prefill
PULL_S = 5  # the consumer's transfer_timeout: a stalled pull costs this, then a local prefill


def transfer(role: str, **extra: float) -> str:
    return json.dumps(
        {"kv_role": role, "kv_ip": "127.0.0.1", "kv_port": 0, "kv_connector_extra_config": extra}
    )


class Fleet:
    def __init__(self, model: Path) -> None:
        self.model = str(model)
        self.prefill = ServerProcess([
            "--model", self.model, *SERVE, "--kv-transfer-config", transfer("kv_producer", abort_request_timeout=HOLD_S)
        ], startup_timeout=300)  # fmt: skip
        self.decode = ServerProcess([
            "--model", self.model, *SERVE, "--kv-transfer-config", transfer("kv_consumer", transfer_timeout=PULL_S)
        ], startup_timeout=300)  # fmt: skip
        self.aggregated = ThreadedServer(model, served_model_name="tiny", **ENGINE)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    fleet = Fleet(write_tiny_model(tmp_path_factory.mktemp("disagg") / "tiny"))
    started: list[Any] = []
    try:
        for server in (fleet.prefill, fleet.decode, fleet.aggregated):
            started.append(server.start())
        yield fleet
    finally:
        for server in started:
            server.stop(timeout=10)


def text(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return "".join(chr(rng.randrange(97, 123)) for _ in range(n))


def mixed_requests() -> list[dict[str, Any]]:
    """32 requests: short, medium and long prompts (up to 230 of 256 tokens), streamed ones, chat ones,
    and eight sharing a 120-character prefix (sent last, one after another)."""
    base = {"model": "tiny", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    out: list[dict[str, Any]] = []
    for i, n in enumerate([12, 30, 47, 64, 90, 120, 150, 170, 190, 205, 215, 230] * 2):
        req = {**base, "prompt": text(i, n)}
        if i % 5 == 1:
            req["stream"] = True
        if i % 7 == 3:
            req = {**base, "messages": [{"role": "user", "content": text(i, n - 20 if n > 40 else n)}]}
        out.append(req)
    shared = text(1000, 120)
    out += [{**base, "prompt": shared + text(2000 + i, 10 + 7 * i)} for i in range(8)]
    assert len(out) == 32
    return out


def endpoint(req: dict[str, Any]) -> str:
    return "/v1/chat/completions" if "messages" in req else "/v1/completions"


async def answer(client: httpx.AsyncClient, url: str, req: dict[str, Any]) -> tuple[str, httpx.Headers]:
    """The generated text of one request, streamed or not (and the response's headers)."""
    if not req.get("stream"):
        r = await client.post(url + endpoint(req), json=req)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice.get("text", (choice.get("message") or {}).get("content")), r.headers
    parts = []
    async with client.stream("POST", url + endpoint(req), json=req) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                parts += [c.get("text") or "" for c in chunk["choices"]]
        return "".join(parts), r.headers


def scrape(url: str) -> Any:
    return parse(httpx.get(f"{url}/metrics", timeout=10).text)


def sample(url: str, name: str, **labels: str) -> float:
    scrape_ = scrape(url)
    return sum(
        v for lbl, v in scrape_.samples.get(name, []) if all(lbl.get(k) == x for k, x in labels.items())
    )


async def no_blocks_held(*urls: str) -> None:
    """Each replica's KV cache back to zero use, nothing held for a pull: no block leaked."""
    for url in urls:
        await eventually(
            lambda u=url: sample(u, "plimsoll_kv_cache_usage_ratio") == 0.0
            and sample(u, "plimsoll_kv_transfer_held_blocks") == 0.0,
            f"{url}'s KV cache usage back to zero", timeout=HOLD_S + 30,
        )  # fmt: skip


async def test_split_output_equals_aggregated(fleet: Fleet) -> None:
    requests = mixed_requests()
    async with httpx.AsyncClient(timeout=120) as client:
        expected = [(await answer(client, fleet.aggregated.url, r))[0] for r in requests]
        async with run_router(
            prefill_backends=(fleet.prefill.url,), decode_backends=(fleet.decode.url,)
        ) as router:
            gate = asyncio.Semaphore(6)

            async def through_router(req: dict[str, Any]) -> tuple[str, httpx.Headers]:
                async with gate:
                    return await answer(client, router.url, req)

            got = list(await asyncio.gather(*(through_router(r) for r in requests[:24])))
            for req in requests[24:]:  # the shared-prefix family, in order: each finds its prefix on D
                got.append(await through_router(req))
            split = router.metric("plimsoll_router_pd_requests_total", path="split", reason="split")
    mismatches = [i for i, ((t, _), e) in enumerate(zip(got, expected, strict=True)) if t != e]
    assert not mismatches, f"split output differs from aggregated for requests {mismatches}"
    assert all(
        h[REPLICA_HEADER] == fleet.decode.url and h[PREFILL_HEADER] == fleet.prefill.url for _, h in got
    )
    assert split == 32
    pulled = sample(fleet.decode.url, "plimsoll_kv_transfer_blocks_total", direction="received")
    skipped = sample(fleet.decode.url, "plimsoll_kv_transfer_blocks_total", direction="skipped")
    pulls = sample(fleet.decode.url, "plimsoll_kv_transfer_pulls_total")
    print(f"split path: {split:.0f} requests, {pulls:.0f} pulls, {pulled:.0f} blocks pulled, "
          f"{skipped:.0f} not pulled (prefix hits on the decode replica)")  # fmt: skip
    # The shared prefix's 7 full blocks: pulled once, then held by the decode replica for the other seven.
    assert skipped >= 7 * 7
    assert pulls >= 24 and sample(fleet.decode.url, "plimsoll_kv_transfer_failures_total") == 0
    await no_blocks_held(fleet.prefill.url, fleet.decode.url)


async def test_transfer_times_out(fleet: Fleet) -> None:
    """The producer stops after hop 1: the pull waits its timeout, then the decode replica prefills locally."""
    req = {"model": "tiny", "prompt": text(3000, 200), "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=120) as client:
        expected = (await answer(client, fleet.aggregated.url, req))[0]
        hop1 = await client.post(fleet.prefill.url + "/v1/completions", json=prefill_body(req))
        params = hop1.json()["kv_transfer_params"]
        assert params["do_remote_prefill"] and params["remote_block_ids"]
        before = sample(fleet.decode.url, "plimsoll_kv_transfer_failures_total", reason="timeout")
        assert fleet.prefill.proc is not None
        os.kill(fleet.prefill.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            got, _ = await answer(client, fleet.decode.url, {**req, "kv_transfer_params": params})
            waited = time.monotonic() - t0
        finally:
            os.kill(fleet.prefill.proc.pid, signal.SIGCONT)
    assert got == expected
    assert sample(fleet.decode.url, "plimsoll_kv_transfer_failures_total", reason="timeout") == before + 1
    print(f"a stalled producer cost the decode hop {waited:.1f}s (transfer_timeout {PULL_S}s)")
    await no_blocks_held(fleet.prefill.url, fleet.decode.url)


async def test_decode_replica_gone(fleet: Fleet) -> None:
    """No decode replica answers: the request runs whole on the prefill pool; the unpulled hold expires."""
    gone = f"http://127.0.0.1:{free_port()}"
    req = {"model": "tiny", "prompt": text(4000, 150), "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=120) as client:
        expected = (await answer(client, fleet.aggregated.url, req))[0]
        async with run_router(prefill_backends=(fleet.prefill.url,), decode_backends=(gone,)) as router:
            got, headers = await answer(client, router.url, req)
            streamed, _ = await answer(client, router.url, {**req, "stream": True})
            assert router.metric("plimsoll_router_pd_requests_total", path="aggregated",
                                 reason="decode_unavailable") == 2  # fmt: skip
        # One gone and one alive: the request goes to the live decode replica, split as usual.
        async with run_router(
            prefill_backends=(fleet.prefill.url,), decode_backends=(gone, fleet.decode.url)
        ) as router:
            for _ in range(3):
                again, _ = await answer(client, router.url, req)
                assert again == expected
    assert got == expected and streamed == expected
    assert headers[REPLICA_HEADER] == fleet.prefill.url
    await no_blocks_held(fleet.prefill.url, fleet.decode.url)


async def test_prefill_killed_between_hops(fleet: Fleet) -> None:
    """Hop 1 done, then the producer dies: the pull finds nobody and the decode replica prefills locally.

    Runs last in this module: it kills the module's producer. Then the router's own fallback when
    no prefill replica answers at all.
    """
    req = {"model": "tiny", "prompt": text(5000, 180), "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=120) as client:
        expected = (await answer(client, fleet.aggregated.url, req))[0]
        hop1 = await client.post(fleet.prefill.url + "/v1/completions", json=prefill_body(req))
        params = hop1.json()["kv_transfer_params"]
        assert fleet.prefill.proc is not None
        fleet.prefill.proc.kill()
        fleet.prefill.proc.wait()
        got, _ = await answer(client, fleet.decode.url, {**req, "kv_transfer_params": params})
        assert got == expected
        assert sample(fleet.decode.url, "plimsoll_kv_transfer_failures_total", reason="connect") >= 1
        async with run_router(
            prefill_backends=(fleet.prefill.url,), decode_backends=(fleet.decode.url,)
        ) as router:
            routed, headers = await answer(client, router.url, req)
            assert router.metric("plimsoll_router_pd_requests_total", path="fallback",
                                 reason="prefill_unavailable") == 1  # fmt: skip
    assert routed == expected and headers[REPLICA_HEADER] == fleet.decode.url
    await no_blocks_held(fleet.decode.url)
