"""The host and disk tiers in a real engine: evicted prompts come back as hits, outputs unchanged.

A primary cache of 20 blocks (320 tokens) and prompts of 200 tokens: serving A, then B,
evicts A's blocks; A again must find them in the host tier (``cached_tokens`` counts them)
and compute only the rest, with greedy output identical to an engine without tiers. The
same holds with chunked prefill, an int8 KV cache, LoRA adapters (whose salted blocks stay
their own), preemption, and a disk tier below a host tier too small to hold them.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from plimsoll.runtime.engine.outputs import RequestOutput, StepStats

PROMPT = 200


class Prefill:
    def __init__(self) -> None:
        self.tokens = 0

    def on_step(self, stats: StepStats) -> None:
        self.tokens += stats.num_prefill_tokens

    def on_request_finished(self, output: RequestOutput) -> None:
        pass


def prompts(seed: int, n: int = 2) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 259) for _ in range(PROMPT)] for _ in range(n)]


def run(
    model: Path, sequence: list[list[int]], lora: str | None = None, **kw: Any
) -> tuple[list[Any], Prefill]:
    from plimsoll.runtime import LLM, SamplingParams

    counter = Prefill()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    kw.setdefault("kv_cache_memory", "160KiB")  # 20 blocks of 16 tokens in float32
    llm = LLM(model=str(model), observer=counter, max_model_len=256, **kw)
    out = []
    try:
        for prompt in sequence:
            result = llm.engine.generate([prompt], params, [lora] if lora else None)[0]
            if llm.engine.kv_connector is not None:
                llm.engine.kv_connector.drain()
            out.append((result.metrics.num_cached_tokens, result.outputs[0].token_ids))
    finally:
        llm.close()
    return out, counter


@pytest.mark.parametrize(
    "extra",
    [{}, {"max_num_batched_tokens": 48}, {"kv_cache_dtype": "int8", "kv_cache_memory": "50KiB"}],
    ids=["plain", "chunked-prefill", "int8-kv"],
)
def test_evicted_prompt_is_a_host_tier_hit(tiny_model_dir: Any, extra: dict[str, Any]) -> None:
    model = tiny_model_dir("llama")
    a, b = prompts(1)
    base, base_prefill = run(model, [a, b, a], **extra)
    tier, tier_prefill = run(model, [a, b, a], kv_offloading_size=0.01, **extra)
    assert [t for _, t in tier] == [t for _, t in base]  # greedy output identical
    # Without tiers only the blocks B left behind are hits; with them all of A's full blocks.
    full = (PROMPT - 1) // 16 * 16
    assert base[2][0] < full and tier[2][0] == full
    print(f"third request computed {PROMPT - base[2][0]} tokens without tiers, {PROMPT - tier[2][0]} with")
    assert tier_prefill.tokens == base_prefill.tokens - (full - base[2][0])


def test_lora_blocks_are_salted_and_tiered(tiny_model_dir: Any, tmp_path: Path) -> None:
    from plimsoll.runtime.engine.config import LoRAModule
    from plimsoll.runtime.testing import write_random_lora

    model = tiny_model_dir("llama")
    adapter = write_random_lora(model, tmp_path / "ad", r=4)
    kw: dict[str, Any] = {"enable_lora": True, "lora_modules": [LoRAModule(name="ad", path=str(adapter))],
                          "max_lora_rank": 8}  # fmt: skip
    a, b = prompts(2)
    base, _ = run(model, [a, b, a], lora="ad", **kw)
    tier, _ = run(model, [a, b, a], lora="ad", kv_offloading_size=0.01, **kw)
    assert [t for _, t in tier] == [t for _, t in base] and tier[2][0] == (PROMPT - 1) // 16 * 16
    # The base model's A after the adapter's A: no block of the adapter's is served to it.
    mixed, _ = run(model, [a], kv_offloading_size=0.01)
    assert mixed[0][1] != tier[0][1] or mixed[0][0] == 0


def test_preemption_with_offload_keeps_outputs(tiny_model_dir: Any) -> None:
    from plimsoll.runtime import LLM, SamplingParams

    model = str(tiny_model_dir("llama"))
    batch = [p[:150] for p in prompts(3, n=4)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = []
    for extra in ({}, {"kv_offloading_size": 0.01}):
        llm = LLM(model=model, kv_cache_memory="160KiB", max_model_len=256, **extra)
        try:
            result = llm.generate(batch, params)  # two 150-token prompts fill the cache; decoding preempts
            outs.append([o.outputs[0].token_ids for o in result])
            assert llm.engine.scheduler.total_preemptions > 0
        finally:
            llm.close()
    assert outs[0] == outs[1]


def test_disk_tier_below_a_small_host_tier(tiny_model_dir: Any, tmp_path: Path) -> None:
    model = tiny_model_dir("llama")
    a, b, c = prompts(4, n=3)
    base, _ = run(model, [a, b, c, a])
    # Host tier of 16 blocks: B's and C's evictions push A's 12 blocks to the 64-block disk tier;
    # A comes back from it (through the host tier, which stages a prompt's blocks).
    tier, _ = run(model, [a, b, c, a], kv_offloading_size=16 * 8192 / 2**30,
                  kv_offloading_disk_path=str(tmp_path / "disk"), kv_offloading_disk_size=64 * 8192 / 2**30)  # fmt: skip
    assert [t for _, t in tier] == [t for _, t in base]
    assert tier[3][0] > base[3][0]
