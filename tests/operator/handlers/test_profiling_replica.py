"""The choice of the replica a profile measures (``handlers/profiling.current_replica_ip``), without a cluster."""

from typing import Any

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.handlers.profiling import current_replica_ip
from plimsoll.operator.resources.deployment import build_deployment
from plimsoll.operator.resources.settings import BuildSettings

SETTINGS = BuildSettings(plimsoll_image="plimsoll:test")


def _svc() -> LLMService:
    return LLMService.from_body(
        {
            "metadata": {"name": "chat", "namespace": "ns", "uid": "u"},
            "spec": {"model": {"uri": "file:///models/tiny"}, "engine": {"maxNumSeqs": 8}},
        }
    )


def _pod(svc: LLMService, name: str, ip: str, ready: bool = True) -> dict[str, Any]:
    template = build_deployment(svc, SETTINGS)["spec"]["template"]
    return {
        "metadata": {"name": name},
        "spec": template["spec"],
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def test_only_a_ready_pod_on_the_current_spec_is_measured() -> None:
    old, new = _svc(), _svc()
    new.spec.engine.max_num_seqs = 4
    pods = [_pod(old, "a-old", "127.1.0.2"), _pod(new, "b-new", "127.1.0.3", ready=False)]
    assert current_replica_ip(new, SETTINGS, pods) is None  # the old replica would measure the old spec
    pods.append(_pod(new, "c-new", "127.1.0.4"))
    assert current_replica_ip(new, SETTINGS, pods) == "127.1.0.4"
