"""Invariants of the autoscaler over random timelines (hypothesis), checked against the decisions' own history.

- the result stays within min..max;
- a scale-up happens only if every raw recommendation in the scale-up window
  was above the current count, or the queue fast path fired;
- a scale-down happens only if every raw recommendation in the scale-down
  window was below the current count;
- a fast-path step adds exactly one replica and needs 30 s of queue since the last one;
- a scale-up adds at most max(+4, +100 %) over the replicas at the start of the 15 s period.

And of the replica planner that strings the autoscaler together with the drain and
zero rules, over a simulated cluster (see the second test's comment).
"""

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st
from planner_cases import Service, spec

from plimsoll.operator.scaling.autoscaler import Autoscaler, AutoscalerConfig
from plimsoll.operator.scaling.metrics import PodSample
from plimsoll.operator.scaling.observations import PodObservation
from plimsoll.operator.scaling.replica_plan import Drain, Undrain

UP_S, DOWN_S = 30.0, 120.0

pod_state = st.one_of(
    st.tuples(st.just("ok"), st.integers(0, 20), st.integers(0, 20)),
    st.just(("silent", 0, 0)),
    st.just(("unready", 0, 0)),
)


def observe(states: list[tuple[str, int, int]]) -> list[PodObservation]:
    out = []
    for i, (kind, running, waiting) in enumerate(states):
        sample = PodSample("plimsoll", running, waiting, None, None, None) if kind == "ok" else None
        out.append(PodObservation(name=f"p{i}", ready=kind != "unready", sample=sample))
    return out


@settings(max_examples=80, deadline=None)
@given(
    target=st.integers(1, 8),
    bounds=st.tuples(st.integers(1, 3), st.integers(0, 6)),
    timeline=st.lists(
        st.tuples(st.integers(1, 15), st.lists(pod_state, min_size=0, max_size=8)), max_size=60
    ),
)
def test_decisions_respect_bounds_and_windows(
    target: int, bounds: tuple[int, int], timeline: list[tuple[int, list[tuple[str, int, int]]]]
) -> None:
    low, high = bounds[0], bounds[0] + bounds[1]
    scaler = Autoscaler(
        AutoscalerConfig(target_per_replica=target, min_replicas=low, max_replicas=high,
                         scale_up_window_s=UP_S, scale_down_window_s=DOWN_S)
    )  # fmt: skip
    current, now = low, 0.0
    raws: list[tuple[float, int]] = [(0.0, low)]  # the first decision records the current count
    last_fast: float | None = None
    counts: list[tuple[float, int]] = []
    for gap, states in timeline:
        now += gap
        d = scaler.decide(now, current, observe(states))
        assert low <= d.desired_replicas <= high
        if d.recommendation is not None:
            raws.append((now, d.recommendation))
            counts.append((now, current))
            start = min(c for t, c in counts if t > now - 15)
            assert d.desired_replicas <= max(current, start + 4, 2 * start), (now, counts, d)
        if d.fast_path:
            assert d.desired_replicas == min(current + 1, high)  # one replica, unless at max
            assert last_fast is None or now - last_fast >= 30
            last_fast = now
        elif d.desired_replicas > current:
            window = [r for t, r in raws if t > now - UP_S]
            assert min(window) > current, (now, window, d)
        if d.desired_replicas < current:
            window = [r for t, r in raws if t > now - DOWN_S]
            assert max(window) < current, (now, window, d)
        current = d.desired_replicas


# -- the replica planner over a simulated cluster --------------------------------------------------
#
# Each tick the cluster shows its pods (Ready after a start-up, marked ones not Ready, deleted ones
# terminating for a tick), the planner plans, and the plan is applied as the handler and the
# ReplicaSet controller would: counts into the spec, marks onto pods, the marked pods deleted first
# when the count goes down. A tick may also restart a marked pod's engine, which forgets its drain
# mark (the label stays). Invariants, checked on every plan:
#
# - every count lies in max(1, min)..max, or is 0 (only with scaling.min 0, only by ScaledToZero);
# - a count goes down only at the end of a drain, by exactly the drain's pods, each kept marked
#   (a Drain action) on every tick from the drain's start while it was there and not being deleted;
# - a count leaves 0 only for requests held by the router;
# - no action names a pod that is not there or is being deleted, and no pod of a drain in progress
#   is unmarked while the drain goes on;
# - a changed count is always explained in the same tick's status write, and every count, action
#   and Event carries a reason (and every count a formula).


@dataclass
class SimPod:
    ready_at: float
    marked: bool = False  # the label
    deleting: bool = False
    share: float = 0.0  # requests on it: a marked pod takes none new and finishes one per tick


def planner_observations(pods: dict[str, SimPod], now: float, in_flight: int) -> list[PodObservation]:
    serving = [n for n, p in pods.items() if not p.marked and not p.deleting and now >= p.ready_at]
    out = []
    for name, p in pods.items():
        ready = now >= p.ready_at and not p.marked and not p.deleting
        if name in serving:
            p.share = in_flight / len(serving)
        elif p.marked:
            p.share = max(0.0, p.share - 1)
        scraped = PodSample("plimsoll", p.share, 0.0, None, None, None) if ready or p.marked else None
        out.append(PodObservation(name, ready, scraped, draining=p.marked, terminating=p.deleting))
    return out


@settings(max_examples=60, deadline=None)
@given(
    low=st.integers(0, 2),
    extra=st.integers(0, 4),
    target=st.integers(1, 6),
    timeline=st.lists(
        # (seconds since the last tick, requests in flight, requests held by the router, restart an engine);
        # idle stretches and held requests often enough that drains, zero and wakes all happen.
        st.tuples(
            st.integers(1, 20),
            st.sampled_from([0, 0, 0, 1, 2, 4, 8, 16, 40]),
            st.sampled_from([0, 0, 0, 0, 1, 3]),
            st.booleans(),
        ),
        max_size=50,
    ),
)
def test_the_planner_keeps_its_invariants_over_a_simulated_cluster(
    low: int, extra: int, target: int, timeline: list[tuple[int, int, int, bool]]
) -> None:
    high = max(1, low) + extra
    svc = Service(spec(
        replicas=max(1, low), scaling={"min": low, "max": high, "idleSeconds": 10, "drainSeconds": 25},
        capacity={"mode": "Manual", "concurrencyPerReplica": target}, router={"enabled": True},
        autoscaling={"scaleUpStabilizationSeconds": 10, "scaleDownStabilizationSeconds": 40},
    ))  # fmt: skip
    pods = {f"p{i}": SimPod(ready_at=0.0) for i in range(max(1, low))}
    made, now = len(pods), 0.0
    victims: tuple[str, ...] = ()
    for gap, in_flight, held, restart in timeline:
        now += gap
        for name in [n for n, p in pods.items() if p.deleting]:
            del pods[name]  # deleted a tick ago: gone now
        current = svc.spec.desired_replicas()
        plan = svc.tick(now, planner_observations(pods, now, in_flight), held=held)
        for action in plan.actions:
            assert action.pod in pods and not pods[action.pod].deleting, (action, pods)
            assert action.reason
            if isinstance(action, Undrain):
                assert action.pod not in victims or any(e.reason == "DrainCancelled" for e in plan.events)
        assert all(e.reason and e.message for e in plan.events)
        for count in plan.changes():
            assert count.reason and count.formula
            assert plan.status is not None, "a changed count is explained in status the same tick"
            if count.desired == 0:
                assert low == 0 and count.reason == "ScaledToZero"
            else:
                assert max(1, low) <= count.desired <= high, (count, low, high)
            if count.desired < current:
                assert count.reason in ("ScaledDown", "ScaledToZero")
                assert current - count.desired == len(victims), (count, victims)
            if current == 0:
                assert held > 0 and count.reason == "ScaledFromZero"
        if victims and not plan.changes():
            if any(e.reason == "DrainCancelled" for e in plan.events):
                victims = ()
            else:
                live = {n for n in victims if n in pods and not pods[n].deleting}
                assert live <= set(plan.drained()), (live, plan.actions)
        if any(e.reason == "DrainStarted" for e in plan.events):
            victims = tuple(svc.status["scaleDown"]["pods"])
        elif plan.changes() and plan.changes()[0].desired < current:
            victims = ()

        # The handler and the cluster act on the plan.
        for action in plan.actions:
            pods[action.pod].marked = isinstance(action, Drain)
        wanted = svc.spec.desired_replicas()
        live = [n for n, p in pods.items() if not p.deleting]
        if wanted > len(live):
            for _ in range(wanted - len(live)):
                pods[f"p{made}"] = SimPod(ready_at=now + 3)
                made += 1
        elif wanted < len(live):
            # The ReplicaSet takes the lowest deletion cost (the marked pods) first.
            for name in sorted(live, key=lambda n: (not pods[n].marked, n))[: len(live) - wanted]:
                pods[name].deleting = True
        if restart:
            marked = [n for n, p in pods.items() if p.marked and not p.deleting]
            if marked:
                pods[marked[0]].ready_at = now + 1  # its engine restarts: unmarked, not Ready for a second
