"""The KV cache sized from a device's memory figures (``--gpu-memory-utilization``), on a CPU.

A fake card stands in for ``torch.cuda``'s figures: the engine reads it before loading,
after the weights and after its profiling run (largest step, largest sampled batch,
graphs) over a provisional cache, and must then allocate exactly what the rule gives;
bytes given explicitly win; a card too small or too busy fails at start in one line
that says what to set; ``plimsoll plan`` fed the same figures arrives at the same cache.
"""

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from plimsoll import plan as planning
from plimsoll.runtime.engine import kv_sizing
from plimsoll.runtime.engine.config import EngineConfig
from plimsoll.runtime.engine.llm_engine import LLMEngine, select_device
from plimsoll.runtime.engine.sampling_params import SamplingParams
from plimsoll.runtime.serving.metrics import ServerMetrics

MiB = 2**20


class FakeCard:
    """``DeviceMemory`` of a card of ``total`` bytes, ``others`` of them held by other processes.

    torch's reservation is 0 at start, ``weights`` once the model is loaded (the engine's second
    read), and during the profiling run it peaks at weights + the provisional cache + ``activations``;
    ``non_torch`` bytes leave the device outside torch's allocator. ``provisional`` is the engine's
    provisional cache (the tests compute it from ``kv_sizing.profile_blocks``)."""

    def __init__(
        self, total: int, others: int, weights: int, activations: int, non_torch: int, provisional: int = 0
    ) -> None:
        self.total, self.others, self.weights = total, others, weights
        self.activations, self.non_torch, self.provisional = activations, non_torch, provisional
        self.reads = 0
        self.profiled = False

    def _reserved(self) -> int:
        return 0 if self.reads == 0 else self.weights + (self.provisional if self.profiled else 0)

    def mem_get_info(self) -> tuple[int, int]:
        used = self.others + self._reserved() + (self.non_torch if self.profiled else 0)
        return self.total - used, self.total

    def memory_reserved(self) -> int:
        value = self._reserved()
        self.reads += 1
        return value

    def max_memory_reserved(self) -> int:
        return self.weights + self.provisional + self.activations

    def reset_peak_memory_stats(self) -> None:
        self.profiled = True

    def empty_cache(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


def tiny_per_token(model_dir: Path) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4  # float32


def provisional_bytes(model_dir: Path, config: EngineConfig, per_token: int) -> int:
    max_pos = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
    largest = min(config.max_num_batched_tokens, max_pos - 1)
    return kv_sizing.profile_blocks(largest, config.block_size) * config.block_size * per_token


def engine_on(card: FakeCard, model_dir: Path, draft: Path | None = None, **fields: Any) -> LLMEngine:
    if draft is not None:
        fields["speculative_config"] = {"model": str(draft), "num_speculative_tokens": 2}
    config = EngineConfig(model=str(model_dir), max_model_len=512, **fields)
    per_token = tiny_per_token(model_dir) + (tiny_per_token(draft) if draft is not None else 0)
    card.provisional = provisional_bytes(model_dir, config, per_token)
    return LLMEngine(config, device_memory=card)


def test_the_cache_gets_what_the_card_leaves(tiny_model_dir: Any, caplog: pytest.LogCaptureFixture) -> None:
    model = tiny_model_dir("llama")
    card = FakeCard(total=64 * MiB, others=2 * MiB, weights=3 * MiB, activations=5 * MiB, non_torch=MiB)
    with caplog.at_level(logging.INFO, logger="plimsoll.runtime.engine.llm_engine"):
        engine = engine_on(card, model, gpu_memory_utilization=0.8)
    per_token = tiny_per_token(model)
    kv_bytes = int(0.8 * 64 * MiB) - (3 + 5 + 1) * MiB
    blocks = kv_bytes // (per_token * 16)
    assert engine.num_blocks == blocks
    assert engine.runner.kv_cache_bytes() == blocks * 16 * per_token  # the provisional cache is gone
    assert engine.scheduler.kv.num_free_blocks == blocks
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:"))
    assert f"{blocks * 16:,} tokens in {blocks:,} blocks of 16" in line
    assert f"maximum concurrency for 512 tokens per request: {blocks * 16 / 512:.2f}x" in line
    assert "0.8 × 64.0 MiB − 3.0 MiB weights − 5.0 MiB activations" in line and "\n" not in line
    stats = engine.stats()
    assert stats.gpu_memory_utilization == 0.8 and stats.kv_cache_memory_bytes == blocks * 16 * per_token
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_the_start_line_is_exported_as_cache_config_info() -> None:
    from prometheus_client import generate_latest

    metrics = ServerMetrics("m", metrics_compat="vllm")
    metrics.set_cache_config(
        block_size=16, num_blocks=77, enable_prefix_caching=True, cache_dtype="bfloat16",
        gpu_memory_utilization=0.9, kv_cache_memory_bytes=12345,
    )  # fmt: skip
    text = generate_latest(metrics.registry).decode()
    for family in ("plimsoll_cache_config_info", "vllm:cache_config_info"):
        line = next(x for x in text.splitlines() if x.startswith(family + "{"))
        assert 'gpu_memory_utilization="0.9"' in line and 'kv_cache_memory_bytes="12345"' in line
        assert 'num_gpu_blocks="77"' in line


def test_bytes_given_win_over_the_card(tiny_model_dir: Any) -> None:
    card = FakeCard(total=64 * MiB, others=0, weights=MiB, activations=MiB, non_torch=0)
    config = EngineConfig(model=str(tiny_model_dir("llama")), max_model_len=512, kv_cache_memory="1MiB")
    engine = LLMEngine(config, device_memory=card)
    assert card.reads == 0
    assert engine.num_blocks == MiB // (tiny_per_token(tiny_model_dir("llama")) * 16)
    assert engine.stats().gpu_memory_utilization is None


def test_a_card_too_small_fails_in_one_line_saying_what_to_set(tiny_model_dir: Any) -> None:
    card = FakeCard(total=16 * MiB, others=0, weights=6 * MiB, activations=6 * MiB, non_torch=MiB)
    with pytest.raises(ValueError) as err:
        engine_on(card, tiny_model_dir("llama"), gpu_memory_utilization=0.8)
    message = str(err.value)
    assert "\n" not in message and "too small" in message
    assert "raise --gpu-memory-utilization to at least" in message and "--max-model-len" in message


def test_a_busy_card_is_refused_before_loading(tiny_model_dir: Any) -> None:
    card = FakeCard(total=64 * MiB, others=20 * MiB, weights=MiB, activations=MiB, non_torch=0)
    with pytest.raises(ValueError, match=r"only 0\.04 GiB is free.*lower --gpu-memory-utilization to 0\.68"):
        engine_on(card, tiny_model_dir("llama"), gpu_memory_utilization=0.9)
    assert card.reads == 0  # refused on the first figures: nothing was loaded


def test_a_draft_model_shares_the_budget_and_the_block_count(tiny_model_dir: Any) -> None:
    target, draft = tiny_model_dir("llama"), tiny_model_dir("mistral")
    card = FakeCard(total=64 * MiB, others=0, weights=3 * MiB, activations=5 * MiB, non_torch=0)
    engine = engine_on(card, target, draft)
    per_token = tiny_per_token(target) + tiny_per_token(draft)  # both caches hold every token
    assert engine.num_blocks == (int(0.9 * 64 * MiB) - 8 * MiB) // (per_token * 16)
    draft_runner = engine.speculator.draft.runner  # type: ignore[union-attr]
    assert draft_runner.kv_cache_bytes() == engine.num_blocks * 16 * tiny_per_token(draft)
    assert len(engine.speculator.draft.free_blocks) == engine.num_blocks  # type: ignore[union-attr]


def test_the_kv_tiers_attach_to_the_cache_that_replaced_the_provisional_one(tiny_model_dir: Any) -> None:
    card = FakeCard(total=64 * MiB, others=0, weights=3 * MiB, activations=5 * MiB, non_torch=0)
    engine = engine_on(card, tiny_model_dir("llama"), kv_offloading_backend="native", kv_offloading_size=0.01)
    kv = engine.scheduler.kv
    assert engine.kv_connector is not None and kv.connector is engine.kv_connector
    assert kv.pool.on_evicted == engine.kv_connector.on_evicted
    assert kv.num_free_blocks == engine.num_blocks  # the scheduler of the real cache, not the provisional one
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_plimsoll_plan_arrives_at_the_engines_cache(tiny_model_dir: Any) -> None:
    model = tiny_model_dir("llama")
    dims = planning.read_model_config(model)
    shape = planning.EngineShape(max_num_batched_tokens=2048, max_num_seqs=64, block_size=16, non_torch=MiB)
    total = 64 * MiB
    steps = {
        s.name: s.value
        for s in planning.make_plan(
            dims, gpu_memory=total, dtype="fp32", memory_fraction=0.9, context_length=512, engine=shape
        )
    }
    # The card reports what plan estimates; the engine measures the rest itself.
    card = FakeCard(total, 0, int(steps["weight bytes"]), int(steps["activations"]), MiB)
    engine = engine_on(card, model)
    loaded = sum(t.numel() * t.element_size() for t in engine.runner.model.parameters())
    assert loaded == steps["weight bytes"]  # plan's parameter count is the model's
    assert engine.num_blocks * 16 == steps["KV tokens that fit"]


def test_plimsoll_plan_with_a_draft_arrives_at_the_engines_cache(tiny_model_dir: Any) -> None:
    target, draft = tiny_model_dir("llama"), tiny_model_dir("mistral")
    shape = planning.EngineShape(max_num_batched_tokens=2048, max_num_seqs=64, block_size=16, non_torch=MiB)
    total = 64 * MiB
    steps = {
        s.name: s.value
        for s in planning.make_plan(
            planning.read_model_config(target),
            gpu_memory=total,
            dtype="fp32",
            memory_fraction=0.9,
            context_length=512,
            engine=shape,
            draft=planning.read_model_config(draft),
        )
    }
    # Both models' weights on the card, the larger step's activations: the engine's cache holds
    # what plan says fits in both caches.
    card = FakeCard(
        total, 0, int(steps["weight bytes"] + steps["draft weight bytes"]), int(steps["activations"]), MiB
    )
    engine = engine_on(card, target, draft)
    assert engine.num_blocks * 16 == steps["KV tokens that fit"]


def test_cuda_n_becomes_the_current_device(monkeypatch: pytest.MonkeyPatch) -> None:
    chosen: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: chosen.append(torch.device(d)))
    assert select_device("cuda:1") == torch.device("cuda", 1)
    assert select_device("cpu") == torch.device("cpu")
    select_device("cuda")  # no index: the current device stays
    assert chosen == [torch.device("cuda", 1)]


def test_plan_reads_the_engines_defaults() -> None:
    from plimsoll import kv_memory

    config = EngineConfig()
    assert config.max_num_batched_tokens == kv_memory.DEFAULT_MAX_NUM_BATCHED_TOKENS
    assert config.max_num_seqs == kv_memory.DEFAULT_MAX_NUM_SEQS
    assert config.block_size == kv_memory.DEFAULT_BLOCK_SIZE
    assert config.gpu_memory_utilization == kv_memory.DEFAULT_GPU_MEMORY_UTILIZATION
