"""Split prefill and decode onto separate replicas, or not: the verdict, measured or predicted, with its reasons.

What it is: pure arithmetic shared by ``plimsoll bench disagg`` (which measures each layout on the
replicas at hand), ``plimsoll plan`` (which predicts each layout from one replica's profile and a
link bandwidth) and the operator (which says in ``status.disaggregation`` which layout it runs and
why), so "split pays" means one thing everywhere.

- A *layout* is aggregated (every replica prefills and decodes) or a ratio ``pP:dD`` (``p``
  replicas prefill, ``d`` decode, the KV blocks of each prompt moving between them).
- The figure compared is **goodput per replica**: requests per second that meet the TTFT and TPOT
  SLOs, divided by the replicas the layout uses, so layouts of different sizes compare fairly.
- :func:`verdict`: split when the best ratio's goodput per replica beats aggregated by more than
  ``margin`` (5%: less is within what a re-run moves); aggregated otherwise. The reasons name each
  layout's goodput, its TTFT and TPOT, and what the KV transfer cost per request.
- :func:`predict`, from a :class:`ServiceProfile` (one replica's prefill rate, the sequences it
  decodes within the TPOT SLO and their TPOT, KV bytes per token) and a link bandwidth. Per request
  a replica spends ``I/P`` seconds prefilling ``I`` prompt tokens at ``P`` tokens/s and ``O·t/B`` of
  decode capacity (``O`` tokens, ``B`` sequences per step of ``t`` seconds). *Aggregated* it does
  both, and its prefills stall its decodes: while it prefills a share ``u`` of the time, a decode
  step effectively takes ``t/(1−u)``, so the TPOT SLO caps ``u ≤ 1 − t/SLO`` — goodput per replica is
  ``min(1/(I/P + O·t/B), (1 − t/SLO)·P/I)``, and 0 when ``I/P + t`` alone misses the TTFT SLO.
  *Split* ``p:d``: ``min(p·P/I, d·B/(O·t), p·link/(I·kv))/(p+d)`` (the prefill pool, the decode
  pool, the prefill replicas' links), 0 when ``I/P + I·kv/link + t`` misses the TTFT SLO. With a
  perfectly balanced ratio and no interference the two are equal: splitting pays only by removing
  the prefill stalls that cap an aggregated replica under a tight TPOT SLO, and loses to a slow link,
  an unbalanced ratio or a tight TTFT SLO.

What it is not: a simulator (no queueing: each figure is a pool's capacity at saturation, which the
operator then loads to its headroom) or I/O.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

MARGIN = 0.05
AGGREGATED = "aggregated"


@dataclass(frozen=True, slots=True)
class Ratio:
    prefill: int
    decode: int

    @property
    def name(self) -> str:
        return f"{self.prefill}P:{self.decode}D"

    @property
    def replicas(self) -> int:
        return self.prefill + self.decode


def parse_ratios(text: str) -> list[Ratio]:
    """``1:1,1:2`` or ``1P:2D,2P:1D`` -> ratios; ``ValueError`` saying how to write one."""
    out = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*P?\s*:\s*(\d+)\s*D?\s*", part, flags=re.IGNORECASE)
        if not m or int(m[1]) < 1 or int(m[2]) < 1:
            raise ValueError(f"ratio {part.strip()!r}: write PREFILL:DECODE replicas, e.g. 1:1 or 1P:2D")
        out.append(Ratio(int(m[1]), int(m[2])))
    if not out:
        raise ValueError("give at least one PREFILL:DECODE ratio, e.g. 1:1")
    return out


@dataclass(slots=True)
class LayoutFigures:
    """One layout's figures, measured or predicted (seconds, requests/s, bytes)."""

    layout: str  # AGGREGATED or a ratio's name
    replicas: int
    goodput_rps: float  # requests/s meeting the SLOs, all replicas of the layout together
    ttft_p50_s: float | None = None
    ttft_p95_s: float | None = None
    tpot_p50_s: float | None = None
    tpot_p95_s: float | None = None
    itl_p50_s: float | None = None
    itl_p95_s: float | None = None
    transfer_s: float | None = None  # KV transfer per request (split layouts)
    transfer_bytes: float | None = None
    prefill_replicas: int = 0
    decode_replicas: int = 0
    limited_by: str | None = None  # predictions: what caps the goodput
    notes: list[str] = field(default_factory=list)

    @property
    def goodput_per_replica(self) -> float:
        return self.goodput_rps / self.replicas if self.replicas else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "goodput_per_replica_rps": self.goodput_per_replica}


@dataclass(slots=True)
class Verdict:
    choice: str  # AGGREGATED or "split"
    ratio: str | None  # the split layout chosen
    reasons: list[str]
    layouts: list[LayoutFigures]

    @property
    def runs(self) -> str:
        """What to run, in one word: ``aggregated`` or the ratio."""
        return self.ratio if self.ratio is not None else AGGREGATED

    def to_dict(self) -> dict[str, Any]:
        return {"choice": self.choice, "ratio": self.ratio, "reasons": list(self.reasons),
                "layouts": [lay.to_dict() for lay in self.layouts]}  # fmt: skip


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    ms = seconds * 1e3
    return f"{ms:.0f} ms" if ms >= 10 else f"{ms:.2g} ms"


def _describe(lay: LayoutFigures) -> str:
    text = (
        f"{lay.layout} ({lay.replicas} replica{'s' if lay.replicas != 1 else ''}): "
        f"{lay.goodput_per_replica:.3g} good req/s per replica, TTFT p95 {_ms(lay.ttft_p95_s)}, "
        f"TPOT p50 {_ms(lay.tpot_p50_s)}"
    )
    if lay.transfer_s is not None or lay.transfer_bytes is not None:
        mb = f"{lay.transfer_bytes / 1e6:.3g} MB" if lay.transfer_bytes is not None else "n/a"
        text += f", KV transfer {_ms(lay.transfer_s)} and {mb} per request"
    if lay.limited_by:
        text += f", limited by {lay.limited_by}"
    return text


def verdict(layouts: Sequence[LayoutFigures], margin: float = MARGIN) -> Verdict:
    """Split at the best ratio when its goodput per replica beats aggregated by more than ``margin``."""
    agg = next((lay for lay in layouts if lay.layout == AGGREGATED), None)
    splits = [lay for lay in layouts if lay.layout != AGGREGATED]
    if agg is None or not splits:
        raise ValueError("a verdict compares the aggregated layout with at least one split ratio")
    best = max(splits, key=lambda lay: lay.goodput_per_replica)
    reasons = [_describe(agg), *(_describe(lay) for lay in splits)]
    base, alt = agg.goodput_per_replica, best.goodput_per_replica
    if alt > base * (1 + margin) and alt > 0:
        reasons.append(
            f"split {best.layout}: {(alt / base - 1) * 100:.0f}% more good requests per replica than aggregated"
            if base > 0
            else f"split {best.layout}: {alt:.3g} good req/s per replica where aggregated serves none within the SLO"
        )
        why = _why_split(agg, best)
        if why:
            reasons.append(why)
        return Verdict("split", best.layout, reasons, list(layouts))
    if alt >= base * (1 - margin):
        reasons.append(
            f"aggregated: the best split ({best.layout}) is within {margin:.0%} of it ({alt:.3g} vs {base:.3g} per "
            "replica), not worth the KV transfer and a second pool to run"
        )
    else:
        loss = (1 - alt / base) * 100 if base > 0 else 100.0
        reasons.append(
            f"aggregated: the best split ({best.layout}) serves {loss:.0f}% fewer good requests per replica"
        )
        why = _why_not_split(agg, best)
        if why:
            reasons.append(why)
    return Verdict(AGGREGATED, None, reasons, list(layouts))


def _why_split(agg: LayoutFigures, best: LayoutFigures) -> str | None:
    if agg.tpot_p50_s and best.tpot_p50_s and best.tpot_p50_s < agg.tpot_p50_s * 0.9:
        return (
            f"decode no longer waits behind prefills: TPOT p50 {_ms(best.tpot_p50_s)} split vs "
            f"{_ms(agg.tpot_p50_s)} aggregated"
        )
    return None


def _why_not_split(agg: LayoutFigures, best: LayoutFigures) -> str | None:
    parts = []
    if agg.ttft_p95_s and best.ttft_p95_s and best.ttft_p95_s > agg.ttft_p95_s * 1.1:
        parts.append(f"TTFT p95 grows to {_ms(best.ttft_p95_s)} from {_ms(agg.ttft_p95_s)}")
    if best.transfer_s:
        parts.append(f"each request waits {_ms(best.transfer_s)} for its KV blocks")
    if best.limited_by:
        parts.append(f"the split is limited by {best.limited_by}")
    return "; ".join(parts) or None


# -- prediction -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ServiceProfile:
    """One replica as profiling measured it."""

    prefill_tokens_per_s: float  # prompt tokens/s while prefilling
    decode_sequences: float  # sequences decoded together within the TPOT SLO
    decode_tpot_s: float  # TPOT at that many sequences
    kv_bytes_per_token: float


def predict(
    profile: ServiceProfile,
    input_tokens: float,
    output_tokens: float,
    link_bytes_per_s: float,
    ratios: Iterable[Ratio],
    ttft_slo_s: float | None = None,
    tpot_slo_s: float | None = None,
) -> list[LayoutFigures]:
    """Goodput per layout from ``profile`` (see the module docstring for the formulas)."""
    if min(profile.prefill_tokens_per_s, profile.decode_sequences, profile.decode_tpot_s, input_tokens,
           output_tokens, link_bytes_per_s) <= 0:  # fmt: skip
        raise ValueError(
            "predicting a layout needs positive rates, sequences, TPOT, token counts and link bandwidth"
        )
    p_rate, seqs, tpot = profile.prefill_tokens_per_s, profile.decode_sequences, profile.decode_tpot_s
    prefill_s = input_tokens / p_rate
    decode_cost = output_tokens * tpot / seqs  # replica-seconds of decode per request
    transfer_bytes = input_tokens * profile.kv_bytes_per_token
    transfer_s = transfer_bytes / link_bytes_per_s
    out = []
    # Aggregated: both phases on one replica; prefills stall decode steps.
    capacity = 1.0 / (prefill_s + decode_cost)
    limited = "prefill + decode work per replica"
    if tpot_slo_s is not None:
        share = max(0.0, 1.0 - tpot / tpot_slo_s)
        stall_cap = share / prefill_s
        if stall_cap < capacity:
            capacity, limited = (
                stall_cap,
                f"prefill stalls in decode (TPOT SLO leaves {share:.0%} of the time to prefill)",
            )
    ttft = prefill_s + tpot
    agg = LayoutFigures(AGGREGATED, 1, capacity, ttft_p50_s=ttft, ttft_p95_s=ttft,
                        tpot_p50_s=tpot / max(1e-9, 1 - min(0.999, capacity * prefill_s)), limited_by=limited)  # fmt: skip
    if ttft_slo_s is not None and ttft > ttft_slo_s:
        agg.goodput_rps, agg.limited_by = 0.0, f"TTFT {_ms(ttft)} > SLO {_ms(ttft_slo_s)}"
    out.append(agg)
    for r in ratios:
        caps = {
            "the prefill pool": r.prefill / prefill_s,
            "the decode pool": r.decode / decode_cost,
            "the KV link": r.prefill * link_bytes_per_s / transfer_bytes if transfer_bytes > 0 else math.inf,
        }
        limit = min(caps, key=lambda k: caps[k])
        ttft = prefill_s + transfer_s + tpot
        lay = LayoutFigures(r.name, r.replicas, caps[limit], ttft_p50_s=ttft, ttft_p95_s=ttft, tpot_p50_s=tpot,
                            transfer_s=transfer_s, transfer_bytes=transfer_bytes, prefill_replicas=r.prefill,
                            decode_replicas=r.decode, limited_by=limit)  # fmt: skip
        if ttft_slo_s is not None and ttft > ttft_slo_s:
            lay.goodput_rps, lay.limited_by = (
                0.0,
                f"TTFT {_ms(ttft)} > SLO {_ms(ttft_slo_s)} (with the transfer)",
            )
        out.append(lay)
    return out


def profile_from_report(
    report: Mapping[str, Any], kv_bytes_per_token: float, tpot_slo_s: float | None = None
) -> ServiceProfile:
    """A :class:`ServiceProfile` from a `plimsoll bench sweep` report of one replica.

    Prefill rate: the server's prompt tokens per second of prefill at the lowest level (scraped by the
    bench), else mean prompt tokens ÷ TTFT p50 there (a prompt alone on the replica, end to end).
    Decode: the highest level whose TPOT p50 meets ``tpot_slo_s`` (every level without one), and that
    TPOT. ``ValueError`` when the report lacks them.
    """
    levels = [lv for lv in report.get("levels", []) if lv.get("valid") and lv.get("concurrency")]
    if not levels:
        raise ValueError("the report has no valid concurrency level")
    levels.sort(key=lambda lv: lv["concurrency"])
    lowest = levels[0]
    # The server's own prefill rate when the report scraped it; else a prompt alone, end to end.
    rate = (((lowest.get("server") or {}).get("load")) or {}).get("prefill_tokens_per_s")
    if not rate:
        prompt = (lowest.get("tokens") or {}).get("prompt_mean")
        ttft = ((lowest.get("latency_ms") or {}).get("ttft") or {}).get("p50")
        if not prompt or not ttft:
            raise ValueError(
                "the report's lowest level has no prefill rate, nor a prompt length and TTFT for one"
            )
        rate = float(prompt) / (float(ttft) / 1e3)

    def tpot_of(lv: Mapping[str, Any]) -> float | None:
        value = ((lv.get("latency_ms") or {}).get("tpot") or {}).get("p50")
        return value / 1e3 if value else None

    fits = [lv for lv in levels if (t := tpot_of(lv)) is not None and (tpot_slo_s is None or t <= tpot_slo_s)]
    if not fits:
        raise ValueError("no level of the report meets the TPOT SLO: the replica cannot decode within it")
    best = fits[-1]
    return ServiceProfile(float(rate), float(best["concurrency"]), tpot_of(best) or 0.0, kv_bytes_per_token)


def parse_bandwidth(text: str) -> float:
    """``10GB/s``, ``25Gbit/s``, ``400Gbps``, ``1.5GiB/s`` -> bytes per second."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kKmMgGtT]?)(i?)(B|bit|b)(?:/s|ps)?\s*", text)
    if not m:
        raise ValueError(f"link bandwidth {text!r}: write e.g. 10GB/s, 25Gbit/s or 400Gbps")
    scale = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}[m[2].lower()]
    value = float(m[1]) * float((1024 if m[3] else 1000) ** scale)
    return value / 8 if m[4] in ("bit", "b") else value
