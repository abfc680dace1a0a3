"""No request lost when a replica or a router dies: real `plimsoll serve` and `plimsoll route` processes.

* In-flight migration: 32 greedy streams on one replica, started one token apart, so the
  SIGKILL lands at a different token of each; every stream completes through the router
  with exactly the tokens and text of an uninterrupted run, the same ``id``, one role
  chunk, usage for the whole request. Through a second router with ``--migration-limit 0``
  the streams on the same replica end with an error event, as without migration.
* Two router processes: SIGKILL one under load; clients that retry once on the other see
  no failure, and the survivor sends each prompt where both sent it before.
* SIGTERM: a router reports /ready 503, still serves for ``--shutdown-delay``, then lets
  its open streams finish and exits 0.

Three replicas are started once (tiny random model, every engine step at least 20 ms so
"the stream is still running when X happens" holds on any CPU); the first test kills one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from router_harness import eventually, run_router

from plimsoll.prometheus import parse
from plimsoll.runtime.testing import ServerProcess, free_port, write_tiny_model

pytestmark = pytest.mark.slow

STREAMS = 32
MAX_TOKENS = 120
SLOW_STEPS = """
import time
from plimsoll.runtime.engine.llm_engine import LLMEngine
_step = LLMEngine.step
def _slow_step(self):
    time.sleep(0.02)
    return _step(self)
LLMEngine.step = _slow_step
"""


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[ServerProcess]]:
    model = write_tiny_model(Path(tempfile.gettempdir()) / "plimsoll-router-tiny-model")
    args = ["--model", str(model), "--served-model-name", "tiny", "--max-num-seqs", "48",
            "--kv-cache-memory", "4MiB", "--drain-timeout", "2"]  # fmt: skip
    servers = [ServerProcess(args, prelude=SLOW_STEPS, startup_timeout=300) for _ in range(3)]
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda s: s.start(), servers))
    yield servers
    for server in servers:
        server.terminate()
    for server in servers:
        server.stop(timeout=10)


@dataclass
class Stream:
    """One SSE stream as a client sees it: every event, and when each arrived."""

    path: str
    body: dict[str, Any]
    events: list[tuple[float, Any]] = field(default_factory=list)  # (time, JSON object or "[DONE]")
    status: int | None = None

    @property
    def tokens(self) -> int:
        """Output chunks received so far (one token each here; a chat's role chunk not counted)."""
        return sum(1 for _, e in self.events if isinstance(e, dict) and e.get("choices")
                   and "role" not in e["choices"][0].get("delta", {}))  # fmt: skip

    def tokens_before(self, moment: float) -> int:
        return sum(1 for t, e in self.events if t < moment and isinstance(e, dict) and e.get("choices")
                   and "role" not in e["choices"][0].get("delta", {}))  # fmt: skip

    def chunks(self) -> list[dict[str, Any]]:
        return [e for _, e in self.events if isinstance(e, dict) and "choices" in e]

    def text(self) -> str:
        return "".join(c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content") or ""
                       for c in self.chunks() if c["choices"])  # fmt: skip

    def token_ids(self) -> list[int]:
        return [t for c in self.chunks() if c["choices"] for t in c["choices"][0].get("token_ids", [])]

    async def run(self, client: httpx.AsyncClient, base: str) -> None:
        async with client.stream("POST", base + self.path, json={**self.body, "stream": True}) as response:
            self.status = response.status_code
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    data = line.removeprefix("data: ")
                    self.events.append((time.monotonic(), data if data == "[DONE]" else json.loads(data)))


def request(i: int, *, token_ids: bool) -> tuple[str, dict[str, Any]]:
    """Stream i's request: a quarter are chat requests; greedy, the full MAX_TOKENS every time."""
    common = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
              "stream_options": {"include_usage": True}, "return_token_ids": token_ids}  # fmt: skip
    if i % 4 == 3:
        return "/v1/chat/completions", {
            **common,
            "messages": [{"role": "user", "content": f"Stream {i}: go on"}],
        }
    return "/v1/completions", {**common, "prompt": f"Stream {i} carries on:"}


async def uninterrupted(url: str, specs: list[tuple[str, dict[str, Any]]]) -> list[Stream]:
    streams = [Stream(path, {**body, "return_token_ids": True}) for path, body in specs]
    async with httpx.AsyncClient(timeout=120) as client:
        await asyncio.gather(*(s.run(client, url) for s in streams))
    return streams


async def test_streams_killed_at_different_tokens_complete_exactly(replicas: list[ServerProcess]) -> None:
    victim, *others = replicas
    specs = [request(i, token_ids=i % 2 == 0) for i in range(STREAMS)]
    cut_specs = [request(100 + i, token_ids=True) for i in range(4)]  # through the --migration-limit 0 router
    expected = await uninterrupted(others[0].url, specs)
    async with (
        run_router(backends=(victim.url,), migration_limit=3, scrape_interval_s=0.5) as router,
        run_router(backends=(victim.url,), migration_limit=0, scrape_interval_s=0.5) as no_migration,
        httpx.AsyncClient(timeout=120) as client,
    ):
        streams = [Stream(path, body) for path, body in specs]
        cut = [Stream(path, body) for path, body in cut_specs]
        tasks = [asyncio.create_task(s.run(client, no_migration.url)) for s in cut]
        # Stream i starts once stream 0 has i tokens: when the victim dies, each is at its own token.
        for i, stream in enumerate(streams):
            await eventually(lambda i=i: streams[0].tokens >= i, f"stream 0 at token {i}")  # type: ignore[misc]
            tasks.append(asyncio.create_task(stream.run(client, router.url)))
        await eventually(lambda: all(s.tokens >= 1 for s in streams + cut), "every stream under way")
        # The other replicas join the routers' set (as discovery would add them) before the kill.
        for r in (router, no_migration):
            r.state.replica_set.replace([victim.url, *(o.url for o in others)])
            assert r.state.scraper is not None
            await r.state.scraper.scrape_all()
        killed_at = time.monotonic()
        victim.proc.kill()  # type: ignore[union-attr]
        await asyncio.gather(*tasks)

    kill_points = [s.tokens_before(killed_at) for s in streams]
    print(f"\nkill points (tokens each stream had): {sorted(kill_points)}")
    assert all(0 < k < MAX_TOKENS for k in kill_points), kill_points
    # Streams start one token apart, but a loaded host batches their tokens: ask for a spread,
    # not one distinct point per stream.
    assert len(set(kill_points)) >= STREAMS // 4, kill_points
    for i, (stream, want) in enumerate(zip(streams, expected, strict=True)):
        assert stream.status == 200 and stream.events[-1][1] == "[DONE]", (i, stream.events[-3:])
        assert not any(isinstance(e, dict) and "error" in e for _, e in stream.events), i
        chunks = stream.chunks()
        assert {c["id"] for c in chunks} == {chunks[0]["id"]} and {c["created"] for c in chunks} == {
            chunks[0]["created"]}, i  # fmt: skip
        assert stream.text() == want.text(), i
        if stream.body["return_token_ids"]:
            assert stream.token_ids() == want.token_ids(), i
        else:
            assert not any("token_ids" in c["choices"][0] for c in chunks if c["choices"]), i
            assert not any("prompt_token_ids" in c for c in chunks), i
        if "chat" in stream.path:
            assert sum("role" in c["choices"][0]["delta"] for c in chunks if c["choices"]) == 1, i
        usage = chunks[-1]["usage"]
        assert usage["completion_tokens"] == MAX_TOKENS, i
        assert usage["prompt_tokens"] == want.chunks()[-1]["usage"]["prompt_tokens"], i
    assert router.metric("plimsoll_router_migrations_total", outcome="migrated") == STREAMS
    for stream in cut:  # --migration-limit 0: one error event, no [DONE], as before migration
        last = stream.events[-1][1]
        assert isinstance(last, dict) and last["error"]["code"] == 502, stream.events[-2:]
    assert no_migration.metric("plimsoll_router_migrations_total", outcome="limit_reached") == len(cut)


@dataclass
class RouterProcess:
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextlib.contextmanager
def router_process(backends: list[str], *extra: str) -> Iterator[RouterProcess]:
    """`plimsoll route` in its own process, yielded once /ready answers 200; killed at the end."""
    port = free_port()
    log_path = Path(tempfile.mkstemp(prefix="plimsoll-route-", suffix=".log")[1])
    args = ["route", "--port", str(port), "--scrape-interval", "0.2", "--log-level", "warning", *extra]
    for url in backends:
        args += ["--backend", url]
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-c", "from plimsoll.cli import main; main()", *args],
                                stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    router = RouterProcess(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, router.log()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(router.url + "/ready", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, f"plimsoll route never became ready:\n{router.log()}"
            time.sleep(0.1)
        yield router
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def one_stream(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> tuple[bool, str]:
    """(completed, why not): complete means 200, events, [DONE] and no error event."""
    stream = Stream("/v1/completions", body)
    try:
        await stream.run(client, url)
    except httpx.HTTPError as exc:
        return False, f"{type(exc).__name__}: {exc}"
    ok = stream.status == 200 and bool(stream.events) and stream.events[-1][1] == "[DONE]"
    return ok, "" if ok else f"status {stream.status}, last events {stream.events[-2:]}"


def router_metric(router_url: str, name: str, **labels: str) -> float:
    """One sample of a router process's /metrics (0 when absent)."""
    samples = parse(httpx.get(router_url + "/metrics", timeout=5).text).samples.get(name, [])
    return sum(value for have, value in samples if all(have.get(k) == v for k, v in labels.items()))


def ready_replicas(router_url: str) -> int:
    """How many replicas the router counts ready and reachable (its plimsoll_router_replica_ready)."""
    text = httpx.get(router_url + "/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1]) == 1.0
        for line in text.splitlines()
        if line.startswith("plimsoll_router_replica_ready{")
    )


async def affinity(client: httpx.AsyncClient, url: str, prompts: list[str]) -> dict[str, str]:
    """Which replica each prompt is sent to (one token each, one at a time)."""
    homes = {}
    for prompt in prompts:
        r = await client.post(
            url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1}
        )
        assert r.status_code == 200, r.text
        homes[prompt] = r.headers["x-plimsoll-replica"]
    return homes


async def test_a_router_killed_under_load_fails_no_client_that_retries_once(
    replicas: list[ServerProcess],
) -> None:
    alive = [r.url for r in replicas if r.proc is not None and r.proc.poll() is None]
    assert len(alive) >= 2
    prompts = [f"conversation {i:02d} opens with its own system prompt" for i in range(24)]
    # A load factor of the replica count keeps bounded load from ever moving a prompt, so the
    # decisions compared depend on the replica set alone: two routers scrape the replicas' loads
    # at different moments, and a request just finished can still count in one router's view.
    args = ("--policy", "prefix-affinity", "--prefix-chars", "16", "--load-factor", str(len(alive)))
    with router_process(alive, *args) as first, router_process(alive, *args) as second:
        async with httpx.AsyncClient(timeout=120) as client:
            for router in (first, second):  # /ready answers once one replica is; compare over all of them
                await eventually(lambda r=router: ready_replicas(r.url) == len(alive), "every replica ready")
            before = await affinity(client, first.url, prompts)
            assert await affinity(client, second.url, prompts) == before  # same set, same decisions
            assert len(set(before.values())) == len(alive)
            outcomes: list[tuple[bool, int, str]] = []  # (ok, tries, why)
            stop = asyncio.Event()

            async def worker(w: int) -> None:
                n = 0
                while not stop.is_set():
                    body = {"model": "tiny", "prompt": f"client {w} request {n}", "max_tokens": 16,
                            "ignore_eos": True}  # fmt: skip
                    order = [first.url, second.url] if (w + n) % 2 == 0 else [second.url, first.url]
                    ok, why = await one_stream(client, order[0], body)
                    tries = 1
                    if not ok:  # one retry, on the other router (what a Service's next connection gives)
                        ok, why = await one_stream(client, order[1], body)
                        tries = 2
                    outcomes.append((ok, tries, why))
                    n += 1

            workers = [asyncio.create_task(worker(w)) for w in range(6)]
            await eventually(lambda: len(outcomes) >= 12, "load under way")
            first.proc.send_signal(signal.SIGKILL)
            first.proc.wait()
            killed_at = len(outcomes)
            await eventually(lambda: len(outcomes) >= killed_at + 24, "load after the kill")
            stop.set()
            await asyncio.gather(*workers)
            after = await affinity(client, second.url, prompts)
    failed = [o for o in outcomes if not o[0]]
    retried = [o for o in outcomes if o[1] == 2]
    print(f"\n{len(outcomes)} streams, {len(retried)} retried once, {len(failed)} failed")
    assert not failed, failed[:3]
    assert retried, "the kill should have cut streams or refused connections that the retry then served"
    assert after == before


async def test_sigterm_drains_a_router_without_failing_a_request(replicas: list[ServerProcess]) -> None:
    alive = [r.url for r in replicas if r.proc is not None and r.proc.poll() is None]
    with router_process(alive, "--shutdown-delay", "2", "--drain-timeout", "60") as router:
        async with httpx.AsyncClient(timeout=120) as client:
            long = {"model": "tiny", "prompt": "a long answer", "max_tokens": 200, "ignore_eos": True}
            streams = [Stream("/v1/completions", long) for _ in range(4)]
            tasks = [asyncio.create_task(s.run(client, router.url)) for s in streams]
            await eventually(lambda: all(s.tokens >= 1 for s in streams), "streams under way")
            router.proc.send_signal(signal.SIGTERM)
            await eventually(lambda: httpx.get(router.url + "/ready", timeout=5).status_code == 503,
                             "/ready 503 after SIGTERM")  # fmt: skip
            # Still serving during the delay: a request that got here before the endpoints updated.
            ok, why = await one_stream(
                client, router.url, {"model": "tiny", "prompt": "late", "max_tokens": 2}
            )
            assert ok, why
            await asyncio.gather(*tasks)
        code = await asyncio.to_thread(router.proc.wait, 60)
    assert all(s.events[-1][1] == "[DONE]" and s.tokens == 200 for s in streams)
    assert code == 0, router.log()


async def test_a_stream_waits_for_a_replica_to_answer_again(replicas: list[ServerProcess]) -> None:
    """With no other replica, a stream whose replica stops answering waits (--migration-wait)
    and is carried on there once its probes answer again, as with a restarted pod."""
    alive = [r for r in replicas if r.proc is not None and r.proc.poll() is None]
    home, reference = alive[0], alive[1]
    path, body = request(200, token_ids=True)
    (want,) = await uninterrupted(reference.url, [(path, body)])
    stream = Stream(path, body)
    assert home.proc is not None
    with router_process([home.url], "--migration-wait", "120") as router:
        async with httpx.AsyncClient(timeout=120) as client:
            task = asyncio.create_task(stream.run(client, router.url))
            await eventually(lambda: stream.tokens >= 4, "the stream under way")
            os.kill(home.proc.pid, signal.SIGSTOP)
            try:
                # Two probes unanswered: the router counts the replica lost and ends its leg of the stream.
                await eventually(lambda: router_metric(router.url, "plimsoll_router_upstream_errors_total",
                                                       replica=home.url, kind="stream_broken") == 1,
                                 "the stream's replica found lost", timeout=60)  # fmt: skip
                assert ready_replicas(router.url) == 0 and not task.done()
            finally:
                os.kill(home.proc.pid, signal.SIGCONT)
            await task
        assert router_metric(router.url, "plimsoll_router_migrations_total", outcome="migrated") == 1
    assert stream.status == 200 and stream.events[-1][1] == "[DONE]", stream.events[-3:]
    assert stream.token_ids() == want.token_ids()
    assert stream.chunks()[-1]["usage"]["completion_tokens"] == MAX_TOKENS
