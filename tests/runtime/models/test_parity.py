"""Greedy output equals transformers ``generate()`` token for token (fp32, 32 new tokens).

32 prompts of mixed lengths (half sharing a prefix) go in at once, under three
engine set-ups: prefix caching on, off, and a KV budget so small that requests are
preempted and recomputed (with a small token budget that chunks prefills too).
"""

import random
from typing import Any

import pytest
import torch
from tiny_models import ARCHS

NEW_TOKENS = 32
SETUPS = {
    "prefix-caching": dict(enable_prefix_caching=True, kv_cache_memory="8MiB"),
    "no-prefix-caching": dict(enable_prefix_caching=False, kv_cache_memory="8MiB"),
    # 512 bytes/token x 16 = 8 KiB per block: 40 blocks for ~4,200 tokens of demand.
    "preemption": dict(enable_prefix_caching=True, kv_cache_memory=40 * 8192, max_model_len=640, max_num_batched_tokens=96),
}


def make_prompts(seed: int, count: int = 32) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 259) for _ in range(40)]
    prompts = []
    for i in range(count):
        length = rng.choice([1, 5, 17, 33, 64, 100, 150, 200])
        body = [rng.randrange(3, 259) for _ in range(length)]
        prompts.append(shared + body if i % 2 else body)
    return prompts


_REFERENCE: dict[str, tuple[list[list[int]], list[list[int]]]] = {}


def reference(arch: str, directory: Any) -> tuple[list[list[int]], list[list[int]]]:
    if arch not in _REFERENCE:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(
            str(directory), attn_implementation="eager", dtype=torch.float32
        )
        prompts = make_prompts(ARCHS.index(arch))
        # Prompts of equal length go through generate() together: no padding, so
        # each row is computed exactly as it would be alone, in a fraction of the time.
        by_len: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            by_len.setdefault(len(p), []).append(i)
        refs: list[list[int]] = [[] for _ in prompts]
        with torch.inference_mode():
            for length, idx in by_len.items():
                out = hf.generate(
                    torch.tensor([prompts[i] for i in idx]),
                    max_new_tokens=NEW_TOKENS,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )
                for row, i in enumerate(idx):
                    refs[i] = out[row, length:].tolist()
        _REFERENCE[arch] = (prompts, refs)
    return _REFERENCE[arch]


@pytest.mark.slow
@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_transformers(arch: str, setup: str, tiny_model_dir: Any, record_property: Any) -> None:
    from plimsoll.runtime import LLM, SamplingParams

    directory = tiny_model_dir(arch)
    prompts, refs = reference(arch, directory)
    llm = LLM(model=str(directory), **SETUPS[setup])
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    got = [o.outputs[0].token_ids for o in outs]
    mismatched = [i for i, (g, r) in enumerate(zip(got, refs, strict=True)) if g != r]
    assert not mismatched, f"{arch}/{setup}: prompts {mismatched} differ from transformers"
    preemptions = llm.engine.scheduler.total_preemptions
    record_property("preemptions", preemptions)
    print(f"{arch}/{setup}: 32 prompts equal, preemptions={preemptions}")
    if setup == "preemption":
        assert preemptions > 0, "the small KV budget was meant to force preemptions"
    # Everything finished: every block is back in the free queue.
    assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.num_blocks
