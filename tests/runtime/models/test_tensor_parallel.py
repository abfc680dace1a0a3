"""Tensor parallelism on CPU: two real processes over gloo give the greedy tokens of one.

Each TP engine spawns one worker rank (``engine/tp_executor.py``); the references
are the same models at ``tensor_parallel_size=1``. Models are fp32, so a reduction
order that differs between the split and whole matmuls moves logits by ~1e-7, far
below the tiny models' greedy margins (``initializer_range=0.3``).
"""

from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import byte_tokenizer, tiny_config

from plimsoll.runtime import LLM, SamplingParams
from plimsoll.runtime.engine.config import EngineConfig
from plimsoll.runtime.engine.outputs import RequestOutput, StepStats
from plimsoll.runtime.models.tensor_parallel import check_tensor_parallel, kv_heads_per_rank

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = ["hello world", "the quick brown fox jumps", "a"]


def greedy_tokens(model: str, **engine: Any) -> tuple[list[list[int]], LLM]:
    with LLM(model=model, max_model_len=256, **engine) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tp2_greedy_equals_tp1(tiny_model_dir: Any, arch: str) -> None:
    model = str(tiny_model_dir(arch))
    ref, one = greedy_tokens(model, kv_cache_memory="2MiB")
    got, two = greedy_tokens(model, kv_cache_memory="2MiB", tensor_parallel_size=2)
    print(f"{arch}: TP=1 {ref}\n{arch}: TP=2 {got}")
    assert got == ref
    # kv_cache_memory is per rank (vLLM's convention) and each rank caches half the KV heads.
    assert two.engine.num_blocks == 2 * one.engine.num_blocks
    kv_shape = two.engine.runner.kv_caches[0][0].shape  # [blocks, block_size, kv_heads, head_dim]
    assert kv_shape[2] == tiny_config(arch).num_key_value_heads // 2
    executor = two.engine.executor
    assert executor is not None and [p.exitcode for p in executor.workers] == [
        0
    ]  # close() stopped it cleanly


class Recorder:
    def __init__(self) -> None:
        self.preemptions = self.hits = 0

    def on_step(self, stats: StepStats) -> None:
        self.preemptions += stats.num_preemptions
        self.hits += stats.prefix_cache_hits

    def on_request_finished(self, output: RequestOutput) -> None:
        pass


def test_tp2_prefix_caching_and_preemption_reach_the_worker(tiny_model_dir: Any) -> None:
    """Rank 0's scheduler reuses cached blocks and preempts; the worker's cache follows its block tables."""
    model = str(tiny_model_dir("llama"))
    prefix = "shared system prompt, thirty-two b"  # two 16-token blocks, then distinct tails
    first = [prefix + "!"]
    batch = [prefix + tail for tail in ("one", "two", "three", "four")]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    results = []
    # Eight 16-token blocks per rank in both runs: 512 B/token at TP=1, 256 B on each of two ranks.
    for tp, kv_bytes in ((1, 8 * 16 * 512), (2, 8 * 16 * 256)):
        seen = Recorder()
        with LLM(
            model=model, observer=seen, kv_cache_memory=kv_bytes, max_model_len=128, tensor_parallel_size=tp
        ) as llm:
            assert llm.engine.num_blocks == 8
            outs = llm.generate(first, params) + llm.generate(batch, params)
        results.append(([o.outputs[0].token_ids for o in outs], seen))
    (ref, one), (got, two) = results
    print(
        f"TP=1 preemptions {one.preemptions} hits {one.hits}; TP=2 preemptions {two.preemptions} hits {two.hits}"
    )
    assert got == ref
    assert two.preemptions > 0 and two.hits >= 32  # the batch hit the first request's two prefix blocks


class Drafts:
    def __init__(self) -> None:
        self.drafts = 0

    def on_step(self, stats: StepStats) -> None:
        self.drafts += stats.spec_num_drafts

    def on_request_finished(self, output: RequestOutput) -> None:
        pass


def test_tp2_speculative_decoding_keeps_tp1_greedy_tokens(tiny_model_dir: Any) -> None:
    """n-gram proposals are verified by a k + 1-row forward on both ranks; rejected ones roll back on rank 0."""
    model = str(tiny_model_dir("llama"))
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    # Every byte id once: whatever token comes out, the prompt holds it, so n-gram lookup proposes.
    prompts = [list(range(3, 259)), list(range(258, 2, -1))]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with LLM(model=model, kv_cache_memory="2MiB", max_model_len=512) as plain:
        ref = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    seen = Drafts()
    with LLM(
        model=model,
        observer=seen,
        kv_cache_memory="2MiB",
        max_model_len=512,
        speculative_config=spec,
        tensor_parallel_size=2,
    ) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    print(f"TP=2 with ngram: {seen.drafts} drafts")
    assert got == ref
    assert seen.drafts > 0


def _write_llama(directory: Path, **overrides: Any) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = tiny_config("llama")
    for key, value in overrides.items():
        setattr(cfg, key, value)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(str(directory))
    byte_tokenizer().save_pretrained(str(directory))
    return directory


def test_tp2_replicates_a_kv_head_shared_by_both_ranks(tmp_path: Path) -> None:
    """One KV head (MQA) on two ranks: each rank caches a copy, beside its own two query heads."""
    model = str(_write_llama(tmp_path / "mqa", num_key_value_heads=1))
    ref, _ = greedy_tokens(model, kv_cache_memory="1MiB")
    got, two = greedy_tokens(model, kv_cache_memory="1MiB", tensor_parallel_size=2)
    assert got == ref
    assert two.engine.runner.kv_caches[0][0].shape[2] == 1


def test_shapes_that_cannot_split_are_refused_with_the_reason() -> None:
    from transformers import LlamaConfig

    smollm = LlamaConfig(
        num_attention_heads=9, num_key_value_heads=3, hidden_size=576, intermediate_size=1536
    )
    with pytest.raises(ValueError, match=r"does not divide the model's 9 attention heads"):
        check_tensor_parallel(smollm, 2)
    check_tensor_parallel(smollm, 3)  # 9 / 3 heads, 3 / 3 KV heads, 1536 / 3 columns
    six = LlamaConfig(num_attention_heads=12, num_key_value_heads=4, hidden_size=96, intermediate_size=96)
    with pytest.raises(ValueError, match=r"neither divides the model's 4 KV heads nor is a multiple"):
        check_tensor_parallel(six, 6)
    odd = LlamaConfig(num_attention_heads=4, num_key_value_heads=4, hidden_size=64, intermediate_size=130)
    with pytest.raises(ValueError, match=r"intermediate_size 130"):
        check_tensor_parallel(odd, 4)
    assert kv_heads_per_rank(six, 2) == 2 and kv_heads_per_rank(six, 12) == 1
    with pytest.raises(ValueError, match=r"quantization='int8' with tensor_parallel_size=2 is not supported"):
        EngineConfig(quantization="int8", tensor_parallel_size=2)


def test_a_refused_split_fails_the_engine_before_any_step(tiny_model_dir: Any) -> None:
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size=3 does not divide the model's 4 attention heads"
    ):
        LLM(model=str(tiny_model_dir("llama")), kv_cache_memory="1MiB", tensor_parallel_size=3)


@pytest.mark.slow
def test_embedded_model_tp3_equals_tp1() -> None:
    """SmolLM2-135M has 9 heads and 3 KV heads: TP=2 is refused (above), TP=3 splits it evenly."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    outs = []
    for tp in (1, 3):
        with LLM(
            model="smollm2-135m", kv_cache_memory="64MiB", max_model_len=64, tensor_parallel_size=tp
        ) as llm:
            outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    print(f"smollm2 TP=1 {outs[0]}\nsmollm2 TP=3 {outs[1]}")
    assert outs[1] == outs[0]


@pytest.mark.parametrize(("arch", "tp", "rank"), [("llama", 2, 1), ("qwen2", 2, 0), ("qwen3", 4, 3)])
def test_each_rank_reads_only_its_share_and_gets_what_slicing_the_whole_gives(
    tiny_model_dir: Any, arch: str, tp: int, rank: int
) -> None:
    # The loader's tensor-parallel path (read_rank_state, shard_model on the meta model, assign)
    # against the whole checkpoint loaded and then sharded: the same tensors, rank by rank.
    from types import SimpleNamespace

    from plimsoll.runtime.models.loader import load_model
    from plimsoll.runtime.models.tensor_parallel import read_rank_state, shard_model

    group = SimpleNamespace(rank=rank, world_size=tp, is_first=rank == 0)
    directory = tiny_model_dir(arch)
    presharded = load_model(str(directory), torch.float32, tensor_parallel=group).model  # type: ignore[arg-type]
    whole = load_model(str(directory), torch.float32).model
    shard_model(whole, group)  # type: ignore[arg-type]
    mine, theirs = presharded.state_dict(), whole.state_dict()
    assert mine.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(mine[name], tensor), name
    if whole.config.tie_word_embeddings:
        assert presharded.lm_head.weight is presharded.model.embed_tokens.weight
    read = read_rank_state(directory, whole.config, group)  # type: ignore[arg-type]
    q = read["model.layers.0.self_attn.q_proj.weight"]
    assert (
        q.shape[0] == whole.config.num_attention_heads // tp * presharded.model.layers[0].self_attn.head_dim
    )
