"""The forwarding path: pick a replica, send the request, relay the answer byte for byte.

What it is: one async function per request. The body is read once, routed by
:class:`plimsoll.router.policy.Router`, and sent with ``httpx.AsyncClient`` in
streaming mode; the replica's status, headers and body (SSE included) go back to
the client chunk by chunk as they arrive, so a replica's 4xx reaches the client
unchanged. What it is not: a validator or a transformer of requests; the router
never parses more of a body than it needs to route it.

Retry rule: a request goes to another replica, without the client seeing anything,
when the connection could not be made at all (connect refused or timed out), or
when the replica refused it for reasons of its own: ``x-plimsoll-overload: replica``
(its queue is full, or it is draining) or a 502/503. When every replica refused so,
the client gets 429 with ``x-plimsoll-overload: service`` and ``Retry-After``: the
service, not one replica, is out of room.

Wait rule: a POST that finds no replica ready, after one failed it or while replicas
that served before are away (restarting), waits up to ``--migration-wait`` seconds for
one to be ready (less if its client goes away first), then gets 503 with
``Retry-After``: nothing of it was started, so the client may send it again as it is.

Migration rule (``--migration-limit N``, ``migration.py``): a generation request whose
replica fails after it was sent is carried on by another replica, up to N times. A
request still waiting for its answer is sent again whole (the client has nothing yet);
a stream already under way continues from the last token the client received, on the
same SSE stream with the same ``id``. With N = 0 the client gets the failure: a 502,
or, mid-stream, one error event (vLLM's convention) and no ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from plimsoll.auth import bearer_matches
from plimsoll.objectives import FAIRNESS_HEADER, GATEWAY_HEADER_PREFIX, OBJECTIVE_HEADER, objective_priority
from plimsoll.overload import OVERLOAD_HEADER, SERVICE
from plimsoll.router import migration
from plimsoll.router.backends import Replica, ReplicaSet
from plimsoll.router.config import RouterConfig
from plimsoll.router.hold import HoldFull, HoldQueue, HoldTimeout
from plimsoll.router.metrics import RouterMetrics
from plimsoll.router.migrating_relay import MigratingRelay
from plimsoll.router.migration import ReplicaFailed, StreamLedger
from plimsoll.router.policy import (
    AllSaturated,
    Decision,
    NoReadyReplica,
    RequestFeatures,
    Router,
    prompt_tokens,
)
from plimsoll.router.slo_routing import SLO_TTFT_HEADER, request_bound, slo_exclusions
from plimsoll.router.standby_wake import StandbyWaker
from plimsoll.router.upstream import Leg, is_event_stream, refused_for_itself, send_watched
from plimsoll.tracing import inject_headers, tracer

log = logging.getLogger(__name__)

# Headers that describe one hop, not the message; the router sets its own.
_HOP_HEADERS = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "host", "content-length", "date", "server",
})
HOP_HEADERS = _HOP_HEADERS
REPLICA_HEADER = "x-plimsoll-replica"
# Failures that happen before a connection exists: nothing was sent, a retry is safe.
_NOTHING_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
# While a request waits for a replica, how often it checks that its client is still there.
_DISCONNECT_CHECK_S = 1.0


class _RelayResponse(StreamingResponse):
    """A streamed relay that releases its replica even when the body is never iterated.

    If the client goes away before the first byte, Starlette never starts the
    body iterator, so its ``finally`` would not run; this does.
    """

    def __init__(self, content: AsyncIterator[bytes], release: Callable[[], Awaitable[None]], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._release()


def error_response(status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """An error in the OpenAI shape the replicas use, so clients parse the router's errors alike."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


class Proxy:
    def __init__(
        self,
        config: RouterConfig,
        replica_set: ReplicaSet,
        router: Router,
        metrics: RouterMetrics,
        client: httpx.AsyncClient,
        hold: HoldQueue | None = None,
    ) -> None:
        self._config = config
        self._hold = hold
        self._replica_set = replica_set
        self._router = router
        self._metrics = metrics
        self._client = client
        self._chars_per_token = config.lanes.chars_per_token if config.lanes else 4.0
        self.shed_slo_total = 0  # requests refused because every replica would miss their TTFT bound
        # Requests the router answered itself, by reason (the counter's values, for the operator's GET /hold).
        self.refused_total: dict[str, int] = {}
        # --policy precise-prefix: the prompt's block hashes, computed off the event loop.
        self.prompt_tokens: Any = None
        self.kv_events: Any = None
        # Standby (router/standby_wake.py): wakes a parked replica when every ready one is past its target.
        self.waker: StandbyWaker | None = None

    @property
    def config(self) -> RouterConfig:
        return self._config

    async def forward(self, request: Request, body: bytes | None = None) -> Response:
        """Route ``request`` (with ``body`` in place of its own when given: the prefill/decode path's hops)."""
        arrival = time.monotonic()
        endpoint = request.url.path
        # Who is asking is settled before a byte of the body is read, and before the request can
        # be held (an anonymous request never wakes replicas up when the router authenticates).
        identity = authenticate(self._config, request.headers.get("authorization"))
        if isinstance(identity, Response):
            return self._finish(identity, endpoint, arrival, reason="unauthenticated")
        if body is None:
            read = await read_capped_body(request, self._config.max_request_bytes)
            if isinstance(read, Response):
                return self._finish(read, endpoint, arrival, reason="too_large")
            body = read
        parsed = _parse_json(body)
        features = RequestFeatures.from_body(
            parsed, prefix_chars=self._config.prefix_chars, chars_per_token=self._chars_per_token
        )
        if self.prompt_tokens is not None and endpoint != "/v1/models":
            block_size = self.kv_events.block_size or self._config.kv_block_size
            hashes = await asyncio.to_thread(self.prompt_tokens.block_hashes, parsed, block_size)
            features = dataclasses.replace(features, block_hashes=hashes)
        headers = upstream_headers(self._config, request, identity)
        target = endpoint + (f"?{request.url.query}" if request.url.query else "")
        if self.waker is not None and request.method == "POST" and endpoint in migration.GENERATION_ENDPOINTS:
            # Every ready replica past its target: a parked one is woken and this request waits for it.
            wake = self.waker.reserve()
            if wake is not None:
                await self.waker.wait(wake)
        # Replicas predicted to miss the request's TTFT bound are not tried; when that is all, refuse now.
        tried, refused = self._slo_exclusions(request, parsed, endpoint, arrival)
        if refused is not None:
            return refused
        # Released from the hold queue: the release slot is given back when the response ends.
        held = False
        # Only generation is held: a GET (/v1/models) at zero replicas is answered 503 at once, so
        # it never counts as demand that starts a GPU replica.
        if self._hold is not None and request.method == "POST" and self._hold.should_hold():
            priority = hold_priority(dict(headers).get(OBJECTIVE_HEADER), body, self._config.inference_objectives)
            refused = await self._wait_in_hold(endpoint, arrival, priority)
            if refused is not None:
                return refused
            held = True
        try:
            response = await self._forward(request, endpoint, body, features, headers, target, arrival, tried, held)
        except BaseException:
            if held:
                self._hold.done()  # type: ignore[union-attr]
            raise
        if held and not isinstance(response, _RelayResponse):
            self._hold.done()  # type: ignore[union-attr]
        return response

    async def _wait_in_hold(self, endpoint: str, arrival: float, priority: int = 0) -> Response | None:
        """Hold until a replica can take the request; None when released, else the 429/503 to send."""
        assert self._hold is not None
        self._metrics.held.set(self._hold.held + 1)
        try:
            waited = await self._hold.hold(priority)
        except HoldFull as full:
            response = error_response(429, str(full), "RateLimitError",
                                      headers={"Retry-After": str(full.retry_after_s), OVERLOAD_HEADER: SERVICE})
            return self._finish(response, endpoint, arrival, reason="hold_full")
        except HoldTimeout as timeout:
            response = error_response(503, str(timeout), "ServiceUnavailableError",
                                      headers={"Retry-After": str(self._hold.cold_starts.retry_after_s(None)),
                                               OVERLOAD_HEADER: SERVICE})
            return self._finish(response, endpoint, arrival, reason="hold_timeout")
        finally:
            self._metrics.held.set(self._hold.held)
        self._metrics.hold_seconds.observe(waited)
        return None

    def _pick(self, features: RequestFeatures, exclude: set[str]) -> Decision:
        """The policy's choice among ready replicas not in ``exclude``, traced and counted."""
        with tracer().start_as_current_span("pick", attributes={"plimsoll.router.policy": self._router.picker.name}) as pick:
            decision = self._router.choose(features, frozenset(exclude))
            pick.set_attributes({
                "plimsoll.router.replica": decision.replica.url,
                "plimsoll.router.reason": decision.reason,
                "plimsoll.router.lane": decision.lane,
            })
        self._metrics.decisions.labels(self._router.picker.name, decision.reason, decision.lane).inc()
        return decision

    async def _forward(
        self, request: Request, endpoint: str, body: bytes, features: RequestFeatures,
        headers: list[tuple[str, str]], target: str, arrival: float, tried: set[str], held: bool,
    ) -> Response:
        limit = self._config.migration_limit
        generation = request.method == "POST" and endpoint in migration.GENERATION_ENDPOINTS
        # Until the client has a byte, another replica can do a generation request whole.
        resendable = generation and limit > 0
        ledger: StreamLedger | None = None
        # What a failure mid-answer counts as when no ledger carries the stream on.
        lost_outcome: str | None = None
        if generation:
            parsed = _parse_json(body)
            lost_outcome = migration.UNSUPPORTED
            if migration.unsupported(endpoint, parsed) is None:
                lost_outcome = migration.LIMIT_REACHED
                if limit > 0:
                    ledger = StreamLedger(endpoint, parsed)
                    body = ledger.first_body()  # asks the replica for the token ids a continuation needs
        resends = 0
        refused_retry_after: list[str] = []  # Retry-After of each replica that refused for itself
        unreachable: set[str] = set()  # replicas this request could not connect to
        # Set once a replica failed the request, or when it arrives while replicas that served
        # are away (restarting): from then on, with no replica ready, wait for one.
        wait_deadline: float | None = None
        while True:
            try:
                decision = self._pick(features, tried)
            except AllSaturated:
                return self._reject_saturated(endpoint, arrival)
            except NoReadyReplica:
                if wait_deadline is None and request.method == "POST" and self._replica_set.away():
                    wait_deadline = time.monotonic() + self._config.migration_wait_s
                remaining = wait_deadline - time.monotonic() if wait_deadline is not None else 0.0
                if remaining > 0 and await self._wait_for_replica(request, tried, remaining):
                    continue
                if refused_retry_after:
                    return self._reject_overloaded(endpoint, arrival, refused_retry_after)
                return self._reject_unavailable(endpoint, arrival, unreachable, waited=wait_deadline is not None)
            replica = decision.replica
            inject_headers(headers)  # the replica's spans join this trace (W3C traceparent)
            self._begin(replica)
            upstream_request = self._client.build_request(
                request.method, replica.url + target, content=body, headers=headers
            )
            try:
                upstream = await send_watched(self._client, upstream_request, replica)
            except _NOTHING_SENT as exc:
                self._end(replica)
                log.warning("connect to %s failed (%s); retrying on another replica", replica.url, exc)
                # Not ready again until its probe answers (a restarted pod keeps its address), so
                # it is not excluded for good: the request may wait for it to come back.
                self._replica_set.mark_unreachable(replica.url)
                self._metrics.upstream_errors.labels(replica.url, "connect").inc()
                self._metrics.retries.labels(replica.url).inc()
                unreachable.add(replica.url)
                if wait_deadline is None:
                    wait_deadline = time.monotonic() + self._config.migration_wait_s
                continue
            except (httpx.HTTPError, ReplicaFailed) as exc:
                # The request reached the replica and it failed before answering: it may have
                # started, so it is sent again only where that is safe and allowed.
                self._end(replica)
                self._replica_set.mark_unreachable(replica.url)  # a candidate again once its probe answers
                self._metrics.upstream_errors.labels(replica.url, "read").inc()
                if resendable and resends < limit:
                    resends += 1
                    if wait_deadline is None:
                        wait_deadline = time.monotonic() + self._config.migration_wait_s
                    self._metrics.migrations.labels(migration.MIGRATED).inc()
                    log.warning("replica %s failed before answering (%s); sending the request to another "
                                "replica (%d of --migration-limit %d)", replica.url, exc, resends, limit)
                    continue
                if generation:
                    self._metrics.migrations.labels(migration.LIMIT_REACHED).inc()
                why = f"--migration-limit {limit} reached" if resendable else "not retried because it may have started"
                return self._finish(
                    error_response(502, f"replica {replica.url} failed after the request was sent "
                                   f"({type(exc).__name__}); {why}", "BadGatewayError"),
                    endpoint, arrival, reason="upstream_failed",
                )
            if refused_for_itself(upstream):
                # Its queue is full or it is draining: another replica may take it, and nothing was started.
                refused_retry_after.append(upstream.headers.get("retry-after", ""))
                await upstream.aclose()
                self._end(replica)
                self._metrics.retries.labels(replica.url).inc()
                tried.add(replica.url)
                continue
            if ledger is not None and upstream.status_code == 200 and is_event_stream(upstream):
                relay = MigratingRelay(self, ledger, Leg(upstream, replica), features, headers, target,
                                       endpoint, arrival, held)  # fmt: skip
                return _RelayResponse(relay.content(), relay.release, status_code=200, headers={
                    **{k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS},
                    REPLICA_HEADER: replica.url,
                })  # fmt: skip
            release = self._releaser(upstream, replica, endpoint, arrival, held)
            return _RelayResponse(
                self._relay(upstream, replica, endpoint, arrival, release, lost_outcome),
                release,
                status_code=upstream.status_code,
                headers={
                    **{k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS},
                    # Which replica answered: lets a client (and the tests) tie a failure to a replica.
                    REPLICA_HEADER: replica.url,
                },
            )

    async def _wait_for_replica(self, request: Request, exclude: set[str], timeout: float) -> bool:
        """Wait up to ``timeout`` s for a ready replica not in ``exclude``; False at once if the client
        goes away (its own deadline passed), so a request nobody waits for is never sent."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (remaining := deadline - loop.time()) > 0:
            if await self._replica_set.wait_ready(exclude, min(remaining, _DISCONNECT_CHECK_S)):
                return True
            if await request.is_disconnected():
                return False
        return False

    def _releaser(
        self, upstream: httpx.Response, replica: Replica, endpoint: str, arrival: float, held: bool = False
    ) -> Callable[[], Awaitable[None]]:
        """Close the upstream response and count the request out, exactly once."""
        released = False

        async def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            try:
                await upstream.aclose()
            finally:
                self._end(replica)
                if held and self._hold is not None:
                    self._hold.done()
            self._metrics.duration.labels(endpoint, str(upstream.status_code)).observe(time.monotonic() - arrival)

        return release

    async def _relay(
        self, upstream: httpx.Response, replica: Replica, endpoint: str, arrival: float,
        release: Callable[[], Awaitable[None]], lost_outcome: str | None = None,
    ) -> AsyncIterator[bytes]:
        first = True
        try:
            async for chunk in upstream.aiter_raw():
                replica.heard()
                if first and chunk:
                    self._metrics.first_byte.labels(endpoint).observe(time.monotonic() - arrival)
                    first = False
                yield chunk
        except httpx.HTTPError as exc:
            # The replica broke off mid-answer (died, or reset the connection). The
            # client already has part of it, so the only honest thing is to fail it.
            self._metrics.upstream_errors.labels(replica.url, "stream_broken").inc()
            if lost_outcome is not None:
                self._metrics.migrations.labels(lost_outcome).inc()
            self._replica_set.mark_unreachable(replica.url)
            log.warning("replica %s broke off a response to %s: %s", replica.url, endpoint, exc)
            if upstream.headers.get("content-type", "").startswith("text/event-stream"):
                # vLLM's convention for a mid-stream error: one error event, no [DONE];
                # the openai client raises on it.
                error = {"error": {"message": f"replica {replica.url} failed mid-stream: {type(exc).__name__}",
                                   "type": "BadGatewayError", "param": None, "code": 502}}
                yield f"data: {json.dumps(error)}\n\n".encode()
            else:
                raise  # abort the connection so the client cannot mistake a truncated body for a whole one
        finally:
            await release()

    def _begin(self, replica: Replica) -> None:
        replica.inflight += 1
        replica.routed_total += 1
        self._set_inflight_gauge(replica)

    def _end(self, replica: Replica) -> None:
        replica.inflight -= 1
        self._set_inflight_gauge(replica)

    def _set_inflight_gauge(self, replica: Replica) -> None:
        if self._replica_set.get(replica.url) is replica:  # a replica that left has no series
            self._metrics.inflight.labels(replica.url).set(replica.inflight)

    def _slo_exclusions(
        self, request: Request, parsed: Any, endpoint: str, arrival: float
    ) -> tuple[set[str], Response | None]:
        try:
            bound = request_bound(request.headers.get(SLO_TTFT_HEADER), self._config.slo_ttft_s)
        except ValueError as exc:
            return set(), self._finish(error_response(400, str(exc), "BadRequestError"), endpoint, arrival,
                                       reason="invalid_request")  # fmt: skip
        prompt = prompt_tokens(parsed, self._chars_per_token)
        missing, refusal = slo_exclusions(self._replica_set.ready(), prompt, bound)
        if refusal is None:
            return missing, None
        self.shed_slo_total += 1
        response = error_response(
            429, refusal.message(), "RateLimitError",
            headers={"Retry-After": str(refusal.retry_after_s), OVERLOAD_HEADER: SERVICE},
        )  # fmt: skip
        return missing, self._finish(response, endpoint, arrival, reason="slo_ttft")

    def _reject_saturated(self, endpoint: str, arrival: float) -> Response:
        retry_after = str(self._config.retry_after_seconds)
        response = error_response(
            429,
            f"every ready replica is saturated (running + waiting >= "
            f"{self._config.max_inflight_per_replica} each); retry after {retry_after} s",
            "RateLimitError",
            headers={"Retry-After": retry_after, OVERLOAD_HEADER: SERVICE},
        )
        return self._finish(response, endpoint, arrival, reason="saturated")

    def _reject_overloaded(self, endpoint: str, arrival: float, retry_after: list[str]) -> Response:
        """Every replica refused for itself (full or draining): the service is out of room."""
        seconds = max([int(v) for v in retry_after if v.isdigit()] or [self._config.retry_after_seconds])
        response = error_response(
            429,
            f"every ready replica refused this request as full or draining ({len(retry_after)} asked); "
            f"retry after {seconds} s",
            "RateLimitError",
            headers={"Retry-After": str(seconds), OVERLOAD_HEADER: SERVICE},
        )
        return self._finish(response, endpoint, arrival, reason="replicas_full")

    def _reject_unavailable(self, endpoint: str, arrival: float, unreachable: set[str], *, waited: bool) -> Response:
        """No replica can take the request (none was ready, or none ready came back within the wait): 503.

        Nothing of the request was started anywhere, so the client may send it again as it is.
        """
        message = "no ready replica"
        if waited:
            message += f" came back within --migration-wait {self._config.migration_wait_s:g} s"
        if unreachable:
            message += f" (could not connect to {', '.join(sorted(unreachable))})"
        response = error_response(
            503, f"{message}; check the replicas' /ready and the router's /metrics "
            "(plimsoll_router_replica_ready)", "ServiceUnavailableError",
            headers={"Retry-After": str(self._config.retry_after_seconds), OVERLOAD_HEADER: SERVICE},
        )
        return self._finish(response, endpoint, arrival, reason="no_replica")

    def _finish(self, response: Response, endpoint: str, arrival: float, *, reason: str) -> Response:
        self._metrics.rejections.labels(reason).inc()
        self.refused_total[reason] = self.refused_total.get(reason, 0) + 1
        self._metrics.duration.labels(endpoint, str(response.status_code)).observe(time.monotonic() - arrival)
        return response


class Identity:
    """An authenticated client: its tenant (from a tenant key), or None (the service key, or auth off)."""

    __slots__ = ("tenant",)

    def __init__(self, tenant: str | None) -> None:
        self.tenant = tenant


def authenticate(config: RouterConfig, header: str | None) -> Identity | Response:
    """The client's identity from ``Authorization``, or the 401 to send; everyone passes with auth off."""
    if not config.authenticates:
        return Identity(None)
    if config.api_key is not None and bearer_matches(header, config.api_key):
        return Identity(None)
    for key, tenant in config.tenant_keys.items():  # every key compared, in constant time each
        if bearer_matches(header, key):
            return Identity(tenant)
    what = "missing" if not header else "wrong"
    return error_response(401, f"The API key is {what}; send the header `Authorization: Bearer <key>`.",
                          "AuthenticationError")  # fmt: skip


async def read_capped_body(request: Request, limit: int) -> bytes | Response:
    """The body, or a 413 once it passes ``limit`` bytes (a declared length over it is refused unread)."""
    declared = request.headers.get("content-length", "")
    too_large = error_response(
        413, f"The request body is larger than this router accepts ({limit} bytes, --max-request-bytes); "
        "send a smaller request.", "RequestTooLargeError",
    )  # fmt: skip
    if declared.isdigit() and int(declared) > limit:
        return too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            return too_large
    return bytes(body)


def upstream_headers(config: RouterConfig, request: Request, identity: Identity) -> list[tuple[str, str]]:
    """The headers sent to the replica: the client's, less hop-by-hop ones, with the router's own
    credential and gateway headers in place of anything the client claimed."""
    headers = []
    for name, value in request.headers.items():
        lower = name.lower()
        if lower in _HOP_HEADERS:
            continue
        if lower.startswith(GATEWAY_HEADER_PREFIX) and not config.trust_gateway_headers:
            continue  # a client does not pick its own tenant or objective
        if lower == "authorization" and config.authenticates:
            continue  # the client's key (a tenant key) is the router's to check, not the replica's
        headers.append((name, value))
    if config.authenticates and config.api_key is not None:
        headers.append(("authorization", f"Bearer {config.api_key}"))
    if identity.tenant is not None:
        headers = [(k, v) for k, v in headers if k.lower() != FAIRNESS_HEADER]
        headers.append((FAIRNESS_HEADER, identity.tenant))
    if request.client is not None:
        headers.append(("x-forwarded-for", request.client.host))
    return headers


def hold_priority(objective: str | None, body: bytes, objectives: dict[str, int]) -> int:
    """The vLLM priority a held request is released by: its objective's, else the body's ``priority``."""
    try:
        return objective_priority(objective, _priority(body), objectives)
    except ValueError:
        return _priority(body)  # forwarded as it is: the replica answers the 400 that names the fix


def _priority(body: bytes) -> int:
    """The request's vLLM ``priority`` (lower first), 0 when absent or not an integer."""
    parsed = _parse_json(body)
    value = parsed.get("priority", 0) if isinstance(parsed, dict) else 0
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _parse_json(body: bytes) -> Any:
    try:
        return json.loads(body) if body else None
    except ValueError:
        return None  # the replica will say what is wrong with it
