"""The built-in autoscaler's decision: how many replicas an LLMService should run now.

What it is: a deterministic state machine driven by an explicit clock. Each call
to :meth:`Autoscaler.decide` takes the pods (ready or not, metrics or none), the
current replica count and ``now``, and returns a :class:`Decision` that carries
every input, the formula with its numbers, the result and the reason. The
algorithm is the Kubernetes HPA's, as ``pkg/controller/podautoscaler`` implements
it for a per-pod metric (here in-flight = running + waiting):

1. Bounds first: replicas outside ``min..max`` go straight to the bound; 0
   replicas means scaling is disabled (someone scaled the service to zero).
2. ``desired = ceil(pods × average / target)`` over ready pods with metrics,
   unchanged when ``|average / target − 1| ≤ tolerance``. Pods that are not
   ready are left out, except that on a scale-up they count as 0 load; ready
   pods whose metrics cannot be read count as 0 load on a scale-up and as
   exactly the target on a scale-down; if counting them would reverse the
   direction or land within tolerance, nothing changes.
3. Stabilisation: the result is the current count pulled up to the MIN of the
   recommendations in the scale-up window and down to the MAX of those in the
   scale-down window.
   With ``trend_lookahead_s`` set, a rising in-flight total is also projected
   ahead by its least-squares slope over ``trend_window_s``; when
   ``ceil(projected / target)`` is above the level's recommendation, it is the
   recommendation (reason ``InFlightRising``; the formula shows the slope and
   the projection). Only upwards: a falling trend never removes a replica.
4. The queue fast path from the seed articles: when waiting requests stay above
   half of the current capacity (replicas × target) for the hold time, add at
   least one replica; the hold only runs while every replica is ready (one
   that is starting will take its share of the queue).
5. The HPA's default scale-up rate policy (+4 pods or +100 % per 15 s), then
   clamp to ``min..max``. ``limited_reason`` names whichever bit
   (``ScaleUpLimit``, ``TooManyReplicas``, ``TooFewReplicas``), but only
   ``TooManyReplicas`` — at max and still overloaded — sets ``scaling_limited``:
   idling at min is the normal quiet state and a rate limit passes within one
   period, so neither deserves a Warning (the HPA's own ScalingLimited is noisier).

What it is not: it does not scrape, patch or write status (the handler does),
and it is one part of the replica planner (``planner.py``), which calls it only
when no other rule (starting size, zero, a drain) owns the tick.
"""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from plimsoll.operator.scaling.formula import fmt
from plimsoll.operator.scaling.metrics import PodSample
from plimsoll.operator.scaling.observations import PodObservation
from plimsoll.operator.scaling.timestamps import rfc3339_seconds


class AutoscalerConfig(BaseModel):
    """Knobs of one LLMService's autoscaler, validated once at the edge."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    target_per_replica: float = Field(gt=0, description="in-flight requests one replica should hold")
    # What the per-pod figure is, in the decisions' messages (a split service's pools scale on others).
    metric_name: str = "in-flight per pod"
    target_source: str = Field(
        default="override", description="where the target came from (profile, manual, override)"
    )
    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=1, ge=1)
    tolerance: float = Field(default=0.1, ge=0, lt=1)
    scale_up_window_s: float = Field(default=30.0, ge=0)
    scale_down_window_s: float = Field(default=600.0, ge=0)
    fast_path_queue_fraction: float = Field(
        default=0.5, gt=0, description="waiting above this share of capacity"
    )
    fast_path_hold_s: float = Field(default=30.0, ge=0)
    # The HPA's default scale-up policies (selectPolicy Max): +4 pods or +100 % per 15 s.
    scale_up_max_pods: int = Field(default=4, ge=1)
    scale_up_max_percent: float = Field(default=100.0, gt=0)
    scale_up_period_s: float = Field(default=15.0, ge=0)
    # Acting on the trend as well as the level: in-flight projected this far ahead (0 = off) from
    # its least-squares slope over the last trend_window_s.
    trend_lookahead_s: float = Field(default=0.0, ge=0)
    trend_window_s: float = Field(default=30.0, gt=0)

    @model_validator(mode="after")
    def _bounds_ordered(self) -> "AutoscalerConfig":
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"max_replicas ({self.max_replicas}) is below min_replicas ({self.min_replicas}); "
                "set scaling.max to at least scaling.min"
            )
        return self


@dataclass(frozen=True, slots=True)
class Decision:
    """One autoscaler verdict with everything needed to explain it."""

    time: float  # seconds since the epoch
    current_replicas: int
    desired_replicas: int
    reason: str  # CamelCase, for status and Events
    message: str
    formula: str
    target: float
    target_source: str
    metric: float | None  # average in-flight per pod the formula used
    in_flight: float  # sum over ready pods with metrics
    waiting: float
    recommendation: int | None  # the raw HPA recommendation before stabilisation
    stabilized: int | None
    ready_pods: tuple[str, ...]
    unready_pods: tuple[str, ...]
    missing_pods: tuple[str, ...]
    fast_path: bool
    scaling_limited: bool  # at max and still overloaded (TooManyReplicas) only
    limited_reason: str | None  # TooManyReplicas / TooFewReplicas / ScaleUpLimit
    min_replicas: int
    max_replicas: int
    errors: tuple[str, ...] = field(default=())

    @property
    def changed(self) -> bool:
        return self.desired_replicas != self.current_replicas

    def to_status(self) -> dict[str, Any]:
        """The ``status.autoscaler`` block (``AutoscalerStatus``: inputs, formula, decision, time)."""
        return {
            "time": rfc3339_seconds(self.time),
            "formula": self.formula,
            "inputs": {
                "targetInFlightPerReplica": self.target,
                "targetSource": self.target_source,
                "averageInFlightPerPod": self.metric,
                "inFlight": self.in_flight,
                "waiting": self.waiting,
                "readyPods": len(self.ready_pods),
                "unreadyPods": len(self.unready_pods),
                "podsWithoutMetrics": list(self.missing_pods),
                "minReplicas": self.min_replicas,
                "maxReplicas": self.max_replicas,
            },
            "decision": {
                "currentReplicas": self.current_replicas,
                "desiredReplicas": self.desired_replicas,
                "recommendation": self.recommendation,
                "stabilizedRecommendation": self.stabilized,
                "reason": self.reason,
                "message": self.message,
                "fastPath": self.fast_path,
                "scalingLimited": self.scaling_limited,
                "limitedReason": self.limited_reason,
            },
        }

    def span_attributes(self) -> dict[str, Any]:
        """The verdict as trace span attributes (no pod names: they are unbounded)."""
        attributes: dict[str, Any] = {
            "plimsoll.autoscaler.current_replicas": self.current_replicas,
            "plimsoll.autoscaler.desired_replicas": self.desired_replicas,
            "plimsoll.autoscaler.changed": self.changed,
            "plimsoll.autoscaler.reason": self.reason,
            "plimsoll.autoscaler.formula": self.formula,
            "plimsoll.autoscaler.target": self.target,
            "plimsoll.autoscaler.target_source": self.target_source,
            "plimsoll.autoscaler.in_flight": self.in_flight,
            "plimsoll.autoscaler.waiting": self.waiting,
            "plimsoll.autoscaler.ready_pods": len(self.ready_pods),
            "plimsoll.autoscaler.scaling_limited": self.scaling_limited,
        }
        if self.metric is not None:
            attributes["plimsoll.autoscaler.metric"] = self.metric
        if self.limited_reason is not None:
            attributes["plimsoll.autoscaler.limited_reason"] = self.limited_reason
        return attributes

    def event_message(self) -> str:
        """One line for a Kubernetes Event."""
        arrow = (
            f"{self.current_replicas} → {self.desired_replicas}"
            if self.changed
            else f"stay at {self.current_replicas}"
        )
        return f"{arrow}: {self.formula}; {self.message}"


class Autoscaler:
    """Stateful across calls only through its recommendation history and the fast-path timer.

    The first call records the current replica count as if it had been
    recommended then, so an operator restart neither scales up on a single spiky
    scrape nor scales down before a full scale-down window has been observed.
    """

    def __init__(self, config: AutoscalerConfig) -> None:
        self.config = config
        self._history: list[tuple[float, int]] = []
        self._queue_high_since: float | None = None
        # (time, in-flight over ready pods): the trend's points.
        self._in_flight: list[tuple[float, float]] = []
        # (time, replicas observed): the count at the start of the rate-policy period. Observed rather
        # than decided, so a decision the handler did not apply does not use up the budget.
        self._counts: list[tuple[float, int]] = []

    @property
    def history(self) -> tuple[tuple[float, int], ...]:
        """(time, raw recommendation) pairs still inside a stabilisation window."""
        return tuple(self._history)

    def decide(
        self,
        now: float,
        current_replicas: int,
        pods: Sequence[PodObservation],
        floor: tuple[int, str] | None = None,
        wakeable: int = 0,
    ) -> Decision:
        """The verdict for this tick; ``floor`` is another rule's (replicas, formula) the recommendation
        is raised to before stabilisation (the predicted-TTFT rule, ``token_signal.py``).

        ``wakeable``: replicas parked asleep in standby. Up to that many are added at once, without the
        scale-up window: the window keeps a passing spike from starting pods that take a cold start to
        come and a drain to go, where a wake takes about a second and parking undoes it."""
        cfg = self.config
        if self._history and now < self._history[-1][0]:
            raise ValueError(
                f"time went backwards: {now} after {self._history[-1][0]}; pass a monotonic clock"
            )
        if not self._history:
            self._history.append((now, current_replicas))

        with_metrics = {p.name: p.sample for p in pods if p.ready and p.sample is not None}
        ready = tuple(sorted(with_metrics))
        unready = tuple(sorted(p.name for p in pods if not p.ready))
        missing = tuple(sorted(p.name for p in pods if p.ready and p.sample is None))
        errors = tuple(f"{p.name}: {p.error}" for p in pods if p.error)
        in_flight = sum(s.in_flight for s in with_metrics.values() if s is not None)
        waiting = sum(s.waiting for s in with_metrics.values() if s is not None)
        base: dict[str, Any] = dict(
            time=now,
            current_replicas=current_replicas,
            target=cfg.target_per_replica,
            target_source=cfg.target_source,
            in_flight=in_flight,
            waiting=waiting,
            ready_pods=ready,
            unready_pods=unready,
            missing_pods=missing,
            min_replicas=cfg.min_replicas,
            max_replicas=cfg.max_replicas,
            errors=errors,
        )

        def early(desired: int, reason: str, message: str, formula: str) -> Decision:
            """A decision taken before any metric is used (no recommendation is recorded)."""
            return Decision(
                **base, desired_replicas=desired, reason=reason, message=message, formula=formula, metric=None,
                recommendation=None, stabilized=None, fast_path=False, scaling_limited=False, limited_reason=None,
            )  # fmt: skip

        # 1. Bounds and disabled scaling come before any metric, as in the HPA.
        if current_replicas == 0:
            return early(0, "ScalingDisabled", "the service is scaled to zero; scale it up to re-enable "
                         "autoscaling", "replicas = 0")  # fmt: skip
        if current_replicas > cfg.max_replicas:
            return early(cfg.max_replicas, "AboveMaxReplicas", f"current replicas {current_replicas} are above "
                         f"max {cfg.max_replicas}", f"min({current_replicas}, {cfg.max_replicas}) = "
                         f"{cfg.max_replicas}")  # fmt: skip
        if current_replicas < cfg.min_replicas:
            return early(cfg.min_replicas, "BelowMinReplicas", f"current replicas {current_replicas} are below "
                         f"min {cfg.min_replicas}", f"max({current_replicas}, {cfg.min_replicas}) = "
                         f"{cfg.min_replicas}")  # fmt: skip
        if not with_metrics:
            # The HPA stops on "no metrics for ready pods" and records no recommendation.
            self._queue_high_since = None
            return early(current_replicas, "NoMetrics", "no ready pod returned readable metrics; keeping the "
                         "current replica count", "no data")  # fmt: skip

        # 2. The HPA's replica calculation, then the trend's (when enabled).
        recommendation, metric, formula, calc_note = self._calculate(
            current_replicas, with_metrics, unready, missing
        )
        rising = self._trend(now, in_flight, max(recommendation, current_replicas))
        if rising is not None:
            recommendation, trend_formula = rising
            formula = f"{formula}; {trend_formula}"
        raised = floor is not None and floor[0] > max(recommendation, current_replicas)
        if floor is not None and raised:
            recommendation = floor[0]
            formula = f"{formula}; {floor[1]}"

        # 3. Stabilisation over the windows (the current raw recommendation included).
        self._history.append((now, recommendation))
        up_cutoff = now - cfg.scale_up_window_s
        down_cutoff = now - cfg.scale_down_window_s
        self._history = [(t, r) for t, r in self._history if t > min(up_cutoff, down_cutoff)]
        up_floor = min([r for t, r in self._history if t > up_cutoff] + [recommendation])
        down_ceiling = max([r for t, r in self._history if t > down_cutoff] + [recommendation])
        stabilized = min(max(current_replicas, up_floor), down_ceiling)

        if stabilized > recommendation:
            reason, message = (
                "ScaleDownStabilized",
                (
                    f"recommendations in the last {fmt(cfg.scale_down_window_s)} s went up to {down_ceiling}; "
                    "holding the highest"
                ),
            )
        elif stabilized < recommendation:
            reason, message = (
                "ScaleUpStabilized",
                (
                    f"recommendations in the last {fmt(cfg.scale_up_window_s)} s went down to {up_floor}; "
                    "waiting for the load to persist"
                ),
            )
        elif recommendation > current_replicas and raised:
            reason, message = "PredictedTTFTAboveSLO", "predicted TTFT above the SLO: the queue needs more replicas"
        elif recommendation > current_replicas and rising is not None:
            reason, message = (
                "InFlightRising",
                (
                    f"in-flight rising; projected {fmt(cfg.trend_lookahead_s)} s ahead it needs more replicas "
                    "than its level does"
                ),
            )
        elif recommendation > current_replicas:
            reason, message = "MetricAboveTarget", f"{cfg.metric_name} above target"
        elif recommendation < current_replicas:
            reason, message = "MetricBelowTarget", f"{cfg.metric_name} below target"
        else:
            reason, message = "WithinTolerance", calc_note or f"{cfg.metric_name} near target"
        if calc_note and reason != "WithinTolerance":
            message = f"{message} ({calc_note})"

        desired = stabilized
        if stabilized < recommendation and wakeable > 0:
            woken = min(recommendation, max(stabilized, current_replicas) + wakeable)
            if woken > stabilized:
                desired = woken
                reason, message = (
                    "WakeWithoutWindow",
                    f"{woken - max(stabilized, current_replicas)} of {wakeable} replica(s) asleep in standby "
                    f"woken at once, without the {fmt(cfg.scale_up_window_s)} s scale-up window (a wake takes "
                    "about a second and parking undoes it)",
                )

        # 4. Fast path: a queue above half the capacity for the hold time adds a replica.
        fast_path = False
        capacity = current_replicas * cfg.target_per_replica
        # Replicas still starting (or restarting) take their share of the queue once Ready; another
        # replica for the same queue would overshoot, so the hold runs only while every replica serves.
        settled = not unready and len(ready) + len(missing) >= current_replicas
        if settled and waiting > cfg.fast_path_queue_fraction * capacity:
            if self._queue_high_since is None:
                self._queue_high_since = now
            held = now - self._queue_high_since
            if held >= cfg.fast_path_hold_s and desired <= current_replicas:
                desired = current_replicas + 1
                fast_path = True
                reason = "QueueFastPath"
                message = (
                    f"waiting {fmt(waiting)} > {fmt(cfg.fast_path_queue_fraction)} × capacity "
                    f"{fmt(capacity)} for {fmt(held)} s; adding a replica"
                )
            if held >= cfg.fast_path_hold_s:
                # Start a new hold period, so the next extra replica needs the queue to persist again.
                self._queue_high_since = now
        else:
            self._queue_high_since = None

        # 5. Rate policy and bounds, as the HPA's convertDesiredReplicasWithBehaviorRate applies them.
        self._counts = [(t, c) for t, c in self._counts if t > now - cfg.scale_up_period_s]
        self._counts.append((now, current_replicas))
        period_start = min(c for _, c in self._counts)
        rate_limit = max(
            period_start + cfg.scale_up_max_pods,
            math.ceil(period_start * (1 + cfg.scale_up_max_percent / 100)),
        )
        limited_reason = None
        wanted = max(desired, recommendation)
        ceiling = min(cfg.max_replicas, rate_limit)
        if desired > ceiling and ceiling == rate_limit < cfg.max_replicas:
            limited_reason = "ScaleUpLimit"
            reason = "ScaleUpLimit"
            message = (
                f"{message}; at most {rate_limit} within {fmt(cfg.scale_up_period_s)} s "
                f"(+{cfg.scale_up_max_pods} pods or +{fmt(cfg.scale_up_max_percent)} % of {period_start})"
            )
        elif wanted > cfg.max_replicas:
            limited_reason = "TooManyReplicas"
        elif min(desired, recommendation) < cfg.min_replicas:
            limited_reason = "TooFewReplicas"
        clamped = min(max(min(desired, ceiling), cfg.min_replicas), cfg.max_replicas)
        if limited_reason == "TooManyReplicas" and clamped == cfg.max_replicas:
            reason, message = (
                limited_reason,
                f"{message}; limited to max {cfg.max_replicas} while {wanted} are wanted",
            )
        elif limited_reason == "TooFewReplicas" and clamped == cfg.min_replicas:
            wanted = min(desired, recommendation)
            reason, message = (
                limited_reason,
                f"{message}; limited to min {cfg.min_replicas} while {wanted} would do",
            )
        return Decision(
            **base,
            desired_replicas=clamped,
            reason=reason,
            message=message,
            formula=formula,
            metric=float(metric),
            recommendation=recommendation,
            stabilized=stabilized,
            fast_path=fast_path,
            # Only "at max and still overloaded" is a limit worth a condition and a Warning.
            scaling_limited=limited_reason == "TooManyReplicas" and clamped == cfg.max_replicas,
            limited_reason=limited_reason,
        )

    def _trend(self, now: float, in_flight: float, floor: int) -> tuple[int, str] | None:
        """(recommendation, formula) from the projected in-flight, when that asks for more than ``floor``."""
        cfg = self.config
        if cfg.trend_lookahead_s <= 0:
            return None
        self._in_flight = [(t, v) for t, v in self._in_flight if t > now - cfg.trend_window_s]
        self._in_flight.append((now, in_flight))
        if len(self._in_flight) < 3:
            return None
        n = len(self._in_flight)
        mean_t = sum(t for t, _ in self._in_flight) / n
        mean_v = sum(v for _, v in self._in_flight) / n
        spread = sum((t - mean_t) ** 2 for t, _ in self._in_flight)
        if spread <= 0:
            return None
        slope = sum((t - mean_t) * (v - mean_v) for t, v in self._in_flight) / spread
        if slope <= 0:
            return None
        projected = in_flight + slope * cfg.trend_lookahead_s
        wanted = math.ceil(projected / cfg.target_per_replica)
        if wanted <= floor:
            return None
        return wanted, (
            f"trend: {fmt(in_flight)} + {fmt(slope)}/s × {fmt(cfg.trend_lookahead_s)} s = {fmt(projected)} "
            f"in flight, ceil({fmt(projected)} / {fmt(cfg.target_per_replica)}) = {wanted}"
        )

    def _calculate(
        self,
        current: int,
        with_metrics: Mapping[str, PodSample | None],
        unready: tuple[str, ...],
        missing: tuple[str, ...],
    ) -> tuple[int, Fraction, str, str]:
        """HPA ``calcPlainMetricReplicas``: (recommendation, average metric, formula, note)."""
        cfg = self.config
        # Exact arithmetic, so ceil(3 × 0.1 / 0.1) is 3 and not 4.
        target = Fraction(cfg.target_per_replica)
        tol = Fraction(cfg.tolerance)
        values = [Fraction(s.in_flight) for s in with_metrics.values() if s is not None]
        average = sum(values, Fraction(0)) / len(values)
        ratio = average / target
        t = fmt(target)
        if not (unready and ratio > 1) and not missing:
            raw = math.ceil(ratio * len(values))
            formula = f"ceil({len(values)} × {fmt(average)} / {t}) = {raw}"
            if abs(1 - ratio) <= tol:
                return current, average, formula, f"|{fmt(average)} / {t} − 1| ≤ {fmt(tol)} tolerance"
            return raw, average, formula, ""

        notes = []
        filled = list(values)
        if missing:
            # Scale-down: assume the silent pods sit exactly at target; scale-up: assume they are idle.
            fill = target if ratio < 1 else Fraction(0)
            filled += [fill] * len(missing)
            notes.append(f"{len(missing)} pod(s) without metrics counted at {fmt(fill)}")
        if unready and ratio > 1:
            filled += [Fraction(0)] * len(unready)
            notes.append(f"{len(unready)} unready pod(s) counted at 0")
        new_average = sum(filled, Fraction(0)) / len(filled)
        new_ratio = new_average / target
        raw = math.ceil(new_ratio * len(filled))
        formula = f"ceil({len(filled)} × {fmt(new_average)} / {t}) = {raw}"
        note = "; ".join(notes)
        if abs(1 - new_ratio) <= tol or (ratio < 1 < new_ratio) or (ratio > 1 > new_ratio):
            return current, new_average, formula, f"{note}; change too small or direction reversed"
        if (new_ratio < 1 and raw > current) or (new_ratio > 1 and raw < current):
            return current, new_average, formula, f"{note}; would move against the metric"
        return raw, new_average, formula, note
