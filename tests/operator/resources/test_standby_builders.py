"""What standby and SLO admission change in the built objects: the Deployment's size and the engine's flags."""

from typing import Any

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.resources.deployment import build_deployment
from plimsoll.operator.resources.engine import VLLM_SLEEP_ENDPOINTS_ENV
from plimsoll.operator.resources.router import build_router_deployment
from plimsoll.operator.resources.settings import BuildSettings

SETTINGS = BuildSettings(plimsoll_image="plimsoll:test", vllm_image="vllm/vllm-openai:v0.32.0")


def _svc(**spec: Any) -> LLMService:
    body = {
        "model": {"uri": "embedded://smollm2-135m"},
        "replicas": 2,
        "scaling": {"min": 0, "max": 4},
        **spec,
    }
    return LLMService.from_body({
        "apiVersion": "plimsoll.dev/v1alpha1", "kind": "LLMService",
        "metadata": {"name": "s", "namespace": "ns"}, "spec": body,
    })  # fmt: skip


def _engine(deployment: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "engine")


def test_the_deployment_runs_the_parked_replicas_beside_the_active_ones() -> None:
    plain = build_deployment(_svc(), SETTINGS)
    parked = build_deployment(_svc(autoscaling={"standby": {"replicas": 3, "level": 2}}), SETTINGS)
    assert plain["spec"]["replicas"] == 2 and parked["spec"]["replicas"] == 5
    assert (
        "--enable-sleep-mode" in _engine(parked)["args"]
        and "--enable-sleep-mode" not in _engine(plain)["args"]
    )
    at_zero = build_deployment(_svc(replicas=0, autoscaling={"standby": {"replicas": 1}}), SETTINGS)
    assert at_zero["spec"]["replicas"] == 1  # the one parked replica waits asleep at zero


def test_predicted_admission_turns_on_the_replicas_slo_admission() -> None:
    engine = _engine(build_deployment(_svc(slo={"ttftP95Ms": 400, "admission": "Predicted"}), SETTINGS))
    assert "--slo-admission" in engine["args"]
    assert "--slo-admission" not in _engine(build_deployment(_svc(slo={"ttftP95Ms": 400}), SETTINGS))["args"]


def test_predicted_admission_gives_the_router_the_ttft_bound() -> None:
    def router_args(slo: dict[str, Any]) -> list[str]:
        built = build_router_deployment(_svc(router={"enabled": True}, slo=slo), SETTINGS)
        return list(built["spec"]["template"]["spec"]["containers"][0]["args"])

    args = router_args({"ttftP95Ms": 400, "admission": "Predicted"})
    assert args[args.index("--slo-ttft-ms") + 1] == "400"
    assert "--slo-ttft-ms" not in router_args({"ttftP95Ms": 400})


def test_vllm_standby_gets_the_sleep_flag_and_its_dev_mode_endpoints() -> None:
    svc = _svc(
        model={"uri": "hf://org/model"}, engine={"kind": "vllm"}, autoscaling={"standby": {"replicas": 1}}
    )
    engine = _engine(build_deployment(svc, SETTINGS))
    assert "--enable-sleep-mode" in engine["args"] and VLLM_SLEEP_ENDPOINTS_ENV in engine["env"]


def test_with_standby_the_router_gets_the_wake_key_alone_from_the_secret() -> None:
    def router_env(**spec: Any) -> list[dict[str, Any]]:
        built = build_router_deployment(_svc(router={"enabled": True}, **spec), SETTINGS)
        container = built["spec"]["template"]["spec"]["containers"][0]
        assert not any("key" in a for a in container["args"])  # never in the arguments
        return list(container.get("env") or [])

    wake = {"name": "PLIMSOLL_WAKE_API_KEY", "valueFrom": {"secretKeyRef": {"name": "s-admin-key", "key": "wake-api-key"}}}
    assert router_env(autoscaling={"standby": {"replicas": 1}}) == [wake]  # never the admin key
    assert router_env() == []  # nothing to wake: the router holds no key
    # The replicas take it (on POST /wake_up only) beside their admin key.
    engine = _engine(build_deployment(_svc(router={"enabled": True}, autoscaling={"standby": {"replicas": 1}}), SETTINGS))
    assert wake in engine["env"] and any(e["name"] == "PLIMSOLL_ADMIN_API_KEY" for e in engine["env"])
    off = {"standby": {"replicas": 1, "routerWake": False}}
    built = build_router_deployment(_svc(router={"enabled": True}, autoscaling=off), SETTINGS)
    container = built["spec"]["template"]["spec"]["containers"][0]
    assert "--no-standby-wake" in container["args"] and not container.get("env")
    engine = _engine(build_deployment(_svc(router={"enabled": True}, autoscaling=off), SETTINGS))
    assert wake not in engine["env"]
