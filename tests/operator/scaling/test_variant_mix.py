"""The variant-mix optimiser: against a brute force over every mix, and the explanation it gives."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plimsoll.operator.scaling.variant_mix import (
    Offer,
    choose_mix,
    make_mix,
    mix_key,
    replicas_alone,
    spot_excess,
)

H100 = Offer("h100", capacity=24, cost_per_hour=4.0, min_replicas=0, max_replicas=4)
L4 = Offer("l4", capacity=6, cost_per_hour=0.8, min_replicas=0, max_replicas=8)
MIG = Offer("mig", capacity=2, cost_per_hour=0.5, min_replicas=0, max_replicas=6, spot=True)


def brute_force(offers: list[Offer], demand: float, f: float) -> tuple[int, ...]:
    """Every mix within the bounds, ranked by the optimiser's own order."""
    ranges = [range(o.min_replicas, o.max_replicas + 1) for o in offers]
    return min(
        (make_mix(offers, counts) for counts in itertools.product(*ranges)),
        key=lambda m: mix_key(m, demand, f),
    ).counts


offer = st.builds(
    Offer,
    name=st.just(""),
    capacity=st.integers(1, 30).map(float),
    cost_per_hour=st.sampled_from([0.25, 0.5, 0.8, 1.0, 1.5, 2.0, 4.0, 7.5]),
    min_replicas=st.integers(0, 2),
    max_replicas=st.integers(2, 5),
    spot=st.booleans(),
)


@settings(max_examples=300, deadline=None)
@given(
    offers=st.lists(offer, min_size=1, max_size=4),
    demands=st.lists(st.floats(0, 150, allow_nan=False), min_size=1, max_size=6),
    f=st.sampled_from([0.0, 0.2, 0.5, 0.75, 1.0]),
)
def test_the_chosen_mix_equals_a_brute_force_optimum_over_a_sweep_of_demands(
    offers: list[Offer], demands: list[float], f: float
) -> None:
    offers = [Offer(f"v{i}", o.capacity, o.cost_per_hour, o.min_replicas, o.max_replicas, o.spot)
              for i, o in enumerate(offers)]  # fmt: skip
    for demand in sorted(demands):
        choice = choose_mix(offers, demand, f)
        assert choice.chosen.counts == brute_force(offers, demand, f), (demand, f)
        for o, n in zip(offers, choice.chosen.counts, strict=True):
            assert o.min_replicas <= n <= o.max_replicas
        if choice.shortfall == 0 and choice.spot_excess == 0:
            assert choice.chosen.capacity >= demand - 1e-9
            assert choice.chosen.spot_capacity <= f * choice.chosen.capacity + 1e-9
        if choice.runner_up is not None:
            # The runner-up gives up a variant the chosen mix adds, and never beats it.
            assert mix_key(choice.runner_up, demand, f) >= mix_key(choice.chosen, demand, f)
            assert any(r < c for r, c in zip(choice.runner_up.counts, choice.chosen.counts, strict=True))


def test_a_sweep_of_demands_on_three_variants() -> None:
    offers = [H100, L4, MIG]
    picks = {d: choose_mix(offers, d, max_spot_fraction=0.25) for d in (0, 1, 12, 20, 40, 60)}
    said = {d: c.chosen.describe() for d, c in picks.items()}
    # Nothing asked, nothing bought; a trickle: one L4 (a lone MIG slice would be all spot, above 25 %).
    assert said[0] == "nothing" and said[1] == "l4 × 1" and said[12] == "l4 × 2"
    # A MIG slice tops up three L4s: 2 of 20 on spot (10 %) for 0.3/h less than a fourth L4.
    assert said[20] == "l4 × 3 + mig × 1" and picks[20].why_not == "costs 3.2/h, 0.3/h (10%) more"
    assert said[40] == "l4 × 7"
    # The L4s run out at 8; past that the H100 is next cheapest per unit of capacity.
    assert said[60] == "h100 × 1 + l4 × 6"
    assert picks[60].runner_up is not None and picks[60].runner_up.describe() == "l4 × 8 + mig × 6"


def test_the_spot_limit_binds_and_the_runner_up_says_why() -> None:
    spot_l4 = Offer("l4-spot", capacity=6, cost_per_hour=0.3, min_replicas=0, max_replicas=8, spot=True)
    choice = choose_mix([H100, L4, spot_l4], 30, max_spot_fraction=0.5)
    chosen = choice.chosen
    assert chosen.spot_capacity <= 0.5 * chosen.capacity
    assert chosen.capacity >= 30
    unlimited = choose_mix([H100, L4, spot_l4], 30, max_spot_fraction=1.0)
    assert unlimited.chosen.describe() == "l4-spot × 5"
    assert choice.runner_up is not None and choice.why_not is not None
    assert "more" in choice.why_not or "spot" in choice.why_not


def test_beyond_every_maximum_the_largest_mix_is_chosen_and_the_shortfall_said() -> None:
    choice = choose_mix([H100, L4], 500)
    assert choice.chosen.counts == (4, 8)
    assert choice.shortfall == pytest.approx(500 - 4 * 24 - 8 * 6)


def test_minimums_stay_and_spot_minimums_can_force_the_limit() -> None:
    forced = Offer("spot", capacity=10, cost_per_hour=1, min_replicas=3, max_replicas=3, spot=True)
    od = Offer("od", capacity=10, cost_per_hour=2, min_replicas=0, max_replicas=1)
    choice = choose_mix([forced, od], 5, max_spot_fraction=0.5)
    assert choice.chosen.counts == (3, 1)  # as close to the limit as the bounds allow
    assert choice.spot_excess == pytest.approx(spot_excess(30, 40, 0.5))


def test_replicas_alone() -> None:
    assert replicas_alone(L4, 13) == 3
    assert replicas_alone(L4, 100) is None
    assert replicas_alone(L4, 0) == 1


def test_bad_input_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="positive"):
        Offer("x", capacity=0, cost_per_hour=1)
    with pytest.raises(ValueError, match="unique"):
        choose_mix([L4, L4], 3)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        choose_mix([L4], 3, max_spot_fraction=2)
