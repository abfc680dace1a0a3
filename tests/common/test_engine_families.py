"""The metric families the operator, bench and router read: SGLang's names beside plimsoll's and vLLM's."""

from plimsoll import metric_names as mn


def test_sglang_family_is_detected_by_its_running_and_queue_gauges() -> None:
    assert mn.detect_family({"sglang:num_running_reqs", "sglang:token_usage"}) is mn.SGLANG
    assert mn.detect_family({"sglang:num_queue_reqs"}) is mn.SGLANG
    assert mn.ENGINE_FAMILIES["sglang"].running == "sglang:num_running_reqs"
    assert mn.SGLANG.waiting == "sglang:num_queue_reqs" and mn.SGLANG.kv_usage == "sglang:token_usage"


def test_every_family_names_distinct_running_and_waiting_series() -> None:
    names = [(f.running, f.waiting) for f in mn.ENGINE_FAMILIES.values()]
    assert len({n for pair in names for n in pair}) == 2 * len(names)
