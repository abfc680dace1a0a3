"""The embedded SmolLM2-135M-Instruct: fetched, converted, cached; greedy equals transformers."""

import pytest
import torch


@pytest.mark.slow
def test_smollm2_greedy_equals_transformers() -> None:
    from transformers import AutoModelForCausalLM

    from plimsoll.runtime import LLM, SamplingParams

    # 46,080 bytes per token (2 x 30 layers x 3 KV heads x 64 x 4 B): 8 blocks of 16 for
    # four sequences needing 3 each, so the batch is also preempted and recomputed.
    llm = LLM(model="smollm2-135m", kv_cache_memory=8 * 16 * 46_080, max_model_len=128)
    tok = llm.tokenizer
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, a robot",
        "List three colours: red,",
    ]
    prompts = [tok(t).input_ids for t in texts]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(
        str(llm.engine.model_path), dtype=torch.float32, attn_implementation="eager"
    )
    for p, out in zip(prompts, outs, strict=True):
        ref = hf.generate(
            torch.tensor([p]), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(p) :].tolist()
        assert out.outputs[0].token_ids == ref, tok.decode(out.outputs[0].token_ids)
    assert "Paris" in outs[0].outputs[0].text
    preemptions = llm.engine.scheduler.total_preemptions
    print(f"smollm2: {len(prompts)} prompts equal, preemptions={preemptions}")
    assert preemptions > 0
