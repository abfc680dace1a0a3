"""Finishing rules and configuration errors of the engine (tiny model, fast)."""

import random
from pathlib import Path
from typing import Any

import pytest

from plimsoll.runtime.engine.config import EngineConfig, parse_bytes
from plimsoll.runtime.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Any) -> Any:
    from plimsoll.runtime import LLM

    return LLM(model=str(tiny_model_dir("llama")), kv_cache_memory="4MiB", max_model_len=64)


def test_eos_stops_unless_ignored_or_below_min_tokens(llm: Any) -> None:
    prompt = [random.Random(3).randrange(3, 259) for _ in range(12)]
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    ids = greedy.outputs[0].token_ids
    eos = ids[3]
    cut = ids.index(eos)
    saved = llm.engine.eos_token_ids
    llm.engine.eos_token_ids = frozenset({eos})  # pretend the model's EOS is that token
    try:
        stopped = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
        assert stopped.token_ids == ids[: cut + 1]
        assert (stopped.finish_reason, stopped.stop_reason) == ("stop", None)
        ignored = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
        assert ignored.outputs[0].token_ids == ids and ignored.outputs[0].finish_reason == "length"
        held = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, min_tokens=cut + 3))[0]
        assert len(held.outputs[0].token_ids) >= cut + 3
        assert eos not in held.outputs[0].token_ids[: cut + 3]
    finally:
        llm.engine.eos_token_ids = saved


def test_max_model_len_ends_with_length(llm: Any) -> None:
    out = llm.generate([[9] * 60], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 64
    assert out.outputs[0].finish_reason == "length"


def test_string_prompts_and_text(llm: Any) -> None:
    out = llm.generate("plimsoll", SamplingParams(temperature=0, max_tokens=5))[0]
    assert out.prompt == "plimsoll"
    assert out.prompt_token_ids == llm.tokenizer("plimsoll").input_ids
    assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)


def test_request_metrics_are_ordered(llm: Any) -> None:
    m = llm.generate([[4] * 20], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].metrics
    assert (
        m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    )
    assert (m.num_prompt_tokens, m.num_generation_tokens, m.finish_reason) == (20, 4, "length")


def test_stats(llm: Any) -> None:
    s = llm.engine.stats()
    assert (s.num_running, s.num_waiting, s.block_size, s.enable_prefix_caching) == (0, 0, 16, True)
    assert s.num_free_blocks == s.num_blocks > 0 and s.kv_cache_usage == 0.0


def test_stats_count_the_prefill_backlog_until_computed(llm: Any) -> None:
    """Prompt tokens admitted and not yet computed (a prefill pool's scaling signal); the KV size of a token."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request("backlog-a", [5] * 20, params)
    engine.add_request("backlog-b", [6] * 30, params)
    assert engine.stats().prefill_backlog_tokens == 50
    assert engine.stats().kv_bytes_per_token > 0
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().prefill_backlog_tokens == 0


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    from transformers import GPT2Config

    from plimsoll.runtime import LLM

    GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(
        str(tmp_path)
    )
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM"):
        LLM(model=str(tmp_path))


def test_config_errors_say_what_to_change(tiny_model_dir: Any) -> None:
    from plimsoll.runtime import LLM

    assert parse_bytes("2GiB") == 2 * 1024**3 and parse_bytes("512MB") == 512 * 1000**2
    assert parse_bytes(4096) == 4096
    with pytest.raises(ValueError, match="GiB"):
        parse_bytes("lots")
    with pytest.raises(ValueError):
        EngineConfig(scheduling_policy="fifo")
    with pytest.raises(ValueError, match="kv_cache_memory"):
        LLM(model=str(tiny_model_dir("llama")), kv_cache_memory=1000)
    with pytest.raises(ValueError, match="raise kv_cache_memory"):
        LLM(model=str(tiny_model_dir("llama")), kv_cache_memory="64KiB", max_model_len=1000)
    # A KV budget too small for one default-length sequence is refused with the numbers
    # (not silently turned into a tiny max_model_len); lowering max_model_len explicitly is accepted.
    with pytest.raises(ValueError, match=r"less than one sequence of max_model_len \d+.*set max_model_len explicitly"):
        LLM(model=str(tiny_model_dir("llama")), kv_cache_memory="64KiB")
    small = LLM(model=str(tiny_model_dir("llama")), kv_cache_memory="64KiB", max_model_len=32)
    assert small.engine.max_model_len == 32
    with pytest.raises(ValueError, match="neither a directory"):
        LLM(model="/nonexistent/model")


def test_dtype_auto_follows_the_device_as_serve_does() -> None:
    # vLLM's --dtype auto: float32 on CPU, bfloat16 on an accelerator; an explicit dtype is kept.
    from plimsoll.runtime.engine.config import EngineConfig
    from plimsoll.runtime.serve_args import resolve_dtype

    for device in ("cpu", "cuda", "cuda:1"):
        assert EngineConfig(device=device).dtype == resolve_dtype("auto", device.split(":")[0])
        assert EngineConfig(device=device, dtype="auto").dtype == EngineConfig(device=device).dtype
        assert EngineConfig(device=device, dtype="float16").dtype == "float16"
    assert EngineConfig().dtype == "float32"
    assert EngineConfig(device="cuda").dtype == "bfloat16"
