"""Host stalls on demand: spin one core for 0.2–0.5 s at random moments, every 0.5–2 s, until killed.

What it is: what another tenant's burst of work does to a replica on a shared host, reproducible
(``--seed``), to run beside a benchmark that must hold up under it — e.g. two of these beside
``benchmarks/admission_refusal.py`` to see which requests the replica refuses from its queue after a
stall (``benchmarks/results/2026-12-06-burst-means.md``). A load generator, not a measurement.

    python benchmarks/host_stalls.py --seed 1 & python benchmarks/host_stalls.py --seed 2 &
"""

from __future__ import annotations

import argparse
import random
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gap", type=float, nargs=2, default=(0.5, 2.0), help="seconds between stalls (min max)")
    p.add_argument("--stall", type=float, nargs=2, default=(0.2, 0.5), help="seconds a stall spins (min max)")
    args = p.parse_args()
    rng = random.Random(args.seed)
    while True:
        time.sleep(rng.uniform(*args.gap))
        end = time.monotonic() + rng.uniform(*args.stall)
        while time.monotonic() < end:
            pass


if __name__ == "__main__":
    main()
