"""torch.compile of the forward (engine/compilation.py) on CPU: inductor's C++ backend.

One tiny model, steps of two or more tokens only (one dynamic graph: CI pays one compile), run
in two fresh processes sharing a cache directory: the compiled logits equal the eager ones within
float32 tolerance in both (prefill, decode, a decode mixed with a prompt chunk, and a decode step
through the CUDA-graph buffers with the Triton attention in its interpreter), the first compiles
(cache misses, no hits) and the second loads what the first stored (hits, no misses): checked by
torch's cache counters, not by time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from plimsoll.runtime.engine.compilation_config import CompilationConfig
from plimsoll.runtime.engine.config import EngineConfig

PROBE = textwrap.dedent(
    """
    import json, sys, time
    t0 = time.monotonic()
    import torch
    torch.set_num_threads(1)
    from plimsoll.runtime import LLM
    from plimsoll.runtime.engine.compilation import cache_counters, use_cache_dir
    from plimsoll.runtime.engine.request import Request
    from plimsoll.runtime.engine.sampling_params import SamplingParams
    from plimsoll.runtime.engine.scheduler import SchedulerOutput

    model_dir, cache_dir = sys.argv[1], sys.argv[2]
    use_cache_dir(cache_dir)
    llm = LLM(model=model_dir, kv_cache_memory="1MiB", max_model_len=64, max_num_seqs=4, block_size=4)
    runner = llm.engine.runner

    def booked(rid, tokens, computed, blocks):
        req = Request(rid, rid, 0, tokens, SamplingParams(), frozenset())
        req.num_computed_tokens, req.block_ids = computed, blocks
        return req

    a = booked("a", [5, 9, 13, 2, 7, 7, 1], 7, [0, 1, 7])
    b = booked("b", [30, 31, 32, 33, 34], 5, [2, 3])
    c = booked("c", list(range(40, 52)), 4, [4, 5, 6])
    steps = [[(a, 7), (b, 5)]]  # two prefills, 12 tokens
    worst = 0.0
    for i, step in enumerate(steps + [None, None]):
        if step is None:  # then decode a and b together, and a decode mixed with c's first chunk
            for r in (a, b):
                r.append_token(60 + i)
                r.num_computed_tokens += 1
            step = [(a, 1), (b, 1)] if i == 1 else [(a, 1), (c, 4)]
        sched = SchedulerOutput(scheduled=step)
        runner.forward = runner.model
        _, eager = runner.execute(sched)
        if runner.compiled is None:
            runner.enable_compile(warm_up=False)
        runner.forward = runner.compiled
        _, compiled = runner.execute(sched)  # stores the same K/V again
        worst = max(worst, float((compiled - eager).abs().max()))
    # The decode graphs' static, padded buffers over the compiled forward (capture=False: no CUDA
    # here; the Triton attention in its interpreter): 2 sequences in the 4-row buffers.
    runner.enable_cuda_graphs(4, 64, capture=False, sizes=[4])
    for r in (a, b):
        r.append_token(70)
        r.num_computed_tokens += 1
    sched = SchedulerOutput(scheduled=[(a, 1), (b, 1)])
    graphs, runner.decode_graphs = runner.decode_graphs, None
    runner.forward = runner.model
    _, eager = runner.execute(sched)
    runner.decode_graphs = graphs
    _, replayed = runner.execute(sched)
    assert graphs.replays == 1
    worst = max(worst, float((replayed - eager).abs().max()))
    print(json.dumps({
        "max_abs_diff": worst, "graphs": runner.compiled.graphs,
        "compile_seconds": runner.compiled.compile_seconds, "process_seconds": time.monotonic() - t0,
        **cache_counters(),
    }))
    """
)


def run_probe(model_dir: Path, cache_dir: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(model_dir), str(cache_dir)],
        capture_output=True,
        text=True,
        timeout=500,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.slow
def test_compiled_forward_equals_eager_and_a_second_start_loads_the_cache(
    tiny_model_dir: Any, tmp_path: Path
) -> None:
    model_dir = tiny_model_dir("llama")
    cold = run_probe(model_dir, tmp_path / "cache")
    warm = run_probe(model_dir, tmp_path / "cache")
    print(
        f"compile cold {cold['compile_seconds']:.1f} s, warm {warm['compile_seconds']:.1f} s; {cold} {warm}"
    )
    for run in (cold, warm):
        assert run["max_abs_diff"] < 1e-4, run  # float32: the same logits, up to summation order
        assert run["graphs"] == 1
    assert cold["fxgraph_cache_miss"] >= 1 and cold["fxgraph_cache_hit"] == 0
    assert warm["fxgraph_cache_hit"] >= 1 and warm["fxgraph_cache_miss"] == 0
    assert any((tmp_path / "cache").rglob("*")), "the cache directory was not written"


def test_compilation_config_takes_vllm_forms_and_refuses_unknown_ones() -> None:
    assert EngineConfig(compilation_config="3").compilation_config.mode == 3
    assert EngineConfig(compilation_config='{"level": 0}').compilation_config.mode == 0
    parsed = EngineConfig(
        compilation_config={"mode": 3, "cache_dir": "/c", "cudagraph_capture_sizes": [8, 1, 8]}
    )
    assert parsed.compilation_config.cache_dir == "/c"
    assert parsed.compilation_config.cudagraph_capture_sizes == [1, 8]
    default = EngineConfig().compilation_config
    assert default.resolved_mode("cuda") == 3 and default.resolved_mode("cpu") == 0
    with pytest.raises(ValidationError, match=r"use 0 .* or 3"):
        EngineConfig(compilation_config={"mode": 2})
    with pytest.raises(ValidationError, match="splitting_ops"):
        EngineConfig(compilation_config={"splitting_ops": []})
    with pytest.raises(ValidationError, match="JSON object"):
        EngineConfig(compilation_config="{mode: 3")
    with pytest.raises(ValidationError, match="level=0 and mode=3"):
        CompilationConfig.model_validate({"level": 0, "mode": 3})


def test_serve_flags_fold_the_cache_dir_into_the_compilation_config() -> None:
    from plimsoll.runtime.cli import _compilation_config

    assert _compilation_config(None, None) == {}
    assert _compilation_config("3", "/vol/compile") == {"mode": 3, "cache_dir": "/vol/compile"}
    assert _compilation_config('{"mode": 0}', "/v") == {"mode": 0, "cache_dir": "/v"}
    assert (
        EngineConfig(compilation_config=_compilation_config(None, "/v")).compilation_config.cache_dir == "/v"
    )


@pytest.mark.gpu
def test_compiled_and_captured_forward_equals_eager_on_gpu(tiny_model_dir: Any, tmp_path: Path) -> None:
    import random

    from plimsoll.runtime import LLM, SamplingParams

    common: dict[str, Any] = dict(
        model=str(tiny_model_dir("llama")),
        device="cuda",
        dtype="float32",
        attention_backend="triton",
        kv_cache_memory="64MiB",
        max_model_len=512,
        max_num_seqs=8,
        max_num_batched_tokens=64,
    )
    rng = random.Random(3)
    batch = [[rng.randrange(3, 250) for _ in range(rng.choice([1, 7, 30, 90]))] for _ in range(16)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    eager = LLM(**common, enforce_eager=True, compilation_config={"mode": 0})
    want = [o.outputs[0].token_ids for o in eager.generate(batch, params)]
    del eager
    # No mode given: 3, CUDA's default.
    compiled = LLM(**common, compilation_config={"cache_dir": str(tmp_path / "cache")})
    runner = compiled.engine.runner
    assert runner.compiled is not None and runner.decode_graphs is not None
    got = [o.outputs[0].token_ids for o in compiled.generate(batch, params)]
    assert got == want
    assert runner.graph_replays > 0
    report = compiled.engine.compile_report()
    print(report)
    assert report["compiled_graphs"] == 2 and report["cuda_graph_capture_seconds"] > 0


def test_the_cache_dir_reaches_triton_without_importing_it(tmp_path: Path) -> None:
    """A CPU replica names Triton's cache directory without paying triton's import; once triton is
    imported (a GPU replica, a test), its knob reads the same directory."""
    pytest.importorskip("triton")
    probe = textwrap.dedent(
        """
        import json, sys
        from plimsoll.runtime.engine.compilation import use_cache_dir
        root = use_cache_dir(sys.argv[1])
        before = "triton" in sys.modules
        import triton
        print(json.dumps({"imported_by_it": before, "knob": triton.knobs.cache.dir, "root": str(root)}))
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}
    out = subprocess.run(
        [sys.executable, "-c", probe, str(tmp_path / "caches")],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["imported_by_it"] is False
    assert seen["knob"] == str(Path(seen["root"]) / "triton-jit")
