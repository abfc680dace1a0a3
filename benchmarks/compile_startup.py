"""Engine start-up with ``torch.compile``: a cold compile cache, then a warm one (two processes).

What it is: a script that prints figures. It starts an engine twice, each time in a fresh
process, on one fresh ``--compilation-cache-dir``: the first compiles the forward (inductor:
C++ on CPU, Triton on CUDA) and writes the cache, the second loads it. For each it prints the
seconds to build the engine, the seconds spent in the compiled forward's first calls (both
graphs: one-token and multi-token steps), CUDA-graph capture seconds (GPU), and torch's cache
counters (FX-graph and AOT-autograd hits and misses), then the warm/cold ratio. A third line
builds the same engine eagerly (``mode 0``) for the baseline start-up.

Run::

    python benchmarks/compile_startup.py                         # the tiny test model, CPU
    python benchmarks/compile_startup.py --model smollm2-135m    # the embedded SmolLM2
    python benchmarks/compile_startup.py --device cuda --dtype bfloat16 --model smollm2-135m

What it is not: a timed test. Compile time moves with whatever else runs on the host.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

CHILD = textwrap.dedent(
    """
    import json, sys, time
    t0 = time.monotonic()
    import torch
    torch.set_num_threads(int(sys.argv[5]))
    from plimsoll.runtime import LLM
    from plimsoll.runtime.engine.compilation import cache_counters
    imported = time.monotonic() - t0
    model, device, dtype, cache, threads, mode = sys.argv[1:7]
    t = time.monotonic()
    llm = LLM(model=model, device=device, dtype=dtype, kv_cache_memory="256MiB",
              max_num_seqs=8, compilation_config={"mode": int(mode), "cache_dir": cache})
    llm.engine.warmup()  # what `plimsoll serve` does before it is ready
    built = time.monotonic() - t
    report = llm.engine.compile_report()
    print(json.dumps({"imports_s": round(imported, 2), "engine_build_and_warmup_s": round(built, 2), **report}))
    """
)


def start(args: argparse.Namespace, cache: Path, mode: int) -> dict[str, object]:
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD,
            args.model,
            args.device,
            args.dtype,
            str(cache),
            str(args.threads),
            str(mode),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "TRITON_INTERPRET": "0"},
    )
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-4000:])
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", default=None, help="model directory or name (default: the tiny test model)"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="plimsoll-compile-startup-") as tmp:
        if args.model is None:
            from plimsoll.runtime.testing import write_tiny_model

            args.model = str(write_tiny_model(Path(tmp) / "tiny-llama"))
        cache = Path(tmp) / "compile-cache"
        runs = {
            "cold cache": start(args, cache, 3),
            "warm cache": start(args, cache, 3),
            "eager": start(args, cache, 0),
        }
    print(f"model {args.model} on {args.device} ({args.dtype}), {args.threads} threads")
    for name, r in runs.items():
        print(
            f"  {name:10s}: engine build + warm-up {r['engine_build_and_warmup_s']:7.1f} s, compiled forward "
            f"{r['compile_seconds']:6.1f} s over {r['compiled_graphs']} graphs, capture "
            f"{r['cuda_graph_capture_seconds']} s, caches {r['cache_counters']}"
        )
    cold, warm = runs["cold cache"], runs["warm cache"]
    print(
        f"  warm / cold: engine start-up {float(warm['engine_build_and_warmup_s']) / float(cold['engine_build_and_warmup_s']):.2f}, "  # type: ignore[arg-type]
        f"compile {float(warm['compile_seconds']) / float(cold['compile_seconds']):.2f}"  # type: ignore[arg-type]
    )


if __name__ == "__main__":
    main()
