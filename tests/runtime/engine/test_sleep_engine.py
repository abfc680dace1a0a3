"""Sleep and wake on an in-process engine over a tiny model: what each level frees and keeps.

The server test (tests/runtime/serving/test_sleep_mode.py) covers the endpoints, resident
memory and the answers; here the engine's own state is read: level 1 on CPU keeps the
weights and their packed panels and gives the KV pages back in place (no warm-up on wake);
level 2 drops the panels too and packs them again; and the path an accelerator takes
(KV storages resized to nothing and grown back, a warm-up request on wake) runs on CPU with
the in-place release switched off.
"""

from pathlib import Path

import pytest
import torch

from plimsoll.runtime.engine import kv_pages, sleep_mode
from plimsoll.runtime.engine.config import EngineConfig
from plimsoll.runtime.engine.llm_engine import LLMEngine
from plimsoll.runtime.engine.sampling_params import SamplingParams
from plimsoll.runtime.testing import write_tiny_model

KV_BYTES = 8 * 2**20
PROMPTS = ["the quick brown fox", "sleep and wake"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("sleep") / "tiny")


def _engine(model_dir: Path, cache_dir: Path | None = None) -> LLMEngine:
    compilation = {"cache_dir": str(cache_dir)} if cache_dir is not None else {}
    config = EngineConfig(
        model=str(model_dir),
        enable_sleep_mode=True,
        kv_cache_memory=KV_BYTES,
        max_model_len=128,
        seed=0,
        compilation_config=compilation,
    )
    engine = LLMEngine(config)
    engine.warmup()
    return engine


def _answers(engine: LLMEngine) -> list[list[int]]:
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    return [out.outputs[0].token_ids for out in engine.generate(PROMPTS, params)]


def _kv(engine: LLMEngine) -> list[torch.Tensor]:
    return [t for pair in engine.runner.kv_caches for t in pair]


def _panels(engine: LLMEngine) -> list[torch.Tensor]:
    fused = engine.runner.cpu_plan.fused
    return [] if fused is None else [p.data for layer in fused.panels for p in layer]


@pytest.mark.skipif(not kv_pages.supported(), reason="needs madvise and mincore (Linux)")
def test_level_1_on_cpu_releases_the_kv_pages_in_place_and_keeps_weights_and_panels(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(model_dir)
    before = _answers(engine)
    kv_addresses = [t.data_ptr() for t in _kv(engine)]
    weights = {n: (p.data_ptr(), p.detach().clone()) for n, p in engine.runner.model.named_parameters()}
    panels = [(p.data_ptr(), p.clone()) for p in _panels(engine)]
    assert panels, "the tiny float32 Llama is packed in column panels on CPU"
    assert engine.runner.kv_cache_resident_bytes() >= KV_BYTES * 0.99
    freed = engine.sleep(1)
    assert freed >= KV_BYTES * 0.99
    assert engine.runner.kv_cache_resident_bytes() == 0  # counted before anything reads the pages
    assert engine.stats().kv_cache_resident_bytes == 0
    warmups: list[int] = []
    monkeypatch.setattr(engine, "warmup_first_request", lambda: warmups.append(1))
    engine.wake_up()
    assert warmups == []  # nothing to warm: every address and every packed panel is as it was
    assert engine.runner.kv_cache_resident_bytes() >= KV_BYTES * 0.99
    assert [t.data_ptr() for t in _kv(engine)] == kv_addresses
    assert all(float(t.abs().sum()) == 0 for t in _kv(engine))
    for name, p in engine.runner.model.named_parameters():
        assert p.data_ptr() == weights[name][0] and torch.equal(p, weights[name][1])
    for (address, copy), p in zip(panels, _panels(engine), strict=True):
        assert p.data_ptr() == address and torch.equal(p, copy)
    monkeypatch.undo()
    assert _answers(engine) == before
    engine.close()


@pytest.mark.parametrize("panels", ["packed", "stored", "mapped"])
def test_level_2_drops_the_panels_and_packs_them_again(model_dir: Path, tmp_path: Path, panels: str) -> None:
    # stored: packed and written to the panel cache (models/panel_cache.py), the weights to the weight
    # cache; mapped: both read from them.
    cached = panels == "mapped"
    if cached:
        _engine(model_dir, tmp_path).close()
    engine = _engine(model_dir, tmp_path if panels != "packed" else None)
    assert engine.runner.cpu_plan.fused is not None and engine.runner.cpu_plan.fused.mapped is cached
    assert engine.runner.model.weights_mapped is cached  # the weight cache beside them (weight_cache.py)
    before = _answers(engine)
    copies = [p.clone() for p in _panels(engine)]
    weight_bytes = sum(p.nbytes for p in engine.runner.model.parameters())
    panel_pages = sum(p.nbytes // kv_pages.PAGE * kv_pages.PAGE for p in copies)
    freed = engine.sleep(2)
    if not cached:
        assert all(p.untyped_storage().nbytes() == 0 for p in _panels(engine))
    assert freed >= KV_BYTES * 0.99 + weight_bytes * 0.9 + panel_pages
    engine.wake_up()
    assert all(torch.equal(p, copy) for p, copy in zip(_panels(engine), copies, strict=True))
    assert _answers(engine) == before
    engine.close()


@pytest.mark.parametrize("level", [1, 2])
def test_the_resize_path_an_accelerator_takes(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, level: int
) -> None:
    monkeypatch.setattr(kv_pages, "supported", lambda: False)  # torch.zeros caches, resized on sleep
    engine = _engine(model_dir)
    before = _answers(engine)
    state = sleep_mode.sleep(engine, level)
    assert not state.in_place and not state.kv_released
    assert all(t.untyped_storage().nbytes() == 0 for t in _kv(engine))
    warmups: list[int] = []
    warm = engine.warmup_first_request
    monkeypatch.setattr(engine, "warmup_first_request", lambda: (warmups.append(1), warm()))
    engine.wake_up()
    assert warmups == [1]
    assert all(t.untyped_storage().nbytes() == t.nbytes for t in _kv(engine))
    assert _answers(engine) == before
    engine.close()
