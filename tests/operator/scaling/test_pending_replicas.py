"""The autoscaler while replicas are starting or restarting: the queue must not buy extra replicas.

Found on real engines (test_autoscale_real_k8s): after a scale-up 1 → 3 the two
new replicas took over a minute to load on a shared CPU; the one ready replica
still held the whole queue, and the queue fast path (waiting above half the
capacity for 30 s) added a fourth replica the load did not need. The same
happened to a replica restarting after its engine was killed. The HPA formula
already counts such pods (unready as 0 load on a scale-up), so the fast path
waits until every replica serves.
"""

from plimsoll.operator.scaling.autoscaler import Autoscaler, AutoscalerConfig
from plimsoll.operator.scaling.metrics import PodSample
from plimsoll.operator.scaling.observations import PodObservation


def pod(name: str, running: float, waiting: float) -> PodObservation:
    sample = PodSample(
        engine="plimsoll", running=running, waiting=waiting, kv_usage=None, ttft=None, tpot=None
    )
    return PodObservation(name=name, ready=True, sample=sample)


def starting(name: str) -> PodObservation:
    return PodObservation(name=name, ready=False, sample=None)


def config() -> AutoscalerConfig:
    return AutoscalerConfig(target_per_replica=2, min_replicas=1, max_replicas=4, scale_up_window_s=3)


def silent(name: str) -> PodObservation:
    return PodObservation(name=name, ready=True, sample=None, error="connection refused")


def test_no_fast_path_while_new_replicas_start() -> None:
    scaler = Autoscaler(config())
    # 6 clients on one replica holding 2 sequences: ceil(1 × 6 / 2) = 3.
    scaler.decide(0.0, 1, [pod("a", 1, 0)])
    d = scaler.decide(5.0, 1, [pod("a", 2, 4)])  # the scale-up window (3 s) saw only this
    assert d.desired_replicas == 3
    # The two new replicas take 90 s to become Ready; the queue (4 > 0.5 × 3 × 2) stays meanwhile.
    # HPA: unready pods count as 0 on a scale-up, ceil(3 × 6/3 / 2) = 3, no change either.
    for t in range(6, 96):
        d = scaler.decide(float(t), 3, [pod("a", 2, 4), starting("b"), starting("c")])
        assert not d.fast_path and d.desired_replicas == 3, (t, d)


def test_no_fast_path_before_the_new_pods_exist() -> None:
    scaler = Autoscaler(config())
    assert scaler.decide(0.0, 3, [pod("a", 2, 4)]).desired_replicas == 3  # ceil(1 × 6 / 2) = 3
    for t in range(1, 61):
        d = scaler.decide(float(t), 3, [pod("a", 2, 4)])
        assert not d.fast_path and d.desired_replicas == 3, (t, d)


def test_no_fast_path_while_a_killed_replica_restarts() -> None:
    scaler = Autoscaler(config())
    assert scaler.decide(0.0, 3, [pod("a", 2, 0), pod("b", 2, 0), pod("c", 2, 0)]).desired_replicas == 3
    # c's engine is killed: a and b carry 3 each; (3 + 3 + 0) / 3 = 2 = target, no change.
    for t in range(1, 61):
        d = scaler.decide(float(t), 3, [pod("a", 2, 1), pod("b", 2, 1), starting("c")])
        assert d.desired_replicas == 3 and not d.fast_path, (t, d)


def test_fast_path_waits_for_a_starting_replica_then_fires() -> None:
    """Target 6: the formula stays put ((7 + 7 + 0) / 3 < 6 reverses the direction), the queue
    (12 > 0.5 × 3 × 6 = 9) does not — but only once the third replica is up, here Ready and silent."""
    scaler = Autoscaler(AutoscalerConfig(target_per_replica=6, min_replicas=1, max_replicas=5))
    fired = []
    for t in range(0, 120, 5):
        third = starting("c") if t < 45 else silent("c")
        d = scaler.decide(float(t), 3, [pod("a", 1, 6), pod("b", 1, 6), third])
        assert d.recommendation == 3, (t, d)
        if d.fast_path:
            fired.append(t)
    assert fired == [75, 105], fired
