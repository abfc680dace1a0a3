"""The two rules that turn a concurrency sweep into a per-replica concurrency.

What it is: pure arithmetic shared by the bench (which writes the report) and
the operator and ``plimsoll plan`` (which re-derive a concurrency from it for
another SLO or headroom), so the number cannot mean two things.

- :func:`latency_crossing`: where latency leaves its limits. Per level, the worst
  normalised margin m(c) = max_j (observed_j / limit_j − 1), made monotone by a
  running max (once over, a noisy dip does not reopen the range), interpolated
  in log2(c) where it crosses zero. "none" when every level holds, "below_range"
  when the lowest level already fails.
- :func:`recommend`: ⌊headroom × min(knees)⌋, at least 1; none without a knee.

What it is not: where the limits come from (an SLO, or inflation over the lowest
level: the bench decides), the throughput knee (bench statistics), or I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# A level as this module reads it: concurrency, and the observed value (None when
# not measured) of each limited quantity, keyed as in the limits.
Level = tuple[float, Mapping[str, float | None]]


@dataclass(frozen=True, slots=True)
class Crossing:
    """Where the worst latency margin crosses zero, and the margins that show it."""

    status: str  # "found" | "none" | "below_range" | "no_data"
    concurrency: float | None  # only when found
    binding: str | None  # the limit that fails first
    margins: list[dict[str, Any]] = field(default_factory=list)
    # The last level that holds and the first that fails (concurrency), when they exist.
    last_pass: float | None = None
    first_fail: float | None = None


def latency_crossing(levels: Sequence[Level], limits: Mapping[str, float]) -> Crossing:
    """The latency knee of ``levels`` (any order) against ``limits`` (name -> limit, same unit as observed)."""
    if not levels or not limits:
        return Crossing("no_data", None, None)
    margins: list[dict[str, Any]] = []
    running = -math.inf
    for concurrency, observed in sorted(levels, key=lambda lv: lv[0]):
        per = {}
        for name, limit in limits.items():
            value = observed.get(name)
            per[name] = math.inf if value is None else value / limit - 1.0
        worst = max(per, key=lambda k: per[k])
        running = max(running, per[worst])
        margins.append(
            {
                "concurrency": concurrency,
                "margin": per[worst],
                "monotone_margin": running,
                "binding": worst,
                "margins": per,
            }
        )
    fail = next((i for i, m in enumerate(margins) if m["monotone_margin"] > 0), None)
    if fail is None:
        return Crossing("none", None, None, margins, last_pass=margins[-1]["concurrency"])
    binding = margins[fail]["binding"]
    if fail == 0:
        return Crossing("below_range", None, binding, margins, first_fail=margins[0]["concurrency"])
    lo, hi = margins[fail - 1], margins[fail]
    x0, x1 = math.log2(lo["concurrency"]), math.log2(hi["concurrency"])
    m0, m1 = lo["monotone_margin"], min(hi["monotone_margin"], 1e9)  # an unmeasured level is +inf
    x = x0 + (0.0 - m0) * (x1 - x0) / (m1 - m0) if m1 > m0 else x0
    return Crossing(
        "found", round(2.0**x, 2), binding, margins, last_pass=lo["concurrency"], first_fail=hi["concurrency"]
    )


@dataclass(frozen=True, slots=True)
class Recommendation:
    concurrency_per_replica: int | None
    headroom: float
    limited_by: str | None
    knee_concurrency: float | None
    reason: str


def recommend(knees: Mapping[str, float | None], headroom: float) -> Recommendation:
    """⌊headroom × the smallest knee⌋ (name -> concurrency, None when not found), or None with the reason."""
    found = sorted((k, name) for name, k in knees.items() if k is not None)
    if not found:
        return Recommendation(
            None,
            headroom,
            None,
            None,
            "no knee within the tested range; the replica was not saturated — extend --levels",
        )
    knee, name = found[0]
    value = math.floor(headroom * knee)
    if value < 1:
        return Recommendation(
            1,
            headroom,
            name,
            float(knee),
            f"{headroom:g} × {name} knee {knee:g} rounds below 1; using 1 (the replica saturates "
            "almost at once)",
        )
    return Recommendation(
        value, headroom, name, float(knee), f"⌊{headroom:g} × {name} knee {knee:g}⌋ = {value}"
    )


__all__ = ["Crossing", "Level", "Recommendation", "latency_crossing", "recommend"]
