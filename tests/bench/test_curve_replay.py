"""The event-time replay of simulated replicas behind the router: the simulator's semantics and known queues."""

import statistics

import pytest

from plimsoll.bench.curve_replay import ReplicaKind, replay
from plimsoll.bench.simulator import ServiceCurve


def test_a_request_alone_takes_one_step_per_token_at_batch_one() -> None:
    curve = ServiceCurve(batch_cap=8, step_t0_s=0.08, step_k_s=0.008)
    out = replay({"l4": (ReplicaKind(curve, 6.0, 11.0), 1)}, rate=0.01, seconds=20_000, output_tokens=4)
    alone = [
        r for before, r, after in zip([None, *out], out, [*out[1:], None], strict=False)
        if (before is None or r.at - before.at > 1.0) and (after is None or after.at - r.at > 1.0)
    ]  # fmt: skip
    assert len(alone) > 100
    for r in alone:
        assert r.ttft_s == pytest.approx(curve.step_s(1)) and r.tpot_s == pytest.approx(curve.step_s(1))


def test_one_slot_with_a_flat_step_is_the_m_d_1_queue() -> None:
    # Batch cap 1, 4 tokens of 50 ms: a deterministic 200 ms service; at 3 req/s (rho 0.6) the
    # Pollaczek-Khinchine mean wait is rho * D / (2 (1 - rho)) = 150 ms, and TTFT adds one step.
    curve = ServiceCurve(batch_cap=1, step_t0_s=0.05)
    out = replay({"one": (ReplicaKind(curve, 1.0, 5.0), 1)}, rate=3.0, seconds=8_000, output_tokens=4)
    assert statistics.fmean(r.ttft_s for r in out) == pytest.approx(0.150 + 0.05, rel=0.04)
    assert all(r.tpot_s == pytest.approx(0.05) for r in out)  # alone in its batch: one step a token


def test_the_router_splits_arrivals_by_rate_and_a_bigger_batch_steps_slower() -> None:
    fast = ServiceCurve(batch_cap=8, step_t0_s=0.08, step_k_s=0.008)
    slow = ServiceCurve(batch_cap=4, step_t0_s=0.1, step_k_s=0.012)
    mix = {"l4": (ReplicaKind(fast, 6.0, 11.12), 1), "spot": (ReplicaKind(slow, 3.0, 5.32), 2)}
    out = replay(mix, rate=14.0, seconds=600, output_tokens=4)
    share = sum(r.replica == "l4-0" for r in out) / len(out)
    assert share == pytest.approx(11.12 / (11.12 + 2 * 5.32), abs=0.02)
    # Every token of a request comes at least one batch-of-one step apart, at most one full batch's step.
    for r in out:
        curve = fast if r.replica == "l4-0" else slow
        assert curve.step_s(1) - 1e-9 <= r.tpot_s <= curve.step_s(curve.batch_cap) + 1e-9


def test_bad_input_is_refused_with_what_was_wrong() -> None:
    kind = ReplicaKind(ServiceCurve(), 1.0, 1.0)
    with pytest.raises(ValueError, match="rate, seconds and output_tokens must be positive"):
        replay({"a": (kind, 1)}, rate=0.0, seconds=10, output_tokens=4)
    with pytest.raises(ValueError, match="no replicas"):
        replay({"a": (kind, 0)}, rate=1.0, seconds=10, output_tokens=4)
