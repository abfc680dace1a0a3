"""Decode step time with and without one CPU fast path, alternated step by step in one engine.

A shared 2-core host moves step times by ±15 % between runs, more than most single
changes are worth, so each comparison here runs both variants in the same process
on the same batch, alternating every step, and prints the median step time of each.
A script that prints figures, not a test.

    python benchmarks/step_ab.py --compare attention --levels 1,16,64

``--compare pool`` first prints the cost of one kernel call (an empty split, a tiny matmul)
with threads started per call against the persistent pool.
"""

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from plimsoll.runtime.engine.config import EngineConfig
from plimsoll.runtime.engine.llm_engine import LLMEngine
from plimsoll.runtime.engine.sampling_params import SamplingParams
from plimsoll.runtime.kernels import cpu_kernels
from plimsoll.runtime.models import dense
from plimsoll.runtime.models.cpu_plan import CPUOptions, CPUPlan

Switch = Callable[[bool], None]


def _onednn(on: bool) -> None:
    dense._ONEDNN = on


def _small_batch(on: bool) -> None:
    plan = PLAN[0]
    for module in plan.model.modules():
        if isinstance(module, dense.Linear):
            module.kernel_rows = plan.options.rows.small_matmul if on else 0


def _attention(on: bool) -> None:
    cpu_kernels.supports_attention = SUPPORTS_ATTENTION if on else (lambda *_: False)


def _fused(on: bool) -> None:
    fused = PLAN[0].fused
    assert fused is not None
    fused.max_rows = FUSED_ROWS[0] if on else 0


def _glued(on: bool) -> None:
    PLAN[0].glued = GLUED[0] if on else None


def _pool(on: bool) -> None:
    cpu_kernels.set_pool_enabled(on)


def _step_overhead(on: bool) -> None:
    _pool(on)
    _fused(on)


def _threads(on: bool) -> None:
    torch.set_num_threads(DEFAULT_THREADS if on else 1)


# The engine's CPU plan (models/cpu_plan.py), and what the switches above put back into it.
PLAN: list[CPUPlan] = []
FUSED_ROWS: list[int] = []
GLUED: list[Any] = []
# --compare packed: the model's plan for each variant, built once.
_PLANS: dict[bool, CPUPlan] = {}


def _packed(on: bool) -> None:
    _PLANS[on].model.cpu_plan = _PLANS[on]


def build_packed_plans(model: Any) -> None:
    """Off: the fused step on plain rows and the glued layers on oneDNN over its prepacked weights
    (the default before column panels); on: both on the panels, and the head too."""
    _PLANS[False] = CPUPlan(model, CPUOptions(packed_weights=False))
    _PLANS[True] = CPUPlan(model, CPUOptions())


DEFAULT_THREADS = torch.get_num_threads()
SUPPORTS_ATTENTION = cpu_kernels.supports_attention
# name: (switch, label off, label on); every other fast path stays as the engine has it.
COMPARISONS: dict[str, tuple[Switch, str, str]] = {
    "onednn": (_onednn, "MKL F.linear", "oneDNN"),
    "small-batch": (_small_batch, "oneDNN", "small-batch kernel"),
    "attention": (_attention, "SDPA over gathered contexts", "decode-attention kernel"),
    "fused": (_fused, "layer by layer (modules)", "fused decode step"),
    "overhead": (_step_overhead, "threads per call, layer by layer", "worker pool + fused decode step"),
    "glued": (_glued, "layer by layer (modules)", "glued layers (oneDNN + native glue)"),
    "pool": (_pool, "threads started per kernel call", "persistent worker pool"),
    "threads": (_threads, "1 intra-op thread", "torch's default threads"),
    "packed": (_packed, "plain rows + oneDNN prepacked", "column panels"),
}


def per_call_overhead(calls: int = 2000, rounds: int = 5) -> None:
    """Microseconds per call of an empty split and of a tiny matmul (1 x 576 @ 576 x 576, SmolLM2's
    o_proj), threads per call vs the pool, alternating rounds; medians over the rounds."""
    x, w = torch.randn(1, 576), torch.randn(576, 576)
    threads = torch.get_num_threads()
    cases = {
        f"empty call over {threads} threads": lambda: cpu_kernels.pool_noop(threads),
        "small_batch_linear 1x576 @ 576x576": lambda: cpu_kernels.small_batch_linear(x, w, None),
    }
    for name, fn in cases.items():
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(rounds):
            for variant in (False, True):
                _pool(variant)
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                times[variant].append((time.perf_counter() - t0) / calls * 1e6)
        a, b = (statistics.median(times[v]) for v in (False, True))
        print(f"{name}: threads per call {a:6.1f} us | pool {b:6.1f} us | ratio {b / a:.2f}", flush=True)
    _pool(True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compare", choices=sorted(COMPARISONS), required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64])
    ap.add_argument("--steps", type=int, default=8, help="measured steps per variant and level")
    ap.add_argument("--prompt", type=int, default=160, help="context tokens before decoding starts")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--dtype", default="float32", help="the engine's --dtype (bfloat16: the bf16 glue and kernels)")
    ap.add_argument(
        "--fused-max-rows", type=int, default=0,
        help="with --compare fused: the most decode rows the fused step takes (0: the plan's)",
    )  # fmt: skip
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    switch, off, on = COMPARISONS[args.compare]
    if args.compare != "onednn" and cpu_kernels.library() is None:
        raise SystemExit(f"the CPU kernels are not available here: {cpu_kernels.unavailable_reason()}")
    if args.compare == "pool":
        per_call_overhead()
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            kv_cache_memory="1GiB",
            max_num_seqs=max(args.levels),
            enable_prefix_caching=False,
        )
    )
    engine.warmup()
    plan = engine.runner.cpu_plan
    PLAN.append(plan)
    FUSED_ROWS.append(args.fused_max_rows or (plan.fused.max_rows if plan.fused is not None else 0))
    GLUED.append(plan.glued)
    if args.compare == "packed":
        build_packed_plans(engine.runner.model)
    vocab = int(engine.hf_config.vocab_size)
    rng = random.Random(0)
    print(
        f"# {args.compare}: {off} vs {on}; decode step ms (median of {args.steps}), context ~{args.prompt}, "
        f"{args.dtype}"
    )
    for b in args.levels:
        params = SamplingParams(temperature=0, max_tokens=2 * args.steps + 2, ignore_eos=True)
        for i in range(b):
            engine.add_request(f"ab-{b}-{i}", [rng.randrange(100, vocab) for _ in range(args.prompt)], params)
        while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
            engine.step()  # prefill until every sequence decodes
        times: dict[bool, list[float]] = {False: [], True: []}
        for i in range(args.steps):
            # ABBA order: a step that runs after the other variant's pays for its leftovers
            # (caches, a helper thread still spinning) the same number of times in each variant.
            for variant in (False, True) if i % 2 == 0 else (True, False):
                switch(variant)
                t0 = time.perf_counter()
                engine.step()
                times[variant].append(time.perf_counter() - t0)
        switch(True)
        while engine.has_unfinished_requests():
            engine.step()
        a, b_ms = (statistics.median(times[v]) * 1000 for v in (False, True))
        print(f"batch {b:3d}: {off} {a:7.1f} ms | {on} {b_ms:7.1f} ms | ratio {b_ms / a:.2f}", flush=True)


if __name__ == "__main__":
    main()
