"""hf:// replicas: the fetch init container, the cache volume, and ModelReady read back from pod status."""

from typing import Any

import pytest
from pydantic import ValidationError

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.resources.deployment import build_deployment
from plimsoll.operator.resources.inference_pool import build_inference_pool
from plimsoll.operator.resources.model_fetch import FETCH_CONTAINER, fetch_condition
from plimsoll.operator.resources.settings import BuildSettings

SETTINGS = BuildSettings(plimsoll_image="plimsoll:test", vllm_image="vllm/vllm-openai:v0.32.0")


def _svc(**spec: Any) -> LLMService:
    body = {"model": {"uri": "hf://org/model@v1"}, **spec}
    return LLMService.from_body({"metadata": {"name": "m", "namespace": "ns"}, "spec": body})


@pytest.mark.parametrize("engine", ["plimsoll", "vllm"])
def test_both_engines_fetch_first_then_load_offline(engine: str) -> None:
    svc = _svc(engine={"kind": engine, "env": [{"name": "HF_ENDPOINT", "value": "http://mirror:8080"}]},
               model={"uri": "hf://org/model@v1", "tokenSecretRef": {"name": "hf"}})  # fmt: skip
    pod = build_deployment(svc, SETTINGS)["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["name"] == FETCH_CONTAINER and init["image"] == "plimsoll:test", "the vLLM image has no fetch"
    assert init["command"] == ["python", "-m", "plimsoll.model_fetch"], (
        "not the whole CLI: start-up is the cost"
    )
    assert init["args"] == [
        "hf://org/model@v1",
        "--local-dir",
        "/var/cache/plimsoll/models/hf/org/model/v1",
    ]
    env = {e["name"]: e for e in init["env"]}
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert env["HF_ENDPOINT"]["value"] == "http://mirror:8080", "the engine's hub settings reach the download"
    engine_container = pod["containers"][0]
    args = engine_container["args"]
    assert args[args.index("--model") + 1] == "/var/cache/plimsoll/models/hf/org/model/v1"
    engine_env = {e["name"]: e for e in engine_container["env"]}
    assert "HF_TOKEN" not in engine_env, "the token goes to the download step only"
    assert engine_env["HF_HUB_OFFLINE"]["value"] == "1"
    assert {"name": "model-cache", "emptyDir": {}} in pod["volumes"]


def test_cache_volume_is_the_named_claim_or_a_sized_empty_dir() -> None:
    claim = build_deployment(_svc(model={"uri": "hf://o/m", "cache": {"claimName": "weights"}}), SETTINGS)
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "weights"}} in claim["spec"][
        "template"
    ]["spec"]["volumes"]
    sized = build_deployment(_svc(model={"uri": "hf://o/m", "cache": {"sizeLimit": "40Gi"}}), SETTINGS)
    assert {"name": "model-cache", "emptyDir": {"sizeLimit": "40Gi"}} in sized["spec"]["template"]["spec"][
        "volumes"
    ]
    with pytest.raises(ValidationError, match=r"claimName \(a PVC\), sizeLimit \(an emptyDir\) or hostPath"):
        _svc(model={"uri": "hf://o/m", "cache": {"claimName": "w", "sizeLimit": "1Gi"}})


def test_pod_level_fields_pass_through() -> None:
    svc = _svc(
        imagePullSecrets=[{"name": "regcred"}],
        serviceAccountName="llm-reader",
        volumes=[{"name": "templates", "configMap": {"name": "t"}}],
        volumeMounts=[{"name": "templates", "mountPath": "/etc/t"}],
    )
    pod = build_deployment(svc, SETTINGS)["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["serviceAccountName"] == "llm-reader" and pod["automountServiceAccountToken"] is True
    assert {"name": "templates", "configMap": {"name": "t"}} in pod["volumes"]
    assert {"name": "templates", "mountPath": "/etc/t"} in pod["containers"][0]["volumeMounts"]
    plain = build_deployment(_svc(), SETTINGS)["spec"]["template"]["spec"]
    assert plain["automountServiceAccountToken"] is False and "serviceAccountName" not in plain


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"volumes": [{"name": "tmp", "emptyDir": {}}]}, "used by the operator"),
        ({"volumeMounts": [{"name": "nope", "mountPath": "/x"}]}, "name of an entry in volumes"),
        ({"router": {"enabled": True, "mode": "inferencePool"}}, "choose one"),
        ({"router": {"endpointPickerRef": {"name": "epp"}}}, "needs router.mode inferencePool"),
    ],
)
def test_bad_specs_say_what_to_fix(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        _svc(**spec)


def test_inference_pool_selects_the_replica_selector() -> None:
    svc = _svc(
        router={"mode": "inferencePool", "endpointPickerRef": {"name": "epp", "failureMode": "FailOpen"}}
    )
    pool = build_inference_pool(svc)
    deployment = build_deployment(svc, SETTINGS)
    assert pool["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"] == {
        "kind": "Service", "name": "epp", "port": {"number": 9002}, "failureMode": "FailOpen",
    }  # fmt: skip
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--metrics-compat") + 1] == "vllm"
    assert "endpointPickerRef" not in build_inference_pool(_svc(router={"mode": "inferencePool"}))["spec"]


def _pod(name: str, **fetch: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "status": {"initContainerStatuses": [{"name": FETCH_CONTAINER, **fetch}]},
    }


def test_fetch_condition_names_the_failure_from_exit_code_and_message() -> None:
    failed = _pod(
        "m-1",
        ready=False,
        restartCount=3,
        state={"waiting": {"reason": "CrashLoopBackOff"}},
        lastState={
            "terminated": {"exitCode": 4, "message": "AccessDenied: no access to org/model with no token"}
        },
    )
    done = _pod("m-0", ready=True, state={"terminated": {"exitCode": 0}})
    condition = fetch_condition([done, failed])
    assert condition is not None
    assert (condition.status, condition.reason) == ("False", "AccessDenied")
    assert "no access to org/model" in condition.message and "retried 3 times" in condition.message
    running = _pod("m-2", ready=False, state={"running": {}})
    assert fetch_condition([done, running]).reason == "Downloading"  # type: ignore[union-attr]
    assert fetch_condition([done]).status == "True"  # type: ignore[union-attr]
    assert fetch_condition([{"metadata": {"name": "x"}, "status": {}}]) is None
