"""Re-read the recorded ``pd_split.py`` runs with the current prediction: does it agree with what was measured?

What it is: the figures each run of ``benchmarks/pd_split.py`` printed (the one-replica profile: prefill
rate, decode step by sequences; the link its pulls measured; the SLOs; the measurement's difference, noise
band and category — from ``benchmarks/results/2026-12-06-pd-split.md``), fed to
``plimsoll.disaggregation.predict`` with the transfer's cost on the replicas' own cores off and on
(``pull_stall`` 0 and 1). Prints each run's predicted difference and category beside the measured one.

What it is not: a measurement. A new ``pd_split.py`` run is.

    python benchmarks/pd_split_reread.py
"""

from __future__ import annotations

from typing import NamedTuple

from plimsoll.disaggregation import Ratio, ServiceProfile, predict, verdict


class Run(NamedTuple):
    name: str
    input_tokens: int
    output_tokens: int
    ttft_slo_ms: float
    tpot_slo_ms: float
    link_bytes_per_s: float
    prefill_tokens_per_s: float
    step_ms: tuple[tuple[int, float], ...]  # (sequences, decode step ms)
    transfer_bytes: float
    measured_gain: float  # split vs aggregated, goodput per replica
    band: float
    measured: str


RUNS = (
    Run("A long", 512, 16, 6869.9, 79.7, 17e6, 275, ((1, 39.4), (2, 34.3), (4, 90.8)), 3.96e6, -0.40, 0.79, "no clear gain"),
    Run("A short", 32, 48, 224.9, 26.7, 14e6, 596, ((1, 14.7), (2, 7.0), (4, 13.8)), 0.128e6, -0.11, 0.41, "no clear gain"),
    Run("B long", 512, 16, 684.2, 7.5, 122e6, 2759, ((1, 4.4), (2, 7.6), (4, 12.4)), 3.96e6, -0.51, 0.50, "aggregated"),
    Run("B short", 32, 48, 66.9, 5.7, 23e6, 2206, ((1, 3.2), (2, 5.6), (4, 5.3)), 0.128e6, -0.34, 0.94, "no clear gain"),
    Run("C long", 512, 16, 815.8, 9.7, 93e6, 1930, ((1, 5.4), (2, 6.5), (4, 8.4)), 3.96e6, -0.72, 0.40, "aggregated"),
    Run("C short", 32, 48, 71.8, 5.0, 45e6, 2003, ((1, 3.2), (2, 3.9), (4, 8.2)), 0.128e6, -0.16, 0.31, "no clear gain"),
)  # fmt: skip


def profile(run: Run) -> ServiceProfile:
    steps = tuple((float(b), ms / 1e3) for b, ms in run.step_ms)
    fits = [(b, t) for b, t in steps if t <= run.tpot_slo_ms / 1e3] or [steps[0]]
    blocks_moved = (run.input_tokens - 1) // 16 * 16  # full 16-token blocks
    return ServiceProfile(run.prefill_tokens_per_s, fits[-1][0], fits[-1][1], run.transfer_bytes / blocks_moved,
                          step_s=steps, levels=tuple(b for b, _ in steps))  # fmt: skip


def main() -> None:
    agree = {0.0: 0, 1.0: 0}
    direction = {0.0: 0, 1.0: 0}
    error = {0.0: 0.0, 1.0: 0.0}
    for run in RUNS:
        cells = [f"{run.name:8} measured {run.measured_gain:+.0%} (±{run.band:.0%}) {run.measured:13}"]
        for stall in (0.0, 1.0):
            layouts = predict(profile(run), run.input_tokens, run.output_tokens, run.link_bytes_per_s, [Ratio(1, 1)],
                              run.ttft_slo_ms / 1e3, run.tpot_slo_ms / 1e3, levels=(1, 2), pull_stall=stall)  # fmt: skip
            v = verdict(layouts, margin=run.band)
            agg, split = (lay.goodput_per_replica for lay in layouts)
            gain = (split - agg) / agg
            agree[stall] += v.category == run.measured
            direction[stall] += (gain > 0) == (run.measured_gain > 0)
            error[stall] += abs(gain - run.measured_gain) / len(RUNS)
            said = "agrees" if v.category == run.measured else "DIFFERS"
            cells.append(f"pull_stall {stall:g}: {gain:+.0%} {v.category} ({said})")
        print(" | ".join(cells))
    for stall in (0.0, 1.0):
        print(f"pull_stall {stall:g}: category {agree[stall]} of {len(RUNS)}, direction {direction[stall]} of "
              f"{len(RUNS)}, mean absolute error {error[stall] * 100:.0f} percentage points")  # fmt: skip


if __name__ == "__main__":
    main()
