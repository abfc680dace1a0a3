"""The engine for the server: a background thread runs the step loop; asyncio streams outputs.

What it is: ``AsyncEngine.start()`` loads the model and KV cache in a worker
thread, warms up, then keeps stepping while there is work. ``generate()`` is an
async iterator of ``RequestOutput`` per step; closing or cancelling it aborts the
request and frees its blocks at once. What it is not: HTTP (see ``server.py``).

Threading: only the engine thread touches the ``LLMEngine``. Other threads post
commands (add, abort) to a queue and are woken by a condition; outputs go back
through ``loop.call_soon_threadsafe`` into per-request asyncio queues.
"""

import asyncio
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any, Unpack

from plimsoll.runtime.engine.client import RequestOptions
from plimsoll.runtime.engine.config import EngineConfig
from plimsoll.runtime.engine.llm_engine import LLMEngine
from plimsoll.runtime.engine.lora_manager import LoRARequest
from plimsoll.runtime.engine.outputs import EngineObserver, EngineStats, RequestOutput
from plimsoll.runtime.engine.sampling_params import SamplingParams
from plimsoll.runtime.engine.step_profiler import StepProfiler
from plimsoll.ttft_prediction import QueueSnapshot, ServiceRates

log = logging.getLogger(__name__)

SHUTDOWN_JOIN_S = 5.0
# The engine idles this long before the deferred warm-up (engine.warmup) takes its next pieces.
DEFERRED_WARMUP_IDLE_S = 1.0
# ... and this many times as long before its first piece, the largest step: the one piece a request
# can wait seconds behind, and the request a scale-up was for may reach a new replica a few seconds
# after Ready (the router's discovery, a client's retry).
FIRST_PIECE_IDLE_FACTOR = 5.0


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error; no request can proceed."""


class StreamCutError(RuntimeError):
    """The server cut this request at its drain deadline (the engine itself is fine)."""


class AsyncEngine:
    def __init__(self, config: EngineConfig, observer: EngineObserver | None = None) -> None:
        self.config = config
        self.observer = observer
        self.engine: LLMEngine | None = None
        self._thread: threading.Thread | None = None
        self._cond = threading.Condition()
        self._commands: list[tuple[str, Any]] = []
        self._streams: dict[
            str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput | BaseException]]
        ] = {}
        self._stopping = False
        self._error: BaseException | None = None
        # Requests handed to the engine thread but not yet in its scheduler: (prompt, max new tokens)
        # each, counted by the queue the admission predictor sees.
        self._posted: dict[str, tuple[int, int]] = {}
        self._posted_lock = threading.Lock()  # written by the event loop and the engine thread
        self.is_ready = False
        # Called from the engine thread when the loop dies; the server uses it to drain and exit 1.
        self.on_dead: Callable[[BaseException], None] | None = None
        self.step_profiler = StepProfiler(config.device)

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Build the engine, warm it up and run its loop, all on one thread (``plimsoll-engine``).

        One thread runs every torch op: OpenMP (libgomp) keeps a pool of workers for each thread
        that starts a parallel region, and once the pooled workers outnumber the CPUs they spin
        100 times instead of 300,000 before sleeping, so every small oneDNN matmul then pays to
        wake them. Warming up on one thread and stepping on another cost that: 30 layers of
        SmolLM2's bf16 projections at one row, 14 ms on the thread that warmed up, 27 on another;
        a bf16 decode step at c = 1 over HTTP 39 against 23 ms.
        """
        loop = asyncio.get_running_loop()
        built: asyncio.Future[LLMEngine] = loop.create_future()

        def settle(result: LLMEngine | None, exc: BaseException | None) -> None:
            if built.done():  # start() was cancelled (shutdown while loading)
                return
            if exc is not None:
                built.set_exception(exc)
            else:
                built.set_result(result)  # type: ignore[arg-type]

        def run() -> None:
            try:
                engine = LLMEngine(self.config, self.observer)
                engine.warmup(defer_rest=True)  # the rest runs once Ready, while the loop idles
            except BaseException as exc:  # start() raises it
                loop.call_soon_threadsafe(settle, None, exc)
                return
            self.engine = engine
            remote = engine.kv_connector.remote if engine.kv_connector is not None else None
            if remote is not None:
                remote.wake = lambda: self._post("kv_releases", None)  # held blocks to free, even when idle
            if engine.executor is not None:
                engine.executor.on_failure = self._die  # a rank died, maybe while this loop idles
            loop.call_soon_threadsafe(settle, engine, None)
            self._loop()

        self._thread = threading.Thread(target=run, name="plimsoll-engine", daemon=True)
        self._thread.start()
        await built
        self.is_ready = True

    async def shutdown(self) -> None:
        self.is_ready = False
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            # A dead engine's thread may sit in a collective with a dead rank (bounded by its timeout).
            await asyncio.to_thread(self._thread.join, None if self._error is None else SHUTDOWN_JOIN_S)
        if self.engine is not None:
            await asyncio.to_thread(self.engine.close)
        for loop, queue in list(self._streams.values()):
            loop.call_soon_threadsafe(queue.put_nowait, EngineDeadError("the engine was shut down"))
        self._streams.clear()

    # -- properties the server reads ------------------------------------------------------

    def _engine(self) -> LLMEngine:
        if self.engine is None:
            raise RuntimeError("AsyncEngine.start() has not finished yet")
        return self.engine

    @property
    def tokenizer(self) -> Any:
        return self._engine().tokenizer

    @property
    def model_name(self) -> str:
        return str(self.config.display_name)

    @property
    def max_model_len(self) -> int:
        return int(self._engine().max_model_len)

    @property
    def vocab_size(self) -> int:
        """Ids a client may send: those both the tokenizer and the model's embedding know."""
        engine = self._engine()
        return min(len(engine.tokenizer), int(engine.hf_config.vocab_size))

    @property
    def is_dead(self) -> bool:
        return self._error is not None

    def stats(self) -> EngineStats:
        return self._engine().stats()  # reads plain ints; a slightly stale view is fine

    def queue_snapshot(self) -> QueueSnapshot:
        """The engine's queue after its last step, plus what was handed to it since (admission reads it)."""
        if self.engine is None:
            return QueueSnapshot()
        with self._posted_lock:
            posted = tuple(self._posted.values())
        return self.engine.queue.plus(posted)

    def service_rates(self) -> ServiceRates | None:
        """This replica's measured prefill rate and decode step (None until the rate probe or requests did)."""
        return self.engine.rate_meter.rates() if self.engine is not None else None

    def recent_steps(self, since: float) -> list[tuple[float, int]]:
        """``(seconds, prompt tokens)`` of the engine's steps that ended after ``since`` (``time.monotonic()``,
        within the last half minute): what a request received then has waited through."""
        return self.engine.rate_meter.steps_since(since) if self.engine is not None else []

    # -- LoRA adapters -----------------------------------------------------------------

    def list_loras(self) -> list[LoRARequest]:
        """Registered adapters (a copy; read without the engine thread, like ``stats``)."""
        return list(self._engine().list_loras()) if self.engine is not None else []

    async def add_lora(self, name: str, path: str) -> LoRARequest:
        """Read and check the adapter in a worker thread, then register it on the engine thread.

        Raises ``LoRAAdapterError`` (bad directory) or ``ValueError`` (name taken, LoRA off);
        nothing is registered then.
        """
        engine = self._engine()
        engine._lora_manager()  # LoRA off: refuse before reading anything
        weights = await asyncio.to_thread(engine.read_lora, name, path)
        lora: LoRARequest = await self._call(lambda e: e.add_lora(name, path, weights))
        return lora

    async def remove_lora(self, name: str) -> None:
        """Unregister on the engine thread; ``LoRANotFoundError`` or ``LoRAInUseError`` if it cannot."""
        await self._call(lambda e: e.remove_lora(name))

    async def _call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps and return (or raise) its result."""
        if self._error is not None:
            raise EngineDeadError(f"the engine loop died: {self._error!r}")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._post("call", (fn, loop, future))
        return await future

    # -- requests ----------------------------------------------------------------------

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        lora_name: str | None = None,
        **options: Unpack[RequestOptions],
    ) -> AsyncGenerator[RequestOutput, None]:
        """Outputs of one request already validated by the caller (the HTTP edge), under the
        adapter ``lora_name`` if given.

        ``options`` go to ``LLMEngine.add_request`` as they are: ``priority`` and ``fairness_id``
        (the request's scheduling attributes), ``cache_salt`` (its prefix-cache salt),
        ``continuation`` (the output already produced elsewhere) and ``ttft_deadline`` (the TTFT
        bound it was admitted under: a request refused from the queue for it raises
        ``TTFTDeadlineRefusal`` before any output).
        """
        if self._error is not None:
            raise EngineDeadError(f"the engine loop died: {self._error!r}")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use; use a unique id")
        arrival = time.monotonic()
        ids = list(prompt_token_ids)
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), queue)
        limit = self.max_model_len - len(ids)
        wanted = params.max_tokens if params.max_tokens is not None else limit
        with self._posted_lock:
            for i in range(params.n):
                self._posted[f"{request_id}#{i}"] = (len(ids), max(1, min(wanted, limit)))
        self._post("add", (request_id, ids, params, arrival, lora_name, options))
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    # Failed in the engine: nothing left there to abort, unless the server cut it.
                    finished = not isinstance(item, StreamCutError)
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            # The one place a request is aborted: any early exit (close, cancel, timeout).
            self._streams.pop(request_id, None)
            if not finished:
                self._post("abort", request_id)

    def cut_streams(self) -> None:
        """End every open stream now with :class:`StreamCutError`; each then aborts its request."""
        for request_id in list(self._streams):
            self._deliver(StreamCutError("the server's drain deadline passed"), request_id)

    def abort(self, request_id: str) -> None:
        self._post("abort", request_id)

    @property
    def sleep_level(self) -> int:
        """0 awake, else the level it sleeps at (engine/sleep_mode.py)."""
        return self.engine.sleep_level if self.engine is not None else 0

    async def sleep(self, level: int) -> int:
        """Sleep at ``level`` on the engine thread; the bytes freed. ``SleepModeError`` when it cannot."""
        freed: int = await self._call(lambda e: e.sleep(level))
        return freed

    async def wake_up(self) -> float:
        """Wake on the engine thread; the seconds it took."""
        took: float = await self._call(lambda e: e.wake_up())
        return took

    async def begin_profile(self) -> None:
        """Start a torch profile of the engine loop (on its thread); ProfileBusyError if one runs."""
        await self._on_engine_thread(self.step_profiler.begin)

    async def end_profile(self) -> Any:
        """Stop it and return the torch profile (export it off the event loop)."""
        return await self._on_engine_thread(self.step_profiler.end)

    async def _on_engine_thread(self, call: Callable[[], Any]) -> Any:
        return await self._call(lambda _engine: call())

    def _post(self, kind: str, payload: Any) -> None:
        with self._cond:
            self._commands.append((kind, payload))
            self._cond.notify()

    # -- the engine thread --------------------------------------------------------------

    def _deliver(self, out: RequestOutput | BaseException, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, queue = stream
            loop.call_soon_threadsafe(queue.put_nowait, out)

    @staticmethod
    def _run_call(
        engine: LLMEngine, fn: Callable[[LLMEngine], Any], loop: asyncio.AbstractEventLoop, future: Any
    ) -> None:
        def settle(result: Any, exc: BaseException | None) -> None:
            if future.done():  # the caller gave up (cancelled)
                return
            if exc is not None:
                future.set_exception(exc)
            else:
                future.set_result(result)

        try:
            result = fn(engine)
        except Exception as exc:  # the caller's error (a bad name), not the engine's
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    def _idle_for(self, engine: LLMEngine, idle_periods: float) -> bool:
        """Whether the engine stays idle (no command, no request, not stopping) for ``idle_periods``
        times ``DEFERRED_WARMUP_IDLE_S``; ``False`` as soon as work arrives."""

        def quiet() -> bool:
            return not self._commands and not engine.has_unfinished_requests() and not self._stopping

        with self._cond:
            if quiet():
                self._cond.wait(timeout=DEFERRED_WARMUP_IDLE_S * idle_periods)
            return quiet()

    def _loop(self) -> None:
        engine = self._engine()
        try:
            while True:
                if engine.rate_probe_due and not engine.sleep_level and self._idle_for(engine, 1.0):
                    # After Ready, not before: the first request waits for none of it, and one that
                    # arrives first measures the rates itself (the probe is then skipped).
                    engine.measure_rates()
                if engine.deferred_warmup and not engine.sleep_level:
                    # Only after a quiet moment: the request a scale-up (or a wake) was started
                    # for arrives just after Ready and goes first, not behind the largest step.
                    first = not engine.deferred_warmup_started
                    if self._idle_for(engine, FIRST_PIECE_IDLE_FACTOR if first else 1.0):
                        # Piece by piece: a request (or any command) that arrives meanwhile is served
                        # first, and the warm-up goes on once the engine is idle again.
                        engine.run_deferred_warmup(busy=lambda: bool(self._commands) or self._stopping)
                with self._cond:
                    while not self._commands and not engine.has_unfinished_requests() and not self._stopping:
                        self._cond.wait()
                    commands, self._commands = self._commands, []
                    if self._stopping:
                        return
                for kind, payload in commands:
                    if kind == "add":
                        request_id, ids, params, arrival, lora_name, options = payload
                        with self._posted_lock:
                            for i in range(params.n):
                                self._posted.pop(f"{request_id}#{i}", None)
                        try:
                            engine.add_request(request_id, ids, params, arrival, ids, lora_name, **options)
                        except Exception as exc:  # this request's fault, not the engine's
                            self._deliver(exc, request_id)
                    elif kind == "call":  # adapters, the profiler: run on this thread between steps
                        self._run_call(engine, *payload)
                    elif kind == "kv_releases":
                        engine.apply_kv_releases()
                    else:
                        out = engine.abort_request(payload)
                        if out is not None:
                            self._deliver(out, payload)
                if commands:
                    engine.publish_queue()
                # Judged at each step's start: a stall shows in the step it happened in, and a
                # request refused now has had nothing computed.
                for request_id, refusal in engine.refuse_late().items():
                    self._deliver(refusal, request_id)
                if engine.has_unfinished_requests():
                    with self.step_profiler.span():
                        outs = engine.step()
                    for out in outs:
                        self._deliver(out, out.request_id)
        except BaseException as exc:  # the loop must report, not vanish
            log.exception("engine loop died")
            self._die(exc)

    def _die(self, exc: BaseException) -> None:
        """Fail every stream and tell the server (from the engine thread or the TP watchdog)."""
        with self._cond:
            if self._error is not None:
                return
            self._error = exc
        self.is_ready = False
        for request_id in list(self._streams):
            self._deliver(EngineDeadError(f"the engine loop died: {exc!r}"), request_id)
        if self.on_dead is not None:
            self.on_dead(exc)
