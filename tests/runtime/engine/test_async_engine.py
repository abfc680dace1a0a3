"""AsyncEngine: streams per step, validates before queueing, aborts (and frees blocks) on disconnect."""

import asyncio
import random
from typing import Any

import pytest

from plimsoll.runtime.engine.async_engine import AsyncEngine
from plimsoll.runtime.engine.config import EngineConfig
from plimsoll.runtime.engine.sampling_params import SamplingParams


@pytest.fixture
async def engine(tiny_model_dir: Any) -> Any:
    eng = AsyncEngine(
        EngineConfig(model=str(tiny_model_dir("llama")), kv_cache_memory="2MiB", max_model_len=256)
    )
    await eng.start()
    yield eng
    await eng.shutdown()


async def wait_all_blocks_free(eng: AsyncEngine) -> None:
    for _ in range(200):
        stats = eng.stats()
        if stats.num_free_blocks == stats.num_blocks and stats.num_running == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"blocks not freed: {eng.stats()}")


async def test_streams_concurrent_requests(engine: AsyncEngine) -> None:
    assert engine.is_ready and engine.max_model_len == 256
    rng = random.Random(0)

    async def one(i: int) -> tuple[int, list[int]]:
        outs = [
            o
            async for o in engine.generate(
                [rng.randrange(3, 259) for _ in range(10 + i)],
                SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                f"req-{i}",
            )
        ]
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        deltas = [t for o in outs for t in o.outputs[0].delta_token_ids]
        assert deltas == outs[-1].outputs[0].token_ids
        return len(outs), outs[-1].outputs[0].token_ids

    results = await asyncio.gather(*(one(i) for i in range(6)))
    assert all(n == 8 and len(ids) == 8 for n, ids in results)  # one yield per step that made a token
    await wait_all_blocks_free(engine)


async def test_closing_the_stream_aborts_and_frees_blocks(engine: AsyncEngine) -> None:
    gen = engine.generate([5] * 40, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True), "gone")
    seen = 0
    async for out in gen:
        seen += 1
        assert not out.finished
        if seen == 3:
            break
    await gen.aclose()  # what a client disconnect does to the server's iterator
    await wait_all_blocks_free(engine)


async def test_explicit_abort_finishes_with_abort(engine: AsyncEngine) -> None:
    outs = []
    async for out in engine.generate([6] * 20, SamplingParams(max_tokens=200, ignore_eos=True), "ab"):
        outs.append(out)
        if len(outs) == 2:
            engine.abort("ab")
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    await wait_all_blocks_free(engine)


async def test_bad_input_raises_before_queueing(engine: AsyncEngine) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        async for _ in engine.generate([5] * 300, SamplingParams(), "too-long"):
            pass
    with pytest.raises(ValueError, match="temperature"):
        async for _ in engine.generate("hi", SamplingParams(temperature=-1), "bad"):
            pass
    assert engine.stats().num_waiting == 0


async def test_the_engine_is_built_warmed_and_stepped_on_one_thread(
    tiny_model_dir: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One thread runs every torch op (OpenMP keeps a worker pool per thread that starts parallel
    # work; two pools on a 2-core host made each small matmul wake sleeping workers).
    import threading

    from plimsoll.runtime.engine.llm_engine import LLMEngine

    seen: dict[str, set[str]] = {"init": set(), "warmup": set(), "step": set()}
    for name in seen:
        real = getattr(LLMEngine, "__init__" if name == "init" else name)

        def traced(self: Any, *args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            seen[_name].add(threading.current_thread().name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(LLMEngine, "__init__" if name == "init" else name, traced)
    eng = AsyncEngine(EngineConfig(model=str(tiny_model_dir("llama")), kv_cache_memory="2MiB", max_model_len=256))
    await eng.start()
    try:
        outs = [o async for o in eng.generate([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True), "one")]
        assert outs[-1].finished
    finally:
        await eng.shutdown()
    assert seen == {"init": {"plimsoll-engine"}, "warmup": {"plimsoll-engine"}, "step": {"plimsoll-engine"}}, seen


async def test_a_model_that_fails_to_load_fails_start(tmp_path: Any) -> None:
    eng = AsyncEngine(EngineConfig(model=str(tmp_path / "no-such-model"), kv_cache_memory="2MiB"))
    with pytest.raises(Exception, match="no-such-model"):
        await eng.start()
    assert not eng.is_ready
    await eng.shutdown()  # nothing left running


async def test_the_deferred_warmup_waits_for_a_quiet_moment(
    tiny_model_dir: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from plimsoll.runtime.engine import async_engine

    # A quiet moment longer than the test: the request that arrives at Ready is served while the
    # rest of the warm-up still waits; once the engine may take it (no wait), it runs to the end.
    monkeypatch.setattr(async_engine, "DEFERRED_WARMUP_IDLE_S", 3600.0)
    eng = AsyncEngine(
        EngineConfig(model=str(tiny_model_dir("llama")), kv_cache_memory="2MiB", max_model_len=256)
    )
    await eng.start()
    try:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        outs = [o async for o in eng.generate([5, 6, 7], params, "first")]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
        assert eng.engine is not None and eng.engine.deferred_warmup  # not begun: never quiet long enough
        monkeypatch.setattr(async_engine, "DEFERRED_WARMUP_IDLE_S", 0.0)
        [o async for o in eng.generate([5, 6, 7], params, "wake the loop")]
        for _ in range(3000):
            if not eng.engine.deferred_warmup:
                break
            await asyncio.sleep(0.01)
        assert not eng.engine.deferred_warmup
    finally:
        await eng.shutdown()


async def test_the_rate_probe_runs_after_ready_and_rates_come_without_traffic(
    tiny_model_dir: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """start() returns (the server says Ready) with only the first-request warm-up done; the probe
    runs on the engine's loop once it idles, and the rates admission and the router read appear
    without any request."""
    from plimsoll.runtime.engine.llm_engine import LLMEngine

    config = EngineConfig(model=str(tiny_model_dir("llama")), kv_cache_memory="2MiB", max_model_len=256)
    eng = AsyncEngine(config)
    probes: list[bool] = []
    measure = LLMEngine.measure_rates

    def recording(self: LLMEngine) -> bool:
        probes.append(eng.engine is self)  # handed to the server already: start() had returned
        return measure(self)

    monkeypatch.setattr(LLMEngine, "measure_rates", recording)
    await eng.start()
    try:
        for _ in range(3000):
            if eng.service_rates() is not None:
                break
            await asyncio.sleep(0.02)
        assert eng.service_rates() is not None
        assert probes == [True]
        assert eng.stats().num_running == 0 and eng.stats().num_waiting == 0
    finally:
        await eng.shutdown()
