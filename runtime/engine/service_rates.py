"""This replica's service rates, measured from its own steps: prefill tokens per second, decode step time.

What it is: :class:`ServiceRateMeter`, fed every engine step (the rate probe's included:
it measures them once the engine idles after Ready, if requests have not) with the step's
prefill tokens, its decode rows and its wall time. A step with no prefill measures the decode step; a
step with prefill (of at least a few tokens) measures the prefill rate from what the
step took beyond a decode step: the same split the predictor makes, ``ttft = backlog +
prompt / prefill rate + one decode step``.
Both are exponentially weighted, so they follow the host (a shared CPU slows down and
speeds up) without jumping on one slow step. Beside the means it keeps, for every step
of any kind (mixed steps with a few prompt tokens too, which is what a burst runs) within
the last ``TAIL_WINDOW_S`` seconds of stepping (and at least the last ``TAIL_WINDOW``
steps), its time; the slowest against what the current means predict for it is
``slow_step_factor``. On a shared host a step is now and then several times the mean, and
a TTFT promised at admission must allow for that (``ServiceRates.at_tail``); a mean lags
such a slowdown by many steps, the slowest recent step follows at once. :meth:`ServiceRateMeter.rates` is what
the TTFT predictor (``plimsoll.ttft_prediction``) needs.

Why measured here rather than passed from the capacity profile: the profile measured
a replica once, on whatever host ran its Job; the rates that decide whether a request
waiting now will meet its bound are this replica's, now. The profile's own figures
stay what the operator sizes with; the replica exports both the raw queue (prompt
tokens waiting, decode tokens remaining) and the rates, so a reader that prefers the
profile's rate can divide by it.

It also keeps the last ``HISTORY_S`` seconds of steps with when each ended
(:meth:`ServiceRateMeter.steps_since`): the server reads the steps an admitted request waited
through when it misses its bound, to say whether a step ran slower than its promise allowed.

What it is not: a profiler, or thread-safe beyond what a reader of two floats needs
(the engine thread writes, the server reads a consistent :class:`ServiceRates`).
"""

from __future__ import annotations

import dataclasses
from collections import deque

from plimsoll.ttft_prediction import ServiceRates

# Weight of a new observation. Decode steps are many and alike; prefill steps fewer and more varied.
DECODE_ALPHA = 0.2
PREFILL_ALPHA = 0.1
# A prefill step shorter than this beyond the decode step is noise, not a rate.
MIN_PREFILL_S = 1e-4
# Fewer prompt tokens than this in a step say more about the step's fixed cost than about the rate.
MIN_PREFILL_TOKENS = 8
# The recent steps whose slowness a promise allows for: the last TAIL_WINDOW_S seconds of
# stepping (a host that stalled one step stalls others within seconds, however many fast steps
# ran in between: 16 steps of 30 ms are half a second), at least TAIL_WINDOW steps, and
# MIN_TAIL_STEPS before there is a factor at all.
TAIL_WINDOW = 16
TAIL_WINDOW_S = 4.0
MIN_TAIL_STEPS = 4
# How long the timed step history reaches back: longer than any admitted request waits for its
# first token under a TTFT bound (a few seconds), short enough to stay small.
HISTORY_S = 30.0


class ServiceRateMeter:
    """EWMA of the decode step (seconds) and of prefill cost (seconds per token)."""

    def __init__(self, max_num_seqs: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.decode_step_s: float | None = None
        self.prefill_s_per_token: float | None = None
        self._rates: ServiceRates | None = None
        # A prefill step seen before any decode step (a request's prefill comes first): kept until
        # a decode step says what part of it was the step's own cost.
        self._pending_prefill: tuple[int, float] | None = None
        # (step time, prompt tokens in it) of the recent steps, and their summed time.
        self._recent: deque[tuple[float, int]] = deque()
        self._window_s = 0.0
        # (when it ended, its time, prompt tokens in it) of the steps of the last HISTORY_S seconds.
        self._history: deque[tuple[float, float, int]] = deque()

    def observe(
        self, prefill_tokens: int, decode_tokens: int, step_s: float, end: float | None = None
    ) -> None:
        """One engine step: prompt tokens computed, decode tokens computed, wall seconds, and
        when it ended (``time.monotonic()``; None keeps it out of the timed history)."""
        if step_s <= 0:
            return
        if end is not None:
            self._history.append((end, step_s, prefill_tokens))
            while self._history and self._history[0][0] < end - HISTORY_S:
                self._history.popleft()
        if prefill_tokens > 0 or decode_tokens > 0:
            self._recent.append((step_s, prefill_tokens))
            self._window_s += step_s
            while len(self._recent) > TAIL_WINDOW and self._window_s - self._recent[0][0] >= TAIL_WINDOW_S:
                self._window_s -= self._recent.popleft()[0]
        if prefill_tokens <= 0:
            if decode_tokens > 0:
                self.decode_step_s = _ewma(self.decode_step_s, step_s, DECODE_ALPHA)
                if self._pending_prefill is not None:
                    self._observe_prefill(*self._pending_prefill)
                    self._pending_prefill = None
        elif prefill_tokens >= MIN_PREFILL_TOKENS:
            if self.decode_step_s is None:
                self._pending_prefill = (prefill_tokens, step_s)
            else:
                self._observe_prefill(prefill_tokens, step_s)
        if self.decode_step_s is not None and self.prefill_s_per_token is not None:
            self._rates = ServiceRates(
                prefill_tokens_per_s=1.0 / self.prefill_s_per_token,
                decode_step_s=self.decode_step_s,
                max_num_seqs=self.max_num_seqs,
            )

    def _observe_prefill(self, prefill_tokens: int, step_s: float) -> None:
        assert self.decode_step_s is not None
        # A step costs about one decode step whatever it carries (the predictor adds that step
        # to every TTFT); what the prompt tokens add beyond it is the prefill's.
        prefill = step_s - self.decode_step_s
        if prefill >= MIN_PREFILL_S:
            self.prefill_s_per_token = _ewma(
                self.prefill_s_per_token, prefill / prefill_tokens, PREFILL_ALPHA
            )
        elif self.prefill_s_per_token is None:
            # The step was no slower than a decode step (the host slowed the decode step it is
            # split against): charge the whole step to the prompt rather than know no rate — a
            # replica without rates admits everything, and short prompts may never measure one.
            self.prefill_s_per_token = step_s / prefill_tokens

    def slow_step_factor(self) -> float | None:
        """The slowest recent step's time ÷ what the current means predict for it (None before
        ``MIN_TAIL_STEPS``). Against the means now, not those of its own time: once the means have
        caught up with a slower host, the steps that taught them no longer count twice."""
        decode = self.decode_step_s
        if decode is None or len(self._recent) < MIN_TAIL_STEPS:
            return None
        per_token = self.prefill_s_per_token or 0.0
        return max(step / (decode + prompt * per_token) for step, prompt in list(self._recent))

    def steps_since(self, start: float) -> list[tuple[float, int]]:
        """``(seconds, prompt tokens)`` of every step that ended after ``start`` (a monotonic time
        within the last ``HISTORY_S`` seconds), in order; the part of a step before ``start``
        counts too (a request waited through the rest of it)."""
        return [(s, p) for end, s, p in list(self._history) if end > start]

    def rates(self) -> ServiceRates | None:
        """The rates measured so far, with the slow-step factor as of now; None until both a decode
        step and a prefill have been seen."""
        if self._rates is None:
            return None
        return dataclasses.replace(self._rates, slow_step_factor=self.slow_step_factor())


def _ewma(old: float | None, new: float, alpha: float) -> float:
    return new if old is None else old + alpha * (new - old)
