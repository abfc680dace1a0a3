"""Routing by predicted TTFT: send a request only where it can meet its TTFT bound, else refuse it at once.

What it is: :func:`predicted_ttft` (one replica's prediction for a request: the backlog
it exported at its last scrape, plus the prefill of what this router has sent it
since, plus the request's own prefill and one step, at the rates it measured) and
:func:`slo_exclusions` (which ready replicas would miss a request's bound, and, when
all would, the 429 to answer). The bound is the request's ``x-slo-ttft-ms`` header,
else ``--slo-ttft-ms`` (the operator passes ``spec.slo.ttftP95Ms`` with
``slo.admission: Predicted``). Replicas that export no backlog (vLLM, not measured
yet) are never excluded: nothing is known against them. The replica checks again
with its exact queue (``runtime/serving/slo_admission.py``); the router's view is a
scrape old, so it filters, and the replica decides.

What it is not: the picker among the replicas that remain (``policy.py``) or the
prediction model itself (``plimsoll.ttft_prediction``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from plimsoll.router.backends import Replica
from plimsoll.ttft_prediction import SLO_TTFT_HEADER, parse_ttft_bound


@dataclass(frozen=True, slots=True)
class SLORefusal:
    """Every ready replica would miss the bound: what to tell the client."""

    bound_s: float
    best_s: float
    retry_after_s: int

    def message(self) -> str:
        return (
            f"every ready replica would miss this request's TTFT bound of {self.bound_s * 1000:.0f} ms "
            f"(the best predicted {self.best_s * 1000:.0f} ms); retry after {self.retry_after_s} s"
        )


def request_bound(header: str | None, default_s: float | None) -> float | None:
    """Seconds: the request's ``x-slo-ttft-ms``, else the router's default; ValueError on a bad header."""
    bound = parse_ttft_bound(header)
    return bound if bound is not None else default_s


def predicted_ttft(replica: Replica, prompt_tokens: int) -> float | None:
    """The TTFT a request of ``prompt_tokens`` would see on ``replica`` now; None when it exports no backlog."""
    load = replica.token_load
    if load is None or not load.prefill_tokens_per_s:
        return None
    # Sent since the scrape (its backlog does not show them yet): each one's prompt is prefilled first.
    unseen = max(0, replica.inflight - replica.inflight_at_scrape)
    per_request = max(prompt_tokens, 1) / load.prefill_tokens_per_s
    return float(load.backlog_s + unseen * per_request + per_request + load.decode_step_s)


def slo_exclusions(
    ready: list[Replica], prompt_tokens: int, bound_s: float | None
) -> tuple[set[str], SLORefusal | None]:
    """The ready replicas predicted to miss ``bound_s`` (URLs), and the refusal when that is all of them."""
    if bound_s is None or not ready:
        return set(), None
    predictions = {r.url: predicted_ttft(r, prompt_tokens) for r in ready}
    missing = {url for url, p in predictions.items() if p is not None and p > bound_s}
    if len(missing) < len(ready):
        return missing, None
    best = min(p for p in predictions.values() if p is not None)
    return missing, SLORefusal(bound_s, best, max(1, math.ceil(best - bound_s)))


__all__ = ["SLO_TTFT_HEADER", "SLORefusal", "predicted_ttft", "request_bound", "slo_exclusions"]
