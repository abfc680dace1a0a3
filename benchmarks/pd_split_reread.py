"""Re-read the recorded ``pd_split.py`` runs with the current prediction: does it agree with what was measured?

What it is: the figures each run of ``benchmarks/pd_split.py`` printed (the one-replica profile: prefill
rate, decode step by sequences; the link its pulls measured; the SLOs; the measurement's difference, noise
band and category — runs A–D from ``benchmarks/results/2026-12-06-pd-split.md``, and any run saved with
``pd_split.py --output FILE`` given as an argument), fed to ``plimsoll.disaggregation.predict`` three ways:
the transfer's cost on the replicas' own cores off (``pull_stall`` 0), charged at the pull's wall time to
each side (``pull_stall`` 1, the prediction before the transfer's CPU time was measured), and charged at
its measured CPU time per request on each side, and (runs that measured it) at that CPU time over the
share of a core the profiled replica got (its wall time per CPU second, the profile's unit). Runs A–D predate the CPU measurement: for them the CPU
time is the mean of what the saved runs measured for the same workload (the same blocks moved), said so in
the output; a saved run uses its own. A saved run that measured the bench's own CPU per request (its
load generator and router, on the replicas' cores) is predicted with it, each layout its own figure.
Prints each run's predicted difference and category beside the
measured one, and the agreement of each way over all runs and over the saved runs alone.

What it is not: a measurement. A new ``pd_split.py`` run is.

    python benchmarks/pd_split_reread.py [RUN.json ...]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import NamedTuple

from plimsoll.disaggregation import Ratio, ServiceProfile, moved_tokens, predict, profile_from_report, verdict


class Run(NamedTuple):
    name: str
    input_tokens: int
    output_tokens: int
    ttft_slo_ms: float
    tpot_slo_ms: float
    link_bytes_per_s: float
    prefill_tokens_per_s: float
    step_ms: tuple[tuple[float, float], ...]  # (sequences, decode step ms)
    transfer_bytes: float
    measured_gain: float  # split vs aggregated, goodput per replica
    band: float
    measured: str
    transfer_cpu_ms: tuple[float, float] | None = None  # (producer, consumer) ms per request, measured
    core_share: float | None = None  # the profiled replica's CPU seconds per wall second at c = 1
    overhead_ms: float = 0.0  # the profile's request overhead (TTFT at c = 1 less prefill and a step)
    bench_cpu_ms: tuple[float, float] | None = None  # the bench's own CPU per request: aggregated, split


RUNS = (
    Run("A long", 512, 16, 6869.9, 79.7, 17e6, 275, ((1, 39.4), (2, 34.3), (4, 90.8)), 3.96e6, -0.40, 0.79, "no clear gain"),
    Run("A short", 32, 48, 224.9, 26.7, 14e6, 596, ((1, 14.7), (2, 7.0), (4, 13.8)), 0.128e6, -0.11, 0.41, "no clear gain"),
    Run("B long", 512, 16, 684.2, 7.5, 122e6, 2759, ((1, 4.4), (2, 7.6), (4, 12.4)), 3.96e6, -0.51, 0.50, "aggregated"),
    Run("B short", 32, 48, 66.9, 5.7, 23e6, 2206, ((1, 3.2), (2, 5.6), (4, 5.3)), 0.128e6, -0.34, 0.94, "no clear gain"),
    Run("C long", 512, 16, 815.8, 9.7, 93e6, 1930, ((1, 5.4), (2, 6.5), (4, 8.4)), 3.96e6, -0.72, 0.40, "aggregated"),
    Run("C short", 32, 48, 71.8, 5.0, 45e6, 2003, ((1, 3.2), (2, 3.9), (4, 8.2)), 0.128e6, -0.16, 0.31, "no clear gain"),
    Run("D long", 512, 16, 760.2, 9.4, 173e6, 2866, ((1, 6.2), (2, 8.4), (4, 9.6)), 3.96e6, -0.09, 0.10, "no clear gain"),
    Run("D short", 32, 48, 92.3, 5.6, 52e6, 1869, ((1, 3.5), (2, 4.5), (4, 6.6)), 0.128e6, -0.26, 0.46, "no clear gain"),
)  # fmt: skip
# The transfer's cost: not charged, its wall time, its measured CPU time, that over the replica's core share.
WAYS = ("off", "wall", "cpu", "cpu/share")


def saved_runs(path: str, label: str) -> list[Run]:
    """The workloads of one ``pd_split.py --output`` file that have a prediction (a measured link)."""
    out = []
    for res in json.loads(Path(path).read_text()):
        pred = res.get("predicted")
        if not pred:
            continue
        slo, v = res["slo"], res["measured"]["verdict"]
        prof = profile_from_report(res["profile"], 1.0, slo["tpot_p50_ms"] / 1e3)
        split = v["layouts"][1]
        cpu = pred.get("transfer_cpu_s")
        out.append(Run(
            f"{label} {'long' if res['input_tokens'] > 100 else 'short'}", res["input_tokens"], res["output_tokens"],
            slo["ttft_p95_ms"], slo["tpot_p50_ms"], pred["link_bytes_per_s"], prof.prefill_tokens_per_s,
            tuple((b, t * 1e3) for b, t in prof.step_s), split["transfer_bytes"], pred["measured_gain"], v["band"],
            v["category"], (cpu[0] * 1e3, cpu[1] * 1e3) if cpu else None, res["profile"].get("core_share"),
            prof.request_overhead_s * 1e3,
            (v["layouts"][0]["bench_cpu_s"] * 1e3, split["bench_cpu_s"] * 1e3)
            if v["layouts"][0].get("bench_cpu_s") and split.get("bench_cpu_s") else None,
        ))  # fmt: skip
    return out


def profile(run: Run, long_transfer_bytes: float) -> ServiceProfile:
    steps = tuple((float(b), ms / 1e3) for b, ms in run.step_ms)
    fits = [(b, t) for b, t in steps if t <= run.tpot_slo_ms / 1e3] or [steps[0]]
    # KV bytes per token as pd_split.py takes it: the long workload's bytes over the full blocks it moved.
    per_token = long_transfer_bytes / moved_tokens(512)
    return ServiceProfile(run.prefill_tokens_per_s, fits[-1][0], fits[-1][1], per_token, step_s=steps,
                          levels=tuple(b for b, _ in steps), request_overhead_s=run.overhead_ms / 1e3)  # fmt: skip


def main(paths: list[str]) -> None:
    runs = list(RUNS)
    for i, path in enumerate(paths):
        runs += saved_runs(path, chr(ord("E") + i))
    # CPU time per request for runs that did not measure it: the saved runs' mean for the same workload.
    by_workload: dict[int, list[tuple[float, float]]] = {}
    for run in runs:
        if run.transfer_cpu_ms is not None:
            by_workload.setdefault(run.input_tokens, []).append(run.transfer_cpu_ms)
    borrowed = {
        isl: (statistics.fmean(p for p, _ in cpus), statistics.fmean(c for _, c in cpus))
        for isl, cpus in by_workload.items()
    }
    for isl, (p, c) in sorted(borrowed.items()):
        print(f"transfer CPU per request, {isl}-token prompts, mean of {len(by_workload[isl])} measured runs: "
              f"{p:.2f} ms prefill side, {c:.2f} ms decode side (used for runs that did not measure it)")  # fmt: skip
    tallies = {
        scope: {way: [0, 0, 0.0, 0] for way in WAYS} for scope in ("all", "borrowed CPU", "measured CPU")
    }
    for run in runs:
        cpu_ms = run.transfer_cpu_ms or borrowed.get(run.input_tokens)
        # The bench's own CPU on the replicas' cores, where the run measured it (each layout its own).
        host = (
            {"aggregated": run.bench_cpu_ms[0] / 1e3, "1P:1D": run.bench_cpu_ms[1] / 1e3}
            if run.bench_cpu_ms
            else None
        )
        cells = [f"{run.name:8} measured {run.measured_gain:+.0%} (±{run.band:.0%}) {run.measured:13}"]
        for way in WAYS:
            if way == "cpu" and cpu_ms is None:
                cells.append("cpu: no CPU measurement for this workload")
                continue
            if way == "cpu/share" and (run.core_share is None or run.transfer_cpu_ms is None):
                continue  # only a run that measured both
            share = min(1.0, run.core_share or 1.0) if way == "cpu/share" else 1.0
            cpu_s = (
                (cpu_ms[0] / 1e3 / share, cpu_ms[1] / 1e3 / share)
                if way.startswith("cpu") and cpu_ms
                else None
            )
            layouts = predict(profile(run, 3.96e6), run.input_tokens, run.output_tokens, run.link_bytes_per_s,
                              [Ratio(1, 1)], run.ttft_slo_ms / 1e3, run.tpot_slo_ms / 1e3, levels=(1, 2),
                              pull_stall=0.0 if way == "off" else 1.0, transfer_cpu_s=cpu_s,
                              host_cpu_s=host)  # fmt: skip
            v = verdict(layouts, margin=run.band)
            agg, split = (lay.goodput_per_replica for lay in layouts)
            gain = (split - agg) / agg
            scopes = ["all", "measured CPU" if run.transfer_cpu_ms is not None else "borrowed CPU"]
            for scope in scopes:
                t = tallies[scope][way]
                t[0] += v.category == run.measured
                t[1] += (gain > 0) == (run.measured_gain > 0)
                t[2] += abs(gain - run.measured_gain)
                t[3] += 1
            said = "agrees" if v.category == run.measured else "DIFFERS"
            own = "" if way != "cpu" else " [own CPU]" if run.transfer_cpu_ms else " [borrowed CPU]"
            own += f" [core share {share:.0%}]" if way == "cpu/share" else ""
            cells.append(f"{way}: {gain:+.0%} {v.category} ({said}){own}")
        print(" | ".join(cells))
    for scope, ways in tallies.items():
        for way, (cat, direction, err, n) in ways.items():
            if n:
                print(f"{scope} runs, transfer charged {way}: category {cat} of {n}, direction {direction} of {n}, "
                      f"mean absolute error {err / n * 100:.0f} percentage points")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
