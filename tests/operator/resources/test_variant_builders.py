"""One Deployment per hardware variant: what each carries, and the variants added up for status."""

import pytest
from pydantic import ValidationError

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.resources.settings import BuildSettings
from plimsoll.operator.resources.variants import (
    VARIANT_LABEL,
    build_variant_deployment,
    combine_deployments,
    variant_selector,
)

SETTINGS = BuildSettings(plimsoll_image="plimsoll:test")


def service(*variants: dict[str, object]) -> LLMService:
    return LLMService.from_body({
        "apiVersion": "plimsoll.dev/v1alpha1", "kind": "LLMService",
        "metadata": {"name": "chat", "namespace": "ns", "uid": "u1", "generation": 1},
        "spec": {"model": {"uri": "embedded://smollm2-135m"}, "engine": {"args": ["--max-num-seqs", "8"]},
                 "scheduling": {"nodeSelector": {"pool": "inference"}}, "variants": list(variants)},
    })  # fmt: skip


H100 = {"name": "h100", "costPerHour": 4.0, "maxReplicas": 3, "accelerator": {"type": "NVIDIA-H100-80GB-HBM3"},
        "engineArgs": ["--max-num-batched-tokens", "8192"]}  # fmt: skip
MIG = {"name": "mig", "costPerHour": 0.5, "maxReplicas": 4, "spot": True, "accelerator": {"migProfile": "1g.10gb"},
       "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}]}  # fmt: skip


def test_each_variant_gets_its_own_deployment_hardware_placement_and_arguments() -> None:
    svc = service(H100, MIG)
    h100, mig = (build_variant_deployment(svc, v, SETTINGS) for v in svc.spec.variants)
    assert h100["metadata"]["name"] == "chat-h100" and "replicas" not in h100["spec"]
    pod = h100["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "inference", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    args = " ".join(container["args"])
    assert "--max-num-seqs 8" in args and "--max-num-batched-tokens 8192" in args
    # The MIG slice is its own extended resource; the spot pool's taint is tolerated.
    mig_pod = mig["spec"]["template"]["spec"]
    (mig_container,) = mig_pod["containers"]
    assert mig_container["resources"]["limits"]["nvidia.com/mig-1g.10gb"] == 1
    assert {"key": "spot", "operator": "Exists", "effect": "NoSchedule"} in mig_pod["tolerations"]
    # The selectors keep the variants apart; the labels they share put both behind one Service.
    for deployment, name in ((h100, "h100"), (mig, "mig")):
        assert deployment["spec"]["selector"]["matchLabels"][VARIANT_LABEL] == name
        assert deployment["spec"]["template"]["metadata"]["labels"][VARIANT_LABEL] == name
    assert variant_selector(svc, "mig").endswith(f"{VARIANT_LABEL}=mig")


def test_the_variants_add_up_for_status_and_a_failing_one_is_reported() -> None:
    assert combine_deployments([]) is None
    ok = {"metadata": {"generation": 2}, "spec": {"replicas": 2},
          "status": {"observedGeneration": 2, "replicas": 2, "readyReplicas": 2, "updatedReplicas": 2}}  # fmt: skip
    stuck = {"metadata": {"generation": 1}, "spec": {"replicas": 3},
             "status": {"observedGeneration": 1, "replicas": 1, "readyReplicas": 0, "updatedReplicas": 1,
                        "conditions": [{"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
                                        "message": "exceeded quota"}]}}  # fmt: skip
    combined = combine_deployments([ok, stuck])
    assert combined is not None
    assert combined["spec"]["replicas"] == 5
    assert combined["status"]["replicas"] == 3 and combined["status"]["readyReplicas"] == 2
    assert combined["status"]["observedGeneration"] == 1  # every variant rolled out
    assert combined["status"]["conditions"][0]["message"] == "exceeded quota"
    rolling = {**ok, "metadata": {"generation": 3}}
    assert combine_deployments([rolling])["status"]["observedGeneration"] == 0


@pytest.mark.parametrize(
    ("variant", "says"),
    [
        ({**H100, "minReplicas": 4}, "minReplicas (4) must not exceed maxReplicas (3)"),
        ({**MIG, "accelerator": {"migProfile": "1g.10gb", "resourceName": "x.io/y"}}, "drop resourceName"),
        ({**H100, "costPerHour": 0}, "costPerHour"),
        ({**H100, "name": "H100"}, "name"),
    ],
)
def test_a_bad_variant_is_refused_saying_what_is_wrong(variant: dict[str, object], says: str) -> None:
    with pytest.raises(ValidationError) as error:
        service(variant)
    assert says.lower() in str(error.value).lower()
