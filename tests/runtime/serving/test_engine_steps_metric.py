"""``plimsoll_engine_steps_total{path}``: every engine step that ran the model, counted by what ran it.

A tiny Llama under the default CPU plan: an 11-token prompt's prefill is one glued step, each of
its decode steps a fused one, a 3-token prompt's prefill (fewer rows than the glued layers take)
the module path; steps that ran nothing count nowhere. With the fused step and the glued layers
switched off in the config, every step is the module path. All four paths are exported from the
start, at 0.
"""

from typing import Any

import pytest
from kernel_builds import needs_kernels
from prometheus_client import CollectorRegistry

from plimsoll import metric_names as mn
from plimsoll.runtime.engine.config import EngineConfig
from plimsoll.runtime.engine.llm_engine import LLMEngine
from plimsoll.runtime.engine.sampling_params import SamplingParams
from plimsoll.runtime.models.cpu_plan import STEP_PATHS
from plimsoll.runtime.serving.metrics import ServerMetrics

pytestmark = needs_kernels


def steps(metrics: ServerMetrics) -> dict[str, float]:
    name = mn.ENGINE_STEPS
    return {
        path: metrics.registry.get_sample_value(name, {"model_name": "tiny", "path": path}) or 0.0 for path in STEP_PATHS
    }


def run(engine: LLMEngine, prompt: list[int], max_tokens: int) -> None:
    engine.add_request(f"r{len(prompt)}", prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("planned", [True, False])
def test_each_step_is_counted_by_the_path_that_ran_it(tiny_model_dir: Any, planned: bool) -> None:
    metrics = ServerMetrics("tiny", registry=CollectorRegistry())
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_model_dir("llama")), kv_cache_memory=4 << 20, max_model_len=128,
            cpu_fused_decode=planned, cpu_glued_layers=planned,
        ),
        observer=metrics,
    )  # fmt: skip
    assert steps(metrics) == dict.fromkeys(STEP_PATHS, 0.0)  # every path exported from the start
    metrics.start_counting()
    engine.step()  # nothing to run: counted nowhere
    assert sum(steps(metrics).values()) == 0
    run(engine, list(range(3, 14)), max_tokens=5)  # an 11-row prefill, then 4 decode steps
    run(engine, [7, 8, 9], max_tokens=1)  # a 3-row prefill
    if planned:
        assert steps(metrics) == {"fused_decode": 4.0, "glued_layers": 1.0, "module_layers": 1.0, "cuda_graph": 0.0}
    else:
        assert steps(metrics) == {"fused_decode": 0.0, "glued_layers": 0.0, "module_layers": 6.0, "cuda_graph": 0.0}
    assert f'{mn.ENGINE_STEPS}{{model_name="tiny",path="module_layers"}}' in metrics.exposition()[0].decode()
