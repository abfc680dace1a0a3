"""How one HTTP request becomes engine work: admission, the output stream, abort, the log line.

What it is: :class:`ServingContext` holds the engine, the server settings, the
metrics and the drain state; :meth:`ServingContext.admit` refuses work the replica
cannot take (draining -> 503, waiting queue full -> 429, both with ``Retry-After`` and
``x-plimsoll-overload: replica``, so a router sends the request to another replica);
:meth:`ServingContext.outputs` iterates the engine's outputs for one prompt with
the request timeout, and aborts the request (freeing its KV blocks) whenever the
consumer stops early: client disconnect, timeout, error. Every request that
reached the engine leaves one structured log line.

What it is not: the OpenAI response shapes (``completions.py``,
``chat.py``) or the routes (``server.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, Unpack

import anyio
from starlette.requests import Request

from plimsoll.objectives import FAIRNESS_HEADER, OBJECTIVE_HEADER, objective_priority
from plimsoll.overload import OVERLOAD_HEADER, REPLICA
from plimsoll.runtime.engine.async_engine import StreamCutError
from plimsoll.runtime.engine.client import EngineClient, RequestOptions
from plimsoll.runtime.engine.outputs import RequestOutput
from plimsoll.runtime.engine.sampling_params import SamplingParams
from plimsoll.runtime.serving.errors import APIError, bad_request
from plimsoll.runtime.serving.metrics import ServerMetrics
from plimsoll.runtime.serving.protocol import UsageInfo
from plimsoll.runtime.serving.request_spans import record_request_spans
from plimsoll.runtime.serving.settings import ServerSettings
from plimsoll.runtime.serving.slo_admission import refused_from_queue
from plimsoll.runtime.serving.template_pool import TemplatePool
from plimsoll.ttft_prediction import (
    PREDICTED_TTFT_HEADER,
    QueueSnapshot,
    TTFTDeadline,
    TTFTDeadlineRefusal,
    classify_miss,
)

log = logging.getLogger("plimsoll.runtime.requests")
# The tenant-cap bucket of requests that name no tenant.
ANONYMOUS_BUCKET = ""
T = TypeVar("T")


@dataclass
class Admission:
    """What admit() hands the request: its id and a way to leave the in-flight set."""

    request_id: str
    ctx: ServingContext
    num_seqs: int = 1
    released: bool = False
    tenant: str | None = None
    num_tokens: int = 0  # prompt + max_tokens held against the tenant's in-flight cap
    # The TTFT the replica predicted when it admitted this request (None: none made); reported
    # back as a response header so a client or a benchmark can compare it with what it measured.
    predicted_ttft_s: float | None = None

    def headers(self) -> dict[str, str]:
        """The response headers this admission adds: the predicted TTFT, when one was made."""
        if self.predicted_ttft_s is None:
            return {}
        return {PREDICTED_TTFT_HEADER: f"{self.predicted_ttft_s * 1000:.1f}"}

    def release(self) -> None:
        if not self.released:
            self.released = True
            if self.tenant is not None:
                held = self.ctx.tenant_tokens.get(self.tenant, 0) - self.num_tokens
                if held > 0:
                    self.ctx.tenant_tokens[self.tenant] = held
                else:
                    self.ctx.tenant_tokens.pop(self.tenant, None)
            self.ctx.num_in_flight -= 1
            self.ctx.num_seqs_in_flight -= self.num_seqs
            self.ctx.drop_unposted(self.request_id)
            if self.ctx.num_in_flight == 0:
                self.ctx.idle.set()


@dataclass
class ServingContext:
    engine: EngineClient
    settings: ServerSettings
    metrics: ServerMetrics
    draining: bool = False
    # Marked by the operator for a scale-down (POST /drain): /ready fails so no new work is routed
    # here, but requests are still admitted, so one already on its way is not refused.
    marked_for_removal: bool = False
    # Asleep (sleep mode), or going to sleep: /ready answers 503 and requests are refused.
    sleeping: bool = False
    num_in_flight: int = 0
    num_seqs_in_flight: int = 0
    drain_deadline_passed: bool = False
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    tenant_tokens: dict[str, int] = field(default_factory=dict)  # in-flight prompt + max_tokens
    templates: TemplatePool | None = None  # renders client chat templates (--allow-client-chat-template)
    # Admitted sequences not yet handed to the engine, by request id: (prompt tokens, tokens it may
    # generate) per sequence. The engine registers a request only once its stream is first read,
    # after the response has started; until then admission must still count it, or a burst's
    # requests all see the same short queue and all pass the TTFT check.
    unposted: dict[str, tuple[tuple[int, int], ...]] = field(default_factory=dict)

    # ---- admission -----------------------------------------------------------

    def admit(
        self, prefix: str, tenant: str | None = None, num_tokens: int = 0, num_seqs: int = 1
    ) -> Admission:
        """Take a request in, or raise 503 (draining) / 429 (replica full, tenant cap hit).

        Admission counts sequences (prompts x n), not HTTP requests: one request of
        100 prompts x n=16 is 1,600 sequences of work. The replica holds at most
        ``max_num_seqs`` running plus ``--max-waiting`` waiting.
        """
        if self.draining:
            self.metrics.reject("draining")
            raise APIError(
                503,
                "The server is shutting down and accepts no new requests; retry against another replica.",
                headers=self._replica_overload(),
            )
        if self.sleeping:  # went to sleep while this request was being tokenised
            self.metrics.reject("asleep")
            raise APIError(
                503,
                "This replica went to sleep (sleep mode); retry on another replica.",
                headers={"Retry-After": str(self.settings.retry_after_s), OVERLOAD_HEADER: REPLICA},
            )
        limit = self.settings.max_waiting
        if limit is not None:
            capacity = self.engine.config.max_num_seqs + limit
            if num_seqs > capacity:
                self.metrics.reject("invalid_request")
                raise bad_request(
                    f"This request asks for {num_seqs} sequences (prompts x n) but this replica holds at "
                    f"most {capacity} (--max-num-seqs + --max-waiting); send fewer prompts or a lower n."
                )
            if self.num_seqs_in_flight + num_seqs > capacity:
                self.metrics.reject("queue_full")
                raise APIError(
                    429,
                    f"The replica is full ({self.num_seqs_in_flight} sequences in flight, this request "
                    f"adds {num_seqs}, room for {capacity} = --max-num-seqs + --max-waiting {limit}); "
                    f"retry after {self.settings.retry_after_s}s or send to another replica.",
                    headers=self._replica_overload(),
                )
        cap = self.settings.max_tenant_inflight_tokens
        # Requests that name no tenant share one bucket under the same cap: leaving the header
        # out must not be a way around the limit.
        bucket = tenant if tenant is not None else ANONYMOUS_BUCKET
        if cap is not None:
            held = self.tenant_tokens.get(bucket, 0)
            if held + num_tokens > cap:
                self.metrics.reject("tenant_limit")
                who = (
                    f"Tenant {tenant!r} has"
                    if tenant is not None
                    else "Requests without a tenant (one shared bucket) have"
                )
                raise APIError(
                    429,
                    f"{who} {held} tokens in flight and this request needs {num_tokens} more "
                    f"(prompt + max_tokens), over --max-tenant-inflight-tokens {cap}; retry after "
                    f"{self.settings.retry_after_s}s or lower max_tokens.",
                    headers={"Retry-After": str(self.settings.retry_after_s)},
                )
        self.num_in_flight += 1
        self.num_seqs_in_flight += num_seqs
        self.idle.clear()
        adm = Admission(f"{prefix}-{uuid.uuid4().hex[:16]}", self, num_seqs)
        if cap is not None:
            adm.tenant, adm.num_tokens = bucket, num_tokens
            self.tenant_tokens[bucket] = self.tenant_tokens.get(bucket, 0) + num_tokens
        return adm

    def _replica_overload(self) -> dict[str, str]:
        """Headers of a refusal that another replica may not share: a router retries it there at once."""
        return {"Retry-After": str(self.settings.retry_after_s), OVERLOAD_HEADER: REPLICA}

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight; False if ``timeout`` passed first."""
        if self.num_in_flight == 0:
            return True
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self.idle.wait()
                return True
        return False

    # ---- one prompt through the engine ---------------------------------------

    def lora_of(self, model: str | None) -> str | None:
        """The adapter a request's ``model`` names (the server has checked it exists), or None."""
        return model if model is not None and model != self.settings.served_model_name else None

    def model_of(self, model: str | None) -> str:
        """The ``model`` a response reports: the adapter's name, or the base model's."""
        return self.lora_of(model) or self.settings.served_model_name

    def usage(self, outputs: Sequence[RequestOutput]) -> UsageInfo:
        """A response's usage over its engine requests (a completions request runs one per prompt)."""
        prompt = sum(len(o.prompt_token_ids) for o in outputs)
        completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        # Off unless --enable-prompt-tokens-details: the count tells a client whether a prompt
        # was cached, i.e. whether someone with the same salt sent it before.
        cached = sum(o.metrics.num_cached_tokens for o in outputs)
        details = {"cached_tokens": cached} if self.settings.enable_prompt_tokens_details else None
        return UsageInfo(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=details,
        )

    def queue_snapshot(self) -> QueueSnapshot:
        """The engine's queue with the admitted sequences whose streams have not started behind it."""
        return self.engine.queue_snapshot().plus(tuple(s for seqs in self.unposted.values() for s in seqs))

    def drop_unposted(self, request_id: str) -> None:
        """Forget the unstarted streams of a request that ended (``request_id`` and its ``-i`` prompts)."""
        for key in [k for k in self.unposted if k == request_id or k.startswith(request_id + "-")]:
            del self.unposted[key]

    def outputs(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        endpoint: str,
        lora_name: str | None = None,
        **options: Unpack[RequestOptions],
    ) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for one prompt (see :meth:`_outputs`); counted in
        :meth:`queue_snapshot` from now until the engine has it."""
        limit = max(1, self.engine.max_model_len - len(prompt_ids))
        wanted = params.max_tokens if params.max_tokens is not None else limit
        self.unposted[request_id] = ((len(prompt_ids), max(1, min(wanted, limit))),) * max(1, params.n)
        # Nothing of the engine's generator runs before _outputs first iterates it.
        return self._outputs(
            self.engine.generate(prompt_ids, params, request_id, lora_name, **options),
            request_id,
            endpoint,
            options.get("ttft_deadline"),
        )

    async def _outputs(
        self,
        gen: AsyncGenerator[RequestOutput, None],
        request_id: str,
        endpoint: str,
        ttft_deadline: TTFTDeadline | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The engine's outputs ``gen`` for one prompt; aborts the request if iteration stops early.

        Raises APIError(504) when ``--request-timeout`` passes. The request is
        aborted (blocks freed) on every exit but a normal finish, including the
        cancellation Starlette delivers when the client disconnects.
        """
        started = time.monotonic()
        deadline = started + self.settings.request_timeout if self.settings.request_timeout else None
        # The first anext below registers the request with the engine before it yields to the loop.
        self.unposted.pop(request_id, None)
        last: RequestOutput | None = None
        last_emit = started
        status = "ok"
        try:
            while True:
                try:
                    async with asyncio.timeout_at(_loop_deadline(deadline)):
                        out = await anext(gen)
                except StopAsyncIteration:
                    break
                except LookupError as exc:
                    # The adapter was unloaded between the edge's check and the engine's intake.
                    status = "invalid_request"
                    raise APIError(404, str(exc), param="model") from None
                except ValueError as exc:
                    # The engine refuses bad input before queueing it, with a message saying what to change.
                    status = "invalid_request"
                    self.metrics.reject("invalid_request")
                    raise bad_request(str(exc)) from None
                except TTFTDeadlineRefusal as refusal:
                    status = "refused"
                    raise refused_from_queue(self.metrics, refusal, time.monotonic() - started) from None
                except StreamCutError:
                    status = "shutdown"
                    raise APIError(
                        503,
                        f"The server's drain deadline (--drain-timeout {self.settings.drain_timeout:g}s) "
                        "passed and this request was cut; retry against another replica.",
                    ) from None
                except TimeoutError:
                    status = "timeout"
                    self.metrics.reject("timeout")
                    raise APIError(
                        504,
                        f"The request ran past --request-timeout ({self.settings.request_timeout:g}s) "
                        "and was aborted; lower max_tokens or raise the timeout.",
                    ) from None
                now = time.monotonic()
                if last is not None and any(o.delta_token_ids for o in out.outputs):
                    self.metrics.observe_token_gap(now - last_emit)
                if any(o.delta_token_ids for o in out.outputs):
                    if ttft_deadline is not None and now > ttft_deadline.at:
                        self._judge_miss(request_id, ttft_deadline, now)
                    ttft_deadline = None  # judged at the first token only
                    last_emit = now
                last = out
                if out.error is not None:
                    status = "engine_error"
                    self.metrics.request_error("engine_error")
                    # The exception text stays in the log: it can hold paths, shapes or other
                    # requests' data, none of which is this client's to read.
                    log.error("request %s failed in the engine: %s", request_id, out.error)
                    raise APIError(
                        500,
                        f"Request {request_id} failed in the engine; the engine carries on serving other "
                        "requests. Retry, and report it with this request id if it repeats.",
                    )
                yield out
                if out.finished:
                    break
        except (asyncio.CancelledError, GeneratorExit):
            status = "client_disconnected"
            raise
        except APIError as err:
            if err.status >= 500 and status == "ok":
                status = "error"
            raise
        except Exception as exc:
            # An engine failure (e.g. its loop died) reaches a streaming client as an SSE
            # error event and a non-streaming one as a 500, both in OpenAI's shape.
            status = "error"
            self.metrics.request_error("engine_dead" if self.engine.is_dead else "engine_error")
            log.error("request %s failed in the engine: %r", request_id, exc)
            raise APIError(
                500, f"The engine failed on request {request_id}; the server log has the cause under this id."
            ) from exc
        finally:
            finished = last is not None and last.finished
            # Closing the engine's stream aborts the request there if it did not finish.
            with anyio.CancelScope(shield=True), contextlib.suppress(RuntimeError, StopAsyncIteration):
                await gen.aclose()
            if last is not None:
                record_request_spans(
                    last, self.settings.served_model_name, endpoint, request_id, time.monotonic()
                )
            if status == "client_disconnected" and self.drain_deadline_passed:
                status = "shutdown"
            self._log_finished(request_id, endpoint, last, started, status if not finished else "ok")

    def _judge_miss(self, request_id: str, deadline: TTFTDeadline, now: float) -> None:
        """An admitted request's first token came past its bound: count and log why, from the steps
        the engine ran since it was received (``classify_miss``)."""
        if deadline.promised is None:
            return
        received = deadline.at - deadline.bound_s
        cause, worst, allowed = classify_miss(deadline.promised, self.engine.recent_steps(received))
        self.metrics.admitted_miss(cause)
        log.info(
            "request %s missed its TTFT bound of %.0f ms (first token after %.0f ms): %s, slowest step "
            "against its allowance %.0f ms of %.0f ms",
            request_id, deadline.bound_s * 1000, (now - received) * 1000, cause, worst * 1000, allowed * 1000,
        )  # fmt: skip

    def _log_finished(
        self, request_id: str, endpoint: str, last: RequestOutput | None, started: float, status: str
    ) -> None:
        """One structured line per request: ids, token counts, TTFT, E2E, finish reason; no text."""
        record: dict[str, Any] = {
            "event": "request_finished",
            "request_id": request_id,
            "endpoint": endpoint,
            "model": self.settings.served_model_name,
            "status": status,
        }
        if last is not None:
            rm = last.metrics
            record.update(
                prompt_tokens=len(last.prompt_token_ids),
                completion_tokens=sum(len(o.token_ids) for o in last.outputs),
                cached_tokens=rm.num_cached_tokens,
                preemptions=rm.num_preemptions,
                finish_reasons=[o.finish_reason for o in last.outputs],
                ttft_s=_round(rm.first_token_time - rm.arrival_time) if rm.first_token_time else None,
                e2e_s=_round(time.monotonic() - rm.arrival_time),
            )
        else:
            record.update(
                prompt_tokens=None, completion_tokens=0, ttft_s=None, e2e_s=_round(time.monotonic() - started)
            )
        log.info(json.dumps(record, separators=(",", ":")))


def tenant_of(raw: Request, user: str | None) -> str | None:
    """The tenant a request is charged to: the GIE fairness header, else OpenAI's ``user``."""
    return raw.headers.get(FAIRNESS_HEADER) or user or None


def cache_salt_of(raw: Request, body_salt: str | None, settings: ServerSettings) -> str | None:
    """The prefix-cache salt of a request: the trusted tenant header and the body's ``cache_salt``.

    Only the header counts as the tenant here, never OpenAI's ``user``: a client writes
    ``user`` itself, so salting by it would let one client read another's cache by
    naming it. The header is the router's (or gateway's) to set; the router overwrites
    what a client sent. None keeps the engine's shared, unsalted cache.
    """
    tenant = raw.headers.get(FAIRNESS_HEADER) if settings.tenant_cache_isolation else None
    if not tenant and not body_salt:
        return None
    # JSON keeps the two parts apart: tenant "a" + salt "b:c" never equals tenant "a:b" + salt "c".
    return json.dumps([tenant or "", body_salt or ""], separators=(",", ":"))


def priority_of(raw: Request, body_priority: int, settings: ServerSettings) -> int:
    """The request's vLLM priority: its ``x-gateway-inference-objective``'s (400 if unknown), else the
    body's, raised to ``--min-client-priority`` so a client cannot put itself ahead of others."""
    try:
        return objective_priority(
            raw.headers.get(OBJECTIVE_HEADER),
            max(body_priority, settings.min_client_priority),
            settings.inference_objectives,
        )
    except ValueError as exc:
        raise bad_request(str(exc)) from None


def _round(x: float) -> float:
    return round(x, 6)


def _loop_deadline(deadline: float | None) -> float | None:
    # asyncio.timeout_at wants the loop's clock; time.monotonic() is the same clock in CPython's
    # default loop, but convert anyway so a custom loop clock cannot skew the timeout.
    if deadline is None:
        return None
    loop = asyncio.get_running_loop()
    return loop.time() + (deadline - time.monotonic())


async def hold_head(request: Request, streams: list[AsyncIterator[T]]) -> list[AsyncIterator[T]]:
    """``streams`` with each one's first item already read, for a streamed answer whose head must
    wait for it: a request held to a TTFT bound may still be refused from the queue
    (``engine/late_refusal.py``) and the client must then get a clean 429, not a 200 stream with
    an error event in it. An error before any first item (that 429, a timeout) is raised here,
    with every stream closed (their requests aborted); a disconnect meanwhile aborts them too.
    """
    firsts: list[list[T]] = []
    try:
        for stream in streams:

            async def first(stream: AsyncIterator[T] = stream) -> list[T]:
                async for item in stream:
                    return [item]
                return []

            firsts.append(await until_disconnect(request, first))
    except BaseException:
        with anyio.CancelScope(shield=True):
            for stream in streams:
                with contextlib.suppress(Exception):
                    await stream.aclose()  # type: ignore[attr-defined]
        raise
    return [_after(head, stream) for head, stream in zip(firsts, streams, strict=True)]


async def _after(head: list[T], rest: AsyncIterator[T]) -> AsyncGenerator[T, None]:
    """``head``'s items, then ``rest``'s; closing this closes ``rest``."""
    async with contextlib.aclosing(rest):  # type: ignore[type-var]
        for item in head:
            yield item
        async for item in rest:
            yield item


async def merge(streams: Sequence[AsyncIterator[T]]) -> AsyncGenerator[tuple[int, T], None]:
    """Interleave several async iterators as their items arrive, tagged with their index.

    Used for a completions request with several prompts. The first exception
    ends the merge; the other streams are cancelled (which aborts their requests).
    """
    if len(streams) == 1:
        # aclosing: when our consumer stops early, close the stream now (aborting its
        # request) instead of whenever the garbage collector finalises it.
        async with contextlib.aclosing(streams[0]) as only:  # type: ignore[type-var]
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None, bool]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for item in stream:
                    await queue.put((i, item, None, False))
            await queue.put((i, None, None, True))
        except BaseException as exc:
            await queue.put((i, None, exc, True))
            if isinstance(exc, asyncio.CancelledError):
                raise

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item, exc, done = await queue.get()
            if exc is not None and not isinstance(exc, asyncio.CancelledError):
                raise exc
            if done:
                remaining -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnect(request: Request, work: Callable[[], Awaitable[T]]) -> T:
    """Run ``work`` but cancel it if the client disconnects first (non-streaming requests).

    Starlette only notices disconnects while streaming; a request waiting for a
    full completion would otherwise keep its KV blocks until the engine finished.
    """
    task = asyncio.ensure_future(work())

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                task.cancel()
                return

    watcher = asyncio.ensure_future(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled():
            # Nobody reads this response; returning one keeps the ASGI server's log clean.
            raise APIError(499, "The client closed the connection; the request was aborted.") from None
        raise
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
