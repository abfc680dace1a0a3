"""The variant planner's demand: the rate requests finish at, and in-flight where it shows a queue.

What it is: :class:`DemandHistory` (each variant's replicas' finished-request
counters over the last ``RATE_WINDOW_S``, and whether its in-flight stayed past
its target over the last ``QUEUE_SECONDS``) and :func:`variant_demand`, which
turns a tick's pods into the demand the mix is chosen for, per variant:

- **finished rate** (with every variant's per-replica rate known, the requests/s
  unit): the requests the variant's replicas finished per second over the
  window. It is the offered load the replicas served; Poisson bursts average out
  over the window, and a busy replica's longer latency does not inflate it;
- **arrivals** (finished plus the growth of in-flight, per second, over the last
  ``QUEUE_SECONDS``): taken instead, when larger, only where in-flight **shows a
  queue** — the variant held more than its replicas carry at target
  (``replicas × concurrencyPerReplica``, past ``autoscaling.tolerance``) at every
  tick of the last ``QUEUE_SECONDS``. Then the replicas are saturated, finish no
  faster than they can, and the finished rate understates what arrives by exactly
  the queue's growth. The queue itself is a backlog, not a rate: in-flight ÷
  latency (reported beside it) would turn a backlog a stalled host built in a few
  seconds into tens of requests/s and buy replicas for it. One tick past target
  is a Poisson burst, not a queue: at 90% of its target a replica's in-flight is
  past it a third of the time;
- **arrivals after a queue**: for ``RATE_WINDOW_S`` after any variant last showed a queue, each
  variant's demand is the larger of its finished rate and its arrivals over the last
  ``QUEUE_SECONDS``. A queue marks a step in the load, and a window that straddles the step
  averages the load before it in: once the replicas a queue asked for have cleared it, the
  window's finished rate would price the step at a fraction of what now arrives (and a variant
  that has just joined, at the share of the window it existed) and hand the replicas back a tick
  later. The arrivals over the same ``QUEUE_SECONDS`` sum, over the variants, to what reached the
  service however the router spread it;
- before the window spans ``RATE_MIN_SPAN_S``, or in the in-flight unit (a
  variant without a rate), in-flight alone.

In-flight alone over-provisions: under Poisson arrivals it swings several-fold
within a minute, the scale-down window keeps its highest value, and on a loaded
host latency rises, in-flight with it, and with it the replicas asked for.

What it is not: the windows the decision applies (``variant_planner.py``) or the
targets and pod views (``variant_state.py``). No I/O; time comes from the caller.
"""

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from plimsoll.operator.scaling.variant_state import RATE_UNIT, VariantPods, VariantTarget
from plimsoll.prometheus import counter_increase

# The finished rate is the mean over this long: ~60 Poisson arrivals at 2 req/s, ~13% noise.
RATE_WINDOW_S = 30.0
# A shorter span than this says too little about a rate; in-flight is used meanwhile.
RATE_MIN_SPAN_S = 10.0
# In-flight past target at every tick this long is a queue: a Poisson burst drains within a latency or
# two, and at 90% of its target a variant is past it 6 ticks (2 s apart) in a row about once in 700
# ticks. A false queue costs little: the demand it gives is the arrivals, which equal the finished rate
# (± the in-flight's change) when nothing queues; a real one is answered 10 s sooner than at 20 s, while
# the saturated replicas' TTFT grows with the queue.
QUEUE_SECONDS = 10.0

BASIS_RATE = "finished rate"
BASIS_QUEUE = "arrivals (queue)"
BASIS_AFTER_QUEUE = "arrivals (after a queue)"
BASIS_IN_FLIGHT = "in-flight"

# (from, to, variant -> requests finished in between)
_Step = tuple[float, float, dict[str, float]]


@dataclass
class DemandHistory:
    """Each variant's finished requests per second over ``window_s``, and whether it holds a queue.

    Finished requests are counted per pod between consecutive ticks, so a pod that left
    (drained, reclaimed) keeps what it finished while it was there; a counter that went
    down restarted (from zero).
    """

    window_s: float = RATE_WINDOW_S
    last: dict[str, float] = field(default_factory=dict)  # pod -> its counter at the last tick
    steps: deque[_Step] = field(default_factory=deque)
    last_time: float | None = None
    # The ticks of the last QUEUE_SECONDS: (time, variants past target, variant -> in-flight).
    ticks: deque[tuple[float, frozenset[str], dict[str, float]]] = field(default_factory=deque)
    # The last tick at which some variant showed a queue (see the module docstring).
    queue_seen: float | None = None

    def observe(
        self,
        now: float,
        pods: Mapping[str, VariantPods],
        targets: Mapping[str, VariantTarget],
        tolerance: float,
    ) -> None:
        if self.last_time is not None and now <= self.last_time:
            return  # the same instant twice (or a clock going back): nothing new to count
        past = frozenset(
            name
            for name, view in pods.items()
            if name in targets
            and view.in_flight > len(view.scraped) * targets[name].concurrency * (1 + tolerance)
        )
        self.ticks.append((now, past, {name: view.in_flight for name, view in pods.items()}))
        while len(self.ticks) >= 2 and self.ticks[1][0] <= now - QUEUE_SECONDS:
            self.ticks.popleft()
        if any(self.queued(name) for name in past):
            self.queue_seen = now
        counters: dict[str, tuple[str, float]] = {}
        for name, view in pods.items():
            for seen in view.scraped:
                if seen.sample is not None and seen.sample.requests_finished is not None:
                    counters[seen.name] = (name, seen.sample.requests_finished)
        if self.last_time is not None:
            finished: dict[str, float] = {}
            for pod, (variant, value) in counters.items():
                before = self.last.get(pod)
                if before is None:
                    continue  # first seen: what it finished so far is not this interval's
                finished[variant] = finished.get(variant, 0.0) + counter_increase(value, before)
            self.steps.append((self.last_time, now, finished))
        self.last_time = now
        self.last = {pod: value for pod, (_, value) in counters.items()}
        while self.steps and self.steps[0][0] < now - self.window_s:
            self.steps.popleft()

    def queued(self, name: str) -> bool:
        """The variant's in-flight was past its target at every tick of the last ``QUEUE_SECONDS``."""
        if not self.ticks or self.ticks[-1][0] - self.ticks[0][0] < QUEUE_SECONDS:
            return False
        return all(name in past for _, past, _ in self.ticks)

    def after_queue(self) -> bool:
        """Some variant showed a queue within the last ``window_s``: the window may straddle a step."""
        return (
            self.queue_seen is not None
            and self.last_time is not None
            and self.last_time - self.queue_seen < self.window_s
        )

    def arrivals_per_second(self, name: str) -> float | None:
        """The variant's arrivals per second over the last ``QUEUE_SECONDS``: what it finished plus what its
        in-flight grew by (requests are conserved: each one arrived, and has finished or is still held)."""
        if len(self.ticks) < 2 or not self.steps:
            return None
        since, _, before = self.ticks[0]
        now, _, after = self.ticks[-1]
        if now <= since:
            return None
        finished = sum(done.get(name, 0.0) for start, _, done in self.steps if start >= since)
        return max(0.0, finished + after.get(name, 0.0) - before.get(name, 0.0)) / (now - since)

    def per_second(self) -> dict[str, float] | None:
        """Variant -> finished/s over the window; None while it spans less than ``RATE_MIN_SPAN_S``."""
        span = self.steps[-1][1] - self.steps[0][0] if self.steps else 0.0
        if span < RATE_MIN_SPAN_S:
            return None
        total: dict[str, float] = {}
        for _, _, finished in self.steps:
            for variant, n in finished.items():
                total[variant] = total.get(variant, 0.0) + n
        return {variant: n / span for variant, n in total.items()}


@dataclass(frozen=True, slots=True)
class VariantDemand:
    """One variant's demand this tick, with both inputs (for status)."""

    in_flight: float  # in the comparison unit: in-flight ÷ latency
    finished_rate: float | None  # requests/s over the window; None when not used
    arrival_rate: float | None  # finished + in-flight's growth per second, while or after a queue; else None
    queued: bool  # in-flight past what its replicas carry at target, for QUEUE_SECONDS
    basis: str
    demand: float


def variant_demand(
    pods: Mapping[str, VariantPods],
    targets: Mapping[str, VariantTarget],
    unit: str,
    history: DemandHistory,
) -> tuple[float, dict[str, VariantDemand]]:
    """The demand in the comparison unit (total, and per variant with its inputs); see the module docstring."""
    latencies = [t.latency_s for t in targets.values()]
    fallback = sum(latencies) / len(latencies) if latencies else 1.0
    rates = history.per_second() if unit == RATE_UNIT else None
    after_queue = history.after_queue()
    per: dict[str, VariantDemand] = {}
    for name, view in pods.items():
        target = targets.get(name)
        in_flight = view.in_flight / (target.latency_s if target else fallback)
        if rates is None:
            per[name] = VariantDemand(in_flight, None, None, False, BASIS_IN_FLIGHT, in_flight)
            continue
        rate = rates.get(name, 0.0)
        if target is None:  # still being profiled: no target to judge a queue by, in-flight counts as before
            per[name] = VariantDemand(in_flight, rate, None, True, BASIS_IN_FLIGHT, max(in_flight, rate))
            continue
        queued = history.queued(name)
        arrivals = history.arrivals_per_second(name) if queued or after_queue else None
        if arrivals is not None and arrivals > rate:
            basis = BASIS_QUEUE if queued else BASIS_AFTER_QUEUE
            per[name] = VariantDemand(in_flight, rate, arrivals, queued, basis, arrivals)
        else:
            per[name] = VariantDemand(in_flight, rate, arrivals, queued, BASIS_RATE, rate)
    return sum(d.demand for d in per.values()), per
