"""A simulated OpenAI-compatible server with a known service curve.

What it is: real HTTP (FastAPI on uvicorn, bound to 127.0.0.1), SSE streaming for
``/v1/completions`` and ``/v1/chat/completions``, ``/v1/models``, ``/health``,
``/ready`` and ``/metrics`` with plimsoll metric names. At most ``batch_cap``
requests run at once (FIFO queue beyond that); each running request emits one
token every ``t(b) = step_t0 + step_k * b`` seconds, where ``b`` is the number of
running requests when the token is due. Closed-loop throughput is therefore
``min(c, B) / t(min(c, B))`` tokens per second and the knees are analytic (see
:func:`analytic_knees`). Times are in real seconds but tiny, so a sweep takes
seconds. It is test infrastructure and a way to try `plimsoll bench` without a GPU.

What it is not: a model. Tokens are the word ``tok``; a prompt's token count is
its whitespace-separated word count.
"""

import asyncio
import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from plimsoll import metric_names as mn


@dataclass(frozen=True, slots=True)
class ServiceCurve:
    """The simulated replica: batch cap, per-step time, optional prefill cost and faults."""

    batch_cap: int = 16
    step_t0_s: float = 0.02
    step_k_s: float = 0.0
    prefill_s_per_token: float = 0.0
    kv_capacity_tokens: int = 0  # 0 = batch_cap * 2048
    max_waiting: int = 0  # 0 = unbounded; above it answer 429
    error_rate: float = 0.0  # fraction of requests answered with HTTP 500
    model: str = "sim-model"
    seed: int = 0

    def step_s(self, batch: int) -> float:
        return self.step_t0_s + self.step_k_s * max(batch, 1)

    def tokens_per_s(self, concurrency: int) -> float:
        b = min(concurrency, self.batch_cap)
        return b / self.step_s(b)


def analytic_knees(
    curve: ServiceCurve, levels: tuple[int, ...], alpha: float = 0.9
) -> tuple[int | None, int | None]:
    """The throughput and latency knees the closed-loop curve implies at these levels.

    Throughput knee: the smallest level whose throughput reaches ``alpha`` of the best,
    or None when that is the largest level (still rising). Latency knee (no SLO): the
    largest level with TPOT <= 2x and TTFT <= 3x of concurrency 1, i.e. c <= B and
    t(c) <= 2 t(1); None when every level passes.
    """
    xs = [curve.tokens_per_s(c) for c in levels]
    best = max(xs)
    thr = next(c for c, x in zip(levels, xs, strict=True) if x >= alpha * best)
    thr_knee = None if thr == levels[-1] else thr
    base = curve.step_s(1)
    passing = [c for c in levels if c <= curve.batch_cap and curve.step_s(c) <= 2 * base]
    lat_knee = None if len(passing) == len(levels) else (passing[-1] if passing else None)
    return thr_knee, lat_knee


class SimEngine:
    """The service curve as an asyncio queue plus per-request token timers."""

    def __init__(self, curve: ServiceCurve) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.curve = curve
        self.running = 0
        self.waiting = 0
        self.kv_tokens = 0
        self._slots = asyncio.Semaphore(curve.batch_cap)
        self._rng = random.Random(curve.seed)
        self.kv_capacity = curve.kv_capacity_tokens or curve.batch_cap * 2048
        reg = self.registry = CollectorRegistry()

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
            return Counter(name.removesuffix("_total"), doc, labels, registry=reg)

        Gauge(mn.NUM_REQUESTS_RUNNING, "Requests running.", registry=reg).set_function(lambda: self.running)
        Gauge(mn.NUM_REQUESTS_WAITING, "Requests waiting.", registry=reg).set_function(lambda: self.waiting)
        Gauge(mn.KV_CACHE_USAGE_RATIO, "KV cache usage.", registry=reg).set_function(
            lambda: min(1.0, self.kv_tokens / self.kv_capacity)
        )
        self.ttft = Histogram(mn.TIME_TO_FIRST_TOKEN, "TTFT.", buckets=mn.TTFT_BUCKETS, registry=reg)
        self.itl = Histogram(mn.INTER_TOKEN_LATENCY, "ITL.", buckets=mn.TOKEN_LATENCY_BUCKETS, registry=reg)
        self.tpot = Histogram(
            mn.TIME_PER_OUTPUT_TOKEN, "TPOT.", buckets=mn.TOKEN_LATENCY_BUCKETS, registry=reg
        )
        self.e2e = Histogram(mn.E2E_REQUEST_LATENCY, "E2E.", buckets=mn.REQUEST_LATENCY_BUCKETS, registry=reg)
        self.queue = Histogram(
            mn.REQUEST_QUEUE_TIME, "Queue.", buckets=mn.REQUEST_LATENCY_BUCKETS, registry=reg
        )
        self.prefill = Histogram(
            mn.REQUEST_PREFILL_TIME, "Prefill.", buckets=mn.REQUEST_LATENCY_BUCKETS, registry=reg
        )
        self.decode = Histogram(
            mn.REQUEST_DECODE_TIME, "Decode.", buckets=mn.REQUEST_LATENCY_BUCKETS, registry=reg
        )
        self.prompt_tokens = counter(mn.PROMPT_TOKENS, "Prompt tokens.")
        self.generation_tokens = counter(mn.GENERATION_TOKENS, "Generated tokens.")
        self.success = counter(mn.REQUEST_SUCCESS, "Finished requests.", ("finished_reason",))
        self.preemptions = counter(mn.NUM_PREEMPTIONS, "Preemptions.")
        self.rejections = counter(mn.ADMISSION_REJECTIONS, "Rejected requests.")

    def admit(self) -> str | None:
        """Why a new request is refused now (429/500), or None to accept it."""
        if self.curve.max_waiting and self.waiting >= self.curve.max_waiting:
            self.rejections.inc()
            return "queue_full"
        if self.curve.error_rate and self._rng.random() < self.curve.error_rate:
            return "injected"
        return None

    async def generate(self, prompt_tokens: int, max_tokens: int) -> AsyncIterator[int]:
        """Yield token indices 0..max_tokens-1 on the curve's schedule."""
        arrived = time.perf_counter()
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        start = time.perf_counter()
        self.queue.observe(start - arrived)
        self.kv_tokens += prompt_tokens
        held = prompt_tokens
        last = start
        try:
            await asyncio.sleep(
                self.curve.prefill_s_per_token * prompt_tokens + self.curve.step_s(self.running)
            )
            first = last = time.perf_counter()
            self.ttft.observe(first - arrived)
            self.prefill.observe(first - start)
            self.prompt_tokens.inc(prompt_tokens)
            for i in range(max_tokens):
                if i:
                    await asyncio.sleep(self.curve.step_s(self.running))
                    now = time.perf_counter()
                    self.itl.observe(now - last)
                    last = now
                self.kv_tokens += 1
                held += 1
                self.generation_tokens.inc()
                yield i
            end = time.perf_counter()
            self.e2e.observe(end - arrived)
            self.decode.observe(end - first)
            if max_tokens > 1:
                self.tpot.observe((end - first) / (max_tokens - 1))
            self.success.labels("length").inc()
        finally:
            self.kv_tokens -= held
            self.running -= 1
            self._slots.release()


def _count_tokens(body: dict[str, Any]) -> int:
    if "messages" in body:
        return sum(len(str(m.get("content", "")).split()) for m in body["messages"])
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        prompt = " ".join(str(p) for p in prompt)
    return len(str(prompt).split())


def build_app(curve: ServiceCurve) -> Any:
    """The FastAPI app serving one simulated model."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    app = FastAPI(title="plimsoll bench simulator")
    state: dict[str, SimEngine] = {}

    def engine() -> SimEngine:
        # Created lazily so the semaphore binds to uvicorn's running loop.
        if "engine" not in state:
            state["engine"] = SimEngine(curve)
        return state["engine"]

    def error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
        body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
        headers = {"Retry-After": "1"} if status == 429 else None
        return JSONResponse(body, status_code=status, headers=headers)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> dict[str, str]:
        return {"status": "ready"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": curve.model, "object": "model", "owned_by": "plimsoll-sim"}],
        }

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(engine().registry), media_type=CONTENT_TYPE_LATEST)

    async def complete(request: Request, chat: bool) -> Any:
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return error(400, "request body is not JSON", "invalid_request_error")
        if body.get("model") != curve.model:
            return error(
                404,
                f"The model `{body.get('model')}` does not exist; this server serves `{curve.model}`.",
                "NotFoundError",
                "model",
            )
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        if max_tokens < 1:
            return error(400, "max_tokens must be at least 1", "invalid_request_error", "max_tokens")
        eng = engine()
        refused = eng.admit()
        if refused == "queue_full":
            return error(429, "waiting queue is full; retry later", "rate_limit_error")
        if refused:
            return error(500, "injected simulator fault", "internal_error")
        prompt_tokens = _count_tokens(body)
        rid = f"sim-{uuid.uuid4().hex[:12]}"
        kind = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": max_tokens,
            "total_tokens": prompt_tokens + max_tokens,
        }

        def chunk(i: int, finish: str | None) -> dict[str, Any]:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
            if chat:
                choice["delta"] = {"role": "assistant", "content": " tok"} if i == 0 else {"content": " tok"}
            else:
                choice["text"] = " tok"
            return {"id": rid, "object": kind, "created": created, "model": curve.model, "choices": [choice]}

        if not body.get("stream"):
            async for _ in eng.generate(prompt_tokens, max_tokens):
                pass
            text = " tok" * max_tokens
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                if chat
                else {"index": 0, "text": text, "finish_reason": "length"}
            )
            return {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": created,
                "model": curve.model,
                "choices": [choice],
                "usage": usage,
            }

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def events() -> AsyncIterator[str]:
            async for i in eng.generate(prompt_tokens, max_tokens):
                finish = "length" if i == max_tokens - 1 else None
                yield f"data: {json.dumps(chunk(i, finish))}\n\n"
            if include_usage:
                tail = {
                    "id": rid,
                    "object": kind,
                    "created": created,
                    "model": curve.model,
                    "choices": [],
                    "usage": usage,
                }
                yield f"data: {json.dumps(tail)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await complete(request, chat=True)

    return app


def serve(curve: ServiceCurve, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Run the simulator in the foreground until interrupted."""
    import uvicorn

    uvicorn.run(build_app(curve), host=host, port=port, log_level="warning", access_log=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def running_simulator(curve: ServiceCurve, startup_timeout_s: float = 30.0) -> Iterator[str]:
    """Start the simulator in a child process (its own CPU and GIL); yield its base URL."""
    port = free_port()
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "plimsoll.bench.simulator",
            "--port",
            str(port),
            "--curve",
            json.dumps(asdict(curve)),
        ],
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"simulator exited with status {proc.returncode} before it was ready")
            try:
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"simulator on {url} not ready after {startup_timeout_s:.0f} s")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.asynccontextmanager
async def serving_simulator(curve: ServiceCurve) -> AsyncIterator[str]:
    """Serve the simulator inside the running event loop (no child process); yield its URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            build_app(curve),
            host="127.0.0.1",
            port=port,
            log_level="warning",
            access_log=False,
            lifespan="off",
        )
    )
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("simulator server stopped during start-up")
            await asyncio.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


def _main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--curve", default="{}", help="ServiceCurve fields as JSON")
    args = parser.parse_args()
    serve(ServiceCurve(**json.loads(args.curve)), port=args.port)


if __name__ == "__main__":
    _main()
