"""RSS growth of the engine over many mixed requests (the limit: at most 50 MiB over 2,000).

What it is: the offline engine on the embedded SmolLM2 (or ``--model``), fed waves of requests
with random prompt lengths (8-256 tokens), output lengths (1-48), greedy or sampled, some with
stop strings, logprobs or a shared prefix (prefix-cache hits), so every batch size and row count
a step can have appears. It reads the process's resident set (``VmRSS``) after a warm-up and
after every wave and prints them: a cache keyed by shape (oneDNN's primitives, say) or a
per-request leak shows as growth. It prints figures; it asserts nothing.

Run: ``python benchmarks/rss_growth.py --requests 2000``
"""

import argparse
import gc
import random
import time

from plimsoll.runtime import LLM, SamplingParams


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status (this benchmark reads Linux's /proc)")


def wave(rng: random.Random, size: int, vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    shared = [rng.randrange(100, vocab) for _ in range(64)]
    prompts, params = [], []
    for _ in range(size):
        body = [rng.randrange(100, vocab) for _ in range(rng.randint(8, 256))]
        prompts.append(shared + body[:192] if rng.random() < 0.3 else body)
        kind = rng.random()
        params.append(
            SamplingParams(
                temperature=0 if kind < 0.5 else rng.choice([0.7, 1.0]),
                top_p=1.0 if kind < 0.75 else 0.9,
                max_tokens=rng.randint(1, 48),
                ignore_eos=rng.random() < 0.5,
                stop=["."] if rng.random() < 0.2 else [],
                logprobs=2 if rng.random() < 0.1 else None,
                seed=rng.randrange(2**31),
            )
        )
    return prompts, params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--wave", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--kv-cache-dtype", default="auto")
    args = ap.parse_args()
    llm = LLM(
        model=args.model, max_num_seqs=args.max_num_seqs, max_model_len=512, quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )  # fmt: skip
    llm.engine.warmup()  # as `plimsoll serve` does before it is ready (its largest step included)
    vocab = int(llm.engine.hf_config.vocab_size)
    rng = random.Random(0)
    llm.generate(*wave(rng, args.warmup, vocab))
    gc.collect()
    start, t0, done = rss_mib(), time.perf_counter(), 0
    print(f"after {args.warmup} warm-up requests: RSS {start:.1f} MiB", flush=True)
    while done < args.requests:
        n = min(args.wave, args.requests - done)
        outs = llm.generate(*wave(rng, n, vocab))
        done += len(outs)
        gc.collect()
        print(
            f"{done:5d} requests: RSS {rss_mib():.1f} MiB ({rss_mib() - start:+.1f}), "
            f"{time.perf_counter() - t0:.0f} s",
            flush=True,
        )
    print(f"RSS growth over {done} mixed requests: {rss_mib() - start:+.1f} MiB (limit: 50 MiB)")


if __name__ == "__main__":
    main()
