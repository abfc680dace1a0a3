"""SLO-aware admission: refuse now, with ``Retry-After``, what would miss its TTFT bound in the queue.

What it is: :func:`check_predicted_ttft`, called by the completion routes once a
request is tokenised and before it is admitted (and, with no prompt, before tokenising:
:func:`refuse_before_tokenising`). The request's bound is its
``x-slo-ttft-ms`` header (llm-d's), or, with ``--slo-admission``, the TTFT objective
the operator set (``PUT /slo``). The replica predicts the request's TTFT from its
queue and its measured rates (``plimsoll.ttft_prediction``) as a promise, not a mean: at
the rates its recent slow steps show (``ServiceRates.at_tail``: the slowest step of the
last 4 s over what the means predicted), and with the step under
way finished before the request's own can start; a request predicted to
miss gets 429 at once, ``Retry-After`` = the seconds until the queue has drained
enough, and ``x-plimsoll-overload: replica`` (another replica may meet it: the
router tries one). Each refusal counts in ``plimsoll_admission_rejections_total
{reason="slo_ttft"}`` and, when objectives are set, as a bad request in
``plimsoll_slo_requests_total`` — the operator's attainment counts what was shed.

An idle replica (nothing running or waiting, nothing admitted and unposted) admits
what it is asked whatever the prediction: then the prediction is the measured prefill
rate alone, and a rate measured during a spike in the host's load would refuse every
request after it — refused requests measure nothing, so only an admitted one can
correct it. Such a request costs no other request anything.

An admitted request is held to its bound until its first token: its deadline goes to the
engine with it (``ttft_deadline``), which refuses it from the queue, before computing any of
it, once it can no longer meet it (``engine/late_refusal.py``); :func:`refused_from_queue`
is that 429 (``Retry-After``, ``x-plimsoll-refused-in-queue-ms``: how long it waited). A
streamed answer to a request with a bound therefore sends its head with its first token, not
before (``requests.hold_head``). A request admitted by an idle replica past its bound is
held to none.

What it is not: the prediction (``common/ttft_prediction.py``) or the other
admission rules (``requests.py``: draining, queue full, tenant caps). A replica that
has not yet measured its rates admits everything (it cannot say).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.requests import Request

from plimsoll.overload import OVERLOAD_HEADER, REPLICA
from plimsoll.runtime.serving.errors import APIError, bad_request
from plimsoll.ttft_prediction import (
    PREDICTED_TTFT_HEADER,
    REFUSED_IN_QUEUE_HEADER,
    SLO_TTFT_HEADER,
    TTFTDeadline,
    TTFTDeadlineRefusal,
    TTFTPrediction,
    parse_ttft_bound,
    predict_ttft,
)

if TYPE_CHECKING:
    from plimsoll.runtime.serving.metrics import ServerMetrics
    from plimsoll.runtime.serving.requests import ServingContext


def ttft_bound(ctx: ServingContext, raw: Request) -> float | None:
    """The request's TTFT bound in seconds: its header, else the objective under ``--slo-admission``."""
    try:
        bound = parse_ttft_bound(raw.headers.get(SLO_TTFT_HEADER))
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    if bound is None and ctx.settings.slo_admission:
        bound = ctx.metrics.slo.get("ttft")
    return bound


def refuse_before_tokenising(
    ctx: ServingContext, raw: Request, num_seqs: int, fewest_tokens: int = 0
) -> None:
    """Raise 429 when even a prompt of ``fewest_tokens`` (the fewest the request's prompt can
    have, known before tokenising; 0: an empty one) would miss the request's bound.

    A prompt only adds to the TTFT, so such a refusal is certain without the prompt's exact
    length; made before tokenising, it costs no hop to the tokeniser's thread, which on
    a busy host is most of a refusal's latency. Called first thing in a route: the request's
    bound counts from here.
    """
    raw.state.slo_received = time.monotonic()
    check_predicted_ttft(ctx, raw, [fewest_tokens], num_seqs)


@dataclass(frozen=True, slots=True)
class Promise:
    """What admission predicted for a request, and the deadline the engine holds it to (None: it
    was admitted though predicted past its bound, by an idle replica, and is held to none)."""

    prediction: TTFTPrediction
    deadline: TTFTDeadline | None


def check_predicted_ttft(
    ctx: ServingContext, raw: Request, prompt_tokens: list[int], num_seqs: int
) -> Promise | None:
    """Raise 429 when the request's predicted TTFT exceeds its bound; the promise otherwise (None: none made)."""
    bound = ttft_bound(ctx, raw)
    if bound is None:
        return None
    rates = ctx.engine.service_rates()
    if rates is None:
        return None
    queue = ctx.queue_snapshot()
    rates = rates.at_tail()  # a promise: what the replica's slow steps would give, not its mean ones
    # The engine takes new work only between steps: with sequences running, one is under way.
    in_flight = rates.decode_step_s if queue.running else 0.0
    prediction = predict_ttft(queue, rates, max(prompt_tokens, default=0), num_seqs, in_flight)
    if prediction.ttft_s <= bound:
        received = getattr(raw.state, "slo_received", None)
        received = time.monotonic() if received is None else received
        return Promise(prediction, TTFTDeadline(received + bound, bound, rates))
    if not (queue.running or queue.waiting):
        return Promise(prediction, None)  # an idle replica: it re-measures its rates (see above)
    retry = prediction.retry_after_s(bound)
    raise _slo_refusal(
        ctx.metrics,
        f"This request would miss its TTFT bound of {bound * 1000:.0f} ms here: predicted "
        f"{prediction.formula()} ({prediction.ahead} waiting)",
        retry,
        prediction.ttft_s,
    )


def refused_from_queue(metrics: ServerMetrics, refusal: TTFTDeadlineRefusal, waited_s: float) -> APIError:
    """The 429 for an admitted request the engine refused from its queue (``engine/late_refusal.py``):
    counted as an SLO refusal, like one at admission, and saying how long it waited."""
    return _slo_refusal(
        metrics,
        f"This request was admitted but can no longer meet its TTFT bound here: {refusal}. Nothing of it was computed",
        refusal.retry_after_s,
        refusal.predicted_s,
        {REFUSED_IN_QUEUE_HEADER: f"{waited_s * 1000:.1f}"},
    )


def _slo_refusal(
    metrics: ServerMetrics, why: str, retry_s: int, predicted_s: float, extra: dict[str, str] | None = None
) -> APIError:
    """An SLO refusal, counted (``reason="slo_ttft"`` and as shed): 429 with ``Retry-After``, the
    replica-overload marker (another replica may meet it) and the prediction it was refused on."""
    metrics.reject("slo_ttft")
    metrics.judge_shed()
    return APIError(
        429,
        f"{why}; retry after {retry_s}s or on another replica.",
        headers={
            "Retry-After": str(retry_s),
            OVERLOAD_HEADER: REPLICA,
            PREDICTED_TTFT_HEADER: f"{predicted_s * 1000:.1f}",
            **(extra or {}),
        },
    )
