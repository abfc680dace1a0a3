"""The accelerator's side of `plimsoll diagnose`: GPU series from DCGM-exporter (or NVML) over a window.

What it is: per-GPU time series read from NVIDIA DCGM-exporter's ``/metrics`` (its
default counters and the DCP ones: ``DCGM_FI_DEV_GPU_UTIL``, ``DCGM_FI_DEV_FB_USED``/
``DCGM_FI_DEV_FB_FREE``, ``DCGM_FI_DEV_GPU_TEMP``, ``DCGM_FI_DEV_POWER_USAGE``,
``DCGM_FI_DEV_SM_CLOCK``, ``DCGM_FI_PROF_GR_ENGINE_ACTIVE``, and where configured
``DCGM_FI_DEV_CLOCKS_EVENT_REASONS`` — ``DCGM_FI_DEV_CLOCK_THROTTLE_REASONS`` before
DCGM 3.3 — and the ``*_VIOLATION`` counters), or the same readings taken through NVML
on the replica's own host; and the findings the seed articles' step 3 names:

- ``host``: utilisation flapping around a low mean while requests run or wait — the
  CPU (scheduling, sampling, detokenising, Python between kernels) starves the GPU;
- ``throttling``: clocks held down by power or temperature (clock-event reasons,
  violation counters, or a hot GPU whose SM clock sags under load);
- ``gpu_memory``: device memory nearly full.

A series may be narrowed to one replica's GPUs by the exporter's ``pod`` label (it
sets ``namespace``/``pod``/``container`` when pod mapping is on) or by ``gpu`` index.
What it is not: the server-side analysis (``diagnose.py``), or a Prometheus client —
it reads the exporter's endpoint directly, as diagnose reads the server's.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from plimsoll.bench.scrape import Snapshot

GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"  # %
GR_ENGINE_ACTIVE = "DCGM_FI_PROF_GR_ENGINE_ACTIVE"  # ratio (DCP)
FB_USED = "DCGM_FI_DEV_FB_USED"  # MiB
FB_FREE = "DCGM_FI_DEV_FB_FREE"  # MiB
GPU_TEMP = "DCGM_FI_DEV_GPU_TEMP"  # °C
POWER_USAGE = "DCGM_FI_DEV_POWER_USAGE"  # W
SM_CLOCK = "DCGM_FI_DEV_SM_CLOCK"  # MHz
CLOCK_EVENT_REASONS = ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS")  # bitmask
POWER_VIOLATION = "DCGM_FI_DEV_POWER_VIOLATION"  # µs, counter
THERMAL_VIOLATION = "DCGM_FI_DEV_THERMAL_VIOLATION"  # µs, counter
# NVML's clocks-event reason bits that slow a loaded GPU (idle, application and display clocks do not).
SLOWDOWN_BITS = {
    0x4: "software power cap",
    0x8: "hardware slowdown",
    0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "hardware power brake",
}
DCGM_SERIES = (
    GPU_UTIL,
    GR_ENGINE_ACTIVE,
    FB_USED,
    FB_FREE,
    GPU_TEMP,
    POWER_USAGE,
    SM_CLOCK,
    *CLOCK_EVENT_REASONS,
)


@dataclass(frozen=True, slots=True)
class AcceleratorThresholds:
    """When the accelerator counts as the limit."""

    starved_util_mean: float = 0.6  # mean busy ratio below this while work waits or runs ...
    starved_flap: float = 0.35  # ... and its coefficient of variation above this: the CPU starves it
    throttled_share: float = 0.2  # share of samples with a slowdown reason
    hot_c: float = 85.0  # GPU temperature treated as thermal pressure
    clock_sag: float = 0.1  # SM clock this far below its window max while hot or at the power cap
    memory_full: float = 0.95  # FB used / total


@dataclass(slots=True)
class GPUSeries:
    """One GPU's readings over the window (values in the exporter's units; busy as a 0–1 ratio)."""

    gpu: str
    model: str = ""
    busy: list[float] = field(default_factory=list)
    fb_used_mib: list[float] = field(default_factory=list)
    fb_free_mib: list[float] = field(default_factory=list)
    temp_c: list[float] = field(default_factory=list)
    power_w: list[float] = field(default_factory=list)
    sm_clock_mhz: list[float] = field(default_factory=list)
    reasons: list[int] = field(default_factory=list)
    violation_us: dict[str, tuple[float, float]] = field(default_factory=dict)  # name -> (first, last)


def _matches(labels: dict[str, str], pod: str | None, gpus: Sequence[str]) -> bool:
    if pod is not None and labels.get("pod") != pod:
        return False
    return not gpus or labels.get("gpu") in gpus


def gpu_series(
    samples: Sequence[Snapshot], pod: str | None = None, gpus: Sequence[str] = ()
) -> list[GPUSeries]:
    """Per-GPU series from DCGM-exporter scrapes; empty when none of its series is there."""
    by_gpu: dict[str, GPUSeries] = {}

    def rows(snap: Snapshot, name: str) -> list[tuple[dict[str, str], float]]:
        return [(labels, v) for labels, v in snap.scrape.samples.get(name, []) if _matches(labels, pod, gpus)]

    def series(labels: dict[str, str]) -> GPUSeries:
        key = labels.get("UUID") or labels.get("gpu", "?")
        if key not in by_gpu:
            by_gpu[key] = GPUSeries(gpu=labels.get("gpu", key), model=labels.get("modelName", ""))
        return by_gpu[key]

    for snap in samples:
        # DCP's engine-active ratio is the better busy figure where the exporter has it.
        busy_name = GR_ENGINE_ACTIVE if snap.scrape.samples.get(GR_ENGINE_ACTIVE) else GPU_UTIL
        for labels, v in rows(snap, busy_name):
            series(labels).busy.append(v if busy_name == GR_ENGINE_ACTIVE else v / 100.0)
        for name, attr in (
            (FB_USED, "fb_used_mib"),
            (FB_FREE, "fb_free_mib"),
            (GPU_TEMP, "temp_c"),
            (POWER_USAGE, "power_w"),
            (SM_CLOCK, "sm_clock_mhz"),
        ):
            for labels, v in rows(snap, name):
                getattr(series(labels), attr).append(v)
        for name in CLOCK_EVENT_REASONS:
            for labels, v in rows(snap, name):
                series(labels).reasons.append(int(v))
        for name in (POWER_VIOLATION, THERMAL_VIOLATION):
            for labels, v in rows(snap, name):
                s = series(labels)
                first = s.violation_us.get(name, (v, v))[0]
                s.violation_us[name] = (first, v)
    return [by_gpu[k] for k in sorted(by_gpu)]


@dataclass(slots=True)
class AcceleratorFinding:
    layer: str  # host, throttling or gpu_memory
    score: float
    evidence: list[str]
    advice: list[str]


HOST_ADVICE = [
    "the GPU waits for the CPU between steps: profile the engine loop (`plimsoll profile --url URL "
    "--seconds 20`, needs --enable-profiling) to see scheduling, sampling and detokenising time",
    "keep CUDA graphs on (do not pass --enforce-eager) so a decode step is one launch, not hundreds",
    "give the pod more CPU (resources.cpu) and keep tokenisation off the serving threads",
]
THROTTLE_ADVICE = [
    "the GPU's clocks are held down: check the node's cooling and power limit (nvidia-smi -q -d "
    "PERFORMANCE,POWER,TEMPERATURE); throughput here will not match a profile from a cool GPU",
    "re-profile once the node is fixed (annotate plimsoll.dev/reprofile), or schedule replicas away from it",
]
MEMORY_ADVICE = [
    "device memory is nearly full: lower --gpu-memory-utilization if other processes share the GPU, "
    "or give the KV cache less (--kv-cache-memory-bytes) and lower --max-num-seqs",
]


def _cv(values: Sequence[float]) -> float:
    mean = statistics.fmean(values)
    return statistics.pstdev(values) / mean if mean > 0 else 0.0


def judge(
    gpus: Sequence[GPUSeries],
    work_running: float,
    work_waiting: float,
    th: AcceleratorThresholds | None = None,
) -> list[AcceleratorFinding]:
    """The accelerator findings for these GPUs, given how much work the server had in the window."""
    th = th or AcceleratorThresholds()
    findings: list[AcceleratorFinding] = []
    for g in gpus:
        name = f"GPU {g.gpu}" + (f" ({g.model})" if g.model else "")
        if len(g.busy) >= 3 and (work_running >= 1 or work_waiting > 0):
            mean, cv = statistics.fmean(g.busy), _cv(g.busy)
            if mean < th.starved_util_mean and cv >= th.starved_flap:
                findings.append(
                    AcceleratorFinding(
                        "host",
                        1.0 + (th.starved_util_mean - mean) + cv,
                        [
                            f"{name} is busy {mean:.0%} on average and swings between {min(g.busy):.0%} and "
                            f"{max(g.busy):.0%} (coefficient of variation {cv:.2f}) while {work_running:.1f} "
                            f"requests run and {work_waiting:.1f} wait: the CPU does not feed it",
                        ],
                        list(HOST_ADVICE),
                    )
                )
        evidence = _throttle_evidence(g, th)
        if evidence:
            findings.append(
                AcceleratorFinding(
                    "throttling",
                    1.5 + 0.1 * len(evidence),
                    [f"{name}: {e}" for e in evidence],
                    list(THROTTLE_ADVICE),
                )
            )
        if g.fb_used_mib and g.fb_free_mib:
            total = g.fb_used_mib[-1] + g.fb_free_mib[-1]
            used = max(u / (u + f) for u, f in zip(g.fb_used_mib, g.fb_free_mib, strict=False) if u + f > 0)
            if used >= th.memory_full:
                findings.append(
                    AcceleratorFinding(
                        "gpu_memory",
                        1.0 + (used - th.memory_full) * 10,
                        [f"{name} device memory peaked at {used:.1%} of {total / 1024:.1f} GiB"],
                        list(MEMORY_ADVICE),
                    )
                )
    findings.sort(key=lambda f: f.score, reverse=True)
    return findings


def _throttle_evidence(g: GPUSeries, th: AcceleratorThresholds) -> list[str]:
    evidence = []
    if g.reasons:
        slowed = [r for r in g.reasons if any(r & bit for bit in SLOWDOWN_BITS)]
        share = len(slowed) / len(g.reasons)
        if share >= th.throttled_share:
            why = sorted({label for r in slowed for bit, label in SLOWDOWN_BITS.items() if r & bit})
            evidence.append(f"clocks slowed in {share:.0%} of samples ({', '.join(why)})")
    for name, (first, last) in g.violation_us.items():
        if last > first:
            kind = "power" if name == POWER_VIOLATION else "thermal"
            evidence.append(f"{(last - first) / 1e6:.1f} s of {kind} throttling ({name})")
    if g.temp_c and g.sm_clock_mhz:
        hot = max(g.temp_c)
        top, low = max(g.sm_clock_mhz), min(g.sm_clock_mhz)
        if hot >= th.hot_c and top > 0 and (top - low) / top >= th.clock_sag:
            evidence.append(
                f"{hot:.0f} °C with the SM clock sagging from {top:.0f} to {low:.0f} MHz under load"
            )
    return evidence


def observed(gpus: Sequence[GPUSeries]) -> dict[str, Any]:
    """Summary figures for the diagnosis' ``observed`` block (per GPU)."""
    out: dict[str, Any] = {}
    for g in gpus:
        prefix = f"gpu{g.gpu}_"
        if g.busy:
            out[prefix + "busy_mean"] = statistics.fmean(g.busy)
        if g.temp_c:
            out[prefix + "temp_max_c"] = max(g.temp_c)
        if g.power_w:
            out[prefix + "power_mean_w"] = statistics.fmean(g.power_w)
        if g.fb_used_mib and g.fb_free_mib:
            out[prefix + "fb_used_max_mib"] = max(g.fb_used_mib)
    return out


def nvml_exposition() -> str | None:
    """This host's GPUs read through NVML (``nvidia-ml-py``), written as DCGM-exporter would name them.

    For `plimsoll diagnose --nvml` run on the replica's own host or pod (``kubectl exec``): the
    same analysis without an exporter. None when NVML or a GPU is not there.
    """
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        lines = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else name
            uuid = pynvml.nvmlDeviceGetUUID(h)
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            labels = f'gpu="{i}",UUID="{uuid}",device="nvidia{i}",modelName="{name}"'
            memory = pynvml.nvmlDeviceGetMemoryInfo(h)
            values = {
                GPU_UTIL: pynvml.nvmlDeviceGetUtilizationRates(h).gpu,
                FB_USED: memory.used / 2**20,
                FB_FREE: memory.free / 2**20,
                GPU_TEMP: pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
                POWER_USAGE: pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0,
                SM_CLOCK: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                CLOCK_EVENT_REASONS[0]: pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h),
            }
            lines += [f"{metric}{{{labels}}} {value}" for metric, value in values.items()]
        return "\n".join(lines) + "\n"
    finally:
        pynvml.nvmlShutdown()
