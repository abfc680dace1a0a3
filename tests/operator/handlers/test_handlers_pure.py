"""The handlers' pure helpers: REST paths, settings from the environment, InvalidSpec messages."""

import pytest
from pydantic import ValidationError

from plimsoll.operator.api.spec import LLMServiceSpec
from plimsoll.operator.handlers.kube import object_path
from plimsoll.operator.handlers.llmservice import settings_from_env
from plimsoll.operator.handlers.reconcile import describe_validation_error


def test_object_paths() -> None:
    assert object_path("apps/v1", "Deployment", "ns", "d") == "/apis/apps/v1/namespaces/ns/deployments/d"
    assert object_path("v1", "Service", "ns", "s") == "/api/v1/namespaces/ns/services/s"
    assert (
        object_path("plimsoll.dev/v1alpha1", "LLMService", "ns")
        == "/apis/plimsoll.dev/v1alpha1/namespaces/ns/llmservices"
    )


def test_settings_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLIMSOLL_IMAGE", "registry.local/plimsoll:1")
    monkeypatch.setenv("PLIMSOLL_TERMINATION_GRACE_SECONDS", "300")
    settings = settings_from_env()
    assert settings.plimsoll_image == "registry.local/plimsoll:1"
    assert settings.termination_grace_period_seconds == 300
    monkeypatch.setenv("PLIMSOLL_TERMINATION_GRACE_SECONDS", "soon")
    with pytest.raises(ValidationError, match="termination_grace_period_seconds"):
        settings_from_env()


def test_invalid_spec_message_names_the_field() -> None:
    with pytest.raises(ValidationError) as info:
        LLMServiceSpec.model_validate(
            {"model": {"uri": "embedded://smollm2-135m"}, "engine": {"kind": "vllm"}}
        )
    message = describe_validation_error(info.value)
    assert message.startswith("spec: engine.kind vllm"), message
    assert "engine.kind vllm cannot serve embedded:// models" in message
    assert "Value error" not in message
    with pytest.raises(ValidationError) as info:
        LLMServiceSpec.model_validate(
            {"model": {"uri": "embedded://smollm2-135m"}, "resources": {"gpu": {"count": -2}}}
        )
    assert describe_validation_error(info.value).startswith("spec.resources.gpu.count: ")


def test_contains_tolerates_server_defaults_but_not_extra_list_items() -> None:
    from plimsoll.operator.handlers.kube import contains

    desired = {"ports": [{"port": 8000, "name": "http"}], "limits": {"nvidia.com/gpu": 1}, "flag": False}
    defaulted = {
        "ports": [{"port": 8000, "name": "http", "protocol": "TCP"}],
        "limits": {"nvidia.com/gpu": "1"},
        "flag": False,
        "x": 1,
    }
    assert contains(desired, defaulted)
    assert not contains(desired, {**defaulted, "ports": [*defaulted["ports"], {"port": 9999}]})
    assert not contains(desired, {**defaulted, "flag": 0})
    assert not contains(desired, {**defaulted, "limits": {"nvidia.com/gpu": "2"}})
