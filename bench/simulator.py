"""A simulated OpenAI-compatible server with a known service curve.

What it is: real HTTP (FastAPI on uvicorn, bound to 127.0.0.1), SSE streaming for
``/v1/completions`` and ``/v1/chat/completions``, ``/v1/models``, ``/health``,
``/ready`` and ``/metrics`` in either engine family's names (``engine``:
plimsoll's, or vLLM's, which has no ``/ready``), and OpenAI-style 4xx errors for
malformed requests. At most ``batch_cap``
requests run at once (FIFO queue beyond that); prompts are prefilled one after
another at ``prefill_s_per_token`` (one prefill lane, as a compute-bound engine
prefills), the first token one step after the prefill; each running request emits one
token every ``t(b) = step_t0 + step_k * b`` seconds, where ``b`` is the number of
running requests when the token is due (× ``degrade_factor`` while more than
``degrade_above`` run: a replica whose service falls apart above some load).
Token times are deadlines from the request's start, so the server's own CPU work
between tokens does not add to the step time until it exceeds it. Closed-loop throughput is therefore
``min(c, B) / t(min(c, B))`` tokens per second and the knees are analytic (see
:func:`analytic_knees`). Times are in real seconds but tiny, so a sweep takes
seconds. It is test infrastructure (the bench's sweeps, the router's replicas, the
operator's replay) and a way to try `plimsoll bench` without a GPU.

With ``enable_lora`` it also speaks vLLM's LoRA API (``sim_adapters.py``): adapters
from ``lora_modules`` and the load/unload endpoints, listed by ``/v1/models`` with
their ``parent``, served like the base model, and the ``lora_requests_info`` gauge.

It exports the token-aware gauges a plimsoll replica does (prompt tokens waiting,
decode tokens remaining, its rates, the backlog and predicted TTFT of
``plimsoll.ttft_prediction``) and, like a replica, refuses with 429 and ``Retry-After``
a request whose ``x-slo-ttft-ms`` its predicted TTFT would exceed; every answer
carries the prediction (``x-plimsoll-predicted-ttft-ms``), which is how the predictor
is checked against measured TTFT on a known curve.

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
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from plimsoll import metric_names as mn
from plimsoll.auth import bearer_matches
from plimsoll.bench.sim_adapters import AdapterError, SimAdapters, adapter_problem, parse_lora_module
from plimsoll.overload import OVERLOAD_HEADER, REPLICA
from plimsoll.readiness import wait_until_ready
from plimsoll.ttft_prediction import (
    PREDICTED_TTFT_HEADER,
    SLO_TTFT_HEADER,
    QueueSnapshot,
    ServiceRates,
    TTFTPrediction,
    parse_ttft_bound,
    predict_ttft,
)


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
    engine: str = "plimsoll"  # metric names and probes: a key of metric_names.ENGINE_FAMILIES
    # Above this many running requests every step takes degrade_factor times as long (0 = never).
    degrade_above: int = 0
    degrade_factor: float = 1.0
    enable_lora: bool = False  # vLLM's --enable-lora: the adapter endpoints and gauge exist
    lora_modules: tuple[str, ...] = ()  # name=path adapters registered at start
    max_loras: int = 4  # the gauge's max_lora label
    # The simulator process's own process_* series (resident memory, open fds), as plimsoll serve has.
    process_metrics: bool = False
    # Injected leaks, per finished request (a soak must flag them): file descriptors kept open,
    # bytes kept alive. Either turns the process_* series on.
    leak_fds_per_request: int = 0
    leak_bytes_per_request: int = 0
    # vLLM's sleep mode (--enable-sleep-mode): POST /sleep and /wake_up (the latter taking wake_s), GET
    # /is_sleeping; asleep, /ready and generation answer 503. admin_key guards the two POSTs as
    # plimsoll's admin paths are guarded; start_asleep begins parked.
    enable_sleep_mode: bool = False
    wake_s: float = 0.0
    start_asleep: bool = False
    admin_key: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "lora_modules", tuple(self.lora_modules))  # JSON gives a list
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules need enable_lora (vLLM refuses --lora-modules without --enable-lora)")
        for entry in self.lora_modules:
            name, path = parse_lora_module(entry)
            if (problem := adapter_problem(path)) is not None:
                raise ValueError(f"--lora-modules {name}: {problem}")
        if self.leak_fds_per_request < 0 or self.leak_bytes_per_request < 0:
            raise ValueError("leak_fds_per_request and leak_bytes_per_request must be >= 0")
        if self.engine not in mn.ENGINE_FAMILIES:
            raise ValueError(f"engine must be one of {sorted(mn.ENGINE_FAMILIES)}, got {self.engine!r}")
        if self.batch_cap < 1:
            raise ValueError(f"batch_cap must be at least 1, got {self.batch_cap}")
        if self.start_asleep and not self.enable_sleep_mode:
            raise ValueError("start_asleep needs enable_sleep_mode")
        if self.wake_s < 0:
            raise ValueError(f"wake_s must be >= 0, got {self.wake_s}")
        if self.degrade_above < 0 or self.degrade_factor < 1.0:
            raise ValueError(
                f"degrade_above must be >= 0 and degrade_factor >= 1, got {self.degrade_above}, {self.degrade_factor}"
            )

    def step_s(self, batch: int) -> float:
        step = self.step_t0_s + self.step_k_s * max(batch, 1)
        if self.degrade_above and batch > self.degrade_above:
            step *= self.degrade_factor
        return step

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
        # The prefill lane is busy until this perf_counter time; the queue the predictor reads.
        self.lane_free_at = 0.0
        self._running: dict[int, list[float]] = {}  # id -> [prefill end, tokens left]
        self._waiting: dict[int, tuple[int, int]] = {}  # id -> (prompt, max tokens), FIFO
        self._ids = 0
        # PUT /sim/step-cost multiplies every step's time: a replica whose speed changes mid-run.
        self.step_scale = 1.0
        self.sleep_level = 1 if curve.start_asleep else 0
        self.wakes = 0  # POST /wake_up calls answered (tests read it from /is_sleeping)
        reg = self.registry = CollectorRegistry()
        if curve.process_metrics or curve.leak_fds_per_request or curve.leak_bytes_per_request:
            from prometheus_client import ProcessCollector

            ProcessCollector(registry=reg)
        self.leaked: list[Any] = []  # what the injected leaks hold on to
        self.adapters: SimAdapters | None = None
        if curve.enable_lora:
            self.adapters = SimAdapters(curve.model, curve.lora_modules, curve.max_loras, curve.engine)
            reg.register(self.adapters)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
            return Counter(name.removesuffix("_total"), doc, labels, registry=reg)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, buckets=buckets, registry=reg)

        names = mn.ENGINE_FAMILIES[curve.engine]
        Gauge(names.running, "Requests running.", registry=reg).set_function(lambda: self.running)
        Gauge(names.waiting, "Requests waiting.", registry=reg).set_function(lambda: self.waiting)
        Gauge(names.kv_usage, "KV cache usage.", registry=reg).set_function(
            lambda: min(1.0, self.kv_tokens / self.kv_capacity)
        )
        self.ttft = histogram(names.ttft, "TTFT.", mn.TTFT_BUCKETS)
        self.itl = histogram(names.itl, "ITL.", mn.TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram(names.tpot, "TPOT.", mn.TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram(names.e2e, "E2E.", mn.REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram(names.queue_time, "Queue.", mn.REQUEST_LATENCY_BUCKETS)
        self.prefill = histogram(names.prefill_time, "Prefill.", mn.REQUEST_LATENCY_BUCKETS)
        self.decode = histogram(names.decode_time, "Decode.", mn.REQUEST_LATENCY_BUCKETS)
        self.prompt_tokens = counter(names.prompt_tokens, "Prompt tokens.")
        self.generation_tokens = counter(names.generation_tokens, "Generated tokens.")
        self.success = counter(names.request_success, "Finished requests.", ("finished_reason",))
        self.preemptions = counter(names.preemptions, "Preemptions.")
        if curve.engine == "plimsoll":  # the token-aware gauges a plimsoll replica exports
            Gauge(mn.PROMPT_TOKENS_WAITING, "Prompt tokens waiting.", registry=reg).set_function(
                lambda: self.queue().waiting_prompt_tokens
            )
            Gauge(mn.DECODE_TOKENS_REMAINING, "Decode tokens remaining.", registry=reg).set_function(
                lambda: self.queue().decode_tokens_remaining
            )
            Gauge(mn.BACKLOG_SECONDS, "Backlog, seconds.", registry=reg).set_function(
                lambda: self.predict(0).backlog_s
            )
            Gauge(mn.PREFILL_TOKENS_PER_SECOND, "Prefill rate.", registry=reg).set_function(
                lambda: self.rates().prefill_tokens_per_s
            )
            Gauge(mn.DECODE_STEP_SECONDS, "Decode step.", registry=reg).set_function(
                lambda: self.rates().decode_step_s
            )
        if curve.enable_sleep_mode:
            Gauge(mn.ENGINE_SLEEP_LEVEL, "0 awake; 1 or 2: asleep at that level.", registry=reg).set_function(
                lambda: self.sleep_level
            )
        # vLLM has no admission-rejection counter; plimsoll's is beyond vLLM.
        self.rejections = counter(
            mn.ADMISSION_REJECTIONS if curve.engine == "plimsoll" else "sim_admission_rejections",
            "Rejected requests.",
        )

    def _leak(self) -> None:
        for _ in range(self.curve.leak_fds_per_request):
            self.leaked.append(open(os.devnull, "rb"))  # noqa: SIM115 (kept open on purpose)
        if self.curve.leak_bytes_per_request:
            self.leaked.append(bytearray(os.urandom(self.curve.leak_bytes_per_request)))  # touched: resident

    def admit(self) -> str | None:
        """Why a new request is refused now (429/500), or None to accept it."""
        if self.curve.max_waiting and self.waiting >= self.curve.max_waiting:
            self.rejections.inc()
            return "queue_full"
        if self.curve.error_rate and self._rng.random() < self.curve.error_rate:
            return "injected"
        return None

    def step_s(self, batch: int) -> float:
        return self.curve.step_s(batch) * self.step_scale

    def rates(self) -> ServiceRates:
        per_token = self.curve.prefill_s_per_token * self.step_scale
        return ServiceRates(
            prefill_tokens_per_s=1.0 / per_token if per_token > 0 else 1e12,
            decode_step_s=self.step_s(min(self.curve.batch_cap, self.running + len(self._waiting) + 1)),
            max_num_seqs=self.curve.batch_cap,
        )

    def queue(self) -> QueueSnapshot:
        """The queue now, in the predictor's terms (prompt tokens left to prefill, tokens left)."""
        now = time.perf_counter()
        per_token = self.curve.prefill_s_per_token * self.step_scale
        running = tuple(
            (round(max(0.0, end - now) / per_token) if per_token > 0 else 0, max(1, int(left)))
            for end, left in self._running.values()
        )
        return QueueSnapshot(running, tuple(self._waiting.values()))

    def predict(self, prompt_tokens: int) -> TTFTPrediction:
        return predict_ttft(self.queue(), self.rates(), prompt_tokens)

    def enqueue(self, prompt_tokens: int, max_tokens: int) -> int:
        """Join the queue now (at admission, before a streamed answer starts); the id for :meth:`generate`."""
        self.waiting += 1
        self._ids += 1
        self._waiting[self._ids] = (prompt_tokens, max_tokens)
        return self._ids

    async def generate(
        self, prompt_tokens: int, max_tokens: int, model: str = "", queued: int | None = None
    ) -> AsyncIterator[int]:
        """Yield token indices 0..max_tokens-1 on the curve's schedule (``model``: an adapter, counted);
        ``queued`` is the id :meth:`enqueue` gave this request (else it joins the queue now)."""
        arrived = time.perf_counter()
        adapters = self.adapters
        rid = queued if queued is not None else self.enqueue(prompt_tokens, max_tokens)
        if adapters is not None:
            adapters.queued(model)
        try:
            await self._slots.acquire()
        except BaseException:
            if adapters is not None:
                adapters.finished(model, was_running=False)
            raise
        finally:
            self.waiting -= 1
            del self._waiting[rid]
        if adapters is not None:
            adapters.started(model)
        self.running += 1
        start = time.perf_counter()
        self.queue_time.observe(start - arrived)
        self.kv_tokens += prompt_tokens
        held = prompt_tokens
        last = start
        # One prefill lane: this prompt's prefill starts when the one before it is done.
        prefill_end = (
            max(start, self.lane_free_at) + self.curve.prefill_s_per_token * self.step_scale * prompt_tokens
        )
        self.lane_free_at = prefill_end
        self._running[rid] = [prefill_end, float(max_tokens)]
        try:
            due = prefill_end + self.step_s(self.running)
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            first = last = time.perf_counter()
            self.ttft.observe(first - arrived)
            self.prefill.observe(first - start)
            self.prompt_tokens.inc(prompt_tokens)
            for i in range(max_tokens):
                if i:
                    # A deadline, not a sleep: the time spent streaming the last token is inside the step.
                    due = max(due + self.step_s(self.running), time.perf_counter())
                    await asyncio.sleep(due - time.perf_counter())
                    now = time.perf_counter()
                    self.itl.observe(now - last)
                    last = now
                self.kv_tokens += 1
                held += 1
                self._running[rid][1] = max_tokens - i - 1
                self.generation_tokens.inc()
                yield i
            end = time.perf_counter()
            self.e2e.observe(end - arrived)
            self.decode.observe(end - first)
            if max_tokens > 1:
                self.tpot.observe((end - first) / (max_tokens - 1))
            self.success.labels("length").inc()
            self._leak()
        finally:
            self.kv_tokens -= held
            self.running -= 1
            self._running.pop(rid, None)
            self._slots.release()
            if adapters is not None:
                adapters.finished(model, was_running=True)


def _count_tokens(body: dict[str, Any]) -> int:
    if "messages" in body:
        return sum(len(str(m.get("content", "")).split()) for m in body["messages"])
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        prompt = " ".join(str(p) for p in prompt)
    return len(str(prompt).split())


def _request_problem(body: Any, chat: bool) -> tuple[str, str | None] | None:
    """What is wrong with a request body, as (message, param), or None when it can be served."""
    if not isinstance(body, dict):
        return "request body must be a JSON object", None
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            return "messages must be a non-empty list of objects", "messages"
    else:
        prompt = body.get("prompt")
        if not (isinstance(prompt, str) and prompt) and not (isinstance(prompt, list) and prompt):
            return "prompt must be a non-empty string or list", "prompt"
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            return f"{key} must be a positive integer, got {value!r}", key
    return None


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
        # A full queue is this replica's alone, as a plimsoll replica says: a router tries another one.
        headers = {"Retry-After": "1", OVERLOAD_HEADER: REPLICA} if status == 429 else None
        return JSONResponse(body, status_code=status, headers=headers)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    if curve.engine == "plimsoll":  # vLLM has no /ready: its /health is all a prober gets

        @app.get("/ready")
        async def ready() -> Any:
            if engine().sleep_level:
                return JSONResponse({"ready": False, "reason": "asleep"}, status_code=503)
            return {"status": "ready"}

    if curve.enable_sleep_mode:

        def admin_refusal(request: Request) -> JSONResponse | None:
            if curve.admin_key and not bearer_matches(request.headers.get("authorization"), curve.admin_key):
                return error(401, "this is an admin path: send the admin key", "AuthenticationError")
            return None

        @app.post("/sleep")
        async def sleep(request: Request, level: int = 1) -> Any:
            if (refused := admin_refusal(request)) is not None:
                return refused
            eng = engine()
            if eng.running or eng.waiting:
                return error(409, f"{eng.running + eng.waiting} request(s) are in flight", "ConflictError")
            eng.sleep_level = level
            return {"is_sleeping": True, "level": level}

        @app.post("/wake_up")
        async def wake_up(request: Request) -> Any:
            if (refused := admin_refusal(request)) is not None:
                return refused
            eng = engine()
            if eng.sleep_level:
                await asyncio.sleep(curve.wake_s)
            eng.sleep_level = 0
            eng.wakes += 1
            return {"is_sleeping": False, "seconds": curve.wake_s}

        @app.get("/is_sleeping")
        async def is_sleeping() -> dict[str, Any]:
            return {"is_sleeping": bool(engine().sleep_level), "wakes": engine().wakes}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        adapters = engine().adapters
        cards = adapters.model_cards(int(time.time())) if adapters is not None else []
        return {
            "object": "list",
            "data": [{"id": curve.model, "object": "model", "owned_by": "plimsoll-sim"}, *cards],
        }

    async def adapter_call(request: Request, load: bool) -> Any:
        adapters = engine().adapters
        if adapters is None:
            return error(400, "LoRA is not enabled; start the server with --enable-lora", "BadRequestError")
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return error(400, "request body is not JSON", "BadRequestError")
        if not isinstance(body, dict) or not isinstance(body.get("lora_name"), str):
            return error(400, "the body needs a string lora_name", "BadRequestError", "lora_name")
        try:
            if load:
                path = body.get("lora_path")
                adapters.load(body["lora_name"], path if isinstance(path, str) else "")
            else:
                adapters.unload(body["lora_name"])
        except AdapterError as refused:
            kind = "NotFoundError" if refused.status == 404 else "BadRequestError"
            return error(refused.status, str(refused), kind, "lora_name")
        verb = "loaded" if load else "unloaded"
        return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' {verb} successfully.")

    def post(path: str, handler: Callable[[Request, bool], Awaitable[Any]], flag: bool) -> None:
        """POST ``path`` answered by ``handler(request, flag)``: each handler serves a pair of endpoints."""

        async def endpoint(request: Request) -> Any:
            return await handler(request, flag)

        app.add_api_route(path, endpoint, methods=["POST"], name=path.removeprefix("/v1/").replace("/", "_"))

    post("/v1/load_lora_adapter", adapter_call, True)
    post("/v1/unload_lora_adapter", adapter_call, False)

    @app.put("/sim/step-cost")
    async def step_cost(request: Request) -> Any:
        # Test hook, apart from the served API: {"scale": 2.0} makes every step twice as slow.
        body = await request.json()
        scale = body.get("scale") if isinstance(body, dict) else None
        if not isinstance(scale, int | float) or isinstance(scale, bool) or scale <= 0:
            return error(400, '"scale" must be a positive number, e.g. {"scale": 2.0}', "invalid_request_error", "scale")
        engine().step_scale = float(scale)
        return {"scale": engine().step_scale}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(engine().registry), media_type=CONTENT_TYPE_LATEST)

    async def complete(request: Request, chat: bool) -> Any:
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return error(400, "request body is not JSON", "invalid_request_error")
        problem = _request_problem(body, chat)
        if problem is not None:
            return error(400, problem[0], "invalid_request_error", problem[1])
        eng = engine()
        if eng.sleep_level:
            return JSONResponse({"error": {"message": "This replica is asleep (sleep mode); retry on another replica.",
                                           "type": "ServiceUnavailableError", "param": None, "code": 503}},
                                status_code=503, headers={"Retry-After": "1", OVERLOAD_HEADER: REPLICA})  # fmt: skip
        served = {curve.model, *(eng.adapters.paths if eng.adapters is not None else ())}
        model = body.get("model")
        if model not in served:
            return error(
                404,
                f"The model `{model}` does not exist; this server serves {', '.join(sorted(served))}.",
                "NotFoundError",
                "model",
            )
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or 16
        refused = eng.admit()
        if refused == "queue_full":
            return error(429, "waiting queue is full; retry later", "rate_limit_error")
        if refused:
            return error(500, "injected simulator fault", "internal_error")
        prompt_tokens = _count_tokens(body)
        try:
            bound = parse_ttft_bound(request.headers.get(SLO_TTFT_HEADER))
        except ValueError as exc:
            return error(400, str(exc), "invalid_request_error")
        prediction = eng.predict(prompt_tokens)
        predicted = {PREDICTED_TTFT_HEADER: f"{prediction.ttft_s * 1000:.1f}"}
        if bound is not None and prediction.ttft_s > bound:
            eng.rejections.inc()
            body_ = {"error": {"message": f"predicted TTFT {prediction.formula()} exceeds {bound * 1000:.0f} ms",
                               "type": "rate_limit_error", "param": None, "code": 429}}  # fmt: skip
            headers = {
                "Retry-After": str(prediction.retry_after_s(bound)),
                OVERLOAD_HEADER: REPLICA,
                **predicted,
            }
            return JSONResponse(body_, status_code=429, headers=headers)
        # A plain answer joins the queue now; a streamed one when its body starts (a stream whose body
        # never starts, the client gone, would otherwise stay counted as waiting).
        queued = None if body.get("stream") else eng.enqueue(prompt_tokens, max_tokens)
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
            return {"id": rid, "object": kind, "created": created, "model": model, "choices": [choice]}

        if not body.get("stream"):
            async for _ in eng.generate(prompt_tokens, max_tokens, model, queued):
                pass
            text = " tok" * max_tokens
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                if chat
                else {"index": 0, "text": text, "finish_reason": "length"}
            )
            return JSONResponse({
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": created,
                "model": model,
                "choices": [choice],
                "usage": usage,
            }, headers=predicted)  # fmt: skip

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def events() -> AsyncIterator[str]:
            async for i in eng.generate(prompt_tokens, max_tokens, model):
                finish = "length" if i == max_tokens - 1 else None
                yield f"data: {json.dumps(chunk(i, finish))}\n\n"
            if include_usage:
                tail = {
                    "id": rid,
                    "object": kind,
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": usage,
                }
                yield f"data: {json.dumps(tail)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers=predicted)

    post("/v1/completions", complete, False)
    post("/v1/chat/completions", complete, True)

    return app


def serve(curve: ServiceCurve, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Run the simulator in the foreground until interrupted."""
    import uvicorn

    uvicorn.run(build_app(curve), host=host, port=port, log_level="warning", access_log=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class SimulatorProcess:
    """A simulator in a child process (its own CPU and GIL): stop it, or SIGKILL it as a crashed pod dies."""

    url: str
    process: subprocess.Popen[bytes]

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Return once ``/health`` answers 200; raise if the process exits or the time runs out."""

        def died() -> str | None:
            if self.process.poll() is None:
                return None
            return f"simulator on {self.url} exited with status {self.process.returncode} before it was ready"

        if not wait_until_ready(f"{self.url}/health", timeout_s, died, interval_s=0.05, request_timeout_s=1.0):
            raise RuntimeError(f"simulator on {self.url} not ready after {timeout_s:.0f} s")

    def kill(self) -> None:
        """SIGKILL: the process dies with its open connections."""
        self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not exited within 10 s."""
        if self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()


def spawn_simulator(curve: ServiceCurve, host: str = "127.0.0.1", port: int | None = None) -> SimulatorProcess:
    """Start the simulator in a child process (on a free port unless given); call
    :meth:`SimulatorProcess.wait_ready`. ``host`` is a loopback address (a pod IP in tests)."""
    port = free_port() if port is None else port
    env = dict(os.environ)
    args = [
        sys.executable,
        "-m",
        "plimsoll.bench.simulator",
        "--host",
        host,
        "--port",
        str(port),
        "--curve",
        json.dumps(asdict(curve)),
    ]
    return SimulatorProcess(f"http://{host}:{port}", subprocess.Popen(args, env=env))


@contextlib.contextmanager
def running_simulator(curve: ServiceCurve, startup_timeout_s: float = 30.0) -> Iterator[str]:
    """Start the simulator in a child process; yield its base URL; stop it afterwards."""
    sim = spawn_simulator(curve)
    try:
        sim.wait_ready(startup_timeout_s)
        yield sim.url
    finally:
        sim.stop()


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
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--curve", default="{}", help="ServiceCurve fields as JSON")
    args = parser.parse_args()
    serve(ServiceCurve(**json.loads(args.curve)), host=args.host, port=args.port)


if __name__ == "__main__":
    _main()
