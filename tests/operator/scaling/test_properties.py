"""Invariants of the autoscaler over random timelines (hypothesis), checked against the decisions' own history.

- the result stays within min..max;
- a scale-up happens only if every raw recommendation in the scale-up window
  was above the current count, or the queue fast path fired;
- a scale-down happens only if every raw recommendation in the scale-down
  window was below the current count;
- a fast-path step adds exactly one replica and needs 30 s of queue since the last one;
- a scale-up adds at most max(+4, +100 %) over the replicas at the start of the 15 s period.
"""

from hypothesis import given, settings
from hypothesis import strategies as st

from plimsoll.operator.scaling.autoscaler import Autoscaler, AutoscalerConfig, PodObservation
from plimsoll.operator.scaling.metrics import PodSample

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
