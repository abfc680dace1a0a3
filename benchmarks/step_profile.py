"""Where a decode step's milliseconds go: phases timed by wrapping, ops from torch's profiler.

What it is: one engine on the embedded SmolLM2 (or ``--model``), ``b`` sequences decoding at a
~``--prompt``-token context; for each batch size it times ``--steps`` decode steps, splitting
each into scheduling, input building (``ModelRunner.prepare``), the model's layers, the output
head (``compute_logits``), sampling, and the rest (output processing), then profiles a few more
steps with ``torch.profiler`` and prints the ops that take the most self CPU time per step and
how many ops a step runs. It prints figures; it asserts nothing.

Run: ``python benchmarks/step_profile.py --levels 1,16`` (``--baseline``: kernels
that start threads per call and no fused decode step, the step as it was before them)
"""

import argparse
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from plimsoll.runtime.engine.config import EngineConfig
from plimsoll.runtime.engine.llm_engine import LLMEngine
from plimsoll.runtime.engine.sampling_params import SamplingParams
from plimsoll.runtime.kernels import cpu_kernels

PHASES: dict[str, list[float]] = defaultdict(list)


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            PHASES[name].append(time.perf_counter() - t)

    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--profiled-steps", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=160)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument(
        "--baseline", action="store_true",
        help="the step as it was before the worker pool and the fused decode step: kernels start "
        "threads per call, every layer runs as modules",
    )  # fmt: skip
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = LLMEngine(
        EngineConfig(
            model=args.model, kv_cache_memory="1GiB", max_num_seqs=max(args.levels), enable_prefix_caching=False,
            quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, dtype=args.dtype,
            cpu_fused_decode=not args.baseline,
        )
    )  # fmt: skip
    if args.baseline:
        cpu_kernels.set_pool_enabled(False)
    engine.warmup()
    runner, model = engine.runner, engine.runner.model
    engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)  # type: ignore[method-assign]
    runner.prepare = timed("prepare inputs", runner.prepare)  # type: ignore[method-assign]
    model.forward = timed("model (embedding, layers, norm)", model.forward)  # type: ignore[method-assign]
    model.compute_logits = timed("output head", model.compute_logits)  # type: ignore[method-assign]
    engine._sample = timed("sampling", engine._sample)  # type: ignore[method-assign]
    vocab = int(engine.hf_config.vocab_size)
    rng = random.Random(0)
    for b in args.levels:
        params = SamplingParams(temperature=0, max_tokens=args.steps + args.profiled_steps + 4, ignore_eos=True)
        for i in range(b):
            engine.add_request(f"p-{b}-{i}", [rng.randrange(100, vocab) for _ in range(args.prompt)], params)
        while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
            engine.step()
        PHASES.clear()
        walls = []
        cpu_kernels.fused_decode_timing(True)
        for _ in range(args.steps):
            t = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t)
        fused_parts = cpu_kernels.fused_decode_timing(False)
        wall = statistics.median(walls) * 1e3
        print(f"\n## batch {b}: decode step {wall:.1f} ms (median of {args.steps}; mean {statistics.mean(walls) * 1e3:.1f})")
        accounted = 0.0
        for name, times in PHASES.items():
            ms = statistics.mean(times) * len(times) / args.steps * 1e3
            accounted += ms
            print(f"  {name:<32} {ms:7.1f} ms")
            if name.startswith("model") and any(fused_parts.values()):
                for part, total in fused_parts.items():  # inside the fused step's one native call
                    print(f"    fused: {part:<24} {total / args.steps:7.2f} ms")
        print(f"  {'rest (outputs, bookkeeping)':<32} {statistics.mean(walls) * 1e3 - accounted:7.1f} ms")
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.profiled_steps):
                engine.step()
        events = prof.key_averages()
        ops = sum(e.count for e in events if not e.key.startswith("ProfilerStep"))
        visible = sum(e.self_cpu_time_total for e in events if not e.key.startswith("ProfilerStep"))
        print(
            f"  torch ops per step: {ops / args.profiled_steps:.0f}, their self CPU time "
            f"{visible / args.profiled_steps / 1e3:.1f} ms/step (the compiled kernels, called through ctypes, "
            "are not in it)"
        )
        top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[: args.top]
        for e in top:
            print(
                f"    {e.key[:44]:<44} {e.self_cpu_time_total / args.profiled_steps / 1e3:7.2f} ms/step "
                f"({e.count / args.profiled_steps:.0f} calls)"
            )
        while engine.has_unfinished_requests():
            engine.step()


if __name__ == "__main__":
    main()
