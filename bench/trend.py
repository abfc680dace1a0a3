"""Is a series going up? A least-squares slope with its confidence, and Kendall's monotone trend test.

What it is: :func:`fit_trend` over (time, value) points — the ordinary least-squares
slope, its standard error, a 95 % confidence interval and one-sided p-value from
Student's t (n − 2 degrees of freedom), the rise the slope implies over the span
relative to the series' mean, and Kendall's tau with its p-value (normal
approximation, no ties correction beyond dropping tied pairs); :func:`is_upward`,
the rule a soak flags a leak by. Student's t comes from the regularised incomplete
beta function (a continued fraction), so nothing beyond the standard library is needed.
What it is not: a forecaster, or a test for anything but a rise.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

CONFIDENCE = 0.95
MIN_POINTS = 4


@dataclass(frozen=True, slots=True)
class TrendFit:
    """A fitted trend; slope in value units per second."""

    points: int
    slope_per_s: float
    slope_ci95: tuple[float, float]
    p_value: float  # one-sided: the chance of a slope this steep (or steeper) with no rise at all
    rise: float  # slope × span / mean: the relative rise over the window fitted
    kendall_tau: float
    kendall_p: float  # one-sided, for an upward monotone trend

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c if abs(1.0 + aa / c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c if abs(1.0 + aa / c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-12:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_sf(t: float, df: float) -> float:
    """P(T > t) for Student's t with ``df`` degrees of freedom."""
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return tail if t > 0 else 1.0 - tail


def t_quantile(p: float, df: float) -> float:
    """The t with P(T <= t) = p (bisection on the survival function)."""
    lo, hi = -1e3, 1e3
    for _ in range(200):
        mid = (lo + hi) / 2
        if 1.0 - t_sf(mid, df) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _kendall(times: Sequence[float], values: Sequence[float]) -> tuple[float, float]:
    n = len(values)
    concordant = discordant = 0
    for i in range(n):
        for j in range(i + 1, n):
            s = (times[j] - times[i]) * (values[j] - values[i])
            concordant += s > 0
            discordant += s < 0
    pairs = n * (n - 1) / 2
    tau = (concordant - discordant) / pairs if pairs else 0.0
    var = n * (n - 1) * (2 * n + 5) / 18.0
    s_stat = concordant - discordant
    if var <= 0:
        return tau, 1.0
    z = (s_stat - 1) / math.sqrt(var) if s_stat > 0 else (s_stat + 1) / math.sqrt(var) if s_stat < 0 else 0.0
    return tau, 0.5 * math.erfc(z / math.sqrt(2))


def fit_trend(times: Sequence[float], values: Sequence[float | None]) -> TrendFit | None:
    """The trend of ``values`` over ``times`` (None points dropped); None with too few points."""
    pts = [(t, v) for t, v in zip(times, values, strict=True) if v is not None]
    if len(pts) < MIN_POINTS:
        return None
    xs, ys = [p[0] for p in pts], [float(p[1]) for p in pts]  # type: ignore[arg-type]
    n, mx, my = len(xs), statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx <= 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    residual = sum((y - my - slope * (x - mx)) ** 2 for x, y in zip(xs, ys, strict=True))
    df = n - 2
    se = math.sqrt(residual / df / sxx) if residual > 0 else 0.0
    if se == 0.0:  # a perfect line: certain, in whichever direction it points
        p = 0.0 if slope > 0 else 1.0
        ci = (slope, slope)
    else:
        p = t_sf(slope / se, df)
        half = t_quantile(0.5 + CONFIDENCE / 2, df) * se
        ci = (slope - half, slope + half)
    span = max(xs) - min(xs)
    rise = slope * span / my if my > 0 else (math.inf if slope > 0 else 0.0)
    tau, tau_p = _kendall(xs, ys)
    return TrendFit(n, slope, ci, p, rise, tau, tau_p)


def is_upward(fit: TrendFit | None, min_rise: float, alpha: float = 1 - CONFIDENCE) -> bool:
    """A rise a soak flags: the slope's lower 95 % bound above 0 (one-sided p < alpha), Kendall's
    test agreeing that it is monotone, and a rise over the window of at least ``min_rise``."""
    return (
        fit is not None
        and fit.p_value < alpha
        and fit.kendall_p < alpha
        and fit.kendall_tau > 0
        and fit.rise >= min_rise
    )
