"""Decode speed on this host: default vs int8 weights vs n-gram speculation, against the
memory-bandwidth floor measured in the same run.

For each mode: TPOT at c=1 (one request, 64 tokens, ``ignore_eos``), output tok/s at
c=16 (16 requests of 64 tokens at once), and for speculation the acceptance rate.
The "repetitive" workload asks the model to repeat a passage it was given, which is
where prompt lookup pays; the "plain" one is Workload A-like prose. Offline engine
(no HTTP), SmolLM2-135M, float32 activations. vLLM is not run here. A script that
prints figures, not a test.

    python benchmarks/speed_figures.py [--modes default,int8,ngram]
"""

import argparse
import time

import torch

from plimsoll.bench.hostprobe import bandwidth_gbs
from plimsoll.runtime import LLM, SamplingParams
from plimsoll.runtime.engine.outputs import RequestOutput, StepStats
from plimsoll.runtime.models.quant import weight_bytes

PASSAGE = (
    "The harbour town wakes before dawn. Fishing boats slip out past the lighthouse, their engines "
    "low and steady, while the bakery on the corner lights its ovens and the smell of bread drifts "
    "down to the water. By seven the market stalls are open, selling mackerel, crab and bright "
    "bunches of flowers, and the first ferry of the day sounds its horn as it leaves for the islands."
)
PLAIN = "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 4
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
MODES = {"default": {}, "int8": {"quantization": "int8"}, "ngram": {"speculative_config": NGRAM}}


class Spec:
    def __init__(self) -> None:
        self.draft = self.accepted = 0

    def on_step(self, stats: StepStats) -> None:
        self.draft += stats.spec_num_draft_tokens
        self.accepted += stats.spec_num_accepted_tokens

    def on_request_finished(self, output: RequestOutput) -> None:
        pass


def tpot(out: RequestOutput) -> float:
    m = out.metrics
    assert m.first_token_time is not None and m.last_token_time is not None
    return (m.last_token_time - m.first_token_time) / max(1, m.num_generation_tokens - 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="default,int8,ngram")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    gbs = bandwidth_gbs()
    print(f"memory bandwidth (copy, {torch.get_num_threads()} threads): {gbs:.1f} GB/s")
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    floor_fp32 = None
    for mode in args.modes.split(","):
        spec = Spec()
        llm = LLM(observer=spec, max_num_seqs=16, **MODES[mode])  # type: ignore[arg-type]
        llm.engine.warmup()
        tok = llm.tokenizer
        wbytes = weight_bytes(llm.engine.runner.model)
        floor = wbytes / (gbs * 1e9)
        floor_fp32 = floor_fp32 or floor
        repeat = tok.apply_chat_template(
            [{"role": "user", "content": f"Repeat this text word for word:\n\n{PASSAGE}"}],
            add_generation_prompt=True,
            tokenize=False,
        )
        repeat = tok(repeat).input_ids
        plain = tok(PLAIN).input_ids
        for name, prompt in (("plain", plain), ("repetitive", repeat)):
            spec.draft = spec.accepted = 0
            one = llm.generate([prompt], params)[0]
            t = time.perf_counter()
            many = llm.generate([prompt] * 16, params)
            wall = time.perf_counter() - t
            rate = sum(o.metrics.num_generation_tokens for o in many) / wall
            acc = f", acceptance {spec.accepted / spec.draft:.2f}" if spec.draft else ""
            print(
                f"{mode:8s} {name:10s} weights {wbytes / 2**20:6.1f} MiB  TPOT c=1 {tpot(one) * 1e3:6.1f} ms "
                f"(floor {floor * 1e3:.1f} ms, fp32 floor {floor_fp32 * 1e3:.1f} ms, "
                f"{tpot(one) / floor:.2f}x)  c=16 {rate:6.1f} out tok/s{acc}"
            )


if __name__ == "__main__":
    main()
