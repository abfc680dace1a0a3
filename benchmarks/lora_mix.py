"""Multi-LoRA cost: an even mix of 4 adapters against the base model alone, printing figures.

What it is: a script. It loads the embedded SmolLM2-135M-Instruct once with
``--enable-lora --max-loras 4``, writes 4 random rank-16 PEFT adapters on all seven
projections (q/k/v/o/gate/up/down, made by peft itself), then runs the offline
engine closed loop at concurrency ``--concurrency`` twice: every request on the base
model, then requests spread evenly over the 4 adapters (so every step mixes them).
It prints output tokens/s and TPOT p50 for both and the ratio (the target:
the mix keeps at least 0.8 of the base model's throughput). Runs alternate for
``--rounds`` and the best of each is kept; tokens per CPU-second are printed too,
since on a shared host wall-clock throughput moves with the neighbours' load.

Closed loop: ``c`` requests are in the engine; each time one finishes another is
added before the next step. TPOT leaves out the opening burst of ``c``.

    python benchmarks/lora_mix.py --concurrency 16 --requests 48

What it is not: a test, nor a GPU measurement (``--device cuda`` runs the same torch
path there). Figures move with whatever else runs on the host.
"""

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch

from plimsoll.bench.script_args import add_options
from plimsoll.runtime.engine.config import EngineConfig
from plimsoll.runtime.engine.llm_engine import LLMEngine
from plimsoll.runtime.engine.sampling_params import SamplingParams
from plimsoll.runtime.models.embedded import ensure_embedded_model
from plimsoll.runtime.testing import run_closed_loop, write_random_lora

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))] if s else float("nan")


def closed_loop(
    engine: LLMEngine,
    loras: list[str | None],
    concurrency: int,
    total: int,
    args: argparse.Namespace,
    tag: str,
) -> dict[str, float]:
    rng = random.Random(0)  # the same prompts for both runs
    vocab = int(engine.hf_config.vocab_size)

    def add(i: int) -> str:
        prompt = [rng.randrange(100, vocab) for _ in range(args.input_tokens)]
        params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
        request_id = f"{tag}-{i}"
        engine.add_request(request_id, prompt, params, lora_name=loras[i % len(loras)])
        return request_id

    run = run_closed_loop(engine, concurrency, total, add)
    return {
        "wall_s": run.wall_s,
        "out_tok_s": run.out_tokens / run.wall_s,
        "out_tok_cpu_s": run.out_tokens / run.cpu_s,
        "tpot_p50": pct(run.tpot_s(), 50),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(ap, concurrency=16, requests=48, input_tokens=128, output_tokens=64, rank=16, adapters=4)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--rounds", type=int, default=2, help="alternating base/mix runs; the best of each is kept"
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    base_dir = ensure_embedded_model("smollm2-135m")
    work = Path(tempfile.mkdtemp(prefix="plimsoll-lora-mix-"))
    names = [f"lora{i}" for i in range(args.adapters)]
    t0 = time.monotonic()
    dirs = {
        n: write_random_lora(
            base_dir, work / n, args.rank, ALL_PROJECTIONS, 2.0 * args.rank, seed=i, scale=0.05
        )
        for i, n in enumerate(names)
    }
    print(
        f"{args.adapters} random rank-{args.rank} adapters on all 7 projections written in "
        f"{time.monotonic() - t0:.1f}s under {work}"
    )
    config = EngineConfig(
        model="smollm2-135m",
        device=args.device,
        enable_lora=True,
        max_loras=args.adapters,
        max_lora_rank=args.rank,
        lora_modules=[{"name": n, "path": str(p)} for n, p in dirs.items()],
        kv_cache_memory="2GiB",
        max_num_seqs=max(args.concurrency, 16),
    )
    engine = LLMEngine(config)
    engine.warmup()
    closed_loop(engine, [None, *names], 4, 8, args, "warm")  # first calls of every path
    runs: dict[str, dict[str, float]] = {}
    mix_label = f"even mix of {args.adapters} adapters"
    for i in range(args.rounds):
        for label, loras in (("base alone", [None]), (mix_label, names)):
            r = closed_loop(
                engine, loras, args.concurrency, args.requests, args, f"{label.replace(' ', '-')}-{i}"
            )
            print(
                f"repeat {i} {label:<24} c={args.concurrency} n={args.requests} in={args.input_tokens} "
                f"out={args.output_tokens}  out_tok/s={r['out_tok_s']:7.1f} (per CPU-s {r['out_tok_cpu_s']:7.1f})  "
                f"TPOT p50={r['tpot_p50'] * 1000:6.1f}ms  wall={r['wall_s']:.1f}s",
                flush=True,
            )
            if label not in runs or r["out_tok_s"] > runs[label]["out_tok_s"]:
                runs[label] = r
    base, mix = runs["base alone"], runs[mix_label]
    assert engine.lora is not None
    print(
        f"best of {args.rounds}: mix / base output tok/s = {mix['out_tok_s'] / base['out_tok_s']:.2f} (target >= 0.8), "
        f"per CPU-second {mix['out_tok_cpu_s'] / base['out_tok_cpu_s']:.2f}; TPOT p50 base "
        f"{base['tpot_p50'] * 1000:.1f}ms, mix {mix['tpot_p50'] * 1000:.1f}ms "
        f"(ratio {mix['tpot_p50'] / base['tpot_p50']:.2f}); slot loads = {engine.lora.num_swaps}"
    )


if __name__ == "__main__":
    main()
