"""The replica planner: the one place that decides how many replicas an LLMService runs and which pods go.

What it is: :class:`ReplicaPlanner`, one per LLMService, owned by the handler
that runs its loop. Each tick :meth:`ReplicaPlanner.plan` takes the time, what
the handler observed (:class:`Observations`), the spec and the status as stored,
and returns a :class:`Plan`: the count per pool, the drain and undrain actions,
the status fields and conditions, the Events, each with its reason and formula.
The rules, in the order a tick applies them (the first that owns the tick ends it):

1. **Starting size** (``starting_size.py``): with no ``spec.replicas``,
   ``expectedLoad`` sizes the service, written once and only onto the version
   that was read (:meth:`ReplicaPlanner.plan_start`, which reconcile also runs
   before it builds the Deployment).
2. **Target and bounds** (``inputs.py``): without a per-replica target nothing
   is planned (``NoTarget``).
3. **From zero** (``scale_to_zero.py``, ``cold_start.py``): at zero replicas
   with ``scaling.min: 0``, a request held by the router brings ``max(1, min)``
   back in this tick, and the cold start is measured until a replica is Ready.
4. **A drain in progress** (``drain.py``): its pods stay marked every tick; the
   count goes down once they hold nothing or ``scaling.drainSeconds`` passed; it
   is called off when the load comes back or another writer moves the count.
5. **To zero**: with ``scaling.min: 0`` and no sign of work for
   ``scaling.idleSeconds``, the last replicas are drained (rule 4), then 0.
6. **The HPA formula** (``autoscaler.py``: stabilisation windows, rate policy,
   queue fast path, trend), raised to what the **predicted TTFT** against
   ``spec.slo.ttftP95Ms`` asks (``token_signal.py``: the replicas' backlog in
   seconds, starting replicas credited by their expected Ready) and to what the
   requests refused for want of room would add (``shed_demand.py``): a scale-up is
   written at once and followed to the new pod's first answer
   (``scale_up_timeline.py``); a scale-down starts a drain. ``SLOAtRisk`` comes
   from the replicas' histograms and attainment (``slo.py``).

With ``autoscaling.standby`` the rules above see only the active pods, and a last
rule (``standby.py``) wakes parked replicas when the count asks for more active
ones than there are, and parks the surplus (the pods the Deployment starts to keep
the pool full, the replicas a scale-down drained) asleep.

With ``spec.variants`` the tick is :class:`~plimsoll.operator.scaling.variant_planner.VariantPlanner`'s
instead (rules 2–6 per hardware variant: the cheapest mix that carries the demand,
a count per variant pool), then ``SLOAtRisk`` as above.

On a split service (``spec.disaggregation``, ``pools.py``) the rules above run for the decode
pool (the service's replicas) on its decode load instead of in-flight, and the prefill pool
gets its own count every tick from its prefill backlog; ``status.disaggregation`` says what runs
and why (the prediction from both pools' profiles and the link).

After the rules, a pod that carries the removal mark but that no drain holds
any more is unmarked (:class:`Undrain`). Status is written when something a
reader acts on changed, else at most every :data:`STATUS_MIN_INTERVAL_S`.

State between ticks lives on this object (histories, clocks, the drain) and,
where a restart must not lose it, in status: ``scaleDown`` (a drain goes on after
a restart), ``coldStart``, ``requestsCutTotal``. The handler drops the object
with the LLMService.

What it is not: I/O. ``operator/handlers/replica_planning.py`` observes, acts
and writes; import-linter keeps every other handler away from this module and
its parts. The drain and zero rules' state is ``scale_phases.py``'s.
"""

import math
from typing import Any

from plimsoll.operator.api.spec import LLMServiceSpec
from plimsoll.operator.api.status import ConditionStatus, ConditionUpdate
from plimsoll.operator.scaling.autoscaler import Autoscaler, AutoscalerConfig, Decision
from plimsoll.operator.scaling.drain import PodLoad, choose_victims
from plimsoll.operator.scaling.inputs import (
    autoscaler_config,
    decode_autoscaler_config,
    prefill_autoscaler_config,
)
from plimsoll.operator.scaling.kv_cache import kv_cache_status
from plimsoll.operator.scaling.metrics import PodSample
from plimsoll.operator.scaling.observations import Observations, PodObservation
from plimsoll.operator.scaling.pools import (
    PREFILL_POOL,
    decode_load,
    decode_load_of,
    pool_autoscaler_status,
    prefill_backlog,
    prefill_no_target,
    prefill_rate,
    prefill_signal,
    split_status,
)
from plimsoll.operator.scaling.replica_plan import DEFAULT_POOL, Plan, PlanDraft
from plimsoll.operator.scaling.scale_phases import ScalePhases
from plimsoll.operator.scaling.scale_to_zero import floored
from plimsoll.operator.scaling.scale_up_timeline import ScaleUpTimeline
from plimsoll.operator.scaling.shed_demand import ShedDemand, demand_refusals, shed_recommendation
from plimsoll.operator.scaling.sizing import NoTargetError
from plimsoll.operator.scaling.slo import check_slo
from plimsoll.operator.scaling.standby import Standby
from plimsoll.operator.scaling.starting_size import plan_start
from plimsoll.operator.scaling.timestamps import rfc3339_seconds
from plimsoll.operator.scaling.token_signal import TokenSignal, predicted_ttft_recommendation
from plimsoll.operator.scaling.variant_planner import VariantPlanner, start_counts

# Unchanged replicas and conditions: refresh status.autoscaler at most this often.
STATUS_MIN_INTERVAL_S = 15.0
# Percentiles over less than a minute of traffic are noise.
SLO_WINDOW_S = 60.0
# A scale-up whose new pod has not answered after this long is written as it stands (complete: false).
TIMELINE_GIVE_UP_S = 900.0
# What the predicted-TTFT rule expects a new replica to take before anything was measured, and a wake.
DEFAULT_COLD_START_S = 30.0
DEFAULT_WAKE_S = 2.0

# ScalingLimited=False (reason, message) when the decision touched a bound that is not a problem.
_WITHIN_RANGE = ("DesiredWithinRange", "desired {desired} within bounds")
_QUIET_LIMITS = {
    "TooFewReplicas": ("AtMinReplicas", "at min {min} with less load than it can carry; normal when idle"),
    "ScaleUpLimit": ("ScaleUpRateLimited", "adding replicas as fast as the scale-up rate policy allows"),
}
# Not the decision's: the time changes every tick, lastScaleUp is the timeline's.
_NOT_COMPARED = ("time", "lastScaleUp")


def needs_router_demand(spec: LLMServiceSpec) -> bool:
    """Whether a tick asks the routers' ``/hold``: whenever a router is in front. Its held requests bring a
    service back from zero, and what it refused for want of room is demand and SLO misses (shed_demand.py)."""
    return spec.router_in_front()


def condition_states(conditions: list[dict[str, Any]] | None) -> dict[str, str]:
    return {str(c.get("type")): str(c.get("status")) for c in conditions or []}


def same_decision(a: dict[str, Any] | None, b: dict[str, Any]) -> bool:
    """The stored ``status.autoscaler`` says what ``b`` says (time and the timeline aside)."""
    if a is None:
        return False
    return {k: v for k, v in a.items() if k not in _NOT_COMPARED} == {
        k: v for k, v in b.items() if k not in _NOT_COMPARED
    }


def decision_conditions(decision: Decision, slo: tuple[str, str, str] | None) -> tuple[ConditionUpdate, ...]:
    """ScalingLimited (True only at max and still overloaded) and, when checked, SLOAtRisk."""
    limited: ConditionUpdate
    if decision.scaling_limited:
        reason = decision.limited_reason or "Limited"
        limited = ("ScalingLimited", "True", reason, decision.event_message())
    else:
        # Idle at min and a passing rate limit are normal operation: False, with the reason spelled out.
        reason, message = _QUIET_LIMITS.get(decision.limited_reason or "", _WITHIN_RANGE)
        text = message.format(desired=decision.desired_replicas, min=decision.min_replicas)
        limited = ("ScalingLimited", "False", reason, text)
    if slo is None:
        return (limited,)
    state: ConditionStatus = "True" if slo[0] == "True" else "False" if slo[0] == "False" else "Unknown"
    return limited, ("SLOAtRisk", state, slo[1], slo[2])


def _profiled(status: dict[str, Any]) -> float | None:
    value = (status.get("capacity") or {}).get("concurrencyPerReplica")
    return None if value is None else float(value)


class ReplicaPlanner:
    """One LLMService's planner (see the module docstring); ``engine_container`` names the replicas' engine."""

    def __init__(self, engine_container: str | None = None) -> None:
        self.engine_container = engine_container
        self.last_now = 0.0
        self.forget()

    def forget(self) -> None:
        """Drop every history and clock (another autoscaler took over); the clock's floor stays."""
        self.scaler: Autoscaler | None = None
        self.last_write = 0.0
        # The count the planner last saw or wrote, and the one before its own last write (the
        # object may still show that for a tick); any other count was written by someone else.
        self.replicas: int | None = None
        self.replaced: int | None = None
        self.crossed_at: float | None = None  # since when in-flight per replica has been above target
        self.timeline: ScaleUpTimeline | None = None
        self.slo_base: tuple[float, dict[str, PodSample]] | None = None
        self.phases: ScalePhases | None = None
        self.prefill_scaler: Autoscaler | None = None  # a split service's prefill pool: its own HPA history
        self.split_written = -math.inf  # when status.disaggregation was last written
        self.variants: VariantPlanner | None = None  # spec.variants: the mix's state
        self.standby: Standby | None = None
        self._parked_seen: tuple[PodObservation, ...] = ()
        self._router_woken: tuple[str, ...] = ()  # parked pods a router woke, this tick
        self.shed = ShedDemand()  # requests refused for want of room, counted as demand

    @staticmethod
    def variant_start_counts(spec: LLMServiceSpec, status: dict[str, Any]) -> dict[str, int]:
        """The first count of each variant's Deployment (reconcile creates them with it)."""
        return start_counts(spec, status)

    @staticmethod
    def plan_start(now: float, spec: LLMServiceSpec, status: dict[str, Any]) -> Plan | None:
        """Rule 1 alone: the starting size of a service without ``spec.replicas`` (None: nothing to do)."""
        draft = PlanDraft(now)
        if not _start_size(draft, spec, status):
            return None
        return draft.build(draft.must_write)

    def plan(
        self, now: float, observations: Observations, spec: LLMServiceSpec, status: dict[str, Any]
    ) -> Plan:
        """One tick: the rules in order (module docstring); ``now`` never goes backwards for the windows."""
        now = self.last_now = max(now, self.last_now)
        draft = PlanDraft(now)
        if spec.autoscaling.mode != "builtin":
            # Another autoscaler (or nobody) owns the count; only the starting size is ours.
            self.forget()
            _start_size(draft, spec, status)
            return draft.build(draft.must_write)
        # Parked standby pods serve nothing: every rule but the standby one sees the active pods only.
        active = observations.active()
        self._parked_seen = observations.parked
        self._router_woken = self._woken_by_router(observations, spec)
        if spec.variants:
            self._variant_rules(draft, active, spec, status)
        else:
            self.variants = None
            self._rules(draft, active, spec, status)
            if spec.disaggregation is not None:  # refused together with spec.variants
                self._split(draft, active, spec, status)
        if self.phases is not None:
            self.phases.unmark_strays(draft, active)
        self._standby(draft, observations, spec, status)
        for count in draft.replicas:
            if count.pool == DEFAULT_POOL:  # the prefill pool's count is its own scaler's
                self._saw(count.current, count.desired)
        write = draft.must_write or bool(draft.fields)
        if write:
            if self.phases is not None:
                draft.fields.setdefault("coldStart", self.phases.cold.to_status())
                draft.fields.setdefault("scaleDown", self.phases.to_status())
            self.last_write = now
        return draft.build(write)

    def _rules(
        self, draft: PlanDraft, obs: Observations, spec: LLMServiceSpec, status: dict[str, Any]
    ) -> None:
        now = draft.now
        if _start_size(draft, spec, status) and draft.replicas:
            return
        try:
            # Zero is the idle rule's decision (rule 5), never the HPA formula's.
            if spec.disaggregation is not None:  # the decode pool, on its decode load
                config = floored(decode_autoscaler_config(spec, status))
            else:
                config = floored(autoscaler_config(spec, _profiled(status)))
        except NoTargetError as error:
            self.scaler = None
            if ((status.get("autoscaler") or {}).get("decision") or {}).get("reason") != "NoTarget":
                draft.fields["autoscaler"] = _no_target(now, str(error))
            return
        current = spec.desired_replicas()
        if self.scaler is None or self._needs_fresh_scaler(config, current):
            # A new target or bounds, or a count someone else wrote (`kubectl scale`): a fresh history
            # seeded with the current count, as after a restart, so recommendations made for the old
            # count cannot undo the new one before a full window.
            self.scaler = Autoscaler(config)
        if self.phases is None:
            self.phases = ScalePhases.from_status(status, obs, spec, now)
        phases = self.phases
        phases.park_removed = spec.autoscaling.standby is not None
        samples = obs.ready_samples()
        self.shed.observe(now, demand_refusals(obs.router, samples), samples)
        phases.book(draft, obs)
        self._follow_timeline(draft, obs, samples)

        scaling = spec.scaling
        if scaling is not None and scaling.min == 0 and current == 0:
            phases.at_zero(draft, obs, config, scaling.idle_seconds)
            return
        phases.idle.observe(now, samples, obs.held)
        if not any(p.ready for p in obs.counted):
            phases.idle.last_activity = now  # a service still starting is not idle: nobody could have used it
        if phases.drain is not None:
            load_of = decode_load_of(spec, status) if spec.disaggregation is not None else None
            phases.drain_step(draft, obs, config, current, load_of)
            return
        if (
            scaling is not None
            and scaling.min == 0
            and phases.idle.should_scale_to_zero(now, scaling.idle_seconds)
        ):
            live = tuple(sorted(p.name for p in obs.counted))
            idle = f"no request seen for {phases.idle.idle_for(now):.0f} s (scaling.idleSeconds {scaling.idle_seconds})"
            phases.begin_drain(draft, live, current, 0, float(scaling.drain_seconds), "ScaleToZero", idle)
            return
        self._autoscale(draft, obs, spec, status, current, samples)

    def _variant_rules(
        self, draft: PlanDraft, obs: Observations, spec: LLMServiceSpec, status: dict[str, Any]
    ) -> None:
        """Hardware variants: the mix (``variant_planner.py``), then SLOAtRisk from the same scrapes."""
        if self.variants is None:
            self.variants = VariantPlanner()
        self.variants.plan(draft, obs, spec, status)
        slo = self._check_slo(draft.now, spec, obs.ready_samples(), obs.attainment)
        if slo is not None:
            state: ConditionStatus = "True" if slo[0] == "True" else "False" if slo[0] == "False" else "Unknown"
            condition: ConditionUpdate = ("SLOAtRisk", state, slo[1], slo[2])
            stored = condition_states(status.get("conditions"))
            if draft.must_write or stored.get("SLOAtRisk") != state:
                draft.conditions.append(condition)
                draft.must_write = True

    def _autoscale(
        self, draft: PlanDraft, obs: Observations, spec: LLMServiceSpec, status: dict[str, Any], current: int,
        samples: dict[str, PodSample],
    ) -> None:  # fmt: skip
        """Rule 6: the HPA formula's decision, acted on (scale up now, or begin a drain), and explained."""
        assert self.scaler is not None and self.phases is not None
        now = draft.now
        pods = decode_load(spec, status, obs.counted) if spec.disaggregation is not None else obs.counted
        # The predicted-TTFT rule reads the replicas' prompt backlog; on a split service prompts wait in
        # the prefill pool, which scales on that backlog itself (_prefill), so the decode pool goes without.
        signal = self._token_signal(now, obs, spec, status, current) if spec.disaggregation is None else None
        floors = (
            [(signal.recommendation, signal.formula)] if signal and signal.recommendation is not None else []
        )
        # Requests refused for want of room are demand the in-flight count never sees (shed_demand.py).
        shed = None
        if spec.disaggregation is None:
            in_flight = sum(s.in_flight for s in samples.values())
            shed = shed_recommendation(
                self.shed.rate(), in_flight, self.scaler.config.target_per_replica, current
            )
            if shed.recommendation is not None:
                floors.append((shed.recommendation, shed.formula))
        if self._router_woken:
            # A router saw every awake replica past its target and woke parked ones: demand its scrape had
            # first (standby_wake.py in the router); they are taken in, or parked again by the rule below.
            woken, target = self._router_woken, self.scaler.config.target_per_replica
            floors.append((current + len(woken),
                           f"the router woke {', '.join(woken)} from standby as every awake replica passed its "
                           f"target of {target:g} in flight: {current} + {len(woken)} = {current + len(woken)}"))  # fmt: skip
        floor = max(floors, key=lambda f: f[0]) if floors else None
        decision = draft.decision = self.scaler.decide(now, current, pods, floor, self._wakeable(spec))
        self._saw(current, decision.desired_replicas)
        if decision.metric is not None and decision.metric > decision.target:
            self.crossed_at = now if self.crossed_at is None else self.crossed_at
        else:
            self.crossed_at = None
        slo = self._check_slo(now, spec, samples, obs.attainment)

        if decision.changed and decision.desired_replicas < current:
            # Two-phase: drain the chosen pods first; the count goes down once they are empty.
            loads = [PodLoad(p.name, p.ready, p.sample.in_flight if p.sample else (None if p.ready else 0.0))
                     for p in obs.counted]  # fmt: skip
            victims = choose_victims(loads, current - decision.desired_replicas)
            drain_s = float(spec.scaling.drain_seconds if spec.scaling else 120)
            self.phases.begin_drain(draft, victims, current, decision.desired_replicas, drain_s, "ScaleDown",
                                    decision.event_message())  # fmt: skip
        elif decision.changed:
            draft.count(current, decision.desired_replicas, "ScaledUp", decision.formula)
            self.timeline = ScaleUpTimeline(
                crossed_at=self.crossed_at if self.crossed_at is not None else now, decided_at=now,
                from_replicas=current, to_replicas=decision.desired_replicas,
                existing_pods=frozenset(p.name for p in obs.pods), container=self.engine_container,
            )  # fmt: skip
            draft.event("Normal", "ScaledUp", decision.event_message())
        stored = condition_states(status.get("conditions"))
        if decision.scaling_limited and stored.get("ScalingLimited") != "True":
            draft.event("Warning", "ScalingLimited", decision.event_message())

        block = decision.to_status()
        if signal is not None:
            block["tokenAware"] = signal.to_status()
        if shed is not None and shed.recommendation is not None:
            block["shed"] = shed.to_status()
        conditions = decision_conditions(decision, slo)
        # At once when replicas or a condition's status change; otherwise at most every
        # STATUS_MIN_INTERVAL_S, so a noisy load does not turn into a status write per tick.
        must = decision.changed or any(stored.get(c[0]) != c[1] for c in conditions)
        fresh = not same_decision(status.get("autoscaler"), block)
        if must or draft.must_write or (fresh and now - self.last_write >= STATUS_MIN_INTERVAL_S):
            draft.merge("autoscaler", block)
            draft.conditions.extend(conditions)
            kv = kv_cache_status(samples)  # status.kvCache: hit rates per KV tier, with the same write
            if kv is not None:
                draft.fields["kvCache"] = kv
            draft.must_write = True

    def _split(self, draft: PlanDraft, obs: Observations, spec: LLMServiceSpec, status: dict[str, Any]) -> None:
        """The prefill pool's count on its own signal, and ``status.disaggregation`` (``pools.py``)."""
        assert spec.disaggregation is not None
        prefill_pods = tuple(p for p in obs.prefill_pods if not p.terminating)
        decision, block = self._prefill(draft.now, spec, status, prefill_pods)
        if decision is not None and decision.changed:
            reason = "ScaledUp" if decision.desired_replicas > decision.current_replicas else "ScaledDown"
            draft.count(decision.current_replicas, decision.desired_replicas, reason, decision.formula, pool=PREFILL_POOL)
            draft.event("Normal", f"Prefill{reason}", f"prefill pool {decision.event_message()}")
        samples = [p.sample for p in (*obs.counted, *prefill_pods) if p.sample is not None]
        kv_bytes = next((s.kv_bytes_per_token for s in samples if s.kv_bytes_per_token), None)
        stored = dict(status.get("disaggregation") or {})
        prefill_count = spec.disaggregation.prefill.desired_replicas()
        # Only what the planner owns: the status write is a merge patch, so each pool's profile (the
        # profiling handler's) and counts (reconcile's) stay as their writers left them.
        fresh: dict[str, Any] = {"runs": "split",
                                 **split_status(spec, status, prefill_count, spec.desired_replicas(), kv_bytes),
                                 "prefill": {"autoscaler": block}}  # fmt: skip
        if draft.decision is not None:
            fresh["decode"] = {"autoscaler": pool_autoscaler_status(draft.decision.to_status(), "decode load")}
        changed = any(d is not None and d.changed for d in (decision, draft.decision))
        if changed or (not _same_split(stored, fresh) and draft.now - self.split_written >= STATUS_MIN_INTERVAL_S):
            draft.fields["disaggregation"] = fresh
            self.split_written = draft.now
            draft.must_write = draft.must_write or changed

    def _prefill(
        self, now: float, spec: LLMServiceSpec, status: dict[str, Any], pods: tuple[PodObservation, ...]
    ) -> tuple[Decision | None, dict[str, Any]]:
        """The prefill pool's HPA decision on its backlog (None before its profile gives a rate), and its block."""
        assert spec.disaggregation is not None
        current = spec.disaggregation.prefill.desired_replicas()
        try:
            rate, source = prefill_rate(spec, status)
        except NoTargetError as error:
            self.prefill_scaler = None
            return None, prefill_no_target(now, current, error)
        config = prefill_autoscaler_config(spec)
        if self.prefill_scaler is None or self.prefill_scaler.config != config:
            self.prefill_scaler = Autoscaler(config)
        decision = self.prefill_scaler.decide(now, current, prefill_backlog(pods, rate))
        return decision, pool_autoscaler_status(decision.to_status(), prefill_signal(rate, source))
    def _token_signal(
        self, now: float, obs: Observations, spec: LLMServiceSpec, status: dict[str, Any], current: int
    ) -> TokenSignal | None:
        """The predicted-TTFT rule (``token_signal.py``) when ``spec.slo.ttftP95Ms`` is set and it is on."""
        slo_ms = spec.slo.ttft_p95_ms
        if slo_ms is None or not spec.autoscaling.token_aware:
            return None
        cold = _expected_cold_start(status)
        parked_asleep = any(p.sample is not None and p.sample.sleep_level > 0 for p in self._parked_seen)
        wake = self.standby.last_wake_s if self.standby is not None and self.standby.last_wake_s else DEFAULT_WAKE_S
        return predicted_ttft_recommendation(
            now, current, obs.counted, slo_ms / 1000.0, cold, min(wake, cold) if parked_asleep else cold
        )

    def _wakeable(self, spec: LLMServiceSpec) -> int:
        """Parked replicas asleep and loaded, or woken by a router, which a scale-up may take in without the
        window (0 without standby)."""
        if spec.autoscaling.standby is None:
            return 0
        waking = self.standby.waking if self.standby is not None else {}
        held = self._held_pods()
        asleep = sum(
            1
            for p in self._parked_seen
            if p.name not in waking and p.name not in held and p.sample is not None and p.sample.sleep_level > 0
        )
        return asleep + len(self._router_woken)  # awake already: no window either

    def _woken_by_router(self, obs: Observations, spec: LLMServiceSpec) -> tuple[str, ...]:
        """Parked pods a router woke (its ``GET /hold``), not yet taken in: the scale-up they stand for."""
        if spec.autoscaling.standby is None or obs.router is None or not obs.router.woken:
            return ()
        taken = set(self._held_pods()) | set(self.standby.adopted if self.standby is not None else ())
        return tuple(sorted(p.name for p in obs.parked if p.name in obs.router.woken and p.name not in taken))

    def _held_pods(self) -> frozenset[str]:
        """Pods a drain or a removal owns this tick: neither woken nor parked by the standby rule."""
        if self.phases is None:
            return frozenset()
        drained = self.phases.drain.pods if self.phases.drain is not None else ()
        return frozenset(drained) | frozenset(self.phases.removed)

    def _standby(self, draft: PlanDraft, obs: Observations, spec: LLMServiceSpec, status: dict[str, Any]) -> None:
        """The standby rule (``standby.py``) against the count this tick leaves, and ``status.standby``."""
        config = spec.autoscaling.standby
        if config is None:
            self.standby = None
            if status.get("standby") is not None:
                draft.fields["standby"] = None
            return
        if self.standby is None:
            self.standby = Standby.from_status(status.get("standby"))
        # The service's own pool: a split service's prefill count is not the replicas standby sits beside.
        counts = [c for c in draft.replicas if c.pool != PREFILL_POOL]
        count = counts[-1].desired if counts else spec.desired_replicas()
        self.standby.plan(draft, obs, count, config.replicas, config.level, self._held_pods(),
                          frozenset(self._router_woken))  # fmt: skip
        block = self.standby.to_status(obs, config.replicas, config.level)
        if status.get("standby") != block:
            draft.fields["standby"] = block
            if (status.get("standby") or {}).get("parked") != block["parked"]:
                draft.must_write = True

    def _check_slo(
        self, now: float, spec: LLMServiceSpec, samples: dict[str, PodSample], attainment: float | None
    ) -> tuple[str, str, str] | None:
        """SLOAtRisk once a window of at least :data:`SLO_WINDOW_S` lies between two scrapes."""
        if self.slo_base is None:
            self.slo_base = (now, samples)
            return None
        if now - self.slo_base[0] < SLO_WINDOW_S:
            return None
        check = check_slo(
            ttft_p95_ms=spec.slo.ttft_p95_ms, tpot_p50_ms=spec.slo.tpot_p50_ms,
            current=samples, previous=self.slo_base[1], attainment=attainment,
        )  # fmt: skip
        self.slo_base = (now, samples)
        return check.status, check.reason, check.message

    def _follow_timeline(self, draft: PlanDraft, obs: Observations, samples: dict[str, PodSample]) -> None:
        """Advance the open scale-up timeline; write it once complete (or given up on)."""
        timeline = self.timeline
        if timeline is None:
            return
        timeline.observe(draft.now, list(obs.pod_objects), samples)
        if not timeline.complete and draft.now - timeline.decided_at < TIMELINE_GIVE_UP_S:
            return
        self.timeline = None
        took = timeline.phase_seconds()
        draft.scale_up_phases = {p: s for p, s in took.items() if p != "metricCrossedTarget"}
        draft.merge("autoscaler", {"lastScaleUp": timeline.to_status()})
        draft.event("Normal", "ScaleUpTimeline", timeline.sentence())
        draft.must_write = True

    def _saw(self, current: int | None, desired: int) -> None:
        """Remember the count this tick saw and the one it decided (written when they differ)."""
        self.replicas, self.replaced = desired, (current if desired != current else None)

    def _needs_fresh_scaler(self, config: AutoscalerConfig, current: int) -> bool:
        """No scaler yet, a new target or bounds, or replicas moved by another writer."""
        moved = self.replicas is not None and current not in (self.replicas, self.replaced)
        return self.scaler is None or self.scaler.config != config or moved


def _same_split(stored: dict[str, Any], fresh: dict[str, Any]) -> bool:
    """``stored`` already says what ``fresh`` says, in the keys ``fresh`` holds (a merge patch leaves the
    others, e.g. each pool's profile), the autoscalers' times aside."""
    for key, value in fresh.items():
        old = stored.get(key)
        if key in ("prefill", "decode") and isinstance(value, dict):
            before = (old or {}).get("autoscaler") if isinstance(old, dict) else None
            after = value.get("autoscaler")
            if not isinstance(before, dict) or not isinstance(after, dict):
                if before != after:
                    return False
            elif {k: v for k, v in before.items() if k not in _NOT_COMPARED} != {
                k: v for k, v in after.items() if k not in _NOT_COMPARED
            }:
                return False
        elif old != value:
            return False
    return True


def _start_size(draft: PlanDraft, spec: LLMServiceSpec, status: dict[str, Any]) -> bool:
    """Rule 1 into ``draft``; True when the spec has no count and ``expectedLoad`` (or a seed) applies."""
    if spec.variants:
        return False  # each variant's Deployment starts at its own count (variant_planner.start_counts)
    start = plan_start(spec, _profiled(status))
    if start is None:
        return False
    fresh = start.to_status(rfc3339_seconds(draft.now))
    stored = status.get("sizing") or {}
    if any(stored.get(k) != v for k, v in fresh.items() if k != "time"):
        draft.fields["sizing"] = fresh
        draft.event("Normal", "InitialSizing", start.event_message())
        draft.must_write = True
    if start.write:
        draft.count(
            None, start.replicas, start.reason, start.formula or start.message, only_if_unchanged=True
        )
    return True


def _expected_cold_start(status: dict[str, Any]) -> float:
    """Seconds a new replica is expected to take to be Ready: the measured cold starts' p95, else the last
    scale-up's decision-to-Ready, else a default."""
    p95 = (status.get("coldStart") or {}).get("p95Seconds")
    if p95:
        return float(p95)
    last = ((status.get("autoscaler") or {}).get("lastScaleUp") or {}).get("decisionToReadySeconds")
    return float(last) if last else DEFAULT_COLD_START_S


def _no_target(now: float, why: str) -> dict[str, Any]:
    """``status.autoscaler`` while no per-replica target is known (merge patch: nulls clear an old decision)."""
    return {
        "time": rfc3339_seconds(now),
        "formula": "no per-replica target",
        "inputs": None,
        "decision": {
            **dict.fromkeys(("currentReplicas", "desiredReplicas", "recommendation",
                             "stabilizedRecommendation", "fastPath", "scalingLimited", "limitedReason")),
            "reason": "NoTarget",
            "message": why,
        },
    }  # fmt: skip
