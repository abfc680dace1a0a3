"""Refusing from the queue an admitted request that can no longer meet its TTFT bound.

What it is: :func:`late_refusals`, called by the engine before each step. Admission
(``runtime/serving/slo_admission.py``) promised a request its first token within its bound at
the step times the replica had just measured; the host can stall after that (another process
takes the cores for a second). Each waiting request that carries a bound and has not started
(no token of it computed, none produced) is judged again — the queue walked in order
(``plimsoll.ttft_prediction.late_waiting``) — against the time its bound has left, its first
token predicted at the replica's mean rates now. One that would miss is refused with
``Retry-After`` before anything of it is computed: the client gets a clean 429 it can retry
elsewhere, and its slot goes to requests that can still meet theirs, instead of a late first
token that also delays every request behind it.

At the means, not at the slow steps admission promised at (``ServiceRates.at_tail``): the
margin was taken when the request was admitted, and a refusal from the queue is the late kind
(its client has waited), so it is kept for a request the replica expects to miss. The tail
factor is the slowest step of the last seconds: one stall raises it several-fold for seconds,
and judging the queue by it refuses at once every request behind the stall, most of which then
meet their bound (admitted requests of a 10× burst: measured TTFT 0.48–0.89 of what the tail
predicted). A host that stays slower moves the means within a few steps.

What it is not: a timeout (a request that has produced its first token is never refused here,
and one without a bound never is) or admission itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from plimsoll.runtime.engine.request import Request
from plimsoll.ttft_prediction import QueueSnapshot, ServiceRates, TTFTDeadlineRefusal, late_waiting


def late_refusals(
    queue: QueueSnapshot, waiting: Sequence[Request], rates: ServiceRates | None, now: float
) -> dict[str, TTFTDeadlineRefusal]:
    """The requests (group id → refusal) to refuse now; ``waiting`` are the sequences behind
    ``queue.waiting``'s first entries, in its order; ``rates`` the measured ones, judged at their
    means (None: none yet, nothing is refused); ``now`` a ``time.monotonic()``."""
    if rates is None:
        return {}
    left: list[float | None] = [
        r.ttft_deadline.at - now if r.ttft_deadline is not None and unstarted(r) else None for r in waiting
    ]
    if all(x is None for x in left):
        return {}
    refusals: dict[str, TTFTDeadlineRefusal] = {}
    for i, predicted in late_waiting(queue, rates, left).items():
        seq = waiting[i]
        deadline = seq.ttft_deadline
        assert deadline is not None
        retry = max(1, math.ceil(predicted - deadline.bound_s))
        refusals.setdefault(seq.group_id, TTFTDeadlineRefusal(predicted, deadline.at - now, retry))
    return refusals


def unstarted(seq: Request) -> bool:
    """Nothing of it computed and no token produced: refusing it wastes nothing and shows the client nothing."""
    return seq.num_computed_tokens == 0 and seq.first_token_time is None and seq.num_new_output_tokens == 0
