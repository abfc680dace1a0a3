"""The warm-up after Ready runs in pieces and gives way to work that arrives (engine level)."""

from pathlib import Path
from typing import Any

import pytest

from plimsoll.runtime.engine.config import EngineConfig
from plimsoll.runtime.engine.llm_engine import LLMEngine
from plimsoll.runtime.engine.sampling_params import SamplingParams
from plimsoll.runtime.testing import write_tiny_model


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    model = write_tiny_model(tmp_path_factory.mktemp("deferred") / "tiny")
    built = LLMEngine(EngineConfig(model=str(model), kv_cache_memory=4 * 2**20, max_model_len=128, seed=0))
    built.warmup(defer_rest=True)
    return built


def test_the_deferred_warmup_stops_when_work_arrives_and_goes_on_later(engine: LLMEngine) -> None:
    pieces = (
        sum(
            1
            for _ in engine.runner.model.prime_matmul_steps(
                engine.config.max_num_batched_tokens, engine.config.max_logit_rows
            )
        )
        + 1
    )  # the matmuls (run again here: primitives are cached, the count is the same) and the largest step
    assert engine.deferred_warmup
    asked = 0

    def busy_after_three() -> bool:
        nonlocal asked
        asked += 1
        return asked > 3

    assert engine.run_deferred_warmup(busy=busy_after_three) is False  # stopped after the fourth piece
    assert engine.deferred_warmup and asked == 4
    # A request served in between, then the rest from where it stopped.
    out = engine.generate(["hello"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    seen = 0

    def count() -> bool:
        nonlocal seen
        seen += 1
        return False

    assert engine.run_deferred_warmup(busy=count) is True
    assert not engine.deferred_warmup
    assert asked + seen == pieces  # one check after each piece: nothing ran twice, nothing was skipped
    assert engine.run_deferred_warmup() is True  # done: nothing more to run


def _cached(tmp_path: Path, **extra: Any) -> EngineConfig:
    """A tiny model served with a compile-cache directory (the weight cache under it)."""
    model = write_tiny_model(tmp_path / "tiny")
    cache = {"cache_dir": str(tmp_path / "cache")}
    return EngineConfig(
        model=str(model),
        kv_cache_memory=4 * 2**20,
        max_model_len=128,
        seed=0,
        compilation_config=cache,
        **extra,
    )


def _hello(engine: LLMEngine) -> list[int]:
    out = engine.generate(["hello"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    return list(out[0].outputs[0].token_ids)


def _maps_and_answers(config: EngineConfig, before: list[int]) -> None:
    """The next start maps the weights the cache holds and answers as the start that wrote them."""
    again = LLMEngine(config)
    assert again.runner.model.weights_mapped
    assert _hello(again) == before
    again.close()


def test_a_weight_cache_that_missed_is_written_after_ready(tmp_path: Path) -> None:
    """The weights a start built are written to the weight cache by the deferred warm-up, not
    before Ready; the next start maps them."""
    config = _cached(tmp_path)
    first = LLMEngine(config)
    first.warmup(defer_rest=True)
    assert not first.runner.model.weights_mapped
    assert list((tmp_path / "cache" / "cpu-weights").glob("*.bin")) == []  # nothing written before Ready
    assert first.run_deferred_warmup() is True
    assert len(list((tmp_path / "cache" / "cpu-weights").glob("*.bin"))) == 1
    before = _hello(first)
    first.close()
    _maps_and_answers(config, before)


def test_sleep_level_2_before_the_write_drops_it_and_waking_writes_what_it_read(tmp_path: Path) -> None:
    """Level 2 drops the weights the pending write would read, and the write with them; waking
    reads the checkpoint again and writes the cache from that. The next start maps it and
    answers the same."""
    config = _cached(tmp_path, enable_sleep_mode=True)
    written = tmp_path / "cache" / "cpu-weights"
    engine = LLMEngine(config)
    engine.warmup(defer_rest=True)
    before = _hello(engine)
    engine.sleep(2)
    assert list(written.glob("*.bin")) == []
    engine.wake_up()
    assert len(list(written.glob("*.bin"))) == 1
    assert engine.run_deferred_warmup() is True
    engine.close()
    _maps_and_answers(config, before)
