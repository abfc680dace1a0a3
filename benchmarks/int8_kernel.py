"""Timings of the int8 CPU matmul kernel by weight layout, side by side.

What it is: ``cpu_kernels.int8_linear`` on a SmolLM2-sized head (49,152 × 576) and an MLP
projection (576 inputs × 1,536 outputs) at 1, 4 and 16 rows of x, for one symmetric scale per
output row, symmetric groups of 32, and asymmetric groups of 32 (scale and offset: the default of
``--quantization int8``), with the float32 kernel (``small_batch_linear``) beside them. The
layouts are timed in turn, round after round, and the minimum of the rounds is printed, so a
noisy host slows all of them alike. It prints figures; it asserts nothing.

Run: ``python benchmarks/int8_kernel.py --rounds 9``.
"""

import argparse
import time

import torch

from plimsoll.runtime.kernels import cpu_kernels
from plimsoll.runtime.models import quant


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--rows", default="1,4,16")
    args = ap.parse_args()
    if cpu_kernels.library() is None:
        raise SystemExit(f"the CPU kernels are not available: {cpu_kernels.unavailable_reason()}")
    torch.manual_seed(0)
    print(f"threads {torch.get_num_threads()}; min of {args.rounds} rounds, ms")
    for label, (n, k) in {"head 49152x576": (49152, 576), "proj 576->1536": (1536, 576)}.items():
        w = torch.randn(n, k) * 0.05
        layouts = {
            "per row": quant.quantize_rows(w, 0, asymmetric=False),
            "sym g32": quant.quantize_rows(w, 32, asymmetric=False),
            "asym g32": quant.quantize_rows(w, 32, asymmetric=True),
        }
        for rows in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(rows, k)
            calls = {"fp32": lambda x=x, w=w: cpu_kernels.small_batch_linear(x, w, None)}
            for name, (q, s, z) in layouts.items():
                calls[name] = lambda x=x, q=q, s=s, z=z: cpu_kernels.int8_linear(x, q, s, None, z)
                ref = x @ quant.dequantize(q, s, z, torch.float32).T
                if not torch.allclose(calls[name](), ref, atol=1e-3, rtol=1e-4):
                    raise SystemExit(f"{name}: the kernel disagrees with the dequantised matmul")
            best = {name: float("inf") for name in calls}
            for _ in range(args.rounds):
                for name, call in calls.items():
                    call()  # warm the caches alike
                    t0 = time.perf_counter()
                    call()
                    best[name] = min(best[name], time.perf_counter() - t0)
            base = best["per row"]
            cells = "  ".join(f"{name} {1e3 * t:7.3f} ({t / base:.2f}x)" for name, t in best.items())
            print(f"{label}, {rows:2d} rows: {cells}")


if __name__ == "__main__":
    main()
