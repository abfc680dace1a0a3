"""`plimsoll diagnose`: name the layer that limits a server, with evidence and advice.

What it is: the seed articles' four steps applied to a server's own ``/metrics``
(plimsoll or vLLM names) over a window. TTFT is split into queue time and prefill
time from the histograms' deltas; decode speed comes from TPOT (mean and p90/p50
spread); capacity from KV-cache usage, preemptions and allocation failures; a stalled
engine from scrapes where nothing runs (the batch falls to zero) while requests wait.
With the GPUs' own series (DCGM-exporter, or NVML on the replica's host;
``accelerator.py``) it also tells a GPU the CPU starves, a throttled GPU and full
device memory apart. Each layer that shows strain becomes a :class:`Finding` with its
evidence and what to change; the verdict is the root cause (KV capacity outranks the
queue it causes; a stall, throttling or a starving host outrank the slow decode they cause).
What it is not: a load generator — run load (``plimsoll bench run``) while it watches.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from plimsoll import metric_names as mn
from plimsoll.bench import accelerator
from plimsoll.bench.scrape import Snapshot, counter_delta, family_of, fetch, gauge_summary, histogram_delta

LAYERS = ("queueing", "prefill", "decode", "kv_capacity", "stall", "host", "throttling", "gpu_memory")
# Root causes first: each explains the strain the layers after it show.
ROOT_ORDER = ("kv_capacity", "stall", "throttling", "host", "gpu_memory")

# Advice names only flags the server in front of us has: plimsoll serve's own, or vLLM's.
ADVICE = {
    "queueing": [
        "requests wait for a batch slot: if KV usage leaves room, raise the batch cap (--max-num-seqs)",
        "otherwise add replicas or lower the per-replica concurrency target (see `plimsoll bench sweep`)",
        "check the router spreads requests by queue length, not round-robin",
    ],
    "prefill": [
        "prompt processing dominates TTFT: keep prefix caching on (--enable-prefix-caching) for shared prefixes",
        "a smaller --max-num-batched-tokens splits long prompts into more, shorter steps beside decode",
        "shorten prompts, or send prefill-heavy traffic to its own replicas",
    ],
    "decode_slow": [
        "decode steps are slow at this batch: a smaller batch cap (--max-num-seqs) lowers TPOT at the cost of "
        "throughput",
        "a lower-precision --dtype (bfloat16 on a GPU) cuts memory traffic per step",
    ],
    "decode_uneven": [
        "uneven TPOT usually means prefill interference: a smaller --max-num-batched-tokens keeps prompt "
        "chunks from stalling decode steps",
    ],
    "stall": [
        "the engine schedules nothing while requests wait: a KV allocation that can never succeed (a "
        "prompt bigger than the whole cache; raise the KV memory or lower --max-model-len), or an engine "
        "loop that stopped (check /health and the server log)",
    ],
    "kv_capacity": [
        "the KV cache is full: give it more memory (--kv-cache-memory-bytes, or --gpu-memory-utilization on a "
        "GPU) or lower --max-model-len",
        "lower the batch cap (--max-num-seqs) to stop preemption thrash, or add replicas",
    ],
}
# Flags both engines take (vLLM's names; plimsoll serve follows them).
ADVICE["decode_slow"].append(
    "quantise the weights (--quantization; int8 on plimsoll serve), speculative decoding "
    "(--speculative-config) or tensor parallelism across GPUs (--tensor-parallel-size)"
)
# Where the two differ: name each engine's own option only to that engine.
VLLM_EXTRA = {
    "kv_capacity": ["an fp8 KV cache (--kv-cache-dtype fp8) fits about twice the tokens of bf16"],
}


# Slow or uneven steps can be the CPU side (scheduling, sampling, detokenising, Python between kernels)
# rather than the model: a profile of the engine loop tells which (plimsoll serve only).
PROFILE_TIP = (
    "if the step time is not the model's (the CPU cannot feed the accelerator: scheduling, sampling, "
    "detokenising), profile the engine loop: `plimsoll profile --url URL --seconds 20 -o profiles/` "
    "(the server needs --enable-profiling; engine_step spans show each step and the gaps between them)"
)
PLIMSOLL_EXTRA = {
    "decode_slow": [PROFILE_TIP],
    "decode_uneven": [PROFILE_TIP],
    "kv_capacity": [
        "an int8 KV cache (--kv-cache-dtype int8) fits about twice the tokens of bf16, four times fp32"
    ],
}


def advice(cause: str, family: str | None) -> list[str]:
    extra = VLLM_EXTRA if family == "vllm" else PLIMSOLL_EXTRA
    return ADVICE[cause] + extra.get(cause, [])


@dataclass(frozen=True, slots=True)
class Thresholds:
    """When a layer counts as strained; defaults suit interactive chat."""

    queue_share: float = 0.5  # queue time / TTFT
    prefill_share: float = 0.5  # prefill time / TTFT
    ttft_high_s: float = 1.0
    # Decode is judged against a limit the user gives (an SLO) or the server's own c=1 TPOT
    # (--baseline) times tpot_inflation; no fixed number suits both a GPU and a CPU.
    tpot_limit_s: float | None = None
    tpot_limit_why: str = ""
    tpot_inflation: float = 2.0
    tpot_spread: float = 2.0  # p90 / p50 of TPOT
    kv_high: float = 0.9
    waiting_min: float = 0.5


@dataclass(slots=True)
class Finding:
    layer: str
    score: float
    evidence: list[str]
    advice: list[str]


@dataclass(slots=True)
class Diagnosis:
    verdict: str  # a layer, "none" or "no_traffic"
    engine_family: str | None
    window_s: float
    observed: dict[str, float | None]
    findings: list[Finding] = field(default_factory=list)
    summary: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.0f} ms"


def analyse(
    samples: list[Snapshot],
    th: Thresholds = Thresholds(),
    gpu_samples: list[Snapshot] | None = None,
    gpu_filter: tuple[str | None, tuple[str, ...]] = (None, ()),
) -> Diagnosis:
    """Diagnose from scrapes taken over a window (first and last bound the deltas).

    ``gpu_samples`` are scrapes of DCGM-exporter (or NVML readings in its names) over the
    same window; ``gpu_filter`` narrows them to a pod and/or GPU indices.
    """
    if len(samples) < 2:
        raise ValueError("diagnose needs at least two scrapes of /metrics")
    first, last = samples[0], samples[-1]
    fam = family_of(last)
    window = last.t - first.t
    if fam is None:
        return Diagnosis("none", None, window, {}, summary="no plimsoll or vLLM series in /metrics")
    family = "vllm" if fam.running.startswith("vllm:") else "plimsoll"
    alloc_name = mn.KV_CACHE_ALLOCATION_FAILURES if family == "plimsoll" else ""
    ttft, queue, prefill = (
        histogram_delta(first, last, n) for n in (fam.ttft, fam.queue_time, fam.prefill_time)
    )
    tpot = histogram_delta(first, last, fam.tpot)
    waiting, running, kv = (gauge_summary(samples, n) for n in (fam.waiting, fam.running, fam.kv_usage))
    obs: dict[str, float | None] = {
        "requests": ttft.count if ttft else None,
        "ttft_mean_s": ttft.mean if ttft else None,
        "queue_mean_s": queue.mean if queue else None,
        "prefill_mean_s": prefill.mean if prefill else None,
        "tpot_mean_s": tpot.mean if tpot else None,
        "tpot_p50_s": tpot.quantile(0.5) if tpot else None,
        "tpot_p90_s": tpot.quantile(0.9) if tpot else None,
        "waiting_mean": waiting["mean"] if waiting else None,
        "running_mean": running["mean"] if running else None,
        "kv_usage_max": kv["max"] if kv else None,
        "kv_usage_mean": kv["mean"] if kv else None,
        "preemptions": counter_delta(first, last, fam.preemptions),
        "kv_allocation_failures": counter_delta(first, last, alloc_name) if alloc_name else None,
    }
    judged = dict(obs, _family=family)
    if not obs["requests"] and not obs["running_mean"]:
        return Diagnosis(
            "no_traffic",
            family,
            window,
            obs,
            summary="no request ran during the window: put load on the server "
            "(e.g. `plimsoll bench run`) while diagnosing",
        )
    findings = [
        f
        for f in (
            _kv(judged, th),
            _stall(samples, fam),
            _queue(judged, th),
            _prefill(judged, th),
            _decode(judged, th),
        )
        if f
    ]
    if gpu_samples:
        gpus = accelerator.gpu_series(gpu_samples, *gpu_filter)
        obs.update(accelerator.observed(gpus))
        findings += [
            Finding(a.layer, a.score, a.evidence, a.advice)
            for a in accelerator.judge(gpus, obs["running_mean"] or 0.0, obs["waiting_mean"] or 0.0)
        ]
    findings.sort(key=lambda f: f.score, reverse=True)
    # Root causes before the strain they cause (KV exhaustion before its queue and preemptions).
    ordered = [f for layer in ROOT_ORDER for f in findings if f.layer == layer]
    ordered += [f for f in findings if f.layer not in ROOT_ORDER]
    if not ordered:
        return Diagnosis(
            "none", family, window, obs, [], "no layer is strained: the server has headroom at this load"
        )
    top = ordered[0]
    return Diagnosis(top.layer, family, window, obs, ordered, f"limited by {top.layer}: {top.evidence[0]}")


def _kv(o: dict[str, Any], th: Thresholds) -> Finding | None:
    kv_max, pre, alloc = o["kv_usage_max"] or 0.0, o["preemptions"] or 0.0, o["kv_allocation_failures"] or 0.0
    evidence = []
    if kv_max >= th.kv_high:
        evidence.append(f"KV-cache usage peaked at {kv_max:.0%} (≥ {th.kv_high:.0%})")
    if pre > 0:
        evidence.append(f"{pre:.0f} preemptions in the window (requests evicted and recomputed)")
    if alloc > 0:
        evidence.append(
            f"{alloc:.0f} KV block allocation failures (a request asked for blocks the cache did not have)"
        )
    if not evidence:
        return None
    score = 1.0 + max(0.0, kv_max - th.kv_high) * 10 + (1.0 if pre else 0.0) + (1.0 if alloc else 0.0)
    return Finding("kv_capacity", score, evidence, advice("kv_capacity", family_of_obs(o)))


def _stall(samples: list[Snapshot], fam: Any) -> Finding | None:
    """Scrapes where the batch is empty (nothing running) while requests wait: the engine is stuck."""
    stalled = [s for s in samples if (s.get(fam.running) or 0.0) == 0.0 and (s.get(fam.waiting) or 0.0) > 0.0]
    if len(stalled) < 2:  # one scrape can fall between a finished batch and the next
        return None
    share = len(stalled) / len(samples)
    waiting = max(s.get(fam.waiting) or 0.0 for s in stalled)
    return Finding(
        "stall",
        2.0 + share,
        [f"the batch fell to zero in {len(stalled)} of {len(samples)} scrapes ({share:.0%}) while up to "
         f"{waiting:.0f} requests waited"],
        ADVICE["stall"],
    )  # fmt: skip


def _ttft_part(
    o: dict[str, Any], layer: str, part: str, min_share: float, also: str | None
) -> Finding | None:
    """``layer`` strained: ``part`` (queue, prefill) is at least ``min_share`` of mean TTFT and the
    layer's own second sign, ``also``, holds (None when it does not)."""
    ttft, spent = o["ttft_mean_s"], o[f"{part}_mean_s"]
    if not ttft or spent is None or also is None or spent / ttft < min_share:
        return None
    share = spent / ttft
    return Finding(
        layer,
        1.0 + share,
        [f"{part} time is {share:.0%} of TTFT ({_ms(spent)} of {_ms(ttft)})", also],
        advice(layer, family_of_obs(o)),
    )


def _queue(o: dict[str, Any], th: Thresholds) -> Finding | None:
    waiting = o["waiting_mean"] or 0.0
    also = f"{waiting:.1f} requests waiting on average beside {o['running_mean'] or 0:.1f} running"
    return _ttft_part(o, "queueing", "queue", th.queue_share, also if waiting >= th.waiting_min else None)


def _prefill(o: dict[str, Any], th: Thresholds) -> Finding | None:
    ttft = o["ttft_mean_s"] or 0.0
    also = f"mean TTFT {_ms(ttft)} is above {_ms(th.ttft_high_s)}"
    return _ttft_part(o, "prefill", "prefill", th.prefill_share, also if ttft >= th.ttft_high_s else None)


def family_of_obs(o: dict[str, Any]) -> str | None:
    return o.get("_family")


def _decode(o: dict[str, Any], th: Thresholds) -> Finding | None:
    mean, p50, p90 = o["tpot_mean_s"], o["tpot_p50_s"], o["tpot_p90_s"]
    if mean is None:
        return None
    spread = p90 / p50 if p50 and p90 else 1.0
    evidence, tips, score = [], [], 1.0
    if th.tpot_limit_s is not None and mean >= th.tpot_limit_s:
        evidence.append(f"mean TPOT {_ms(mean)} is above {_ms(th.tpot_limit_s)} ({th.tpot_limit_why})")
        tips += advice("decode_slow", family_of_obs(o))
        score += mean / th.tpot_limit_s - 1.0
    if spread >= th.tpot_spread:
        evidence.append(f"TPOT is unstable: p90/p50 = {spread:.1f} (≥ {th.tpot_spread:g})")
        tips += [t for t in advice("decode_uneven", family_of_obs(o)) if t not in tips]
        score += spread / th.tpot_spread - 1.0
    if not evidence:
        return None
    return Finding("decode", score, evidence, tips)


async def observe(
    url: str,
    window_s: float,
    interval_s: float = 1.0,
    headers: dict[str, str] | None = None,
    on_scrape: Callable[[float], None] | None = None,
) -> list[Snapshot]:
    """Scrape ``url``/metrics every ``interval_s`` for ``window_s`` seconds; ``on_scrape(elapsed)`` after each."""
    samples: list[Snapshot] = []
    async with httpx.AsyncClient(headers=headers or {}) as http:
        start = time.monotonic()
        deadline = start + window_s
        while True:
            samples.append(await fetch(http, url))
            if on_scrape is not None:
                on_scrape(time.monotonic() - start)
            # At least two scrapes whatever the window: on a slow or busy host the first
            # scrape alone can outlast a short window, and one scrape bounds no delta.
            if time.monotonic() >= deadline and len(samples) >= 2:
                return samples
            await asyncio.sleep(min(interval_s, max(0.0, deadline - time.monotonic())))


async def observe_nvml(window_s: float, interval_s: float = 1.0) -> list[Snapshot]:
    """This host's GPUs through NVML every ``interval_s`` for ``window_s`` (in DCGM-exporter's names);
    empty when NVML or a GPU is missing."""
    from plimsoll.bench.scrape import parse_metrics

    samples: list[Snapshot] = []
    deadline = time.monotonic() + window_s
    while True:
        text = await asyncio.to_thread(accelerator.nvml_exposition)
        if text is None:
            return []
        samples.append(parse_metrics(text))
        if time.monotonic() >= deadline and len(samples) >= 2:
            return samples
        await asyncio.sleep(min(interval_s, max(0.0, deadline - time.monotonic())))


def render(d: Diagnosis) -> list[str]:
    lines = [
        f"verdict: {d.verdict} — {d.summary}",
        f"engine family: {d.engine_family}; window {d.window_s:.1f} s",
    ]
    for f in d.findings:
        lines.append(f"[{f.layer}] score {f.score:.2f}")
        lines.extend(f"  evidence: {e}" for e in f.evidence)
        lines.extend(f"  change: {a}" for a in f.advice)
    shown = {k: v for k, v in d.observed.items() if v is not None}
    lines.append("observed: " + ", ".join(f"{k}={v:.3g}" for k, v in shown.items()))
    return lines
