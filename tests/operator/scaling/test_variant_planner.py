"""The replica planner with hardware variants, tick by tick: the mix, how it is carried out, and what status says.

A :class:`Variants` service holds the spec, each variant Deployment's count and the
status as stored, and applies each plan as the handler does (variant pools into
the Deployments, one status write).
"""

from dataclasses import dataclass, field
from typing import Any

from plimsoll.operator.api.spec import LLMServiceSpec
from plimsoll.operator.api.status import set_condition
from plimsoll.operator.scaling.metrics import PodSample
from plimsoll.operator.scaling.observations import CostWindow, Observations, PodObservation
from plimsoll.operator.scaling.planner import ReplicaPlanner
from plimsoll.operator.scaling.replica_plan import Plan, pool_variant, variant_pool

VARIANTS = [
    {"name": "h100", "costPerHour": 4.0, "maxReplicas": 3, "concurrencyPerReplica": 8,
     "accelerator": {"type": "NVIDIA-H100-80GB-HBM3"}},
    {"name": "l4", "costPerHour": 1.0, "maxReplicas": 4, "concurrencyPerReplica": 3,
     "accelerator": {"type": "NVIDIA-L4"}},
    {"name": "spot", "costPerHour": 0.5, "maxReplicas": 4, "concurrencyPerReplica": 2, "spot": True,
     "accelerator": {"migProfile": "1g.10gb"}},
]  # fmt: skip


def spec(**over: Any) -> LLMServiceSpec:
    body: dict[str, Any] = {
        "model": {"uri": "embedded://smollm2-135m"},
        "variants": VARIANTS,
        "capacity": {"mode": "Manual", "concurrencyPerReplica": 4},
        "autoscaling": {
            "mode": "builtin",
            "scaleUpStabilizationSeconds": 0,
            "scaleDownStabilizationSeconds": 0,
        },
        "mix": {"maxSpotFraction": 0.25, "unschedulableSeconds": 10, "unavailableSeconds": 60},
    }
    body.update(over)
    return LLMServiceSpec.model_validate(body)


def sample(in_flight: float, good: float | None = None) -> PodSample:
    return PodSample(engine="plimsoll", running=in_flight, waiting=0.0, kv_usage=None, ttft=None, tpot=None,
                     slo_good=good)  # fmt: skip


def pod(name: str, in_flight: float = 0.0, **kw: Any) -> PodObservation:
    """A Ready scraped pod of the variant its name starts with (``ready``/``sample``/... as given).

    Marked pods are scraped whether Ready or not, as the handler does; other unready pods are not.
    """
    ready = kw.pop("ready", True)
    scraped = kw.pop("sample", sample(in_flight) if ready or kw.get("draining") else None)
    return PodObservation(name=name, ready=ready, sample=scraped, variant=name.split("-")[0], **kw)


@dataclass
class Variants:
    spec: LLMServiceSpec
    counts: dict[str, int]
    status: dict[str, Any] = field(default_factory=dict)
    planner: ReplicaPlanner = field(default_factory=ReplicaPlanner)
    plans: list[Plan] = field(default_factory=list)

    def tick(self, now: float, pods: list[PodObservation], **obs: Any) -> Plan:
        seen = Observations(pods=tuple(pods), variant_replicas=dict(self.counts), **obs)
        plan = self.planner.plan(now, seen, self.spec, self.status)
        for count in plan.changes():
            variant = pool_variant(count.pool)
            assert variant is not None, f"a variant service wrote the pool {count.pool}"
            self.counts[variant] = count.desired
        if plan.status is not None:
            for key, value in plan.status.fields.items():
                old = self.status.get(key)
                if key == "variants" and isinstance(old, dict):
                    value = {n: {**(old.get(n) or {}), **v} for n, v in value.items()}
                self.status[key] = value
            conditions = list(self.status.get("conditions") or [])
            for type_, state, reason, message in plan.status.conditions:
                conditions = set_condition(conditions, type_, state, reason, message)
            self.status["conditions"] = conditions
        self.plans.append(plan)
        return plan

    def events(self, reason: str) -> list[str]:
        return [e.message for p in self.plans for e in p.events if e.reason == reason]


def running(svc: Variants, loads: dict[str, list[float]]) -> list[PodObservation]:
    """Ready pods per variant with these in-flight loads (as many as the Deployment counts)."""
    pods = []
    for variant, n in svc.counts.items():
        values = loads.get(variant, [])
        pods += [pod(f"{variant}-{i}", values[i] if i < len(values) else 0.0) for i in range(n)]
    return pods


def test_a_rising_demand_grows_the_cheapest_variant_with_room_and_says_why() -> None:
    svc = Variants(spec(), {"h100": 0, "l4": 1, "spot": 0})
    plan = svc.tick(0.0, running(svc, {"l4": [9]}))  # 9 in flight on one L4 (target 3)
    changes = {pool_variant(c.pool): (c.current, c.desired) for c in plan.changes()}
    # Add-only: 3 L4s carry 9 at 3/h; an H100 (8 at 4/h) would need a top-up and cost more.
    assert changes == {"l4": (1, 3)}
    mix = svc.status["mix"]
    assert mix["reason"] == "ScaledUp" and mix["unit"] == "in-flight requests"
    assert mix["chosen"]["describe"] == "l4 × 3" and mix["chosen"]["costPerHour"] == 3.0
    assert mix["runnerUp"]["describe"] == "h100 × 1 + l4 × 1" and "5/h" in mix["runnerUp"]["whyNot"]
    rows = {r["name"]: r for r in mix["variants"]}
    assert rows["h100"]["capacityPerReplica"] == 8 and rows["l4"]["costPerCapacity"] == round(1 / 3, 6)
    (event,) = svc.events("VariantMix")
    assert event.startswith("l4 × 1 → l4 × 3: demand 9 in-flight requests")
    assert "runner-up h100 × 1 + l4 × 1 costs 5/h" in event
    assert svc.status["variants"]["l4"]["weight"] == 3.0


def test_past_the_cheap_variants_maximum_the_next_cheapest_per_unit_grows() -> None:
    svc = Variants(spec(), {"h100": 0, "l4": 4, "spot": 0})
    svc.tick(0.0, running(svc, {"l4": [6, 6, 6, 6]}))  # 24 in flight, L4s full at 12
    assert svc.counts["l4"] == 4
    # 12 more: 2 H100 (16, 8/h) or 1 H100 + 2 spot (12, 5/h: spot 4 of 24 is 17%, within 25%).
    assert svc.counts == {"h100": 1, "l4": 4, "spot": 2}


def test_a_falling_demand_drains_the_dearest_first_then_lowers_exactly_its_count() -> None:
    svc = Variants(spec(), {"h100": 1, "l4": 3, "spot": 0})
    plan = svc.tick(0.0, running(svc, {"h100": [2], "l4": [1, 1, 1]}))  # 5 in flight on capacity 17
    assert not plan.changes() and plan.drained() == ("h100-0",)  # remove-only: the H100 goes first
    assert svc.status["mix"]["drain"]["variant"] == "h100" and svc.status["mix"]["reason"] == "Draining"
    marked = [pod("h100-0", 1, draining=True, ready=False), *running(svc, {"l4": [2, 2, 2]})[1:]]
    assert svc.tick(1.0, marked).drained() == ("h100-0",)  # still holding one request: kept marked
    emptied = [pod("h100-0", 0, draining=True, ready=False), *marked[1:]]
    done = svc.tick(2.0, emptied)
    assert [(pool_variant(c.pool), c.current, c.desired) for c in done.changes()] == [("h100", 1, 0)]
    assert "variant h100 1 → 0" in svc.events("ScaledDown")[0]
    assert svc.status["mix"]["drain"] is None


def test_a_rebalance_brings_the_new_replicas_up_before_the_old_are_drained() -> None:
    over = spec(mix={"maxSpotFraction": 0.0, "rebalanceThreshold": 0.1})
    svc = Variants(over, {"h100": 2, "l4": 0, "spot": 0})
    # 8 in flight on two H100s (16 capacity, 8/h): within tolerance? No: 8 < 16 × 0.9, remove-only
    # keeps one H100 (4/h); three L4s (9, 3/h) is cheaper still: that is a rebalance, later.
    svc.tick(0.0, running(svc, {"h100": [4, 4]}))
    assert svc.planner.variants is not None and svc.planner.variants.drain is not None
    svc.tick(1.0, [pod("h100-0", 0, draining=True, ready=False), pod("h100-1", 8)])
    svc.tick(2.0, [pod("h100-0", 0, draining=True, ready=False), pod("h100-1", 8)])
    assert svc.counts["h100"] == 1
    # Now 8 in flight on one H100 (capacity 8): the cheapest mix for 8 is l4 × 3 (3/h < 4/h × 0.9).
    plan = svc.tick(3.0, [pod("h100-1", 8)])
    assert {pool_variant(c.pool): c.desired for c in plan.changes()} == {"l4": 3}
    assert svc.status["mix"]["reason"] == "Rebalanced" and not plan.drained()
    starting = [pod("h100-1", 8), *[pod(f"l4-{i}", ready=False) for i in range(3)]]
    waiting = svc.tick(4.0, starting)
    assert not waiting.drained() and "removals wait" in svc.status["mix"]["message"]
    ready = [pod("h100-1", 5), *[pod(f"l4-{i}", 1) for i in range(3)]]
    assert svc.tick(5.0, ready).drained() == ("h100-1",)


def test_the_spot_limit_holds_while_the_cheapest_capacity_is_spot() -> None:
    svc = Variants(spec(), {"h100": 0, "l4": 0, "spot": 1})
    svc.tick(0.0, [pod("spot-0", 6)])
    chosen = svc.status["mix"]["chosen"]
    assert chosen["spotShare"] <= 0.25 and svc.counts["l4"] >= 1


def test_a_variant_whose_nodes_vanished_is_left_out_and_its_capacity_moves() -> None:
    # (No rebalance to spot × 4, 2/h, at the first tick: this is about the reclaim.)
    svc = Variants(spec(mix={"maxSpotFraction": 1.0, "unschedulableSeconds": 10, "unavailableSeconds": 60,
                             "rebalanceThreshold": 0.5}), {"h100": 0, "l4": 1, "spot": 3})  # fmt: skip
    svc.tick(0.0, [pod("l4-0", 2), pod("spot-0", 2), pod("spot-1", 2), pod("spot-2", 2)])
    # The spot nodes are reclaimed: the pods stop answering (Ready as the API still says).
    dead = [pod("spot-0", ready=True, sample=None), pod("spot-1", ready=True, sample=None),
            pod("spot-2", ready=True, sample=None)]  # fmt: skip
    first = svc.tick(1.0, [pod("l4-0", 8), *dead])
    # Their capacity counts as none at once: the L4s grow, the spot variant gets no new replica.
    grown = {pool_variant(c.pool): c.desired for c in first.changes()}
    assert grown == {"l4": 3} and svc.counts["spot"] == 3
    svc.tick(5.0, [pod("l4-0", 3), pod("l4-1", 3), pod("l4-2", 2), *dead])
    assert not svc.events("VariantUnavailable")
    gone = svc.tick(11.0, [pod("l4-0", 3), pod("l4-1", 3), pod("l4-2", 2), *dead])
    (warning,) = svc.events("VariantUnavailable")
    assert warning.startswith("variant spot: its Ready pods (spot-0, spot-1, spot-2) have not answered")
    assert "its capacity moves to h100, l4" in warning
    assert {pool_variant(c.pool): c.desired for c in gone.changes()} == {"spot": 0}
    assert svc.status["variants"]["spot"]["available"] is False
    # Replacements that find no node are unschedulable; it stays out until its back-off ends.
    pending = [pod("spot-9", ready=False, unschedulable="0/3 nodes are available: 3 node(s) didn't match")]
    svc.tick(30.0, [pod("l4-0", 3), pod("l4-1", 3), pod("l4-2", 2), *pending])
    assert svc.counts["spot"] == 0 and "spot" in svc.planner.variants.unavailable


def test_a_variant_that_cannot_be_scheduled_becomes_unavailable_with_the_schedulers_words() -> None:
    svc = Variants(spec(), {"h100": 0, "l4": 2, "spot": 0})
    stuck = [
        pod("l4-0", 3),
        pod("l4-1", ready=False, unschedulable="0/2 nodes are available: Insufficient nvidia.com/gpu"),
    ]
    svc.tick(0.0, stuck)
    svc.tick(10.0, stuck)
    (warning,) = svc.events("VariantUnavailable")
    assert "1 pod(s) unschedulable for 10 s (0/2 nodes are available: Insufficient nvidia.com/gpu)" in warning


def test_profiled_variants_are_compared_in_requests_per_second() -> None:
    status = {"variants": {
        "h100": {"capacity": {"concurrencyPerReplica": 8, "requestsPerSecondPerReplica": 16.0}},
        "l4": {"capacity": {"concurrencyPerReplica": 4, "requestsPerSecondPerReplica": 2.0}},
    }}  # fmt: skip
    over = spec(capacity={"mode": "Profile"}, variants=VARIANTS[:2])
    svc = Variants(over, {"h100": 1, "l4": 0}, status=status)
    # 8 in flight on the H100 is 16 req/s (0.5 s each): past its 16 req/s? No, equal: within tolerance.
    svc.tick(0.0, [pod("h100-0", 8)])
    mix = svc.status["mix"]
    assert mix["unit"] == "requests/s" and mix["demand"] == 16.0 and mix["reason"] == "WithinTolerance"
    # An L4 holds its requests 2 s each: 4 in flight there is 2 req/s, not 4.
    svc.counts["l4"] = 1
    svc.tick(1.0, [pod("h100-0", 8), pod("l4-0", 4)])
    assert svc.status["mix"]["demand"] == 18.0


def test_an_unprofiled_variant_runs_one_replica_for_its_profile_and_stays_out_of_the_mix() -> None:
    status = {
        "variants": {"h100": {"capacity": {"concurrencyPerReplica": 8, "requestsPerSecondPerReplica": 16.0}}}
    }
    over = spec(capacity={"mode": "Profile"}, variants=VARIANTS[:2])
    assert ReplicaPlanner.variant_start_counts(over, status) == {"h100": 0, "l4": 1}
    assert ReplicaPlanner.variant_start_counts(over, {}) == {"h100": 1, "l4": 1}
    manual = spec()
    assert ReplicaPlanner.variant_start_counts(manual, {}) == {"h100": 0, "l4": 1, "spot": 0}
    svc = Variants(over, {"h100": 1, "l4": 0}, status=status)
    plan = svc.tick(0.0, [pod("h100-0", 2)])
    assert {pool_variant(c.pool): c.desired for c in plan.changes()} == {"l4": 1}
    assert svc.status["variants"]["l4"]["reason"] == "waiting for its profile"


def test_cost_now_and_per_thousand_good_requests() -> None:
    svc = Variants(spec(), {"h100": 1, "l4": 2, "spot": 0})
    pods = [*running(svc, {"h100": [4], "l4": [1, 1]}), pod("spot-0", ready=False, unschedulable="no node")]
    svc.tick(0.0, pods, cost=CostWindow(per_hour=6.0, spent=3.0, good_requests=1500.0, window_s=1800.0))
    cost = svc.status["cost"]
    # h100 4/h + two L4 1/h; the unschedulable spot pod holds no node and costs nothing.
    assert cost["perHour"] == 6.0 and cost["per1kGoodRequests"] == 2.0 and cost["windowSeconds"] == 1800.0
    assert svc.status["variants"]["spot"]["costPerHour"] == 0


def test_an_operator_restart_goes_on_with_the_variant_drain_from_status() -> None:
    svc = Variants(spec(), {"h100": 1, "l4": 3, "spot": 0})
    svc.tick(0.0, running(svc, {"h100": [2], "l4": [1, 1, 1]}))
    restarted = Variants(svc.spec, dict(svc.counts), status=svc.status)
    marked = [pod("h100-0", 0, draining=True, ready=False), *running(svc, {"l4": [2, 2, 2]})[1:]]
    done = restarted.tick(1.0, marked)
    assert [(pool_variant(c.pool), c.desired) for c in done.changes()] == [("h100", 0)]


def test_variant_pools_are_named_apart_from_the_default_pool() -> None:
    assert variant_pool("l4") == "variant/l4" and pool_variant("variant/l4") == "l4"
    assert pool_variant("default") is None


def test_each_variants_ready_count_is_its_ready_pods_answering_the_scrape_or_not() -> None:
    svc = Variants(spec(), {"h100": 1, "l4": 2, "spot": 1})
    pods = [
        pod("h100-0", 2.0),
        pod("l4-0", 1.0),
        pod("l4-1", sample=None),  # Ready, its scrape failed this tick: still Ready
        pod("spot-0", ready=False),  # starting
    ]
    svc.tick(0.0, pods)
    ready = {n: v["readyReplicas"] for n, v in svc.status["variants"].items()}
    assert ready == {"h100": 1, "l4": 2, "spot": 0}
    assert svc.status["variants"]["l4"]["rate"] == 3.0  # Manual: in-flight units, the router's share


def test_replicas_ready_but_not_answering_yet_are_waited_for_not_added_to() -> None:
    """A pod is Ready a moment before it listens: no capacity then is not a demand to scale up for."""
    svc = Variants(spec(), {"h100": 0, "l4": 1, "spot": 0})
    for t in range(0, 8, 2):
        svc.tick(float(t), [pod("l4-0", sample=None)])  # Ready, its scrape failing
    assert svc.counts == {"h100": 0, "l4": 1, "spot": 0} and not svc.events("VariantMix")
    svc.tick(8.0, [pod("l4-0", 1.0)])
    assert svc.counts == {"h100": 0, "l4": 1, "spot": 0}


def test_a_falling_demand_left_on_a_dear_variant_rebalances_to_the_cheap_one() -> None:
    """h100 × 1 at a demand one L4 carries: removing only cannot go below one H100 (a spot alone breaks the spot
    limit), so the planner rebalances: the L4 first, then the H100 drained."""
    svc = Variants(spec(mix={"maxSpotFraction": 0.25, "drainSeconds": 0}), {"h100": 1, "l4": 0, "spot": 0})
    svc.tick(0.0, running(svc, {"h100": [2.0]}))
    assert svc.counts == {"h100": 1, "l4": 1, "spot": 0}
    assert any("h100 × 1 → l4 × 1" in m and "more than" in m for m in svc.events("VariantMix"))
    for t in range(2, 12, 2):
        svc.tick(float(t), running(svc, {"h100": [1.0], "l4": [1.0]}))
    assert svc.counts == {"h100": 0, "l4": 1, "spot": 0}
    assert svc.events("DrainStarted") and "h100" in svc.events("DrainStarted")[0]
