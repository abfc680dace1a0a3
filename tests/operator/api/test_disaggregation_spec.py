"""``spec.disaggregation``: what a split service needs, said when it is missing."""

from typing import Any

import pytest
from pydantic import ValidationError

from plimsoll.operator.api.spec import LLMServiceSpec


def test_a_split_service_gets_the_documented_defaults() -> None:
    spec = LLMServiceSpec.model_validate({"model": {"uri": "embedded://smollm2-135m"}, "disaggregation": {}})
    d = spec.disaggregation
    assert d is not None and spec.router_in_front()
    assert (d.prefill.min, d.prefill.max, d.prefill.desired_replicas()) == (1, 4, 1)
    assert (d.prefill.profile.input_tokens, d.prefill.profile.output_tokens) == (512, 1)
    assert (d.decode.profile.input_tokens, d.decode.profile.output_tokens) == (64, 128)
    assert d.to_api() == LLMServiceSpec.model_validate(spec.to_api()).disaggregation.to_api()  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("patch", "fragment"),
    [
        (
            {"engine": {"kind": "vllm"}, "model": {"uri": "hf://org/model"}},
            "disaggregation needs engine.kind plimsoll",
        ),
        ({"engine": {"prefixCaching": False}}, "disaggregation needs prefix caching"),
        ({"router": {"mode": "inferencePool"}}, "disaggregation needs router.mode plimsoll"),
        (
            {"engine": {"tensorParallelSize": 2}, "resources": {"gpu": {"count": 2}}},
            "one GPU (or CPU) per replica",
        ),
        (
            {"disaggregation": {"prefill": {"min": 3, "max": 2}}},
            "disaggregation.prefill.min (3) must not exceed its max (2)",
        ),
        (
            {"disaggregation": {"prefill": {"replicas": 9}}},
            "disaggregation.prefill.replicas (9) must lie within",
        ),
        ({"disaggregation": {"linkBandwidth": "fast"}}, "String should match pattern"),
        (
            {"variants": [{"name": "h100", "costPerHour": 4.0, "maxReplicas": 2}]},
            "disaggregation needs one hardware variant",
        ),
    ],
)
def test_invalid_split_specs_say_what_is_wrong(patch: dict[str, Any], fragment: str) -> None:
    body: dict[str, Any] = {"model": {"uri": "embedded://smollm2-135m"}, "disaggregation": {}}
    for key, value in patch.items():
        body[key] = {**body[key], **value} if isinstance(body.get(key), dict) else value
    with pytest.raises(ValidationError) as info:
        LLMServiceSpec.model_validate(body)
    assert fragment in str(info.value)
