"""--metrics-compat vllm: the model-server protocol's series, under vLLM's names and types.

A Gateway API Inference Extension endpoint picker reads vllm:num_requests_waiting,
vllm:num_requests_running, vllm:kv_cache_usage_perc (gauges) and vllm:cache_config_info
(labels block_size, num_gpu_blocks). The exposition is parsed by prometheus_client's
own parser; the k8s test (tests/operator/handlers/test_inference_pool_k8s.py) reads a real pod's.
"""

import pytest
from prometheus_client.parser import text_string_to_metric_families

from plimsoll.runtime.engine.outputs import StepStats
from plimsoll.runtime.serving.metrics import ServerMetrics


def _step(running: int, waiting: int, kv: float) -> StepStats:
    return StepStats(
        num_running=running, num_waiting=waiting, batch_size=running, num_scheduled_tokens=running,
        num_prefill_tokens=0, num_decode_tokens=running, num_preemptions=0, num_kv_allocation_failures=0,
        prefix_cache_queries=0, prefix_cache_hits=0, kv_cache_usage=kv, step_time_s=0.01,
    )  # fmt: skip


def _families(m: ServerMetrics) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(m.exposition()[0].decode())}


def test_vllm_series_follow_the_plimsoll_ones() -> None:
    m = ServerMetrics("tiny", metrics_compat="vllm")
    m.set_cache_config(block_size=16, num_blocks=512, enable_prefix_caching=True, cache_dtype="float32")
    m.start_counting()
    m.on_step(_step(running=3, waiting=5, kv=0.25))
    fams = _families(m)
    values = {}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        family = fams[name]
        assert family.type == "gauge", name  # type: ignore[attr-defined]
        (sample,) = family.samples  # type: ignore[attr-defined]
        assert sample.labels == {"model_name": "tiny"}
        values[name] = sample.value
    assert values == {
        "vllm:num_requests_running": 3.0, "vllm:num_requests_waiting": 5.0, "vllm:kv_cache_usage_perc": 0.25,
    }  # fmt: skip
    (info,) = fams["vllm:cache_config_info"].samples  # type: ignore[attr-defined]
    assert info.labels["block_size"] == "16" and info.labels["num_gpu_blocks"] == "512"

    class Fresh:
        num_running, num_waiting, kv_cache_usage = 0, 1, 0.0

    m.refresh(Fresh())
    assert _families(m)["vllm:num_requests_running"].samples[0].value == 0.0  # type: ignore[attr-defined]
    assert _families(m)["plimsoll_num_requests_waiting"].samples[0].value == 1.0  # type: ignore[attr-defined]


def test_off_by_default_and_unknown_family_refused() -> None:
    assert not [n for n in _families(ServerMetrics("tiny")) if n.startswith("vllm:")]
    with pytest.raises(ValueError, match="only compatible family is vllm"):
        ServerMetrics("tiny", metrics_compat="sglang")
