"""Sampled against greedy decoding at 64 concurrent sequences: the batched sampler against the per-row one.

Runs the offline engine (no HTTP) on SmolLM2-135M-Instruct (the embedded model; its
49,152-token vocabulary is what the sampler works over) with 64 requests of ~32-token
prompts and ``--tokens`` output tokens each (ignore_eos), all in the engine at once:
greedy (temperature 0), sampled with the API's defaults (temperature 1.0) and sampled
with top-p 0.9, top-k 50 and a repetition penalty, each with the engine's batched
sampler and with ``sampler_reference.ReferenceSampler`` (the per-row loop with a host
read per row). Prints output tokens/s, the median decode step and sampled ÷ greedy per
sampler; the variants alternate over ``--rounds`` so load drift hits them alike. Then the
samplers alone on the same shapes (64 rows of 49,152 logits, 20 steps of growing
histories): milliseconds per step, which the model's step time does not blur. A script
that prints figures, not a test.

    python benchmarks/sampler_throughput.py --rounds 2
"""

import argparse
import random
import statistics
import time
from typing import Any

import torch

from plimsoll.runtime import LLM, SamplingParams
from plimsoll.runtime.engine.sampler import Sampler
from plimsoll.runtime.engine.sampler_reference import ReferenceSampler

CONCURRENCY = 64
KINDS: dict[str, dict[str, Any]] = {
    "greedy": dict(temperature=0.0),
    "sampled (defaults)": dict(),
    "sampled (top-p, top-k, penalty)": dict(top_p=0.9, top_k=50, repetition_penalty=1.1),
}


class Steps:
    """Observer keeping each decode-only step's time."""

    def __init__(self) -> None:
        self.decode: list[float] = []

    def on_step(self, stats: Any) -> None:
        if stats.num_prefill_tokens == 0 and stats.num_decode_tokens > 0:
            self.decode.append(stats.step_time_s)

    def on_request_finished(self, output: Any) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=32, help="output tokens per request")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--sampler-only", action="store_true", help="only the samplers alone, no model")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.sampler_only:
        sampler_alone(KINDS, 49152)
        return
    steps = Steps()
    llm = LLM(model=args.model, observer=steps, kv_cache_memory="1GiB", max_num_seqs=CONCURRENCY)
    vocab = int(llm.engine.hf_config.vocab_size)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab) for _ in range(32)] for _ in range(CONCURRENCY)]
    kinds = KINDS
    samplers = {
        "batched": Sampler(llm.engine.tokenizer, seed=0),
        "per-row": ReferenceSampler(llm.engine.tokenizer, seed=0),
    }
    llm.generate(prompts[:4], SamplingParams(max_tokens=4))  # warm-up
    figures: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        for sampler_name, sampler in samplers.items():
            llm.engine.sampler = sampler  # type: ignore[assignment]
            for kind, params in kinds.items():
                steps.decode.clear()
                p = SamplingParams(max_tokens=args.tokens, ignore_eos=True, seed=None, **params)  # type: ignore[arg-type]
                t = time.perf_counter()
                outs = llm.generate(prompts, p)
                wall = time.perf_counter() - t
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                figures.setdefault((sampler_name, kind), []).append(
                    (tokens / wall, statistics.median(steps.decode) * 1000)
                )
                print(f"  {sampler_name} / {kind}: {tokens / wall:.1f} tok/s", flush=True)
    print(f"model {args.model}, vocab {vocab}, {CONCURRENCY} concurrent, {args.tokens} output tokens each, "
          f"{torch.get_num_threads()} threads, {args.rounds} rounds (best of each)")  # fmt: skip
    print(f"{'sampler':9s} {'requests':34s} {'tok/s':>8s} {'decode step ms':>15s} {'÷ greedy':>9s}")
    for sampler_name in samplers:
        greedy = max(r for r, _ in figures[(sampler_name, "greedy")])
        for kind in kinds:
            rate = max(r for r, _ in figures[(sampler_name, kind)])
            step = min(s for _, s in figures[(sampler_name, kind)])
            print(f"{sampler_name:9s} {kind:34s} {rate:8.1f} {step:15.2f} {rate / greedy:9.3f}")
    for kind in list(kinds)[1:]:
        new = max(r for r, _ in figures[("batched", kind)])
        old = max(r for r, _ in figures[("per-row", kind)])
        print(f"{kind}: batched ÷ per-row tok/s = {new / old:.2f}")
    sampler_alone(kinds, vocab)


def sampler_alone(kinds: dict[str, dict[str, Any]], vocab: int, steps: int = 20) -> None:
    """Milliseconds per step of each sampler alone, best of ``steps`` steps (histories grow)."""
    from plimsoll.runtime.engine.request import Request

    print(f"samplers alone: {CONCURRENCY} rows x {vocab} logits, best of {steps} steps")
    for kind, params in kinds.items():
        times = {}
        for name, make in (
            ("batched", lambda: Sampler(None, seed=0)),
            ("per-row", lambda: ReferenceSampler(None, seed=0)),
        ):
            sampler: Any = make()
            reqs = [
                Request(
                    f"{kind}{i}",
                    "g",
                    0,
                    list(range(100, 132)),
                    SamplingParams(max_tokens=steps, **params),
                    frozenset(),
                )
                for i in range(CONCURRENCY)
            ]
            gen = torch.Generator().manual_seed(1)
            best = float("inf")
            for _ in range(steps):
                logits = torch.randn(CONCURRENCY, vocab, generator=gen) * 3
                t = time.perf_counter()
                out = sampler(reqs, logits)
                best = min(best, time.perf_counter() - t)
                for req, (token, _) in zip(reqs, out, strict=True):
                    req.append_token(token)
            times[name] = best * 1000
        print(
            f"  {kind:34s} batched {times['batched']:8.2f} ms   per-row {times['per-row']:8.2f} ms   "
            f"per-row / batched {times['per-row'] / times['batched']:6.2f}"
        )


if __name__ == "__main__":
    main()
