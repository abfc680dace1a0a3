"""The replica planner's rule for an LLMService with hardware variants: the cheapest mix, carried out safely.

What it is: :class:`VariantPlanner`, which the replica planner (``planner.py``)
runs instead of the single-pool rules when ``spec.variants`` is set. Each tick:

1. **Targets and availability.** Each variant's per-replica target comes from its
   own profile (or Manual), in requests/s when every variant is profiled
   (``variant_state.py``). A variant whose pods stay unschedulable for
   ``mix.unschedulableSeconds`` (no node fits: spot capacity reclaimed), or whose
   Ready pods all stop answering for as long, is **unavailable** for
   ``mix.unavailableSeconds``: held at its minimum, its capacity counted as none,
   and the mix moves to the others (Event ``VariantUnavailable`` saying why). It
   is back as soon as its pods run again. A variant not profiled yet runs
   ``max(1, minReplicas)`` replicas so its profile Job has one to measure, and
   stays out of the mix until it has a target.
2. **Demand** (``variant_demand.py``). With per-replica rates (requests/s): the
   requests each variant's replicas finished per second over the last 30 s, or
   its arrivals (finished + in-flight's growth, per second) where that is larger
   and in-flight shows a queue (past what its replicas carry at target for
   10 s); without rates,
   in-flight over latency. Projected along its rising trend when
   ``autoscaling.trend.lookaheadSeconds`` is set; kept with its time so the
   HPA's windows apply to it: the demand a scale-up answers is the **lowest** of
   the last ``scaleUpStabilizationSeconds``, the one a scale-down answers the
   **highest** of the last ``scaleDownStabilizationSeconds``.
3. **The mix.** With capacity = the running mix's replicas (not those that
   cannot serve) × their per-replica capacity, and ``autoscaling.tolerance``:
   - demand above capacity: the cheapest mix that **adds** replicas only
     (``variant_mix.choose_mix`` with each variant's count as its floor): the
     cheapest variant with room grows first;
   - demand below capacity: the cheapest mix that **removes** only: the most
     expensive replicas go first;
   - otherwise, when the running mix costs more than ``mix.rebalanceThreshold``
     above the cheapest mix for the demand: that mix (a **rebalance**).
   Every choice is explained in ``status.mix`` and a ``VariantMix`` Event: the
   demand, each variant's capacity and cost, the chosen mix, the runner-up and
   why it lost.
4. **Carrying it out.** Additions are written at once. Removals wait until every
   replica the mix adds is Ready (new capacity before the old goes), then go one
   variant at a time, the most expensive first, each in two phases as a
   single-pool scale-down does (``drain.py``: mark, wait until empty or
   ``mix.drainSeconds``, then lower that variant's count by exactly those pods).
   A drain is called off when the demand comes back above what stays.

Counts are per pool (``variant/<name>``, the variant Deployment's ``spec.replicas``).
State between ticks lives here; a drain in progress is in ``status.mix.drain``, so
a restarted operator goes on with it.

What it is not: the optimiser (``variant_mix.py``), the views of spec and pods
(``variant_state.py``) or any I/O.
"""

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from plimsoll.operator.api.spec import LLMServiceSpec
from plimsoll.operator.api.status import ConditionUpdate
from plimsoll.operator.scaling.drain import DrainPlan, PodLoad, choose_victims
from plimsoll.operator.scaling.formula import fmt
from plimsoll.operator.scaling.observations import Observations
from plimsoll.operator.scaling.replica_plan import PlanDraft, variant_pool
from plimsoll.operator.scaling.timestamps import rfc3339_seconds
from plimsoll.operator.scaling.variant_demand import (
    BASIS_AFTER_QUEUE,
    BASIS_QUEUE,
    QUEUE_SECONDS,
    RATE_MIN_SPAN_S,
    RATE_WINDOW_S,
    DemandHistory,
    VariantDemand,
    variant_demand,
)
from plimsoll.operator.scaling.variant_mix import Mix, MixChoice, Offer, choose_mix, make_mix
from plimsoll.operator.scaling.variant_state import (
    VariantPods,
    VariantTarget,
    billed_cost_per_hour,
    rising_projection,
    variant_pods,
    variant_targets,
)

# Unchanged decisions refresh status.mix at most this often.
STATUS_MIN_INTERVAL_S = 15.0
# A removed pod not being deleted this long after its count went down was kept: unmark it.
REMOVAL_GRACE_S = 60.0
# The least demand planned for: one replica of something always runs.
LEAST_DEMAND = 1e-6
_NOT_COMPARED = ("time", "demand", "demandBasis", "variants", "capacity", "costPerHour", "optimum")


@dataclass
class VariantDrain:
    """One variant's replicas draining so its count can go down."""

    variant: str
    plan: DrainPlan

    def to_status(self) -> dict[str, Any]:
        return {"variant": self.variant, **self.plan.to_status()}

    @classmethod
    def from_status(cls, block: Mapping[str, Any] | None, now: float) -> "VariantDrain | None":
        plan = DrainPlan.from_status(block, now)
        if plan is None or not (block or {}).get("variant"):
            return None
        return cls(str((block or {})["variant"]), plan)


@dataclass(frozen=True, slots=True)
class _Tick:
    """What one tick worked out, for the decision and its explanation."""

    targets: dict[str, VariantTarget]
    unit: str
    pods: dict[str, VariantPods]
    current: dict[str, int]
    demand: float
    per_variant: dict[str, VariantDemand]
    capacity: float


def start_counts(spec: LLMServiceSpec, status: Mapping[str, Any]) -> dict[str, int]:
    """Each variant's first count: its minimum, and one of each variant still to be profiled.

    Nothing at all would serve nothing: then one replica of the cheapest variant.
    """
    targets, _ = variant_targets(spec, status)
    counts = {v.name: v.min_replicas if v.name in targets else max(1, v.min_replicas) for v in spec.variants}
    if sum(counts.values()) == 0:
        offers = [Offer(v.name, targets[v.name].capacity, v.cost_per_hour, v.min_replicas, v.max_replicas, v.spot)
                  for v in spec.variants]  # fmt: skip
        counts.update(choose_mix(offers, LEAST_DEMAND, spec.mix.max_spot_fraction).chosen.as_dict())
    return counts


class VariantPlanner:
    """One service's variant mix across ticks (see the module docstring)."""

    def __init__(self) -> None:
        self.demands: deque[tuple[float, float]] = deque()
        self.history = DemandHistory()
        self.trouble_since: dict[str, float] = {}  # variant -> since when its pods cannot serve
        self.unavailable: dict[str, tuple[float, str]] = {}  # variant -> (until, why)
        self.target: dict[str, int] | None = None  # the mix being carried out
        self.drain: VariantDrain | None = None
        self.removed: dict[str, float] = {}  # pod -> when its count went down
        self.restored = False
        self.last_write = 0.0
        self.last_block: dict[str, Any] | None = None

    # --- the tick ---------------------------------------------------------------------------

    def plan(
        self, draft: PlanDraft, obs: Observations, spec: LLMServiceSpec, status: Mapping[str, Any]
    ) -> None:
        """One tick into ``draft`` (counts, pod marks, status.mix/variants/cost, Events)."""
        now = draft.now
        if not self.restored:
            self.drain = VariantDrain.from_status((status.get("mix") or {}).get("drain"), now)
            self.restored = True
        variants = {v.name: v for v in spec.variants}
        if any(name not in obs.variant_replicas for name in variants):
            return  # a Deployment reconcile has not created yet: nothing to count from
        current = {name: int(obs.variant_replicas[name]) for name in variants}
        targets, unit = variant_targets(spec, status)
        pods = variant_pods(obs, list(variants))
        self._keep_removed(draft, obs)
        changed_availability = self._availability(draft, spec, pods, now)
        self.history.observe(now, pods, targets, spec.autoscaling.tolerance)
        demand, per_variant = variant_demand(pods, targets, unit, self.history)
        capacity = sum(
            max(0, current[n] - len(v.silent) - len(v.unschedulable) - len(v.marked)) * targets[n].capacity
            for n, v in pods.items() if n in targets and n not in self.unavailable
        )  # fmt: skip
        tick = _Tick(targets, unit, pods, current, demand, per_variant, capacity)
        self.demands.append((now, demand))
        keep = max(spec.autoscaling.scale_down_stabilization_seconds, spec.autoscaling.scale_up_stabilization_seconds,
                   spec.autoscaling.trend.window_seconds)  # fmt: skip
        while self.demands and self.demands[0][0] < now - keep:
            self.demands.popleft()

        decision: dict[str, Any] = {
            "reason": "WithinTolerance",
            "message": "the running mix carries the demand",
        }
        choice: MixChoice | None = None
        fixed = self._floors(draft, spec, targets, current)
        if not targets:
            decision = {
                "reason": "NoTarget",
                "message": "no variant has a per-replica target yet (profiling)",
            }
        elif self.drain is not None:
            decision = self._drain_step(draft, spec, tick)
        else:
            choice, decision = self._decide(draft, spec, tick, fixed)
            if self.target is not None and self.drain is None:
                decision = self._carry_out(draft, spec, tick, decision)
        must = changed_availability or draft.must_write
        self._status(draft, spec, status, tick, choice, decision, obs, must)

    # --- availability -------------------------------------------------------------------------

    def _availability(
        self, draft: PlanDraft, spec: LLMServiceSpec, pods: dict[str, VariantPods], now: float
    ) -> bool:
        """Variants whose pods cannot be placed, or all stopped answering, for long enough: out of the mix."""
        changed = False
        limit = float(spec.mix.unschedulable_seconds)
        for name, view in pods.items():
            stuck = bool(view.unschedulable)
            dead = bool(view.silent) and not view.serving and not view.starting
            if not stuck and not dead:
                self.trouble_since.pop(name, None)
                if name in self.unavailable and view.serving:
                    # Its pods run again (its nodes came back): back in the mix at once.
                    del self.unavailable[name]
                    draft.event("Normal", "VariantAvailable", f"variant {name}: its replicas run again; "
                                "back in the mix")  # fmt: skip
                    changed = True
                continue
            since = self.trouble_since.setdefault(name, now)
            if name in self.unavailable or now - since < limit:
                continue
            if stuck:
                message = next(iter(view.unschedulable.values()))
                why = (f"{len(view.unschedulable)} pod(s) unschedulable for {now - since:.0f} s "
                       f"({message[:200]})")  # fmt: skip
            else:
                why = f"its Ready pods ({', '.join(view.silent)}) have not answered for {now - since:.0f} s"
            self.unavailable[name] = (now + spec.mix.unavailable_seconds, why)
            others = [v.name for v in spec.variants if v.name != name and v.name not in self.unavailable]
            draft.event(
                "Warning", "VariantUnavailable",
                f"variant {name}: {why}; left out of the mix for {spec.mix.unavailable_seconds} s, its capacity "
                f"moves to {', '.join(others) or 'no other variant'}",
            )  # fmt: skip
            self.target = None  # re-plan without it
            changed = True
        for name, (until, _) in list(self.unavailable.items()):
            if now >= until and name not in self.trouble_since:
                del self.unavailable[name]
                changed = True
        return changed

    def _floors(
        self,
        draft: PlanDraft,
        spec: LLMServiceSpec,
        targets: dict[str, VariantTarget],
        current: dict[str, int],
    ) -> dict[str, int]:
        """Counts the mix does not choose (bounds, variants out of it, or being profiled), written now."""
        fixed: dict[str, int] = {}
        for v in spec.variants:
            n = current[v.name]
            if v.name in self.unavailable:
                want, why = v.min_replicas, f"unavailable: {self.unavailable[v.name][1]}"
            elif v.name not in targets:
                want, why = max(1, v.min_replicas), "a replica for its profile to measure"
            else:
                want = min(max(n, v.min_replicas), v.max_replicas)
                why = f"within minReplicas {v.min_replicas}..maxReplicas {v.max_replicas}"
                if want == n:
                    continue
            fixed[v.name] = want
            if want != n:
                reason = (
                    "VariantUnavailable"
                    if v.name in self.unavailable
                    else "ScaledUp"
                    if want > n
                    else "ScaledDown"
                )
                draft.pool_count(variant_pool(v.name), n, want, reason, f"{n} → {want}: {why}")
                current[v.name] = want
        return fixed

    # --- deciding ------------------------------------------------------------------------------

    def _offers(
        self, spec: LLMServiceSpec, tick: _Tick, mode: str, fixed: dict[str, int]
    ) -> tuple[list[Offer], float]:
        """The mix's variables for ``mode`` (up: add only; down: remove only; free), and the phantom capacity.

        A variant with pods that cannot serve keeps its count (neither added to nor chosen from),
        and what those pods would carry is added to the demand, since the mix counts them.
        """
        offers, phantom = [], 0.0
        for v in spec.variants:
            target = tick.targets.get(v.name)
            if target is None:
                continue
            n = fixed.get(v.name, tick.current[v.name])
            view = tick.pods[v.name]
            broken = len(view.silent) + len(view.unschedulable)
            if v.name in self.unavailable:
                lo = hi = n
                phantom += n * target.capacity
            elif broken or v.name in fixed:
                lo = hi = n
                phantom += broken * target.capacity
            elif mode == "up":
                lo, hi = max(v.min_replicas, n), v.max_replicas
            elif mode == "down":
                lo, hi = v.min_replicas, min(v.max_replicas, n)
            else:
                lo, hi = v.min_replicas, v.max_replicas
            offers.append(Offer(v.name, target.capacity, v.cost_per_hour, lo, hi, v.spot))
        return offers, phantom

    def _decide(
        self, draft: PlanDraft, spec: LLMServiceSpec, tick: _Tick, fixed: dict[str, int]
    ) -> tuple[MixChoice | None, dict[str, Any]]:
        now, tol = draft.now, spec.autoscaling.tolerance
        window_up = [d for t, d in self.demands if t >= now - spec.autoscaling.scale_up_stabilization_seconds]
        window_down = [
            d for t, d in self.demands if t >= now - spec.autoscaling.scale_down_stabilization_seconds
        ]
        trend = [(t, d) for t, d in self.demands if t >= now - spec.autoscaling.trend.window_seconds]
        projected = rising_projection(trend, float(spec.autoscaling.trend.lookahead_seconds))
        up = max(min(window_up or [tick.demand]), projected or 0.0)
        down = max(window_down or [tick.demand])
        f = spec.mix.max_spot_fraction
        settled = self._settled(tick)
        mode, demand = "hold", down
        # No capacity because the replicas there are still starting or have not answered yet (a pod is Ready a
        # moment before it listens) is not demand: they serve in a moment, or become unavailable and leave.
        waiting = any(
            view.starting or view.silent
            for name, view in tick.pods.items()
            if name in tick.targets and name not in self.unavailable
        )
        if up > tick.capacity * (1 + tol) or (tick.capacity <= 0 and not waiting):
            mode, demand = "up", up
        elif self.target is not None:
            return None, {"reason": "CarryingOut", "message": "carrying out the last mix"}
        elif down < tick.capacity * (1 - tol) and settled:
            mode = "down"
        offers, phantom = self._offers(spec, tick, mode if mode != "hold" else "free", fixed)
        if not offers:
            return None, {"reason": "NoTarget", "message": "no available variant has a target"}
        choice = choose_mix(offers, max(demand, LEAST_DEMAND) + phantom, f)
        running = make_mix(offers, [tick.current[o.name] for o in offers])
        if mode == "down" and choice.chosen.counts == running.counts:
            # Removing only can leave a dear variant that a cheaper one would replace (an H100 kept for a demand
            # one L4 carries, a spot alone being past the spot limit): then rebalance, as a steady demand would.
            free_offers, _ = self._offers(spec, tick, "free", fixed)
            free = choose_mix(free_offers, max(demand, LEAST_DEMAND) + phantom, f)
            if free.chosen.cost_per_hour * (1 + spec.mix.rebalance_threshold) < choice.chosen.cost_per_hour:
                offers, choice, mode = free_offers, free, "hold"
        if mode == "hold":
            cheaper = choice.chosen.cost_per_hour * (1 + spec.mix.rebalance_threshold) < running.cost_per_hour
            if not (cheaper and settled and running.capacity - phantom >= up):
                return choice, {
                    "reason": "WithinTolerance",
                    "message": f"capacity {fmt(tick.capacity)} carries the demand ({fmt(up)}..{fmt(down)} "
                    f"{tick.unit} over the windows) within tolerance {fmt(tol)}",
                }
            mode = "rebalance"
        wanted = choice.chosen.as_dict()
        if all(wanted[o.name] == tick.current[o.name] for o in offers):
            return choice, {"reason": "WithinTolerance", "message": f"the cheapest mix for {fmt(demand)} "
                            f"{tick.unit} is the one running"}  # fmt: skip
        self.target = {**tick.current, **wanted}
        reason = {"up": "ScaledUp", "down": "ScaledDown", "rebalance": "Rebalanced"}[mode]
        why = {
            "up": f"demand {fmt(up)} {tick.unit} (lowest over {spec.autoscaling.scale_up_stabilization_seconds} s"
            + (f", projected {fmt(projected)}" if projected else "")
            + f") above capacity {fmt(tick.capacity)}",
            "down": f"demand {fmt(down)} {tick.unit} (highest over {spec.autoscaling.scale_down_stabilization_seconds}"
            f" s) below capacity {fmt(tick.capacity)}",
            "rebalance": f"{running.describe()} costs {fmt(running.cost_per_hour)}/h, more than "
            f"{fmt(spec.mix.rebalance_threshold * 100)}% above {fmt(choice.chosen.cost_per_hour)}/h",
        }[mode]
        message = (
            f"{running.describe()} → {choice.chosen.describe()}: {why}; {self._explain(tick, offers, choice)}"
        )
        draft.event("Normal", "VariantMix", message)
        for name, n in wanted.items():
            if n > tick.current[name]:
                draft.pool_count(variant_pool(name), tick.current[name], n, "ScaledUp", f"{tick.current[name]} → {n} "
                                 f"({choice.chosen.describe()} for {fmt(demand)} {tick.unit})")  # fmt: skip
                tick.current[name] = n
        draft.must_write = True
        return choice, {"reason": reason, "message": why, "mode": mode}

    def _settled(self, tick: _Tick) -> bool:
        """Every replica asked for runs and is Ready (none starting, none still to be created)."""
        for name, view in tick.pods.items():
            if name in self.unavailable or name not in tick.targets:
                continue
            if view.starting or view.existing < tick.current[name]:
                return False
        return True

    @staticmethod
    def _explain(tick: _Tick, offers: list[Offer], choice: MixChoice) -> str:
        each = "; ".join(
            f"{o.name} {fmt(o.capacity)} {tick.unit} per replica at {fmt(o.cost_per_hour)}/h" for o in offers
        )
        chosen = choice.chosen
        text = f"{each}; chosen {chosen.describe()} ({fmt(chosen.cost_per_hour)}/h, carries {fmt(chosen.capacity)})"
        if choice.runner_up is not None:
            text += f"; runner-up {choice.runner_up.describe()} {choice.why_not}"
        if choice.shortfall > 0:
            text += f"; {fmt(choice.shortfall)} {tick.unit} beyond every variant's maxReplicas"
        return text

    # --- carrying out --------------------------------------------------------------------------

    def _carry_out(
        self, draft: PlanDraft, spec: LLMServiceSpec, tick: _Tick, decision: dict[str, Any]
    ) -> dict[str, Any]:
        """Removals of the mix in progress: once every added replica is Ready, drain the dearest first."""
        assert self.target is not None
        surplus = {n: tick.current[n] - t for n, t in self.target.items() if t < tick.current.get(n, t)}
        short = [n for n, t in self.target.items() if t > tick.current.get(n, t)]
        if not surplus and not short:
            self.target = None
            return decision
        if short or not surplus:
            return decision  # an addition not written yet (it will be), or nothing to remove
        if not self._settled(tick):
            return {**decision, "reason": decision.get("reason", "CarryingOut"),
                    "message": f"{decision.get('message', '')}; removals wait until the new replicas are Ready"}  # fmt: skip
        prices = {v.name: v.cost_per_hour for v in spec.variants}
        name = max(surplus, key=lambda n: (prices[n], n))
        view = tick.pods[name]
        after = tick.capacity - surplus[name] * tick.targets[name].capacity
        if tick.demand > after * (1 + spec.autoscaling.tolerance):
            self.target = None  # the demand moved: the next tick chooses again
            return {"reason": "MixAbandoned", "message": f"demand {fmt(tick.demand)} {tick.unit} would not fit in "
                    f"{fmt(after)} after removing {surplus[name]} of {name}"}  # fmt: skip
        loads = [PodLoad(p.name, True, p.sample.in_flight if p.sample else None) for p in view.serving]
        loads += [PodLoad(p, False, 0.0) for p in view.starting]
        victims = choose_victims(loads, surplus[name])
        n = tick.current[name]
        plan = DrainPlan(victims, n, n - len(victims), draft.now, float(spec.mix.drain_seconds), "ScaleDown")
        self.drain = VariantDrain(name, plan)
        for pod in victims:
            draft.drain(pod, f"variant {name}: {n} → {n - len(victims)}")
        draft.event("Normal", "DrainStarted", f"variant {name} {n} → {n - len(victims)}: draining {', '.join(victims)} "
                    f"(no new requests; up to {spec.mix.drain_seconds} s for in-flight ones), the dearest variant "
                    "of the mix first")  # fmt: skip
        draft.must_write = True
        return {"reason": "Draining", "message": f"draining {', '.join(victims)} of {name}"}

    def _drain_step(self, draft: PlanDraft, spec: LLMServiceSpec, tick: _Tick) -> dict[str, Any]:
        drain = self.drain
        assert drain is not None
        plan, name = drain.plan, drain.variant
        present = {p.name: p for v in tick.pods.values() for p in v.scraped}
        names = {p for v in tick.pods.values() for p in (*v.marked, *v.starting, *v.silent, *v.unschedulable)}
        loads: dict[str, float | None] = {}
        for pod in plan.pods:
            if pod in present:
                sample = present[pod].sample
                loads[pod] = sample.in_flight if sample is not None else None
            elif pod in names:
                loads[pod] = 0.0  # unready and silent: nothing is routed to it
        why = None
        if tick.current.get(name) != plan.from_replicas:
            why = f"variant {name}'s count moved to {tick.current.get(name)} by another writer"
        elif tick.demand > tick.capacity * (1 + spec.autoscaling.tolerance):
            why = f"demand {fmt(tick.demand)} {tick.unit} is back above what stays ({fmt(tick.capacity)})"
        live = [p for p in plan.pods if p in loads]
        if why is not None:
            for pod in live:
                draft.undrain(pod, "drain called off")
            message = f"drain of {', '.join(plan.pods)} called off: {why}"
            draft.event("Normal", "DrainCancelled", message)
            self.drain, self.target = None, None
            draft.must_write = True
            return {"reason": "DrainCancelled", "message": message}
        step = plan.step(draft.now, loads)
        if not step.done:
            for pod in live:
                draft.drain(pod, f"variant {name}: {step.message}")
            return {"reason": "Draining", "message": step.message}
        draft.pool_count(variant_pool(name), plan.from_replicas, plan.to_replicas, "ScaledDown",
                         f"{plan.from_replicas} − {len(plan.pods)} drained = {plan.to_replicas}")  # fmt: skip
        message = f"variant {name} {plan.from_replicas} → {plan.to_replicas}: {step.message}; removing exactly those pods"
        draft.event("Normal" if step.reason == "Drained" else "Warning", "ScaledDown", message)
        for pod in live:
            self.removed[pod] = draft.now
            draft.drain(pod, "removed; waiting for the ReplicaSet to delete it")
        tick.current[name] = plan.to_replicas
        self.drain = None
        draft.must_write = True
        return {"reason": "ScaledDown", "message": message}

    def _keep_removed(self, draft: PlanDraft, obs: Observations) -> None:
        """Removed pods stay marked until deleted; a marked pod nothing holds is unmarked."""
        present = {p.name: p for p in obs.pods}
        for name, since in list(self.removed.items()):
            pod = present.get(name)
            if pod is None or pod.terminating or draft.now - since > REMOVAL_GRACE_S:
                del self.removed[name]
            else:
                draft.drain(name, "removed; waiting for the ReplicaSet to delete it")
        holding = set(self.drain.plan.pods if self.drain is not None else ()) | set(self.removed)
        for pod in obs.pods:
            if (
                pod.draining
                and not pod.terminating
                and pod.name not in holding
                and pod.name not in draft.actions
            ):
                draft.undrain(pod.name, "marked for removal, but no drain holds it")

    # --- status ---------------------------------------------------------------------------------

    def _status(
        self, draft: PlanDraft, spec: LLMServiceSpec, status: Mapping[str, Any], tick: _Tick,
        choice: MixChoice | None, decision: dict[str, Any], obs: Observations, must: bool,
    ) -> None:  # fmt: skip
        now = draft.now
        counts = {n: tick.current[n] for n in tick.current}
        running = make_mix(_all_offers(spec, tick), [counts[v.name] for v in spec.variants])
        variants: dict[str, Any] = {}
        rows = []
        for v in spec.variants:
            view, target = tick.pods[v.name], tick.targets.get(v.name)
            billed = len(view.serving) + len(view.starting) + len(view.silent) + len(view.marked)
            unavailable = self.unavailable.get(v.name)
            reason = unavailable[1] if unavailable else None if target else "waiting for its profile"
            variants[v.name] = {
                "replicas": counts[v.name],
                "readyReplicas": view.ready,
                "weight": target.concurrency if target else None,
                "rate": round(target.capacity, 6) if target else None,
                "costPerHour": round(billed * v.cost_per_hour, 6),
                "available": unavailable is None,
                "reason": reason,
            }
            rows.append({
                "name": v.name,
                "replicas": counts[v.name],
                "target": (self.target or counts).get(v.name, counts[v.name]),
                "concurrencyPerReplica": target.concurrency if target else None,
                "capacityPerReplica": round(target.capacity, 6) if target else None,
                "costPerHour": v.cost_per_hour,
                "costPerCapacity": round(v.cost_per_hour / target.capacity, 6) if target else None,
                "spot": v.spot,
                "minReplicas": v.min_replicas,
                "maxReplicas": v.max_replicas,
                **_demand_status(tick.per_variant.get(v.name)),
                "available": unavailable is None,
                "reason": reason,
            })  # fmt: skip
        block: dict[str, Any] = {
            "time": rfc3339_seconds(now),
            "reason": decision["reason"],
            "message": decision["message"],
            "unit": tick.unit,
            "maxSpotFraction": spec.mix.max_spot_fraction,
            "demand": round(tick.demand, 6),
            "demandBasis": _demand_basis(tick),
            "capacity": round(tick.capacity, 6),
            "costPerHour": round(running.cost_per_hour, 6),
            "replicas": counts,
            "variants": rows,
            "target": self.target,
            "chosen": _mix_status(choice.chosen) if choice else None,
            "runnerUp": {**_mix_status(choice.runner_up), "whyNot": choice.why_not}
            if choice and choice.runner_up
            else None,
            "drain": self.drain.to_status() if self.drain is not None else None,
        }
        cost = _cost_status(spec, tick, obs, now)
        shortfall = choice.shortfall if choice is not None and decision.get("mode") == "up" else 0.0
        limited: ConditionUpdate = ("ScalingLimited", "True", "VariantsAtMax",
                   f"{fmt(shortfall)} {tick.unit} beyond every variant's maxReplicas") if shortfall > 0 else (
                   "ScalingLimited", "False", "DesiredWithinRange", "the mix carries the demand within the bounds")  # fmt: skip
        stored = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
        changed_condition = stored.get("ScalingLimited") != limited[1]
        if limited[1] == "True" and changed_condition:
            draft.event("Warning", "ScalingLimited", limited[3])
        same = self.last_block is not None and {k: v for k, v in block.items() if k not in _NOT_COMPARED} == {
            k: v for k, v in self.last_block.items() if k not in _NOT_COMPARED
        }
        if must or changed_condition or not same or now - self.last_write >= STATUS_MIN_INTERVAL_S:
            draft.fields["mix"] = block
            draft.fields["variants"] = variants
            if cost is not None:
                draft.fields["cost"] = cost
            draft.conditions.append(limited)
            draft.must_write = True
            self.last_write, self.last_block = now, block


def _all_offers(spec: LLMServiceSpec, tick: _Tick) -> list[Offer]:
    """Every variant as an offer (those without a target at capacity 1, for counting cost only)."""
    return [
        Offer(v.name, tick.targets[v.name].capacity if v.name in tick.targets else 1.0, v.cost_per_hour, 0,
              max(v.max_replicas, tick.current[v.name]), v.spot)
        for v in spec.variants
    ]  # fmt: skip


def _demand_status(d: VariantDemand | None) -> dict[str, Any]:
    """A variant row's demand and both its inputs."""
    if d is None:
        return {"demand": 0.0}
    return {
        "demand": round(d.demand, 6),
        "inFlightDemand": round(d.in_flight, 6),
        "finishedRate": round(d.finished_rate, 6) if d.finished_rate is not None else None,
        "arrivalRate": round(d.arrival_rate, 6) if d.arrival_rate is not None else None,
        "demandBasis": d.basis,
    }


def _demand_basis(tick: _Tick) -> str:
    """What the demand is, in words (status.mix.demandBasis)."""
    queued = sorted(n for n, d in tick.per_variant.items() if d.basis == BASIS_QUEUE)
    if all(d.finished_rate is None for d in tick.per_variant.values()):
        return (f"in-flight ÷ each variant's latency ({tick.unit}); requests finished per second take over "
                f"once every variant has a per-replica rate and the window holds {RATE_MIN_SPAN_S:.0f} s")  # fmt: skip
    text = f"requests finished per second over the last {RATE_WINDOW_S:.0f} s"
    if queued:
        text += (f"; arrivals (finished + in-flight's growth per second) on {', '.join(queued)}, whose in-flight "
                 f"stayed past its replicas' target for {QUEUE_SECONDS:.0f} s (a queue)")  # fmt: skip
    settling = sorted(n for n, d in tick.per_variant.items() if d.basis == BASIS_AFTER_QUEUE)
    if settling:
        text += (f"; arrivals over the last {QUEUE_SECONDS:.0f} s on {', '.join(settling)}, above its finished "
                 f"rate for {RATE_WINDOW_S:.0f} s after a queue (the window still holds the load before it)")  # fmt: skip
    return text


def _mix_status(mix: Mix | None) -> dict[str, Any]:
    if mix is None:
        return {}
    return {
        "replicas": mix.as_dict(),
        "describe": mix.describe(),
        "costPerHour": round(mix.cost_per_hour, 6),
        "capacity": round(mix.capacity, 6),
        "spotShare": round(mix.spot_share, 4),
    }


def _cost_status(spec: LLMServiceSpec, tick: _Tick, obs: Observations, now: float) -> dict[str, Any] | None:
    per_hour = billed_cost_per_hour(list(spec.variants), tick.pods)
    window = obs.cost
    block: dict[str, Any] = {"perHour": round(per_hour, 6), "time": rfc3339_seconds(now)}
    if window is not None and window.spent is not None and window.good_requests:
        block.update({
            "per1kGoodRequests": round(window.spent / (window.good_requests / 1000), 6),
            "goodRequests": window.good_requests,
            "spent": round(window.spent, 6),
            "windowSeconds": window.window_s,
        })  # fmt: skip
    return block
