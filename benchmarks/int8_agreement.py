"""Greedy agreement of ``--quantization int8`` with float32 on the embedded SmolLM2, by weight layout.

What it is: the 32 prompts of ``tests/runtime/models/test_quant_int8.py``, 32 greedy tokens each,
decoded by float32 and by int8 in each layout given: ``row`` (one symmetric scale per output row),
``symG`` (symmetric, a scale per G inputs of a row), ``asymG`` (a scale and an offset per G inputs:
the default is ``asym32``) and ``asymG-nogrid`` (the same without grid recovery: what a checkpoint
that is not dequantised from a grid, e.g. a bf16-trained one, gets). It also prints the time
``quantize_model`` took. For each
prompt that differs it prints where the two first part and float32's own logprob margin there
(its chosen token's logprob minus that of int8's token): a margin of a few hundredths of a nat
is a near-tie that any rounding of the weights may flip. It prints figures; it asserts nothing.

Run: ``python benchmarks/int8_agreement.py --layouts row,sym32,asym32-nogrid,asym32``; with
``--kv-cache-dtype`` it compares float32 against float32 weights over an int8 KV cache instead.
"""

import argparse
import sys
import time
from pathlib import Path

from plimsoll.runtime import LLM, SamplingParams
from plimsoll.runtime.models import quant


def prompts() -> list[str]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "runtime" / "models"))
    from test_quant_int8 import PROMPTS  # the test's own prompts, so the figures are the test's

    return list(PROMPTS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default="row,sym32,asym32-nogrid,asym32", help="weight layouts to try")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--kv-cache-dtype", action="store_true", help="compare --kv-cache-dtype int8 (float weights) instead")
    args = ap.parse_args()
    texts = prompts()
    greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True, logprobs=5)
    llm = LLM(model="smollm2-135m", max_num_seqs=32, max_model_len=128)
    ids = [llm.tokenizer(t).input_ids for t in texts]
    ref = [o.outputs[0] for o in llm.generate(ids, greedy)]
    del llm
    timed = quant.quantize_model
    quantize_seconds: list[float] = []

    def timed_quantize(*a: object, **kw: object) -> object:
        t = time.perf_counter()
        out = timed(*a, **kw)  # type: ignore[arg-type]
        quantize_seconds.append(time.perf_counter() - t)
        return out

    quant.quantize_model = timed_quantize  # type: ignore[assignment]
    for layout in ["kv"] if args.kv_cache_dtype else args.layouts.split(","):
        if layout != "kv":
            quant.ASYMMETRIC = layout.startswith("asym")
            quant.GRID_RECOVERY = not layout.endswith("-nogrid")
            digits = layout.removesuffix("-nogrid").removeprefix("a").removeprefix("sym")
            quant.GROUP_SIZE = 0 if layout == "row" else int(digits)
        quantize_seconds.clear()
        t0 = time.perf_counter()
        if layout == "kv":
            llm = LLM(model="smollm2-135m", kv_cache_dtype="int8", max_num_seqs=32, max_model_len=128)
        else:
            llm = LLM(model="smollm2-135m", quantization="int8", max_num_seqs=32, max_model_len=128)
        got = [o.outputs[0].token_ids for o in llm.generate(ids, greedy)]
        secs = time.perf_counter() - t0
        weights = quant.weight_bytes(llm.engine.runner.model)
        del llm
        same = sum(list(r.token_ids) == list(g) for r, g in zip(ref, got, strict=True))
        agree = sum(a == b for r, g in zip(ref, got, strict=True) for a, b in zip(r.token_ids, g, strict=True))
        margins = []
        for r, g in zip(ref, got, strict=True):
            first = next((i for i, (a, b) in enumerate(zip(r.token_ids, g, strict=True)) if a != b), None)
            if first is None:
                continue
            top = r.logprobs[first] if r.logprobs else {}
            mine, theirs = top.get(r.token_ids[first]), top.get(g[first])
            margins.append(
                (first, None if mine is None or theirs is None else mine.logprob - theirs.logprob)
            )
        label = "int8 KV" if layout == "kv" else layout
        took = f", quantised in {quantize_seconds[0]:.1f} s" if quantize_seconds else ""
        print(
            f"{label:>13}: {same}/{len(texts)} prompts identical over {args.tokens} tokens, "
            f"{agree}/{args.tokens * len(texts)} tokens; weights {weights / 2**20:.1f} MiB; {secs:.0f} s{took}"
        )
        for first, margin in sorted(margins, key=lambda m: (m[1] is None, m[1] or 0)):
            shown = "not in fp32's top 5" if margin is None else f"{margin:.3f} nats"
            print(f"           parts at token {first:2d}: fp32 margin {shown}")


if __name__ == "__main__":
    main()
