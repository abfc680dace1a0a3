"""Split prefill and decode onto separate replicas, or not: the verdict, measured or predicted, with its reasons.

What it is: pure arithmetic shared by ``plimsoll bench disagg`` (which measures each layout on the
replicas at hand), ``plimsoll plan`` (which predicts each layout from one replica's profile and a
link bandwidth) and the operator (which says in ``status.disaggregation`` which layout it runs and
why), so "split pays" means one thing everywhere.

- A *layout* is aggregated (every replica prefills and decodes) or a ratio ``pP:dD`` (``p``
  replicas prefill, ``d`` decode, the KV blocks of each prompt moving between them).
- The figure compared is **goodput per replica**: requests per second that meet the TTFT and TPOT
  SLOs, divided by the replicas the layout uses, so layouts of different sizes compare fairly.
- :func:`verdict` puts the best split against aggregated in one of three categories: ``split``
  (ahead by more than the noise band), ``aggregated`` (behind by more than it) or ``no clear gain``
  (inside it: stay aggregated, the simpler layout). The band is ``margin`` (10%), widened, when
  each layout was measured several times (A B, B A repeats), to twice the standard error of the
  repeats' paired differences: a layout wins only where the measurement can tell. The reasons name
  each layout's goodput, TTFT and TPOT, the KV transfer per request and the band.
- :func:`predict`, from a :class:`ServiceProfile` (one replica's prefill rate, its decode step time
  against the sequences decoded together, KV bytes per token), a KV transfer time (a link
  bandwidth, measured or configured) and the per-replica concurrencies the workload runs at: what a
  replica of each layout does at that operating point, as a closed loop solved to its fixed point.
  With ``s = I/P`` seconds to prefill ``I`` prompt tokens, ``t(b)`` the step at ``b`` sequences and
  ``O − 1`` decode steps per request:

  *Aggregated*, ``c`` requests per replica: the other ``c − 1`` requests' prefills take a share
  ``u = X·s·(c−1)/c`` of the replica (``X`` its requests/s) and stall a request's decode while they
  run, so its decode lasts ``D = (O−1)·t(b)/(1−u)``; a prompt waits ``u·s/(2(1−u))`` behind others'
  prefills; ``X = c/(s + wait + t + D)`` with ``b = X·D``. A request meets the TPOT SLO when at
  most ``k = ⌊(SLO − t)·(O−1)/s⌋`` other prefills land in its decode (a Poisson count of mean
  ``u·D/s``): one stall of a long prompt is spread over only ``O − 1`` tokens.

  *Split* ``p:d`` (``n = c·(p+d)`` requests in flight): prefills queue on the prefill pool only
  (share ``ρ = X·s/p``), each prompt's KV moves in ``T``, decodes run at ``t(b)`` with ``b = X·D/d``;
  ``X = n/(s + wait + T + r + t + (O−1)·t)``, capped by ``p/s`` and ``p/T``. Only whole blocks move
  (the tokens before the prompt's last, in blocks of ``B``): the rest, ``r = (I − B·⌊(I−1)/B⌋)/P``,
  is prefilled again on the decode replica, where it stalls the decodes as a pull does — half of a
  32-token prompt at ``B`` = 16. Where the replicas' own
  cores pack, send, receive and unpack the blocks (``pull_stall`` = 1: CPU replicas, whose transfer
  threads take the cores their steps run on), each request's transfer costs both sides compute: the
  producer ``Cp``, the consumer ``Cc`` — the CPU time each side's threads spent on it, as
  ``plimsoll bench disagg`` measures it (``transfer_cpu_s``); without a measurement, the wall time
  ``T`` for each, an upper bound (a pull's wall time also holds the other side's work and the
  wire). The prefill replica spends ``s + Cp`` per request (``ρ = X·(s+Cp)/p``, the cap
  ``p/(s+Cp)``); on the decode replica each pull stalls the decodes as a prefill does on an
  aggregated replica: share ``v = X·Cc/d``, ``D = (O−1)·t(b)/(1−v)``, the TPOT SLO met when at most
  ``⌊(SLO − t)·(O−1)/Cc⌋`` pulls land in a decode (Poisson, mean ``v·D/Cc``). Where a copy engine
  moves them beside the kernels (a GPU), ``pull_stall`` = 0: neither.

  Each request also spends ``o`` outside prefill and decode (HTTP, tokenizing, scheduling, whatever
  stands before the engine: a profiled request's TTFT at one in flight less its prefill and one step);
  a split request is two requests, prefill then decode, and pays ``2·o`` in its TTFT and its cycle.

  Where other processes share the replicas' cores (the load generator and the router of a benchmark
  on one host), the CPU ``h`` they take per request is charged too: aggregated, each replica keeps
  ``1 − X·h`` of its core (``X`` per replica) and computes that much slower; split, the scheduler
  gives them the prefill replicas' idle time first (``p·(1 − ρ)``) and the rest from the decode
  replicas', each side slowed by the share it gives. On a cluster they run elsewhere: ``h`` = 0.

  A request meets the TTFT SLO when the prompts ahead of it fit (``P(j ahead) ≈ ρ^j``). Goodput is
  ``X`` × the share meeting both SLOs, at the best of the given concurrencies (as the bench takes a
  layout's best level). Splitting pays only where the stalls cost an aggregated replica more than
  the split's idle capacity and transfer cost it: at one request per replica nothing stalls.

What it is not: a simulator (mean values, no distributions beyond the stall count and prompts
ahead) or I/O.
"""

from __future__ import annotations

import itertools
import math
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from plimsoll.kv_memory import DEFAULT_BLOCK_SIZE

MARGIN = 0.10  # the least a layout must win by: what a re-run on a quiet host moves
AGGREGATED = "aggregated"
SPLIT = "split"
NO_CLEAR_GAIN = "no clear gain"


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
    transfer_s: float | None = None  # KV transfer per request (split layouts): wall time
    transfer_bytes: float | None = None
    # CPU time the transfer took each side's threads per request (measured; CPU replicas).
    transfer_cpu_producer_s: float | None = None
    transfer_cpu_consumer_s: float | None = None
    replica_cpu_s: float | None = None  # measured: all its replicas' process CPU per request
    # Measured: the bench process's own CPU per request (its load generator and the router it runs):
    # on a host where it shares the replicas' cores, what it takes from them.
    bench_cpu_s: float | None = None
    prefill_replicas: int = 0
    decode_replicas: int = 0
    limited_by: str | None = None  # predictions: the operating point and what caps the goodput
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
    category: str = AGGREGATED  # SPLIT, AGGREGATED (the split loses) or NO_CLEAR_GAIN (stay aggregated)
    band: float = MARGIN  # the noise band the difference was judged against

    @property
    def runs(self) -> str:
        """What to run, in one word: ``aggregated`` or the ratio."""
        return self.ratio if self.ratio is not None else AGGREGATED

    def to_dict(self) -> dict[str, Any]:
        return {"choice": self.choice, "ratio": self.ratio, "category": self.category, "band": self.band,
                "reasons": list(self.reasons), "layouts": [lay.to_dict() for lay in self.layouts]}  # fmt: skip


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
        if lay.transfer_cpu_producer_s is not None and lay.transfer_cpu_consumer_s is not None:
            text += (f" (CPU {_ms(lay.transfer_cpu_producer_s)} on the prefill side, "
                     f"{_ms(lay.transfer_cpu_consumer_s)} on the decode side)")  # fmt: skip
    if lay.limited_by:
        text += f" ({lay.limited_by})"
    return text


def noise_band(
    agg_runs: Sequence[float], split_runs: Sequence[float], margin: float = MARGIN
) -> tuple[float, str]:
    """The band a layout must win by: ``margin``, or twice the standard error of the paired repeats' difference.

    ``agg_runs``/``split_runs``: goodput per replica of each repeat, in the order they ran (repeat ``i``
    of one beside repeat ``i`` of the other). Differences are relative to aggregated's mean (the
    split's when aggregated served nothing).
    """
    pairs = list(zip(agg_runs, split_runs, strict=True))
    what = f"{margin:.0%}"
    if len(pairs) < 2:
        return margin, what
    ref = statistics.fmean(agg_runs) or statistics.fmean(split_runs)
    if ref <= 0:
        return margin, what
    diffs = [(s - a) / ref for a, s in pairs]
    spread = 2 * statistics.stdev(diffs) / math.sqrt(len(diffs))
    if spread <= margin:
        return margin, f"{what} (the {len(pairs)} repeats' spread, ±{spread:.0%}, is inside it)"
    return spread, f"±{spread:.0%}: twice the standard error of the {len(pairs)} repeats' paired differences"


def verdict(
    layouts: Sequence[LayoutFigures],
    margin: float = MARGIN,
    repeats: Mapping[str, Sequence[float]] | None = None,
) -> Verdict:
    """Split at the best ratio only when it beats aggregated by more than the noise band (see the module docstring).

    ``repeats``: each layout's goodput per replica in each repeat, when it was measured several times.
    """
    agg = next((lay for lay in layouts if lay.layout == AGGREGATED), None)
    splits = [lay for lay in layouts if lay.layout != AGGREGATED]
    if agg is None or not splits:
        raise ValueError("a verdict compares the aggregated layout with at least one split ratio")
    best = max(splits, key=lambda lay: lay.goodput_per_replica)
    reasons = [_describe(agg), *(_describe(lay) for lay in splits)]
    base, alt = agg.goodput_per_replica, best.goodput_per_replica
    band, band_text = margin, f"{margin:.0%}"
    if repeats and AGGREGATED in repeats and best.layout in repeats:
        band, band_text = noise_band(repeats[AGGREGATED], repeats[best.layout], margin)
    ref = base if base > 0 else alt
    gain = (alt - base) / ref if ref > 0 else 0.0

    def done(category: str) -> Verdict:
        choice = "split" if category == SPLIT else AGGREGATED
        return Verdict(
            choice, best.layout if choice == "split" else None, reasons, list(layouts), category, band
        )

    if gain > band:
        reasons.append(
            f"split {best.layout}: {gain * 100:.0f}% more good requests per replica than aggregated, beyond "
            f"the noise band ({band_text})"
            if base > 0
            else f"split {best.layout}: {alt:.3g} good req/s per replica where aggregated serves none within the SLO"
        )
        why = _why_split(agg, best)
        if why:
            reasons.append(why)
        return done(SPLIT)
    if gain >= -band:
        reasons.append(
            f"{NO_CLEAR_GAIN}: stay aggregated (simpler): the best split ({best.layout}) is {gain * 100:+.0f}% "
            f"({alt:.3g} vs {base:.3g} good req/s per replica), inside the noise band ({band_text})"
        )
        return done(NO_CLEAR_GAIN)
    reasons.append(
        f"aggregated: the best split ({best.layout}) serves {-gain * 100:.0f}% fewer good requests per replica, "
        f"beyond the noise band ({band_text})"
    )
    why = _why_not_split(agg, best)
    if why:
        reasons.append(why)
    return done(AGGREGATED)


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
    return "; ".join(parts) or None


# -- prediction -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ServiceProfile:
    """One replica as profiling measured it."""

    prefill_tokens_per_s: float  # prompt tokens/s while prefilling
    decode_sequences: float  # sequences decoded together within the TPOT SLO (the knee)
    decode_tpot_s: float  # TPOT at that many sequences
    kv_bytes_per_token: float
    # (sequences, decode step seconds) as measured, ascending; empty: the knee's TPOT at the knee.
    step_s: tuple[tuple[float, float], ...] = ()
    # Per-replica concurrencies the workload runs at; empty: the knee.
    levels: tuple[float, ...] = ()
    # A request's time outside its prefill and decode steps, end to end (HTTP, tokenizing, scheduling, and
    # whatever stands between the client and the engine): one request alone's TTFT less its prefill and
    # one step. A split request is two requests (prefill, then decode), so it pays this twice.
    request_overhead_s: float = 0.0
    # The engine's KV block: a split moves whole blocks only, the decode side prefills the rest itself.
    block_size: int = DEFAULT_BLOCK_SIZE

    def moved_tokens(self, input_tokens: float) -> float:
        return moved_tokens(input_tokens, self.block_size)

    def step_at(self, batch: float) -> float:
        """The decode step at ``batch`` sequences: linear between measured points, the last slope beyond."""
        points = sorted(dict(self.step_s).items()) or [(self.decode_sequences, self.decode_tpot_s)]
        if len(points) == 1 or batch <= points[0][0]:
            return points[0][1]
        for (b0, t0), (b1, t1) in itertools.pairwise(points):
            if batch <= b1:
                return t0 + (t1 - t0) * (batch - b0) / (b1 - b0)
        (b0, t0), (b1, t1) = points[-2], points[-1]
        return t1 + max(0.0, (t1 - t0) / (b1 - b0)) * (batch - b1)


def moved_tokens(input_tokens: float, block_size: int = DEFAULT_BLOCK_SIZE) -> float:
    """Prompt tokens whose KV moves in a split: the whole blocks before the last token (the decode side
    computes the last token itself, to produce the first output token)."""
    return max(0.0, math.floor((input_tokens - 1) / block_size) * block_size)


@dataclass(frozen=True, slots=True)
class OperatingPoint:
    """A layout's closed loop solved at one concurrency (all its replicas together)."""

    concurrency: float  # per replica
    requests_per_s: float
    good_share: float  # of requests meeting both SLOs
    ttft_s: float
    tpot_s: float
    prefill_busy: float  # share of a prefilling replica's time spent on prompts
    batch: float  # sequences per decode step
    stalled_share: float = 0.0  # requests whose decode sees another prompt's prefill (split: another's pull)

    @property
    def goodput_rps(self) -> float:
        return self.requests_per_s * self.good_share


def _poisson_cdf(k: int, mean: float) -> float:
    if k < 0:
        return 0.0
    term = total = math.exp(-mean)
    for i in range(1, k + 1):
        term *= mean / i
        total += term
    return min(1.0, total)


def _queue_wait(rho_other: float, service_s: float, servers: int, in_flight: float) -> float:
    """Mean wait behind others' prompts (M/D/p-like, at most everyone else's prompt ahead)."""
    rho = min(rho_other, 0.99)
    wait = rho**servers * service_s / (2 * servers * (1 - rho))
    return min(wait, max(0.0, in_flight - 1) * service_s / servers)


def _ttft_share(
    base_s: float, slo_s: float | None, rho_other: float, per_prompt_s: float, in_flight: float
) -> float:
    """Share of requests whose TTFT meets the SLO: ``j`` prompts ahead with probability ``≈ ρ^j``, and
    never more than the other requests in flight."""
    if slo_s is None:
        return 1.0
    if base_s > slo_s:
        return 0.0
    ahead = math.floor((slo_s - base_s) / per_prompt_s) if per_prompt_s > 0 else 10**6
    if ahead >= in_flight - 1:
        return 1.0
    return 1.0 - min(0.99, rho_other) ** (ahead + 1)


def aggregated_at(
    profile: ServiceProfile, input_tokens: float, output_tokens: float, c: float,
    ttft_slo_s: float | None = None, tpot_slo_s: float | None = None, host_cpu_s: float = 0.0,
) -> OperatingPoint:  # fmt: skip
    """One aggregated replica with ``c`` requests in flight (the module docstring's closed loop);
    ``host_cpu_s``: CPU seconds per request other processes take from the replicas' cores (see
    :func:`predict`), shared by every replica alike: each computes at ``1 − X·h`` of its core."""
    s0, steps = input_tokens / profile.prefill_tokens_per_s, max(0.0, output_tokens - 1)
    o = profile.request_overhead_s
    others = max(0.0, (c - 1) / c)
    t = profile.step_at(c)
    x = c / (o + s0 + t + steps * t)
    s, u, wait, decode, f = s0, 0.0, 0.0, 0.0, 1.0
    for _ in range(200):  # damped fixed point; converges in tens of steps
        f = 1.0 - min(0.9, x * host_cpu_s)  # the share of its core the replica keeps
        s = s0 / f
        u = min(0.99, x * s * others)
        decode = steps * t / f / (1 - u)
        batch = min(max(1.0, x * decode), max(1.0, c))
        t = profile.step_at(batch)
        wait = _queue_wait(u, s, 1, c)
        x = 0.5 * x + 0.5 * c / (o + s + wait + t / f + decode)
    te = t / f
    batch = min(max(1.0, x * decode), max(1.0, c))
    stalls = u * decode / s if s > 0 else 0.0  # other prompts prefilled during one request's decode
    tpot_share = _stall_share(tpot_slo_s, te, steps, s, stalls)
    good = tpot_share * _ttft_share(o + s + te, ttft_slo_s, u, s, c)
    return OperatingPoint(c, x, good, o + s + wait + te, te + (stalls * s / steps if steps else 0.0),
                          min(1.0, x * s), batch, 1.0 - math.exp(-stalls))  # fmt: skip


def _stall_share(tpot_slo_s: float | None, t: float, steps: float, stall_s: float, stalls: float) -> float:
    """Share of requests meeting the TPOT SLO when a decode of ``steps`` steps at ``t`` meets a Poisson
    count (mean ``stalls``) of ``stall_s`` stalls: at most ``⌊(SLO − t)·steps/stall_s⌋`` may land in it."""
    if tpot_slo_s is None or steps == 0:
        return 1.0
    if tpot_slo_s < t:
        return 0.0
    allowed = math.floor((tpot_slo_s - t) * steps / stall_s) if stall_s > 0 else 10**6
    return _poisson_cdf(allowed, stalls)


def split_at(
    profile: ServiceProfile, input_tokens: float, output_tokens: float, c: float, ratio: Ratio,
    transfer_s: float, ttft_slo_s: float | None = None, tpot_slo_s: float | None = None,
    pull_stall: float = 0.0, transfer_cpu_s: tuple[float, float] | None = None, host_cpu_s: float = 0.0,
) -> OperatingPoint:  # fmt: skip
    """A ``p:d`` layout with ``c`` requests in flight per replica: prefill pool, transfer, decode pool.

    ``pull_stall``: the share of each transfer's cost that takes its replicas' compute (1 where their own
    cores move the blocks, 0 beside a copy engine); the cost is ``transfer_cpu_s`` (producer, consumer:
    CPU seconds per request, measured) or, without it, ``transfer_s`` (the wall time) on each side.
    ``host_cpu_s``: CPU seconds per request other processes take from the replicas' cores (see
    :func:`predict`): first from the prefill replicas' idle time, the rest from the decode replicas."""
    s0, steps = input_tokens / profile.prefill_tokens_per_s, max(0.0, output_tokens - 1)
    # The prompt's tail past its last whole block is prefilled again on the decode replica.
    tail0 = (input_tokens - profile.moved_tokens(input_tokens)) / profile.prefill_tokens_per_s
    o = 2 * profile.request_overhead_s  # two requests: the prefill hop's and the decode hop's
    p, d = ratio.prefill, ratio.decode
    n = c * ratio.replicas
    others = max(0.0, (n - 1) / n)
    send_cpu, receive_cpu = transfer_cpu_s if transfer_cpu_s is not None else (transfer_s, transfer_s)
    t = profile.step_at(n / d)
    x = min(p / (s0 + pull_stall * send_cpu), n / (o + s0 + transfer_s + tail0 + t + steps * t))
    rho = wait = v = 0.0
    fp = fd = 1.0  # the share of their cores the prefill and the decode replicas keep
    s, tail_s, stall_s, per_prompt, cap = s0, tail0, pull_stall * receive_cpu + tail0, s0, math.inf
    decode = steps * t
    for _ in range(200):
        # What one request takes each side: the prompt and serving the pull on a prefill replica; the
        # pull and the tail on a decode replica (it stalls the decodes there as a prefill would).
        s, tail_s = s0 / fp, tail0 / fd
        send_s, stall_s = pull_stall * send_cpu / fp, pull_stall * receive_cpu / fd + tail_s
        per_prompt = s + send_s
        cap = min(p / per_prompt, p / transfer_s if transfer_s > 0 else math.inf)
        rho = min(0.99, x * per_prompt / p)
        v = min(0.99, x * stall_s / d)  # the decode replicas' time taken by pulls and tails
        decode = steps * t / fd / (1 - v)
        batch = min(max(1.0, x * decode / d), max(1.0, n / d))
        t = profile.step_at(batch)
        wait = _queue_wait(rho * others, per_prompt, p, n)
        x = min(cap, 0.5 * x + 0.5 * n / (o + wait + s + transfer_s + tail_s + t / fd + decode))
        host = x * host_cpu_s
        on_prefill = min(host, 0.9 * p * (1 - rho))
        fp, fd = 1.0 - on_prefill / p, 1.0 - min(0.9, (host - on_prefill) / d)
    te = t / fd
    first = s + transfer_s + tail_s + te  # one request alone: prefill, its blocks, the tail, the first step
    batch = min(max(1.0, x * decode / d), max(1.0, n / d))
    stalls = v * decode / stall_s if stall_s > 0 else 0.0  # other requests' pulls and tails during one decode
    tpot_share = _stall_share(tpot_slo_s, te, steps, stall_s, stalls)
    good = tpot_share * _ttft_share(o + first, ttft_slo_s, rho * others, per_prompt / p, n)
    tpot = te + (stalls * stall_s / steps if steps else 0.0)
    return OperatingPoint(c, x, good, o + wait + first, tpot, rho, batch, 1.0 - math.exp(-stalls))


def predict(
    profile: ServiceProfile,
    input_tokens: float,
    output_tokens: float,
    link_bytes_per_s: float,
    ratios: Iterable[Ratio],
    ttft_slo_s: float | None = None,
    tpot_slo_s: float | None = None,
    levels: Sequence[float] | None = None,
    pull_stall: float = 0.0,
    transfer_cpu_s: tuple[float, float] | None = None,
    host_cpu_s: Mapping[str, float] | None = None,
) -> list[LayoutFigures]:
    """Goodput per layout from ``profile`` at its best of ``levels`` (per-replica concurrencies; default the
    profile's), the KV transfer taking the moved tokens' ``kv bytes / link`` (see the module docstring for
    the model); ``pull_stall`` and ``transfer_cpu_s`` (producer, consumer CPU seconds per request) as
    :func:`split_at` (use :func:`pull_stall_for`). ``host_cpu_s``, by layout name: CPU seconds per
    request that other processes take from the replicas' own cores — the load generator and the router
    where they share a host with the replicas, as ``plimsoll bench disagg`` measures them (its
    ``bench_cpu_s``); none on a cluster, where they run elsewhere."""
    if not 0.0 <= pull_stall <= 1.0:
        raise ValueError(
            f"pull_stall {pull_stall!r}: the share of a pull that stalls decoding is within [0, 1]"
        )
    if transfer_cpu_s is not None and (len(transfer_cpu_s) != 2 or min(transfer_cpu_s) < 0):
        raise ValueError(
            f"transfer CPU {transfer_cpu_s!r}: give the producer's and the consumer's CPU seconds per request, "
            "each zero or more"
        )
    if min(profile.prefill_tokens_per_s, profile.decode_sequences, profile.decode_tpot_s, input_tokens,
           output_tokens, link_bytes_per_s) <= 0 or any(t <= 0 for _, t in profile.step_s):  # fmt: skip
        raise ValueError(
            "predicting a layout needs positive rates, sequences, TPOT, token counts and link bandwidth"
        )
    levels = tuple(levels or profile.levels or (profile.decode_sequences,))
    if min(levels) <= 0:
        raise ValueError("the concurrencies a workload runs at must be positive")
    transfer_bytes = profile.moved_tokens(input_tokens) * profile.kv_bytes_per_token
    transfer_s = transfer_bytes / link_bytes_per_s
    host = dict(host_cpu_s or {})
    if any(not (v >= 0 and math.isfinite(v)) for v in host.values()):
        raise ValueError(f"host CPU {host!r}: CPU seconds per request are zero or more")
    out = []
    h = host.get(AGGREGATED, 0.0)
    points = [
        aggregated_at(profile, input_tokens, output_tokens, c, ttft_slo_s, tpot_slo_s, h) for c in levels
    ]
    best = max(points, key=lambda pt: pt.goodput_rps)
    out.append(_figures(AGGREGATED, 1, best, ttft_slo_s, tpot_slo_s, (
        f"c={best.concurrency:g} per replica: prefill {best.prefill_busy:.0%} of the time, decode batch "
        f"{best.batch:.2g} at {_ms(profile.step_at(best.batch))} a step, {best.stalled_share:.0%} of requests "
        "stalled in decode by another prompt's prefill" + _host_said(h, best.requests_per_s, "each replica's core")
    )))  # fmt: skip
    for r in ratios:
        h = host.get(r.name, 0.0)
        points = [split_at(profile, input_tokens, output_tokens, c, r, transfer_s, ttft_slo_s, tpot_slo_s,
                           pull_stall, transfer_cpu_s, h) for c in levels]  # fmt: skip
        best = max(points, key=lambda pt: pt.goodput_rps)
        stalled = (
            f", {best.stalled_share:.0%} of decodes stalled by another request's pull" if pull_stall else ""
        )
        lay = _figures(r.name, r.replicas, best, ttft_slo_s, tpot_slo_s, (
            f"c={best.concurrency:g} per replica: prefill pool busy {best.prefill_busy:.0%}, decode batch "
            f"{best.batch:.2g} at {_ms(best.tpot_s)} a token, KV transfer {_ms(transfer_s)} for "
            f"{profile.moved_tokens(input_tokens):.0f} of {input_tokens:.0f} prompt tokens (the rest prefilled "
            f"again on the decode replica), "
            f"{transfer_charge(transfer_s, pull_stall, transfer_cpu_s)}{stalled}"
            + _host_said(h, best.requests_per_s, "a core, the prefill replicas' idle time first")
        ))  # fmt: skip
        lay.transfer_s, lay.transfer_bytes = transfer_s, transfer_bytes
        if transfer_cpu_s is not None:
            lay.transfer_cpu_producer_s, lay.transfer_cpu_consumer_s = transfer_cpu_s
        lay.prefill_replicas, lay.decode_replicas = r.prefill, r.decode
        out.append(lay)
    return out


def _host_said(host_cpu_s: float, requests_per_s: float, whose: str) -> str:
    if not host_cpu_s:
        return ""
    return (f", other processes taking {_ms(host_cpu_s)} of CPU per request from the replicas' cores "
            f"({requests_per_s * host_cpu_s:.2f} of {whose})")  # fmt: skip


def transfer_charge(transfer_s: float, pull_stall: float, transfer_cpu_s: tuple[float, float] | None) -> str:
    """Which figure the prediction charged to the replicas' compute for each transfer, in words."""
    if pull_stall == 0:
        return "not charged to the replicas' compute (a copy engine moves the blocks)"
    share = "" if pull_stall == 1 else f"{pull_stall:.0%} of "
    if transfer_cpu_s is None:
        return (f"charged {share}its wall time {_ms(transfer_s)} to each side's compute (the transfer's CPU time "
                "was not measured)")  # fmt: skip
    return (f"charged {share}its measured CPU time: {_ms(transfer_cpu_s[0])} to the prefill side, "
            f"{_ms(transfer_cpu_s[1])} to the decode side")  # fmt: skip


def pull_stall_for(gpus_per_replica: int) -> float:
    """How much of a KV pull takes its two replicas' compute: all of it on CPU replicas (packing, sending,
    receiving and unpacking run on the cores that prefill and decode), none on GPUs (a copy engine moves
    blocks beside the kernels)."""
    return 0.0 if gpus_per_replica > 0 else 1.0


def _figures(
    name: str, replicas: int, pt: OperatingPoint, ttft_slo_s: float | None, tpot_slo_s: float | None, how: str
) -> LayoutFigures:
    lay = LayoutFigures(name, replicas, pt.goodput_rps, ttft_p50_s=pt.ttft_s, ttft_p95_s=pt.ttft_s,
                        tpot_p50_s=pt.tpot_s, limited_by=how)  # fmt: skip
    if pt.good_share < 0.995:
        missed = []
        if ttft_slo_s is not None:
            missed.append(f"TTFT SLO {_ms(ttft_slo_s)}")
        if tpot_slo_s is not None:
            missed.append(f"TPOT SLO {_ms(tpot_slo_s)}")
        lay.limited_by = f"{how}; {pt.good_share:.0%} of requests within the {' and '.join(missed) or 'SLOs'}"
    return lay


def profile_from_report(
    report: Mapping[str, Any],
    kv_bytes_per_token: float,
    tpot_slo_s: float | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> ServiceProfile:
    """A :class:`ServiceProfile` from a `plimsoll bench sweep` report of one replica.

    Prefill rate: the server's prompt tokens per second of prefill at the lowest level (scraped by the
    bench), else mean prompt tokens ÷ TTFT p50 there (a prompt alone on the replica, end to end).
    Decode: the highest level whose TPOT p50 meets ``tpot_slo_s`` (every level without one), and that
    TPOT; the step time at each level's concurrency is its ITL p50 (the median gap between tokens: a
    decode step, where the TPOT also carries the prefill stalls the model adds back itself), else its
    TPOT p50; the report's concurrencies are the levels the prediction runs at. The request overhead:
    at one request in flight with a scraped prefill rate, the TTFT p50 less the prompt's prefill and
    one step (what the request spent outside the engine's compute). ``ValueError`` when the report
    lacks them.
    """
    levels = [lv for lv in report.get("levels", []) if lv.get("valid") and lv.get("concurrency")]
    if not levels:
        raise ValueError("the report has no valid concurrency level")
    levels.sort(key=lambda lv: lv["concurrency"])
    lowest = levels[0]
    # The server's own prefill rate when the report scraped it; else a prompt alone, end to end.
    rate = (((lowest.get("server") or {}).get("load")) or {}).get("prefill_tokens_per_s")
    scraped = bool(rate)
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

    def step_of(lv: Mapping[str, Any]) -> float | None:
        value = ((lv.get("latency_ms") or {}).get("itl") or {}).get("p50")
        return value / 1e3 if value else tpot_of(lv)

    steps = tuple((float(lv["concurrency"]), s) for lv in levels if (s := step_of(lv)) is not None)
    profile = ServiceProfile(float(rate), float(best["concurrency"]), tpot_of(best) or 0.0, kv_bytes_per_token,
                             step_s=steps, levels=tuple(float(lv["concurrency"]) for lv in levels),
                             block_size=block_size)  # fmt: skip
    return replace(profile, request_overhead_s=_request_overhead(lowest, profile, scraped=scraped))


def _request_overhead(lowest: Mapping[str, Any], profile: ServiceProfile, *, scraped: bool) -> float:
    """The lowest level's TTFT p50 less its prefill and one step (0 where it is not one request at a time,
    or the prefill rate was itself read off that TTFT)."""
    prompt = (lowest.get("tokens") or {}).get("prompt_mean")
    ttft = ((lowest.get("latency_ms") or {}).get("ttft") or {}).get("p50")
    if not scraped or lowest.get("concurrency") != 1 or not prompt or not ttft:
        return 0.0
    return max(0.0, float(ttft) / 1e3 - float(prompt) / profile.prefill_tokens_per_s - profile.step_at(1))


def parse_bandwidth(text: str) -> float:
    """``10GB/s``, ``25Gbit/s``, ``400Gbps``, ``1.5GiB/s`` -> bytes per second."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kKmMgGtT]?)(i?)(B|bit|b)(?:/s|ps)?\s*", text)
    if not m:
        raise ValueError(f"link bandwidth {text!r}: write e.g. 10GB/s, 25Gbit/s or 400Gbps")
    scale = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}[m[2].lower()]
    value = float(m[1]) * float((1024 if m[3] else 1000) ** scale)
    return value / 8 if m[4] in ("bit", "b") else value
