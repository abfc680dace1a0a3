"""The router's two-hop path for a split fleet: prefill on one pool, decode on the other.

What it is: :class:`PrefillDecode`, what `plimsoll route --prefill URL... --decode URL...` (or
``--llmservice NAME --disaggregated``) runs per request, in vLLM's ``kv_transfer_params`` protocol.
Hop 1 sends the request, with ``max_tokens=1``, ``stream=false`` and ``{"do_remote_decode":
true}``, to the least-loaded prefill replica and reads the parameters its answer carries (where
the prompt's blocks wait). Hop 2 sends the client's own request, plus those parameters, to a
decode replica chosen by the decode pool's policy (load and prefix; ``--decode-policy``); its
answer goes back to the client as it comes (streamed or not, with its usage and its errors), so
the client sees one request. The prefill hop's token is not shown: the decode replica
recomputes the prompt's tail and produces the same first token.

Fallbacks, so a failure anywhere costs time, not the request: no prefill replica, a prefill that
fails, times out or hands back no parameters -> the decode hop goes without them and the decode
replica prefills locally; a pull that fails on the decode replica -> that replica prefills what it
lacks (``runtime/kv/remote_prefill.py``); no decode replica reachable -> the request runs whole on a
prefill replica. A request the protocol cannot split (several prompts, ``n > 1``, its own
``kv_transfer_params``, ``/v1/models``) goes to the decode pool as it is. Every path taken is
counted in ``plimsoll_router_pd_requests_total{path, reason}``.

What it is not: the single-hop proxy (``proxy.py``, which both hops' relaying reuses) or a
policy (``policy.py``).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client import Counter, Histogram
from starlette.requests import Request
from starlette.responses import Response

from plimsoll.metric_names import TTFT_BUCKETS
from plimsoll.router.backends import ReplicaSet
from plimsoll.router.metrics import PREFIX, RouterMetrics
from plimsoll.router.policy import AllSaturated, NoReadyReplica, RequestFeatures, Router
from plimsoll.router.proxy import REPLICA_HEADER, Proxy, authenticate, read_capped_body, upstream_headers

log = logging.getLogger(__name__)

PREFILL_HEADER = "x-plimsoll-prefill-replica"
PD_REQUESTS = PREFIX + "pd_requests"
PREFILL_DURATION = PREFIX + "prefill_duration_seconds"
SPLITTABLE = ("/v1/completions", "/v1/chat/completions")
_NOTHING_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """Hop 1's request: the client's, cut to one token, not streamed, asking the replica to hold its blocks."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens", "echo", "logprobs",
                                                       "top_logprobs", "min_completion_tokens")}  # fmt: skip
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                 "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip
    return out


def split_refusal(endpoint: str, body: Any) -> str | None:
    """Why a request goes to the decode pool unsplit (a metric label), or None when it can be split."""
    if endpoint not in SPLITTABLE:
        return "endpoint"
    if not isinstance(body, dict):
        return "unparsed"
    if body.get("kv_transfer_params"):
        return "client_params"
    if body.get("n", 1) not in (1, None) or body.get("best_of", 1) not in (1, None):
        return "n"
    prompt = body.get("prompt")
    if (
        endpoint == "/v1/completions"
        and isinstance(prompt, list)
        and prompt
        and not isinstance(prompt[0], int)
    ):
        return "batch"
    return None


@dataclass(eq=False)
class PrefillDecode:
    prefill_set: ReplicaSet
    prefill_router: Router
    decode: Proxy
    prefill: Proxy
    metrics: RouterMetrics
    client: httpx.AsyncClient
    prefill_timeout_s: float
    requests: Counter = field(init=False)
    prefill_seconds: Histogram = field(init=False)

    def __post_init__(self) -> None:
        self.requests = Counter(PD_REQUESTS, "Requests on the prefill/decode path by the path taken (split, "
                                "fallback, unsplit, aggregated) and why.", ["path", "reason"],
                                registry=self.metrics.registry)  # fmt: skip
        self.prefill_seconds = Histogram(PREFILL_DURATION, "Hop 1 (prefill, max_tokens=1) from send to answer.",
                                         buckets=TTFT_BUCKETS, registry=self.metrics.registry)  # fmt: skip

    async def forward(self, request: Request) -> Response:
        endpoint = request.url.path
        config = self.decode.config
        # As on the one-hop path: who is asking, and a capped body, before any replica does work for it.
        identity = authenticate(config, request.headers.get("authorization"))
        if isinstance(identity, Response):
            return identity
        raw = await read_capped_body(request, config.max_request_bytes)
        if isinstance(raw, Response):
            return raw
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        refusal = split_refusal(endpoint, body)
        if refusal is not None:
            self.requests.labels("unsplit", refusal).inc()
            unsplit: Response = await self.decode.forward(request, raw)
            return unsplit
        assert isinstance(body, dict)
        headers = upstream_headers(config, request, identity)
        params, prefill_url, reason = await self._prefill(endpoint, body, headers)
        decode_raw = (
            json.dumps({**body, "kv_transfer_params": params}).encode() if params is not None else raw
        )
        response: Response = await self.decode.forward(request, decode_raw)
        if REPLICA_HEADER not in response.headers and response.status_code in (502, 503):
            # No decode replica could take it: run it whole on a prefill replica (a complete engine).
            self.requests.labels("aggregated", "decode_unavailable").inc()
            log.warning("no decode replica reachable; serving the request on the prefill pool")
            whole: Response = await self.prefill.forward(request, raw)
            return whole
        self.requests.labels("split" if params is not None else "fallback", reason).inc()
        if prefill_url is not None:
            response.headers[PREFILL_HEADER] = prefill_url
        return response

    async def _prefill(
        self, endpoint: str, body: dict[str, Any], headers: list[tuple[str, str]]
    ) -> tuple[dict[str, Any] | None, str | None, str]:
        """Hop 1: (the parameters for the decode hop or None, the prefill replica, why)."""
        content = json.dumps(prefill_body(body)).encode()
        features = RequestFeatures.from_body(body, prefix_chars=256)
        tried: set[str] = set()
        while True:
            try:
                replica = self.prefill_router.choose(features, frozenset(tried)).replica
            except (NoReadyReplica, AllSaturated):
                return None, None, "prefill_unavailable"
            replica.inflight += 1
            t0 = time.monotonic()
            try:
                answer = await self.client.post(
                    replica.url + endpoint, content=content, headers=headers,
                    timeout=httpx.Timeout(self.prefill_timeout_s, connect=2.0),
                )  # fmt: skip
            except _NOTHING_SENT as exc:
                log.warning("prefill replica %s unreachable (%s); trying another", replica.url, exc)
                self.prefill_set.mark_unreachable(replica.url)
                self.metrics.upstream_errors.labels(replica.url, "connect").inc()
                tried.add(replica.url)
                continue
            except httpx.HTTPError as exc:
                log.warning(
                    "prefill on %s failed (%r); the decode replica prefills locally", replica.url, exc
                )
                self.metrics.upstream_errors.labels(replica.url, "read").inc()
                return None, replica.url, "prefill_failed"
            finally:
                replica.inflight -= 1
            self.prefill_seconds.observe(time.monotonic() - t0)
            if answer.status_code != 200:
                log.info("prefill on %s answered %d; the decode replica prefills locally", replica.url,
                         answer.status_code)  # fmt: skip
                return None, replica.url, "prefill_status"
            try:
                params = answer.json().get("kv_transfer_params")
            except (ValueError, AttributeError):
                params = None
            if not isinstance(params, dict) or not params.get("do_remote_prefill"):
                return None, replica.url, "no_params"
            return params, replica.url, "split"
