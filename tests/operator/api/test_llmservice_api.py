"""The LLMService pydantic models: defaults, aliases, validation messages, the condition helper."""

import pytest
from pydantic import ValidationError

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.api.model_uri import parse_model_uri
from plimsoll.operator.api.spec import LLMServiceSpec
from plimsoll.operator.api.status import get_condition, set_condition


def test_minimal_spec_gets_documented_defaults() -> None:
    spec = LLMServiceSpec.model_validate({"model": {"uri": "embedded://smollm2-135m"}})
    assert spec.engine.kind == "plimsoll"
    assert spec.resources.gpu.count == 1
    assert spec.resources.gpu.resource_name == "nvidia.com/gpu"
    assert spec.capacity.mode == "Profile"
    assert spec.capacity.headroom == 0.75
    assert spec.capacity.reprofile == "Auto"
    assert spec.autoscaling.mode == "builtin"
    assert spec.autoscaling.scale_up_stabilization_seconds == 30
    assert spec.autoscaling.scale_down_stabilization_seconds == 600
    assert spec.autoscaling.tolerance == 0.1
    assert spec.desired_replicas() == 1


def test_camel_case_round_trip() -> None:
    body = {
        "model": {"uri": "hf://Qwen/Qwen2.5-7B-Instruct", "servedName": "qwen"},
        "engine": {"kind": "vllm", "maxNumSeqs": 64, "kvCacheMemory": "8Gi", "prefixCaching": False},
        "resources": {"gpu": {"count": 2, "resourceName": "amd.com/gpu"}, "cpu": 8, "memory": "64Gi"},
        "slo": {"ttftP95Ms": 500, "tpotP50Ms": 50, "e2eP95Ms": 8000},
        "scaling": {"min": 1, "max": 4},
        "expectedLoad": {"requestsPerSecond": 3, "avgLatencySeconds": 4},
    }
    spec = LLMServiceSpec.model_validate(body)
    assert spec.engine.max_num_seqs == 64
    assert spec.slo.e2e_p95_ms == 8000
    dumped = spec.to_api()
    for section, values in body.items():
        for key, value in values.items():
            assert dumped[section][key] == value, (section, key)


@pytest.mark.parametrize(
    ("patch", "fragment"),
    [
        ({"scaling": {"min": 3, "max": 2}}, "scaling.min (3) must not exceed scaling.max (2)"),
        ({"resources": {"gpu": {"count": -1}}}, "greater than or equal to 0"),
        ({"engine": {"kind": "tgi"}}, "'plimsoll', 'vllm' or 'sglang'"),
        ({"model": {"uri": "s3://bucket/model"}}, "String should match pattern"),
        ({"engine": {"kvCacheMemory": "8 gigs"}}, "is not a Kubernetes quantity"),
        ({"capacity": {"mode": "Manual"}}, "Manual needs capacity.concurrencyPerReplica"),
        ({"expectedLoad": {"concurrency": 4, "requestsPerSecond": 2}}, "not both"),
        ({"replicas": 9, "scaling": {"min": 1, "max": 4}}, "replicas (9) must lie within"),
        (
            {"engine": {"kind": "vllm"}},
            "engine.kind vllm cannot serve embedded:// models",
        ),
    ],
)
def test_invalid_specs_say_what_is_wrong(patch: dict[str, object], fragment: str) -> None:
    body: dict[str, object] = {"model": {"uri": "embedded://smollm2-135m"}, **patch}
    with pytest.raises(ValidationError) as info:
        LLMServiceSpec.model_validate(body)
    assert fragment in str(info.value)


def test_replicas_outside_bounds_allowed_when_autoscaling_off() -> None:
    spec = LLMServiceSpec.model_validate(
        {
            "model": {"uri": "embedded://smollm2-135m"},
            "replicas": 9,
            "scaling": {"max": 4},
            "autoscaling": {"mode": "off"},
        }
    )
    assert spec.desired_replicas() == 9


@pytest.mark.parametrize(
    ("uri", "scheme", "name", "path"),
    [
        ("pvc://models/qwen/7b", "pvc", "models", "qwen/7b"),
        ("pvc://models", "pvc", "models", ""),
        ("hf://Qwen/Qwen2.5-7B-Instruct", "hf", "Qwen/Qwen2.5-7B-Instruct", ""),
        ("file:///opt/models/llama", "file", "/opt/models/llama", ""),
        ("embedded://smollm2-135m", "embedded", "smollm2-135m", ""),
    ],
)
def test_model_uri_forms(uri: str, scheme: str, name: str, path: str) -> None:
    location = parse_model_uri(uri)
    assert (location.scheme, location.name, location.path) == (scheme, name, path)


@pytest.mark.parametrize(
    "uri", ["pvc://Bad_Claim/x", "hf://only-org", "file://relative", "embedded://llama-70b", ""]
)
def test_malformed_model_uris_rejected(uri: str) -> None:
    with pytest.raises(ValueError, match="is not one of"):
        parse_model_uri(uri)


def test_condition_keeps_transition_time_when_status_unchanged() -> None:
    conditions = set_condition([], "Ready", "False", "Progressing", "0/1", now="2026-01-01T00:00:00Z")
    same = set_condition(
        conditions, "Ready", "False", "PodsStarting", "still 0/1", now="2026-01-01T00:05:00Z"
    )
    ready = get_condition(same, "Ready")
    assert ready is not None
    assert ready["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    assert ready["reason"] == "PodsStarting"
    flipped = set_condition(same, "Ready", "True", "AllReplicasReady", now="2026-01-01T00:06:00Z")
    assert get_condition(flipped, "Ready") == {
        "type": "Ready",
        "status": "True",
        "reason": "AllReplicasReady",
        "message": "",
        "lastTransitionTime": "2026-01-01T00:06:00Z",
    }
    assert conditions[0]["reason"] == "Progressing", "the input list must not be modified"


def test_conditions_kept_in_declared_order() -> None:
    conditions = set_condition([], "Degraded", "False", "AsExpected", now="t")
    conditions = set_condition(conditions, "Ready", "True", "AllReplicasReady", now="t")
    conditions = set_condition(conditions, "Progressing", "False", "Complete", now="t")
    assert [c["type"] for c in conditions] == ["Ready", "Progressing", "Degraded"]


def test_condition_reason_must_be_camel_case() -> None:
    with pytest.raises(ValidationError):
        set_condition([], "Ready", "False", "not camel case")


def test_llmservice_from_body_uses_metadata_name_as_served_name() -> None:
    svc = LLMService.from_body(
        {
            "metadata": {"name": "chat", "namespace": "team-a", "generation": 3},
            "spec": {"model": {"uri": "embedded://smollm2-135m"}},
        }
    )
    assert svc.served_name == "chat"
    assert svc.metadata.generation == 3
