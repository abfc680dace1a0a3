"""Predicted time to first token on one replica, from its queue and its measured service rates.

What it is: the one model of a continuous-batching replica that every part uses to
say how long a new request would wait for its first token — the replica's own
admission (``x-slo-ttft-ms``), the router's choice between replicas, the simulator's
admission, and the backlog in seconds each replica exports for the autoscaler.

The model, as the engine schedules (``runtime/engine/scheduler.py``):

* ``max_num_seqs`` slots; a running sequence keeps its slot until it has produced its
  remaining tokens, one per decode step of ``decode_step_s`` (the step time at the
  current batch);
* waiting sequences take slots in arrival order (FCFS) as they free;
* prompts are prefilled one after another at ``prefill_tokens_per_s`` (prefill is
  compute-bound: two prompts in one step take as long as both in turn), the prompt
  tokens running sequences still have to compute first;
* a request's first token comes with the step that finishes its prefill, one decode
  step after the prefill work.

So ``ttft = max(slot free, prefill lane free) + prompt / prefill rate + decode step``;
the first term is the **backlog**: how long a request arriving now waits before its
own prefill starts. :func:`predict_ttft` walks the queue with a heap of slot release
times (exact for the simulator's service curve, ``bench/simulator.py``; tested
against its measured TTFT in ``tests/bench/test_ttft_prediction_sim.py``).

Admission predicts a promise rather than a mean: :meth:`ServiceRates.at_tail` slows
prefill and decode by the replica's measured slow-step factor, and ``in_flight_s`` keeps
every slot busy until the engine's step under way ends (the simulator takes requests at
any instant and passes 0).

An admitted request keeps its bound as a :class:`TTFTDeadline`: before each step the engine
walks its waiting queue again (:func:`late_waiting`) and refuses, with ``Retry-After``, the
sequences that can no longer produce a first token by their deadline at the mean rates it
measures now (a host that stalled after they were admitted) — before any of their tokens is
computed.
:func:`classify_miss` says of an admitted request that missed whether a step ran slower than
the promise allowed for (a stall no prediction made at admission could see) or not.

What it is not: a measurement. The rates come from the replica's own steps
(``runtime/engine/service_rates.py``); KV-cache pressure (a waiting request that fits
no blocks) is not modelled, which is why the autoscaler also reads KV headroom.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

# The request header that carries a request's own TTFT bound (llm-d's name), in milliseconds.
SLO_TTFT_HEADER = "x-slo-ttft-ms"
# Where a prediction is reported back on a response (the bench and the tests read it).
PREDICTED_TTFT_HEADER = "x-plimsoll-predicted-ttft-ms"
# On a 429 for a request refused from the queue after it was admitted: how long it waited there (ms).
REFUSED_IN_QUEUE_HEADER = "x-plimsoll-refused-in-queue-ms"


@dataclass(frozen=True, slots=True)
class ServiceRates:
    """What one replica does per second: its measured prefill rate and decode step time."""

    prefill_tokens_per_s: float
    decode_step_s: float
    max_num_seqs: int
    # How many times what the means predict a step takes at a high percentile of the replica's
    # recent steps, when measured: on a shared host a step is now and then several times its
    # mean, often enough that a promise must allow for it (:meth:`at_tail`).
    slow_step_factor: float | None = None

    def __post_init__(self) -> None:
        if not (self.prefill_tokens_per_s > 0 and self.decode_step_s > 0 and self.max_num_seqs >= 1):
            raise ValueError(
                f"service rates need a positive prefill rate, decode step and slot count, got "
                f"{self.prefill_tokens_per_s} tok/s, {self.decode_step_s} s, {self.max_num_seqs} slots"
            )
        if self.slow_step_factor is not None and not self.slow_step_factor > 0:
            raise ValueError(f"the slow-step factor must be positive, got {self.slow_step_factor}")

    def prefill_s(self, tokens: int) -> float:
        return max(0, tokens) / self.prefill_tokens_per_s

    def at_tail(self) -> ServiceRates:
        """These rates as slow as the replica's steps now often are: prefill and decode scaled by
        ``slow_step_factor`` (unchanged when it is unknown or below 1).

        What slows a step on a shared host (other processes on the cores, the server's own
        threads) slows its prefill and its decode alike. A bound promised at the means holds for
        about half the requests; one promised at the tail holds for most.
        """
        factor = self.slow_step_factor
        if factor is None or factor <= 1.0:
            return self
        return ServiceRates(
            self.prefill_tokens_per_s / factor, self.decode_step_s * factor, self.max_num_seqs
        )


@dataclass(frozen=True, slots=True)
class QueueSnapshot:
    """A replica's queue at one instant, in tokens: per sequence, (prompt tokens still to
    prefill, tokens it may still generate — ``max_tokens`` minus generated, within
    ``max_model_len``); ``running`` in the order the engine runs them, ``waiting`` in
    admission order.
    """

    running: tuple[tuple[int, int], ...] = ()
    waiting: tuple[tuple[int, int], ...] = ()

    @property
    def waiting_prompt_tokens(self) -> int:
        """Prompt tokens not yet computed: the waiting prompts and the running ones' unfinished prefill."""
        return sum(p for p, _ in self.running) + sum(p for p, _ in self.waiting)

    @property
    def decode_tokens_remaining(self) -> int:
        """Decode demand: tokens the running sequences may still generate."""
        return sum(r for _, r in self.running)

    def plus(self, waiting: tuple[tuple[int, int], ...]) -> QueueSnapshot:
        """This snapshot with more sequences waiting behind it (admitted, not yet in the engine)."""
        if not waiting:
            return self
        return QueueSnapshot(self.running, self.waiting + waiting)


@dataclass(frozen=True, slots=True)
class TTFTPrediction:
    """A predicted TTFT and its parts (seconds): wait for a slot and the prefill lane, own prefill, one step."""

    backlog_s: float
    prefill_s: float
    step_s: float
    ahead: int  # sequences ahead of this one in the queue

    @property
    def ttft_s(self) -> float:
        return self.backlog_s + self.prefill_s + self.step_s

    def formula(self) -> str:
        return (
            f"backlog {self.backlog_s:.3f} s ({self.ahead} ahead) + prefill {self.prefill_s:.3f} s "
            f"+ step {self.step_s:.3f} s = {self.ttft_s:.3f} s"
        )

    def retry_after_s(self, bound_s: float) -> int:
        """Whole seconds after which the queue has drained enough for ``bound_s`` (at least 1).

        The backlog shrinks in real time while nothing joins it, so the excess over the bound
        is how long to wait; rounded up, as ``Retry-After`` takes whole seconds.
        """
        return max(1, math.ceil(self.ttft_s - bound_s))


def predict_ttft(
    queue: QueueSnapshot, rates: ServiceRates, prompt_tokens: int, num_seqs: int = 1, in_flight_s: float = 0.0
) -> TTFTPrediction:
    """The TTFT of a request of ``prompt_tokens`` (``num_seqs`` sequences) arriving now; see the module docstring.

    With ``num_seqs`` > 1 (``n``, or several prompts) the last sequence's first token is what
    the request waits for. ``in_flight_s``: how long the step under way may still run — an
    engine that steps in whole steps schedules nothing new before it ends, so no slot is
    free sooner (0 for a model that takes requests at any instant, like the simulator).
    """
    step = rates.decode_step_s
    slots, lane = _release_times(queue.running, rates, in_flight_s)
    lane, _ = _walk_waiting(queue.waiting, rates, slots, lane, [])
    start = 0.0
    for _ in range(max(1, num_seqs)):
        start = max(heapq.heappop(slots), lane)
        lane = start + rates.prefill_s(prompt_tokens)
        heapq.heappush(slots, math.inf)  # its sibling holds the slot past the first token
    own = rates.prefill_s(prompt_tokens)
    return TTFTPrediction(backlog_s=lane - own, prefill_s=own, step_s=step, ahead=len(queue.waiting))


@dataclass(frozen=True, slots=True)
class TTFTDeadline:
    """An admitted request's TTFT bound: ``at`` (``time.monotonic()``) is when its first token is
    due, ``bound_s`` the bound it was admitted under (what its ``Retry-After`` is counted against;
    ``at - bound_s`` is when the replica received it)."""

    at: float
    bound_s: float
    # The rates its admission promised at (``at_tail``): what a miss is judged against (:func:`classify_miss`).
    promised: ServiceRates | None = None


class TTFTDeadlineRefusal(Exception):
    """An admitted request the replica can no longer serve by its deadline, refused before any of
    its tokens was computed; the server answers it 429 with ``Retry-After``."""

    def __init__(self, predicted_s: float, left_s: float, retry_after_s: int) -> None:
        super().__init__(
            f"its first token is now predicted in {predicted_s * 1000:.0f} ms at this replica's mean "
            f"step times, with {max(0.0, left_s) * 1000:.0f} ms of its TTFT bound left"
        )
        self.predicted_s = predicted_s
        self.retry_after_s = retry_after_s


def late_waiting(
    queue: QueueSnapshot, rates: ServiceRates, left_s: list[float | None], in_flight_s: float = 0.0
) -> dict[int, float]:
    """The waiting sequences that would now produce their first token after their deadline:
    index into ``queue.waiting`` → predicted seconds to it. ``left_s[i]``: seconds until waiting
    sequence ``i``'s deadline (None: it has none).

    The queue is walked in order as :func:`predict_ttft` walks it; a late sequence leaves the
    walk (it is refused), so it delays none of those behind it. A sequence that a free slot and
    a free prefill lane would start now is never late: nothing is ahead of it, its first token
    comes with the coming step, and a refusal would only stop it measuring the rates — as an
    idle replica admits whatever it is asked.
    """
    slots, lane = _release_times(queue.running, rates, in_flight_s)
    return _walk_waiting(queue.waiting, rates, slots, lane, left_s)[1]


def classify_miss(promised: ServiceRates, steps: list[tuple[float, int]]) -> tuple[str, float, float]:
    """Why an admitted request missed its bound, from the steps the engine ran between its
    admission and its first token (``(seconds, prompt tokens)`` each) against the step times the
    promise allowed (``promised``: the rates it was admitted at, ``at_tail``).

    ``("stall", s, allowed)`` when a step took longer than the promise allowed for it (the host
    slowed beyond anything the replica's recent steps showed: no prediction made at admission
    could see it); ``("queue", s, allowed)`` when every step kept within it (the time went
    elsewhere: more steps than the queue walk counted, or the path before the engine). ``s`` and ``allowed``: the step furthest over its allowance, and that allowance.
    """
    worst, worst_allowed, ratio = 0.0, 0.0, 0.0
    for seconds, prompt in steps:
        allowed = promised.decode_step_s + promised.prefill_s(prompt)
        if seconds / allowed > ratio:
            worst, worst_allowed, ratio = seconds, allowed, seconds / allowed
    return ("stall" if ratio > 1.0 else "queue"), worst, worst_allowed


def _walk_waiting(
    waiting: tuple[tuple[int, int], ...],
    rates: ServiceRates,
    slots: list[float],
    lane: float,
    left_s: list[float | None],
) -> tuple[float, dict[int, float]]:
    """The waiting sequences in order, each taking the first slot to free and the prefill lane
    after it (``slots``, a heap, updated in place): when the lane frees after the last, and the
    sequences whose first token would come after their ``left_s`` (index → predicted seconds),
    which leave the walk. One that starts now (``start`` 0) is never late."""
    step = rates.decode_step_s
    late: dict[int, float] = {}
    for i, (prompt, out) in enumerate(waiting):
        start = max(slots[0], lane)
        first = start + rates.prefill_s(prompt) + step
        left = left_s[i] if i < len(left_s) else None
        if left is not None and first > left and start > 0.0:
            late[i] = first
            continue
        lane = first - step
        heapq.heapreplace(slots, lane + max(1, out) * step)
    return lane, late


def _release_times(
    running: tuple[tuple[int, int], ...], rates: ServiceRates, in_flight_s: float
) -> tuple[list[float], float]:
    """A heap of when each slot frees (seconds from now) and when the prefill lane frees, given the
    running sequences; no slot frees before the step under way ends (``in_flight_s``)."""
    step = rates.decode_step_s
    lane = 0.0
    slots = []
    for prompt, remaining in running:
        if prompt > 0:  # a chunked prefill under way: its slot frees after its prefill and its decode
            lane += rates.prefill_s(prompt)
            slots.append(lane + remaining * step)
        else:
            slots.append(remaining * step)
    slots += [0.0] * max(0, rates.max_num_seqs - len(slots))
    slots = [max(t, in_flight_s) for t in slots]
    heapq.heapify(slots)
    return slots, lane


def backlog_seconds(queue: QueueSnapshot, rates: ServiceRates) -> float:
    """How long a request arriving now would wait before its prefill starts (0 when a slot is free now)."""
    return predict_ttft(queue, rates, 0).backlog_s


def parse_ttft_bound(value: str | None) -> float | None:
    """Seconds from an ``x-slo-ttft-ms`` header value; None when absent. Raises ValueError on nonsense."""
    if value is None or not value.strip():
        return None
    try:
        ms = float(value)
    except ValueError:
        raise ValueError(f"{SLO_TTFT_HEADER} must be a number of milliseconds, got {value!r}") from None
    if not math.isfinite(ms) or ms <= 0:
        raise ValueError(f"{SLO_TTFT_HEADER} must be a positive number of milliseconds, got {value!r}")
    return ms / 1000.0
