"""Where `plimsoll bench sweep` puts the knees of simulated replicas with known batch caps.

Sweeps a simulator (its own process) per batch cap over the default levels up to
two past the cap, on a quiet host and again with CPU-burning processes beside it,
and prints per cap: throughput knee, latency knee without and with a loose SLO,
the recommendation, the levels marked disturbed and why (first reason), and the
verification hold's outcome when --verify-seconds is given. Figures, not a test.

    .venv/bin/python benchmarks/knee_accuracy.py --caps 12,24,32 --busy 3 --verify-seconds 10
"""

import argparse
import asyncio
import subprocess
import sys
import time
from typing import Any

from plimsoll.bench.config import DEFAULT_LEVELS, SLO, BenchConfig, LengthSpec
from plimsoll.bench.knees import latency_knee
from plimsoll.bench.session import BenchSession
from plimsoll.bench.simulator import ServiceCurve, running_simulator
from plimsoll.bench.verify import apply_verification, verify


def levels_around(cap: int) -> tuple[int, ...]:
    i = max(i for i, c in enumerate(DEFAULT_LEVELS) if c <= cap)
    return DEFAULT_LEVELS[: i + 3]


async def sweep(url: str, curve: ServiceCurve, args: argparse.Namespace) -> dict[str, Any]:
    step_ms = curve.step_s(curve.batch_cap) * 1e3
    cfg = BenchConfig(
        url=url,
        model=curve.model,
        levels=levels_around(curve.batch_cap),
        input_tokens=LengthSpec(value=16),
        output_tokens=LengthSpec(value=args.output_tokens),
        requests_per_level=args.requests_per_level,
        slo=SLO(ttft_p95_ms=4 * step_ms, tpot_p50_ms=2 * step_ms),
        max_client_lag_ms=1000.0,
        min_concurrency_ratio=0.8,
        scrape_interval_s=0.2,
        verify_seconds=args.verify_seconds,
    )
    session = await BenchSession.open(cfg)
    try:
        report = session.report("sweep", await session.sweep())
        verification = await verify(session, report)
        return apply_verification(report, verification) if verification is not None else report
    finally:
        await session.aclose()


def line(cap: int, host: str, report: dict[str, Any], seconds: float) -> str:
    valid = [lv for lv in report["levels"] if lv["valid"]]
    no_slo = latency_knee(valid, SLO())
    knees = report["knees"]
    rec = report["recommendation"]
    disturbed = [lv for lv in report["levels"] if lv["disturbed"]["reasons"]]
    why = "; ".join(f"c={lv['concurrency']}: {lv['disturbed']['reasons'][0][:60]}" for lv in disturbed[:3])
    out = (
        f"cap {cap:3d} {host:5s} thr knee {knees['throughput']['concurrency']}, latency knee (no SLO) "
        f"{no_slo.concurrency} [{no_slo.binding}], (loose SLO) {knees['latency']['concurrency']}, "
        f"recommend {rec['concurrency_per_replica']}"
    )
    if "verification" in report:
        v = report["verification"]
        out += f" (swept {v['swept_concurrency']}, held: " + ", ".join(
            f"c={t['concurrency']} {'ok' if t['passed'] else 'miss'} {t['attainment'] or 0:.1%}"
            for t in v["tried"]
        )
        out += ")"
    out += f"; disturbed {[lv['concurrency'] for lv in disturbed]} {why}; {seconds:.0f} s"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--caps", default="12,24,32")
    parser.add_argument("--step-ms", type=float, default=40.0, help="step time t0")
    parser.add_argument("--step-per-seq-ms", type=float, default=0.5, help="added per running request (k)")
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--requests-per-level", type=int, default=48)
    parser.add_argument(
        "--busy", type=int, default=3, help="CPU-burning processes for the busy pass (0: none)"
    )
    parser.add_argument("--verify-seconds", type=float, default=0.0)
    args = parser.parse_args()
    for cap in (int(c) for c in args.caps.split(",")):
        curve = ServiceCurve(batch_cap=cap, step_t0_s=args.step_ms / 1e3, step_k_s=args.step_per_seq_ms / 1e3)
        with running_simulator(curve) as url:
            for host in ("quiet", "busy") if args.busy else ("quiet",):
                burn = "import time\nend = time.monotonic() + 600\nwhile time.monotonic() < end:\n    pass\n"
                procs = [
                    subprocess.Popen([sys.executable, "-c", burn])
                    for _ in range(args.busy if host == "busy" else 0)
                ]
                t = time.monotonic()
                try:
                    report = asyncio.run(sweep(url, curve, args))
                finally:
                    for p in procs:
                        p.kill()
                        p.wait()
                print(line(cap, host, report, time.monotonic() - t), flush=True)


if __name__ == "__main__":
    main()
