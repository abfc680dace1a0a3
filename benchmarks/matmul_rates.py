"""Float32 matmul rates on this host: column panels against the plain-row kernel and oneDNN.

What it is: a script that prints figures. For each row count it runs every projection of a
model's layers (SmolLM2's shapes by default: qkv 960 x 576, o 576 x 576, gate_up 3072 x 576,
down 576 x 1536), each layer its own random weights so they stream from memory as in an engine
step, through

- ``panels``: ``cpu_kernels.packed_linear`` over weights packed once by ``pack_f32`` (what the
  fused decode step, the glued layers and the output head run by default);
- ``rows``: ``cpu_kernels.small_batch_linear`` over the plain ``[N, K]`` weights (the fused
  step's matmul before the panels; up to ``RowLimits.small_matmul`` rows);
- ``onednn``: oneDNN's matmul over its own prepacked layout, rows padded to the engine's bucket
  (the glued layers' matmul before the panels),

the three alternating round by round, and prints the best round's GFLOP/s for each and the
largest difference between the panels' result and ``F.linear``'s. A script, not a test.

    python benchmarks/matmul_rates.py --rows 1,2,4,8,16,32,64,256
"""

import argparse
import time
from collections.abc import Callable

import torch

from plimsoll.runtime.kernels import cpu_kernels
from plimsoll.runtime.models import dense, fused_decode
from plimsoll.runtime.models.cpu_plan import RowLimits

SMOLLM2 = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8, 16, 32, 64, 256])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if cpu_kernels.library() is None:
        raise SystemExit(f"the CPU kernels are not available here: {cpu_kernels.unavailable_reason()}")
    torch.manual_seed(0)
    weights = [[torch.randn(n, k) / k**0.5 for n, k in SMOLLM2] for _ in range(args.layers)]
    panels = [[cpu_kernels.pack_f32(w) for w in layer] for layer in weights]
    onednn = [[fused_decode._pack(w) for w in layer] for layer in weights] if fused_decode._REORDER else None
    cols = cpu_kernels.library().plimsoll_packed_f32_panel_cols()
    print(
        f"# {args.layers} layers of {', '.join(f'{n}x{k}' for n, k in SMOLLM2)}, float32, "
        f"{torch.get_num_threads()} threads, panels of {cols} columns; GFLOP/s, best of {args.rounds} rounds"
    )
    for m in args.rows:
        best, err = measure(m, weights, panels, onednn, args.rounds)
        flops = 2 * m * sum(n * k for n, k in SMOLLM2) * args.layers
        rates = "  ".join(f"{name} {flops / t / 1e9:6.1f}" for name, t in best.items())
        print(f"rows {m:4d}: {rates}   (panels' max |error| vs F.linear {err:.1e})", flush=True)


def measure(
    m: int,
    weights: list[list[torch.Tensor]],
    panels: list[list[cpu_kernels.PackedWeight]],
    onednn: list[list[torch.Tensor]] | None,
    rounds: int,
) -> tuple[dict[str, float], float]:
    """Best seconds of each path over ``rounds`` alternating rounds at ``m`` rows, and the panels'
    largest difference from ``F.linear`` on one weight."""
    xs = {k: torch.randn(m, k) for _, k in SMOLLM2}
    padded = {k: torch.cat((x, x.new_zeros(dense.bucket_rows(m) - m, k))) for k, x in xs.items()}
    out = {n: torch.empty(m, n) for n, _ in SMOLLM2}

    def run_panels() -> None:
        for layer in panels:
            for p in layer:
                cpu_kernels.packed_linear(xs[p.k], p, out=out[p.n])

    def run_rows() -> None:
        for layer in weights:
            for w in layer:
                cpu_kernels.small_batch_linear(xs[w.shape[1]], w, None)

    def run_onednn() -> None:
        for layer in onednn or []:
            for w in layer:
                fused_decode._onednn_matmul(padded[w.shape[1]], w, m, 0)  # the glued layers' call

    paths: dict[str, Callable[[], None]] = {"panels": run_panels}
    if m <= RowLimits().small_matmul:
        paths["rows"] = run_rows
    if onednn is not None and m <= dense.ONEDNN_CHUNK_ROWS:
        paths["onednn"] = run_onednn
    best = dict.fromkeys(paths, float("inf"))
    for fn in paths.values():
        fn()  # first calls: primitives, page faults
    for _ in range(rounds):
        for name, fn in paths.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    p = panels[0][2]
    err = (cpu_kernels.packed_linear(xs[p.k], p) - xs[p.k] @ weights[0][2].T).abs().max().item()
    return best, err


if __name__ == "__main__":
    main()
