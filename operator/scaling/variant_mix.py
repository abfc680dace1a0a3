"""The cheapest mix of hardware variants that carries a demand: replicas per variant, and why.

What it is: :func:`choose_mix`, an exact small integer program. Each variant is
an :class:`Offer` — what one replica carries at the SLO with headroom
(``capacity``, in the caller's demand unit: requests per second from measured
profiles, or in-flight requests), what it costs per hour, its replica bounds and
whether it runs on spot capacity. The chosen :class:`Mix` minimises, in this order
(:func:`mix_key`):

1. spot exposure above ``max_spot_fraction`` of the mix's capacity
   (``(1 − f) × spot − f × on-demand``, 0 when within the limit): a hard limit,
   broken only when the minimum replicas of spot variants force it;
2. demand the mix cannot carry (``max(0, demand − capacity)``): beyond every
   variant's maximum the mix is the largest that fits;
3. cost per hour;
4. then, at equal cost, more capacity, less of it on spot, and the counts in
   order (so the answer is unique, and a brute force over every mix finds the same).

The search is depth first over the variants, cheapest per unit of capacity first,
with a lower bound on each partial mix (the spot excess the remaining minimums
force, the demand even the remaining maximums cannot carry, and the cheapest
fractional cover of what is left) that cuts any branch that cannot beat the best
mix found. The runner-up is the best mix that gives up at least one variant the
chosen mix adds replicas of (one search per such variant with that variant held
at its minimum); the explanation says why it lost.

What it is not: the planner's timing (scale-ups first, removals after, windows,
availability: ``variant_planner.py``) or any I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from plimsoll.operator.scaling.formula import fmt

# Float sums of capacities are compared with this slack (capacities are ~0.01..1e4).
EPS = 1e-9


@dataclass(frozen=True, slots=True)
class Offer:
    """One variant as the optimiser sees it."""

    name: str
    capacity: float  # demand units one replica carries at its target (> 0)
    cost_per_hour: float  # > 0
    min_replicas: int = 0
    max_replicas: int = 1
    spot: bool = False

    def __post_init__(self) -> None:
        if not self.capacity > 0 or not self.cost_per_hour > 0:
            raise ValueError(f"variant {self.name}: capacity and cost per hour must be positive")
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(
                f"variant {self.name}: need 0 <= min ({self.min_replicas}) <= max ({self.max_replicas})"
            )

    @property
    def cost_per_capacity(self) -> float:
        return self.cost_per_hour / self.capacity


@dataclass(frozen=True, slots=True)
class Mix:
    """Replicas per variant (in the offers' order) and what they add up to."""

    names: tuple[str, ...]
    counts: tuple[int, ...]
    capacity: float
    spot_capacity: float
    cost_per_hour: float

    def count(self, name: str) -> int:
        return self.counts[self.names.index(name)]

    def as_dict(self) -> dict[str, int]:
        return dict(zip(self.names, self.counts, strict=True))

    @property
    def spot_share(self) -> float:
        return self.spot_capacity / self.capacity if self.capacity > 0 else 0.0

    def describe(self) -> str:
        """``h100 × 1 + l4 × 3`` (variants with no replica left out; ``nothing`` when empty)."""
        parts = [f"{n} × {c}" for n, c in zip(self.names, self.counts, strict=True) if c]
        return " + ".join(parts) or "nothing"


@dataclass(frozen=True, slots=True)
class MixChoice:
    """The chosen mix for one demand, the runner-up and why it lost."""

    demand: float
    max_spot_fraction: float
    chosen: Mix
    runner_up: Mix | None
    why_not: str | None
    shortfall: float  # demand the chosen mix cannot carry
    spot_excess: float  # capacity on spot beyond the limit (forced by spot minimums)
    searched: int  # partial mixes the search looked at


def make_mix(offers: Sequence[Offer], counts: Sequence[int]) -> Mix:
    """The :class:`Mix` of ``counts`` (one per offer, in order)."""
    capacity = spot = cost = 0.0
    for offer, n in zip(offers, counts, strict=True):
        capacity += n * offer.capacity
        cost += n * offer.cost_per_hour
        if offer.spot:
            spot += n * offer.capacity
    return Mix(tuple(o.name for o in offers), tuple(counts), capacity, spot, cost)


def spot_excess(spot_capacity: float, capacity: float, max_spot_fraction: float) -> float:
    """How far spot capacity is above ``max_spot_fraction`` of the capacity (0 within the limit)."""
    f = max_spot_fraction
    excess = (1 - f) * spot_capacity - f * (capacity - spot_capacity)
    return excess if excess > EPS else 0.0


# What mix_key returns: spot excess, shortfall, cost, -capacity, spot capacity, the counts.
MixKey = tuple[float, float, float, float, float, tuple[int, ...]]


def mix_key(mix: Mix, demand: float, max_spot_fraction: float) -> MixKey:
    """What the optimiser minimises, in order (module docstring); lower is better."""
    short = demand - mix.capacity
    return (
        spot_excess(mix.spot_capacity, mix.capacity, max_spot_fraction),
        short if short > EPS else 0.0,
        round(mix.cost_per_hour, 9),
        -round(mix.capacity, 9),
        round(mix.spot_capacity, 9),
        mix.counts,
    )


@dataclass
class _Search:
    offers: list[Offer]  # cheapest per unit of capacity first
    demand: float
    f: float
    best: tuple[MixKey, tuple[int, ...]] | None = None
    searched: int = 0

    def run(self) -> tuple[int, ...]:
        self._dfs(0, [], 0.0, 0.0, 0.0)
        assert self.best is not None
        return self.best[1]

    def _bound(self, depth: int, capacity: float, spot: float, cost: float) -> tuple[float, float, float]:
        """A lower bound on (spot excess, shortfall, cost) of any mix completing this partial one."""
        rest = self.offers[depth:]
        lo_cap = sum(o.min_replicas * o.capacity for o in rest)
        hi_cap = sum(o.max_replicas * o.capacity for o in rest)
        spot_lo = spot + sum(o.min_replicas * o.capacity for o in rest if o.spot)
        od_hi = (capacity - spot) + sum(o.max_replicas * o.capacity for o in rest if not o.spot)
        excess = spot_excess(spot_lo, spot_lo + od_hi, self.f) if spot_lo > 0 else 0.0
        short = self.demand - capacity - hi_cap
        cost_lo = cost + sum(o.min_replicas * o.cost_per_hour for o in rest)
        if short <= EPS:
            need = self.demand - capacity - lo_cap
            ratios = [o.cost_per_capacity for o in rest if o.max_replicas > o.min_replicas]
            if need > EPS and ratios:
                cost_lo += need * min(ratios)
        return excess, (short if short > EPS else 0.0), round(cost_lo, 9) - 1e-9

    def _dfs(self, depth: int, counts: list[int], capacity: float, spot: float, cost: float) -> None:
        self.searched += 1
        if self.best is not None and self._bound(depth, capacity, spot, cost) > self.best[0][:3]:
            return
        if depth == len(self.offers):
            mix = make_mix(self.offers, counts)
            key = mix_key(mix, self.demand, self.f)
            if self.best is None or key < self.best[0]:
                self.best = (key, tuple(counts))
            return
        offer = self.offers[depth]
        for n in range(offer.min_replicas, offer.max_replicas + 1):
            add_cap = n * offer.capacity
            self._dfs(
                depth + 1, [*counts, n], capacity + add_cap, spot + (add_cap if offer.spot else 0.0),
                cost + n * offer.cost_per_hour,
            )  # fmt: skip
            # Once the demand is covered and the best mix is within the spot limit, one more replica
            # of this offer that already cannot beat it on cost is no better with two more: the
            # shortfall stays 0, the spot excess of a bound at 0 cannot fall, and the cost grows.
            covered = capacity + add_cap >= self.demand - EPS
            if covered and self.best is not None and self.best[0][0] == 0.0:
                bound = self._bound(depth + 1, capacity + add_cap + offer.capacity,
                                    spot + (add_cap + offer.capacity if offer.spot else 0.0),
                                    cost + (n + 1) * offer.cost_per_hour)  # fmt: skip
                if bound[0] == 0.0 and bound > self.best[0][:3]:
                    break


def _solve(offers: Sequence[Offer], demand: float, max_spot_fraction: float) -> tuple[tuple[int, ...], int]:
    """Counts in ``offers`` order for the best mix, and how many partial mixes were looked at."""
    order = sorted(range(len(offers)), key=lambda i: (offers[i].cost_per_capacity, offers[i].name))
    search = _Search([offers[i] for i in order], demand, max_spot_fraction)
    found = search.run()
    counts = [0] * len(offers)
    for position, i in enumerate(order):
        counts[i] = found[position]
    return tuple(counts), search.searched


def choose_mix(offers: Sequence[Offer], demand: float, max_spot_fraction: float = 1.0) -> MixChoice:
    """The cheapest mix of ``offers`` that carries ``demand`` within the spot limit (module docstring)."""
    if not offers:
        raise ValueError("choose_mix needs at least one variant")
    if not 0 <= max_spot_fraction <= 1:
        raise ValueError(f"max_spot_fraction must lie in [0, 1], got {max_spot_fraction}")
    if len({o.name for o in offers}) != len(offers):
        raise ValueError("variant names must be unique")
    demand = max(0.0, demand)
    counts, searched = _solve(offers, demand, max_spot_fraction)
    chosen = make_mix(offers, counts)
    key = mix_key(chosen, demand, max_spot_fraction)

    runner_up: Mix | None = None
    runner_key: MixKey | None = None
    for i, offer in enumerate(offers):
        if counts[i] <= offer.min_replicas:
            continue  # the chosen mix adds nothing of this variant: giving it up changes nothing
        held = [o if j != i else Offer(o.name, o.capacity, o.cost_per_hour, o.min_replicas, o.min_replicas, o.spot)
                for j, o in enumerate(offers)]  # fmt: skip
        other, more = _solve(held, demand, max_spot_fraction)
        searched += more
        mix = make_mix(offers, other)
        other_key = mix_key(mix, demand, max_spot_fraction)
        if runner_key is None or other_key < runner_key:
            runner_up, runner_key = mix, other_key
    why = None if runner_up is None or runner_key is None else _why_not(key, runner_key, runner_up, chosen)
    return MixChoice(demand, max_spot_fraction, chosen, runner_up, why, key[1], key[0], searched)


def _why_not(key: MixKey, other: MixKey, runner_up: Mix, chosen: Mix) -> str:
    """Why the runner-up lost, in the order the optimiser ranks mixes."""
    if other[0] > key[0]:
        return f"puts {runner_up.spot_share:.0%} of its capacity on spot, above the limit"
    if other[1] > key[1]:
        return f"carries {fmt(runner_up.capacity)}, {fmt(other[1] - key[1])} short of what the chosen mix carries"
    if other[2] > key[2]:
        more = runner_up.cost_per_hour - chosen.cost_per_hour
        return (
            f"costs {fmt(runner_up.cost_per_hour)}/h, {fmt(more)}/h ({more / chosen.cost_per_hour:.0%}) more"
        )
    return "costs the same and carries no more"


def replicas_alone(offer: Offer, demand: float) -> int | None:
    """Replicas of ``offer`` alone that carry ``demand`` (None: more than its maximum)."""
    n = max(offer.min_replicas, math.ceil(demand / offer.capacity - EPS), 1)
    return n if n <= offer.max_replicas else None
