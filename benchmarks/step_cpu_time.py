"""Decode step time as CPU seconds and wall seconds, for comparing two checkouts on a loaded host.

What it is: one engine on the embedded SmolLM2, ``b`` sequences decoding at a ``--prompt``-token
context; for each batch size the median over ``--steps`` decode steps of the process's CPU time
(``time.process_time``) and of wall time, printed as one JSON line ``{b: [cpu_ms, wall_ms]}``.
It uses only the engine's public interface, so the same file measures another checkout:

    PYTHONPATH=/path/to/other/checkout/as/plimsoll python benchmarks/step_cpu_time.py --threads 1

One intra-op thread by default: on a host shared with other work, a single-threaded step's CPU
time is what its code costs, while its wall time (and any multi-threaded figure) measures the
host's load. Run the two checkouts alternately, several rounds, and compare medians. A script
that prints figures, not a test.

``decode_step_times`` is also the step timer of ``engine_workloads.py --workload steps``.
"""

import argparse
import json
import random
import statistics
import time

import torch

from plimsoll.runtime.engine.config import EngineConfig
from plimsoll.runtime.engine.llm_engine import LLMEngine
from plimsoll.runtime.engine.sampling_params import SamplingParams


def decode_step_times(
    engine: LLMEngine, prefix: str, prompts: list[list[int]], params: SamplingParams, steps: int
) -> tuple[list[float], list[float]]:
    """Each of ``steps`` decode steps of the whole batch of ``prompts``: its CPU and its wall seconds.

    The requests (ids ``prefix`` + index) are prefilled first and finished after, so neither is
    timed; ``params`` must leave each more than ``steps`` tokens to make.
    """
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", prompt, params)
    while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()  # prefill until every sequence decodes
    cpu, wall = [], []
    for _ in range(steps):
        c, w = time.process_time(), time.perf_counter()
        engine.step()
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
    while engine.has_unfinished_requests():
        engine.step()
    return cpu, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--prompt", type=int, default=64, help="context tokens before decoding starts")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = LLMEngine(
        EngineConfig(
            model="smollm2-135m", kv_cache_memory="512MiB", max_num_seqs=max(args.levels), max_model_len=512,
            enable_prefix_caching=False,
        )
    )  # fmt: skip
    engine.warmup()
    rng = random.Random(0)
    out = {}
    for b in args.levels:
        params = SamplingParams(temperature=0, max_tokens=args.steps + 4, ignore_eos=True)
        prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt)] for _ in range(b)]
        cpu, wall = decode_step_times(engine, f"r{b}-", prompts, params, args.steps)
        out[b] = [round(statistics.median(cpu) * 1e3, 1), round(statistics.median(wall) * 1e3, 1)]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
