"""Engine workloads A and B through the offline engine (no HTTP), printing figures.

Workload A: ~160-token prompts, 64 output tokens (ignore_eos), closed-loop
concurrency levels; output tokens/s, TTFT p50/p95, TPOT p50; plus transformers
``generate()`` in static batches of the same sizes as a floor.
Workload B: inputs 32-512 and outputs 16-256 tokens drawn at random, closed loop;
the continuous scheduler against ``scheduling_policy="static"``.
Memory: resident set size after N requests against after 100.
Steps: decode step time against batch size (why batching gains little on a CPU).

Closed loop here means: ``c`` requests are in the engine; each time one finishes a
new one is added before the next step. Throughput counts every request; latencies
leave out the opening burst of ``c`` when later requests exist (with ``--rounds 1``
there are none, and the burst is all there is). A script that prints figures, not a test.

    python benchmarks/engine_workloads.py --workload A --levels 1,4,16
"""

import argparse
import random
import time
from collections.abc import Callable

import torch
from step_cpu_time import decode_step_times  # the sibling script's step timer

from plimsoll.bench.script_args import add_options
from plimsoll.runtime.engine.config import EngineConfig
from plimsoll.runtime.engine.llm_engine import LLMEngine
from plimsoll.runtime.engine.sampling_params import SamplingParams
from plimsoll.runtime.testing import run_closed_loop

Shape = Callable[[random.Random], tuple[list[int], int]]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    import os

    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def closed_loop(engine: LLMEngine, concurrency: int, total: int, shape: Shape, seed: int) -> dict[str, float]:
    rng = random.Random(seed)

    def add(i: int) -> str:
        prompt, out_len = shape(rng)
        request_id = f"req-{seed}-{i}"
        params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
        engine.add_request(request_id, prompt, params)
        return request_id

    run = run_closed_loop(engine, concurrency, total, add)
    # Latencies in steady state: the opening burst is excluded when later requests exist.
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in run.steady]  # type: ignore[operator]
    return {
        "requests": len(run.outputs),
        "wall_s": run.wall_s,
        "out_tok_s": run.out_tokens / run.wall_s,
        "ttft_p50": pct(ttft, 50),
        "ttft_p95": pct(ttft, 95),
        "tpot_p50": pct(run.tpot_s(), 50),
        "preemptions": sum(o.metrics.num_preemptions for o in run.steady),
    }


def row(name: str, c: int, r: dict[str, float]) -> str:
    return (
        f"{name:<22} c={c:<3} n={int(r['requests']):<4} out_tok/s={r['out_tok_s']:8.1f}  "
        f"TTFT p50={r['ttft_p50']:7.3f}s p95={r['ttft_p95']:7.3f}s  TPOT p50={r['tpot_p50'] * 1000:7.1f}ms  "
        f"preempt={int(r['preemptions'])}"
    )


def workload_a(args: argparse.Namespace) -> None:
    vocab = None

    def shape(rng: random.Random) -> tuple[list[int], int]:
        return [rng.randrange(100, vocab or 1000) for _ in range(args.a_prompt)], args.a_output

    cfg = EngineConfig(model=args.model, kv_cache_memory=args.kv, max_num_seqs=max(args.levels))
    engine = LLMEngine(cfg)
    vocab = int(engine.hf_config.vocab_size)
    engine.warmup()
    print(f"# Workload A: prompt {args.a_prompt} tokens, output {args.a_output}, model {engine.model_path}")
    for c in args.levels:
        r = closed_loop(engine, c, max(c * args.rounds, c), shape, seed=c)
        print(row("plimsoll continuous", c, r), flush=True)
    if args.hf_floor:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(engine.model_path), dtype=torch.float32)
        del engine
        rng = random.Random(0)
        for c in args.levels:
            batch = torch.tensor([shape(rng)[0] for _ in range(c)])
            t0 = time.monotonic()
            with torch.inference_mode():
                hf.generate(
                    batch,
                    max_new_tokens=args.a_output,
                    min_new_tokens=args.a_output,
                    do_sample=False,
                    pad_token_id=0,
                )
            wall = time.monotonic() - t0
            print(
                f"{'transformers static':<22} c={c:<3} n={c:<4} out_tok/s={c * args.a_output / wall:8.1f}  "
                f"(one generate() batch; TTFT ~ prefill, not measured per request)",
                flush=True,
            )


def workload_b(args: argparse.Namespace) -> None:
    def shape(rng: random.Random) -> tuple[list[int], int]:
        n_in = rng.randint(args.b_in_min, args.b_in_max)
        return [rng.randrange(100, 1000) for _ in range(n_in)], rng.randint(args.b_out_min, args.b_out_max)

    print(
        f"# Workload B: input {args.b_in_min}-{args.b_in_max}, output {args.b_out_min}-{args.b_out_max} tokens"
    )
    results: dict[tuple[str, int], dict[str, float]] = {}
    for policy in ("continuous", "static"):
        cfg = EngineConfig(
            model=args.model, kv_cache_memory=args.kv, max_num_seqs=max(args.levels), scheduling_policy=policy
        )
        engine = LLMEngine(cfg)
        engine.warmup()
        for c in args.levels:
            r = closed_loop(engine, c, max(c * args.rounds, c), shape, seed=1000 + c)
            results[(policy, c)] = r
            print(row(f"plimsoll {policy}", c, r), flush=True)
        del engine
    for c in args.levels:
        cont, stat = results[("continuous", c)], results[("static", c)]
        print(
            f"c={c}: continuous/static output tok/s = {cont['out_tok_s'] / stat['out_tok_s']:.2f}x; "
            f"TTFT p95 {cont['ttft_p95']:.2f}s vs {stat['ttft_p95']:.2f}s"
        )


def memory(args: argparse.Namespace) -> None:
    cfg = EngineConfig(model=args.model, kv_cache_memory=args.kv, max_num_seqs=16)
    engine = LLMEngine(cfg)
    engine.warmup()

    def shape(rng: random.Random) -> tuple[list[int], int]:
        return [rng.randrange(3, 250) for _ in range(rng.randint(8, 64))], rng.randint(4, 16)

    closed_loop(engine, 16, 100, shape, seed=1)
    after_100 = rss_mib()
    closed_loop(engine, 16, args.memory_requests - 100, shape, seed=2)
    after_n = rss_mib()
    print(
        f"# RSS after 100 requests: {after_100:.1f} MiB; after {args.memory_requests}: {after_n:.1f} MiB "
        f"(+{after_n - after_100:.1f} MiB); engine holds {len(engine.groups)} request groups"
    )


def decode_steps(args: argparse.Namespace) -> None:
    """Decode step time against batch size: how much one step's batching buys on this machine.

    Continuous batching wins over static batching by keeping the batch full; that is
    worth something only where a step of b sequences costs much less than b steps of
    one. Process CPU time is printed beside wall time because a shared machine
    stretches wall time by whatever else runs.
    """
    cfg = EngineConfig(
        model=args.model, kv_cache_memory=args.kv, max_num_seqs=max(args.levels), enable_prefix_caching=False
    )
    engine = LLMEngine(cfg)
    engine.warmup()
    vocab = int(engine.hf_config.vocab_size)
    rng = random.Random(0)
    base_cpu = 0.0
    print(f"# decode step time vs batch size, context ~{args.a_prompt} tokens, model {engine.model_path}")
    for b in args.levels:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        prompts = [[rng.randrange(100, vocab) for _ in range(args.a_prompt)] for _ in range(b)]
        cpus, walls = decode_step_times(engine, f"steps-{b}-", prompts, params, steps=8)
        cpu = pct(cpus, 50)
        base_cpu = base_cpu or cpu / b
        print(
            f"batch {b:3d}: step {pct(walls, 50) * 1000:8.1f} ms wall, {cpu * 1000:8.1f} ms CPU; "
            f"{b / cpu:7.1f} tok/s CPU = {b * base_cpu / cpu:5.2f}x the first level's per-token rate",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--workload", choices=["A", "B", "memory", "steps"], default="A")
    ap.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64])
    ap.add_argument("--rounds", type=int, default=2, help="requests per level = rounds x concurrency")
    ap.add_argument("--kv", default="2GiB")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    add_options(ap, a_prompt=160, a_output=64)
    ap.add_argument(
        "--hf-floor", action="store_true", help="also time transformers generate() static batches"
    )
    add_options(ap, b_in_min=32, b_in_max=512, b_out_min=16, b_out_max=256, memory_requests=2000)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    {"A": workload_a, "B": workload_b, "memory": memory, "steps": decode_steps}[args.workload](args)


if __name__ == "__main__":
    main()
