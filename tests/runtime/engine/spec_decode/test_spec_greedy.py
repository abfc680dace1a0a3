"""Speculative decoding changes no greedy output: n-gram and draft proposals, one batch of 32.

Also under the conditions that move KV around: preemption (a cache too small for
the batch), prefix caching (shared prompt heads), and a token budget small enough
to trim proposals.
"""

import random
from typing import Any

import pytest

from plimsoll.runtime.engine.outputs import RequestOutput, StepStats

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}


class SpecCounter:
    def __init__(self) -> None:
        self.drafts = self.draft_tokens = self.accepted = self.preemptions = self.hits = 0

    def on_step(self, stats: StepStats) -> None:
        self.drafts += stats.spec_num_drafts
        self.draft_tokens += stats.spec_num_draft_tokens
        self.accepted += stats.spec_num_accepted_tokens
        self.preemptions += stats.num_preemptions
        self.hits += stats.prefix_cache_hits
        assert sum(stats.spec_num_accepted_tokens_per_pos) == stats.spec_num_accepted_tokens

    def on_request_finished(self, output: RequestOutput) -> None:
        pass


def mixed_prompts(seed: int, count: int = 32) -> list[list[int]]:
    """Short and long, repetitive and not, some sharing a 40-token head (prefix-cache hits)."""
    rng = random.Random(seed)
    head = [rng.randrange(3, 259) for _ in range(40)]
    prompts = []
    for i in range(count):
        motif = [rng.randrange(3, 259) for _ in range(rng.randrange(2, 10))]
        body = (motif * 20)[: rng.randrange(3, 80)]
        prompts.append(head + body if i % 4 == 0 else body)
    return prompts


def greedy_params(seed: int, count: int = 32) -> list[Any]:
    from plimsoll.runtime import SamplingParams

    rng = random.Random(seed)
    return [
        SamplingParams(temperature=0, max_tokens=rng.randrange(4, 48), ignore_eos=True) for _ in range(count)
    ]


def run(model: str, observer: Any = None, **kwargs: Any) -> list[list[int]]:
    from plimsoll.runtime import LLM

    llm = LLM(model=model, observer=observer, **kwargs)
    return [o.outputs[0].token_ids for o in llm.generate(mixed_prompts(1), greedy_params(2))]


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Any) -> list[list[int]]:
    return run(str(tiny_model_dir("llama")), kv_cache_memory="8MiB")


def test_ngram_greedy_is_identical(tiny_model_dir: Any, reference: list[list[int]]) -> None:
    seen = SpecCounter()
    out = run(str(tiny_model_dir("llama")), seen, kv_cache_memory="8MiB", speculative_config=NGRAM)
    print(f"ngram: {seen.drafts} drafts, {seen.accepted}/{seen.draft_tokens} accepted")
    assert out == reference
    assert seen.draft_tokens > 0 and seen.accepted > 0


def test_draft_model_greedy_is_identical(tiny_model_dir: Any, reference: list[list[int]]) -> None:
    # Another random model with the same byte tokenizer: mostly wrong proposals.
    other = SpecCounter()
    cfg = {"model": str(tiny_model_dir("mistral")), "num_speculative_tokens": 3}
    assert (
        run(str(tiny_model_dir("llama")), other, kv_cache_memory="8MiB", speculative_config=cfg) == reference
    )
    assert other.draft_tokens > other.accepted > 0
    # The target as its own draft: every proposal must be accepted (the multi-token path).
    same = SpecCounter()
    cfg = {"model": str(tiny_model_dir("llama")), "num_speculative_tokens": 3}
    assert (
        run(str(tiny_model_dir("llama")), same, kv_cache_memory="8MiB", speculative_config=cfg) == reference
    )
    print(f"draft: other {other.accepted}/{other.draft_tokens}, self {same.accepted}/{same.draft_tokens}")
    assert same.draft_tokens > 0 and same.accepted == same.draft_tokens


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_identical_under_preemption_prefix_hits_and_a_small_budget(
    tiny_model_dir: Any, reference: list[list[int]], method: str
) -> None:
    # 24 blocks of 16 tokens for 32 requests of up to ~170 tokens: preemption is certain;
    # a 40-token budget trims proposals and chunks the longer prompts.
    cfg = NGRAM if method == "ngram" else {"model": str(tiny_model_dir("llama")), "num_speculative_tokens": 4}
    seen = SpecCounter()
    out = run(
        str(tiny_model_dir("llama")),
        seen,
        kv_cache_memory=24 * 16 * 512,
        max_model_len=384,  # the whole (small) cache: an explicit choice, so start-up accepts it
        max_num_batched_tokens=40,
        speculative_config=cfg,
    )
    print(f"{method}: {seen.preemptions} preemptions, {seen.hits} cached tokens, {seen.accepted} accepted")
    assert out == reference
    assert seen.preemptions > 0 and seen.hits > 0 and seen.accepted > 0


def test_bad_speculative_configs_say_what_to_fix(tiny_model_dir: Any, tmp_path: Any) -> None:
    from pydantic import ValidationError

    from plimsoll.runtime import LLM
    from plimsoll.runtime.engine.config import EngineConfig

    for bad, says in [
        ("{not json", "not valid JSON"),
        ('{"num_speculative_tokens": 4}', '"method": "ngram"'),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 2}',
            "<=",
        ),
        ('{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}', "lookahead"),
    ]:
        with pytest.raises(ValidationError, match=says):
            EngineConfig(speculative_config=bad)
    # A draft with another vocabulary is refused at load, naming the two sizes.
    import torch
    from tiny_models import byte_tokenizer, tiny_config
    from transformers import AutoModelForCausalLM

    cfg = tiny_config("llama")
    cfg.vocab_size = 300
    wide = tmp_path / "wide-vocab"
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(str(wide))
    byte_tokenizer().save_pretrained(str(wide))
    with pytest.raises(ValueError, match="300 tokens and the target 259"):
        LLM(
            model=str(tiny_model_dir("llama")),
            speculative_config={"model": str(wide), "num_speculative_tokens": 2},
        )
