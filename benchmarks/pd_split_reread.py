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
the output; a saved run uses its own. Prints each run's predicted difference and category beside the
measured one, and the agreement of each way over all runs and over the saved runs alone.

Beside each way, the same prediction with the profile's per-request spread and the closed loop's gap
between requests (``profile_from_report``: a lognormal factor on each request's TTFT and TPOT fitted to
each level's p95/p50, and ``c/X − E2E mean`` at the lowest level) — "new" — against the prediction
without them — "old" — and the totals of both. Runs A–D recorded their profile's medians only: no
spread and no gap, so there the new prediction is the old one.

What it is not: a measurement. A new ``pd_split.py`` run is.

    python benchmarks/pd_split_reread.py [RUN.json ...]
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path
from typing import NamedTuple

from plimsoll.disaggregation import Ratio, ServiceProfile, predict, profile_from_report, verdict


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
    spread: tuple[tuple[float, float, float], ...] = ()  # (concurrency, σ TTFT, σ TPOT) per profiled level
    gap_s: float = 0.0  # the closed loop's time between requests at the profile's lowest level
    measured_per_replica: tuple[float, float] | None = None  # (aggregated, split) good req/s per replica


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
        prof = profile_from_report(res["profile"], 1.0, slo["tpot_p50_ms"] / 1e3, res["output_tokens"])
        split = v["layouts"][1]
        cpu = pred.get("transfer_cpu_s")
        out.append(Run(
            f"{label} {'long' if res['input_tokens'] > 100 else 'short'}", res["input_tokens"], res["output_tokens"],
            slo["ttft_p95_ms"], slo["tpot_p50_ms"], pred["link_bytes_per_s"], prof.prefill_tokens_per_s,
            tuple((b, t * 1e3) for b, t in prof.step_s), split["transfer_bytes"], pred["measured_gain"], v["band"],
            v["category"], (cpu[0] * 1e3, cpu[1] * 1e3) if cpu else None, res["profile"].get("core_share"),
            prof.spread, prof.request_gap_s,
            (v["layouts"][0]["goodput_per_replica_rps"], split["goodput_per_replica_rps"]),
        ))  # fmt: skip
    return out


def profile(run: Run, long_transfer_bytes: float, new: bool = False) -> ServiceProfile:
    """The run's profile as the prediction takes it; ``new``: with its spread and gap (the old model without)."""
    steps = tuple((float(b), ms / 1e3) for b, ms in run.step_ms)
    fits = [(b, t) for b, t in steps if t <= run.tpot_slo_ms / 1e3] or [steps[0]]
    # KV bytes per token as pd_split.py takes it: the long workload's bytes over the full blocks it moved.
    per_token = long_transfer_bytes / ((512 - 1) // 16 * 16)
    return ServiceProfile(run.prefill_tokens_per_s, fits[-1][0], fits[-1][1], per_token, step_s=steps,
                          levels=tuple(b for b, _ in steps), spread=run.spread if new else (),
                          request_gap_s=run.gap_s if new else 0.0)  # fmt: skip


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
    # The same tallies for the new model (the profile's spread and gap), and its cells printed after the old.
    new_tallies = {
        scope: {way: [0, 0, 0.0, 0] for way in WAYS} for scope in ("all", "borrowed CPU", "measured CPU")
    }
    # Each run's measured goodput per replica against the predicted (transfer at its measured CPU): the
    # relative error of aggregated's and the split's, old and new.
    absolute: dict[str, list[float]] = {
        "old aggregated": [],
        "new aggregated": [],
        "old split": [],
        "new split": [],
    }
    for run in runs:
        cpu_ms = run.transfer_cpu_ms or borrowed.get(run.input_tokens)
        cells = [f"{run.name:8} measured {run.measured_gain:+.0%} (±{run.band:.0%}) {run.measured:13}"]
        new_cells = []
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
            scopes = ["all", "measured CPU" if run.transfer_cpu_ms is not None else "borrowed CPU"]
            for new, counts in ((False, tallies), (True, new_tallies)):
                layouts = predict(profile(run, 3.96e6, new), run.input_tokens, run.output_tokens, run.link_bytes_per_s,
                                  [Ratio(1, 1)], run.ttft_slo_ms / 1e3, run.tpot_slo_ms / 1e3, levels=(1, 2),
                                  pull_stall=0.0 if way == "off" else 1.0, transfer_cpu_s=cpu_s)  # fmt: skip
                v = verdict(layouts, margin=run.band)
                agg, split = (lay.goodput_per_replica for lay in layouts)
                gain = (split - agg) / agg
                for scope in scopes:
                    t = counts[scope][way]
                    t[0] += v.category == run.measured
                    t[1] += (gain > 0) == (run.measured_gain > 0)
                    t[2] += abs(gain - run.measured_gain)
                    t[3] += 1
                said = "agrees" if v.category == run.measured else "DIFFERS"
                if way == "cpu" and run.measured_per_replica is not None:
                    age = "new" if new else "old"
                    for name, predicted, measured in zip(("aggregated", "split"), (agg, split),
                                                         run.measured_per_replica, strict=True):  # fmt: skip
                        absolute[f"{age} {name}"].append(predicted / measured - 1 if measured else math.nan)
                if new:
                    new_cells.append(f"new {way}: {gain:+.0%} {v.category} ({said}), aggregated {agg:.3g} "
                                     f"split {split:.3g} good req/s per replica")  # fmt: skip
                    continue
                own = "" if way != "cpu" else " [own CPU]" if run.transfer_cpu_ms else " [borrowed CPU]"
                own += f" [core share {share:.0%}]" if way == "cpu/share" else ""
                cells.append(f"{way}: {gain:+.0%} {v.category} ({said}){own}")
        if run.measured_per_replica is not None:
            agg_m, split_m = run.measured_per_replica
            new_cells.append(f"measured aggregated {agg_m:.3g} split {split_m:.3g} good req/s per replica")
        if run.spread or run.gap_s:
            sigma = ", ".join(f"c={c:g} {a:.2f}/{b:.2f}" for c, a, b in run.spread)
            new_cells.append(f"gap {run.gap_s * 1e3:.1f} ms, σ TTFT/TPOT {sigma}")
        else:
            new_cells.append("no percentiles or gap recorded: new = old")
        print(" | ".join(cells + new_cells))
    for scope, ways in tallies.items():
        for way, (cat, direction, err, n) in ways.items():
            if n:
                print(f"{scope} runs, transfer charged {way}: category {cat} of {n}, direction {direction} of {n}, "
                      f"mean absolute error {err / n * 100:.0f} percentage points")  # fmt: skip
    print(
        "old model (no spread, no gap) vs new (the profile's per-request spread and the gap between requests):"
    )
    for scope, ways in tallies.items():
        for way, (cat, direction, err, n) in ways.items():
            if n:
                ncat, ndir, nerr, _ = new_tallies[scope][way]
                print(f"{scope} runs, transfer charged {way}: category {cat} -> {ncat} of {n}, direction "
                      f"{direction} -> {ndir} of {n}, mean absolute error {err / n * 100:.0f} -> {nerr / n * 100:.0f} "
                      "percentage points")  # fmt: skip
    for name in ("aggregated", "split"):
        before = [e for e in absolute[f"old {name}"] if not math.isnan(e)]
        after = [e for e in absolute[f"new {name}"] if not math.isnan(e)]
        if before:
            # Medians: a run on a loaded host measures a few hundredths of what its profile predicts.
            print(f"{name} goodput per replica, predicted over measured (transfer at its CPU time; {len(before)} saved "
                  f"runs): median ratio {statistics.median(before) + 1:.2f}x -> {statistics.median(after) + 1:.2f}x, "
                  f"within 25% in {sum(abs(e) <= 0.25 for e in before)} -> {sum(abs(e) <= 0.25 for e in after)} runs")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
