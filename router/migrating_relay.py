"""The relay of a stream that can outlive its replica.

What it is: :class:`MigratingRelay` sends a stream's events to the client through its
:class:`~plimsoll.router.migration.StreamLedger`, one *leg* (one replica's answer) at a
time. When the replica fails mid-stream (the connection breaks, it sends a 5xx error
event, or the scraper finds it lost) the relay picks another replica the same way the
request was first routed (excluding those that failed), sends it the ledger's
continuation, and carries on with its answer; the client sees one stream. It stops, with
one error event, when ``--migration-limit`` is reached, no replica can take the stream,
or a replica refuses the continuation; when the output was already complete it writes
the stream's end itself. Each failure is counted in
``plimsoll_router_migrations_total{outcome}``.

What it is not: the first routing decision or the plain relay (``proxy.py``), or the
reading of events (``migration.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import anyio
import httpx

from plimsoll.router import migration
from plimsoll.router.migration import ReplicaFailed, StreamLedger, error_event
from plimsoll.router.policy import AllSaturated, NoReadyReplica, RequestFeatures
from plimsoll.router.upstream import Leg, is_event_stream, refused_for_itself, send_watched

if TYPE_CHECKING:
    from plimsoll.router.proxy import Proxy

log = logging.getLogger(__name__)


class MigratingRelay:
    def __init__(
        self, proxy: Proxy, ledger: StreamLedger, first: Leg, features: RequestFeatures,
        headers: list[tuple[str, str]], target: str, endpoint: str, arrival: float, held: bool,
    ) -> None:  # fmt: skip
        self.proxy = proxy
        self.ledger = ledger
        self.legs = [first]  # legs[-1] serves the stream now; the others are closed and counted out
        self.features = features
        self.headers = headers
        self.target = target
        self.endpoint = endpoint
        self.arrival = arrival
        # Replicas this stream may not go back to: they failed it with an error event or refused
        # the continuation. One that broke off is marked unreachable instead, and is a candidate
        # again once its probe answers (a restarted pod).
        self.refused: set[str] = set()
        self.held = held
        self._released = False

    async def _drop(self, leg: Leg) -> None:
        if not leg.closed:
            with anyio.CancelScope(shield=True):
                await leg.close()
            self.proxy._end(leg.replica)

    async def release(self) -> None:
        """Close the current leg and count the request out, exactly once."""
        if self._released:
            return
        self._released = True
        try:
            await self._drop(self.legs[-1])
        finally:
            if self.held and self.proxy._hold is not None:
                self.proxy._hold.done()
        self.proxy._metrics.duration.labels(self.endpoint, "200").observe(time.monotonic() - self.arrival)

    async def content(self) -> AsyncIterator[bytes]:
        """The client's stream: every leg's events, as the ledger rewrites them."""
        metrics, ledger = self.proxy._metrics, self.ledger
        first_byte = True
        try:
            while True:
                leg = self.legs[-1]
                failure: ReplicaFailed | None = None
                try:
                    async for chunk in leg.chunks():
                        out, failure = ledger.feed(chunk)
                        if out:
                            if first_byte:
                                metrics.first_byte.labels(self.endpoint).observe(
                                    time.monotonic() - self.arrival
                                )
                                first_byte = False
                            yield out
                        if failure is not None or ledger.done:
                            break
                    else:
                        failure = ReplicaFailed("the replica closed the stream before [DONE]", transport=True)
                except httpx.HTTPError as exc:
                    failure = ReplicaFailed(f"{type(exc).__name__}: {exc}", transport=True)
                except ReplicaFailed as exc:
                    failure = exc
                if failure is None:
                    return  # [DONE] delivered
                end = await self._after_failure(leg, failure)
                if end is not None:
                    yield end
                    return
        finally:
            await self.release()

    async def _after_failure(self, leg: Leg, failure: ReplicaFailed) -> bytes | None:
        """Carry the stream on after ``leg`` failed: None with a new leg in place, else the stream's last bytes."""
        proxy, ledger, limit = self.proxy, self.ledger, self.proxy._config.migration_limit
        url = leg.replica.url
        proxy._metrics.upstream_errors.labels(url, "stream_broken").inc()
        log.warning("replica %s failed mid-stream (%s) after %d tokens", url, failure, len(ledger.token_ids))
        if failure.transport:
            proxy._replica_set.mark_unreachable(url)
        else:
            self.refused.add(url)
        await self._drop(leg)
        if ledger.finished:
            proxy._metrics.migrations.labels(migration.COMPLETED).inc()
            return ledger.ending()
        if ledger.untracked:
            proxy._metrics.migrations.labels(migration.UNSUPPORTED).inc()
            return error_event(f"replica {url} failed mid-stream ({failure}); it sent no token ids "
                               "(return_token_ids), so no other replica can carry the stream on")  # fmt: skip
        if ledger.migrations >= limit:
            proxy._metrics.migrations.labels(migration.LIMIT_REACHED).inc()
            return error_event(f"replica {url} failed mid-stream ({failure}); the stream was already carried "
                               f"on {ledger.migrations} time(s), --migration-limit {limit}")  # fmt: skip
        carried = await self._carry_on()
        if isinstance(carried, bytes):
            return carried
        self.legs.append(carried)
        return None

    async def _carry_on(self) -> Leg | bytes:
        """The stream's next leg on another replica, or the error event that ends the stream.

        With no replica ready (the others restarting too) it waits up to ``--migration-wait``.
        """
        proxy, ledger, config = self.proxy, self.ledger, self.proxy._config
        loop = asyncio.get_running_loop()
        deadline = loop.time() + config.migration_wait_s
        while True:
            # A continuation needs a plimsoll replica: a vLLM one would start the output over.
            exclude = self.refused | {
                r.url for r in proxy._replica_set.replicas.values() if r.engine == "vllm"
            }
            remaining = deadline - loop.time()
            try:
                decision = proxy._pick(self.features, exclude)
            except (AllSaturated, NoReadyReplica) as none:
                if remaining > 0 and isinstance(none, NoReadyReplica):
                    if await proxy._replica_set.wait_ready(exclude, remaining):
                        continue
                elif remaining > 0:  # all saturated: their loads change with the next scrape
                    await asyncio.sleep(min(remaining, config.scrape_interval_s))
                    continue
                proxy._metrics.migrations.labels(migration.NO_REPLICA).inc()
                return error_event(f"no other replica could carry this stream on after {len(ledger.token_ids)} "
                                   f"tokens within --migration-wait {config.migration_wait_s:g} s")  # fmt: skip
            replica = decision.replica
            proxy._begin(replica)
            upstream_request = proxy._client.build_request(
                "POST", replica.url + self.target, content=ledger.continuation_body(), headers=self.headers
            )
            try:
                upstream = await send_watched(proxy._client, upstream_request, replica)
            except (httpx.HTTPError, ReplicaFailed) as exc:
                proxy._end(replica)
                proxy._replica_set.mark_unreachable(replica.url)
                proxy._metrics.upstream_errors.labels(replica.url, "connect").inc()
                log.warning("replica %s could not take a migrated stream (%s)", replica.url, exc)
                continue
            except BaseException:
                proxy._end(replica)
                raise
            if upstream.status_code == 200 and is_event_stream(upstream):
                ledger.begin_leg()
                proxy._metrics.migrations.labels(migration.MIGRATED).inc()
                log.info("stream carried on by %s after %d tokens (%d of --migration-limit %d)", replica.url,
                         len(ledger.token_ids), ledger.migrations, proxy._config.migration_limit)  # fmt: skip
                return Leg(upstream, replica)
            try:
                answer = (await upstream.aread())[:500].decode("utf-8", "replace")
            except httpx.HTTPError:
                answer = ""
            finally:
                await upstream.aclose()
                proxy._end(replica)
            self.refused.add(replica.url)
            if refused_for_itself(upstream):
                proxy._metrics.retries.labels(replica.url).inc()
                continue
            proxy._metrics.migrations.labels(migration.REFUSED).inc()
            return error_event(f"replica {replica.url} refused to carry this stream on "
                               f"({upstream.status_code}: {answer})")  # fmt: skip
