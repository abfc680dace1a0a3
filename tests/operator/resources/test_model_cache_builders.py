"""A node-local model cache (model.cache.hostPath): the replicas' volume, the fill DaemonSet, ModelCached."""

from typing import Any

import pytest
from pydantic import ValidationError

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.resources.deployment import build_deployment
from plimsoll.operator.resources.model_cache import (
    build_model_cache_daemonset,
    cache_condition,
    wants_prefill,
)
from plimsoll.operator.resources.model_fetch import FETCH_CONTAINER
from plimsoll.operator.resources.settings import BuildSettings

SETTINGS = BuildSettings(plimsoll_image="plimsoll:test", vllm_image="vllm/vllm-openai:v0.32.0")
NODE_CACHE = {"hostPath": {"path": "/var/lib/plimsoll/models"}}


def _svc(model: dict[str, Any] | None = None, **spec: Any) -> LLMService:
    body = {"model": model or {"uri": "hf://org/model@v1", "cache": {**NODE_CACHE, "prefill": True}}, **spec}
    return LLMService.from_body({"metadata": {"name": "m", "namespace": "ns"}, "spec": body})


def test_replicas_and_the_daemonset_fetch_into_the_same_node_directory() -> None:
    svc = _svc(engine={"env": [{"name": "HF_ENDPOINT", "value": "http://mirror:8080"}]})
    pod = build_deployment(svc, SETTINGS)["spec"]["template"]["spec"]
    volume = {
        "name": "model-cache",
        "hostPath": {"path": "/var/lib/plimsoll/models", "type": "DirectoryOrCreate"},
    }
    assert volume in pod["volumes"]
    (replica_fetch,) = pod["initContainers"]

    ds = build_model_cache_daemonset(svc, SETTINGS)
    assert (ds["kind"], ds["metadata"]["name"]) == ("DaemonSet", "m-model-cache")
    template = ds["spec"]["template"]
    assert template["metadata"]["labels"]["app.kubernetes.io/component"] == "model-cache"
    assert ds["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "model-cache"
    assert volume in template["spec"]["volumes"]
    (fill,) = template["spec"]["initContainers"]
    assert fill["name"] == FETCH_CONTAINER
    # The same command, env (the mirror) and target directory: the replica then finds the files verified.
    assert fill["args"] == replica_fetch["args"] and fill["env"] == replica_fetch["env"]
    assert fill["volumeMounts"] == replica_fetch["volumeMounts"]
    (hold,) = template["spec"]["containers"]
    assert hold["resources"]["requests"] == {"cpu": "1m", "memory": "16Mi"}, "holding the pod costs ~nothing"


def test_daemonset_goes_where_the_replicas_may_run() -> None:
    gpu = _svc(
        resources={"gpu": {"count": 1}},
        scheduling={
            "nodeSelector": {"pool": "gpu"},
            "tolerations": [{"key": "spot", "operator": "Exists"}],
            "affinity": {"podAntiAffinity": {"x": 1}, "nodeAffinity": {"y": 2}},
        },
    )
    spec = build_model_cache_daemonset(gpu, SETTINGS)["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"pool": "gpu"}
    assert spec["affinity"] == {"nodeAffinity": {"y": 2}}, "pod anti-affinity is about replicas, not caches"
    assert {"key": "spot", "operator": "Exists"} in spec["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]


def test_not_wanted_without_prefill() -> None:
    assert wants_prefill(_svc())
    assert not wants_prefill(_svc(model={"uri": "hf://org/model", "cache": NODE_CACHE}))


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (
            {"uri": "hf://o/m", "cache": {"claimName": "w", "hostPath": {"path": "/c"}}},
            "not claimName and hostPath",
        ),
        ({"uri": "hf://o/m", "cache": {"prefill": True}}, "set model.cache.hostPath.path"),
        (
            {"uri": "hf://o/m", "cache": {"sizeLimit": "1Gi", "prefill": True}},
            "set model.cache.hostPath.path",
        ),
        ({"uri": "hf://o/m", "cache": {"hostPath": {"path": "relative/dir"}}}, "should match pattern"),
        ({"uri": "hf://o/m", "cache": {"hostPath": {"path": "/var/../etc"}}}, "may not contain '..'"),
        (
            {"uri": "embedded://smollm2-135m", "cache": {**NODE_CACHE, "prefill": True}},
            "drop model.cache.prefill",
        ),
        ({"uri": "pvc://weights/m", "cache": NODE_CACHE}, "no adapter is hf://"),
    ],
)
def test_bad_cache_specs_say_what_to_fix(model: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        _svc(model=model)


def _ds(desired: int, ready: int, updated: int, generation: int = 1, observed: int = 1) -> dict[str, Any]:
    return {
        "metadata": {"generation": generation},
        "status": {
            "observedGeneration": observed,
            "desiredNumberScheduled": desired,
            "numberReady": ready,
            "updatedNumberScheduled": updated,
        },
    }


def test_model_cached_condition_follows_the_nodes() -> None:
    assert cache_condition(None, []) is None
    filled = cache_condition(_ds(3, 3, 3), [])
    assert (
        filled is not None
        and (filled.status, filled.reason) == ("True", "Filled")
        and "3 node" in filled.message
    )
    filling = cache_condition(_ds(3, 3, 1), [])  # a new revision rolling out: only one node has it
    assert filling is not None and (filling.status, filling.reason) == ("Unknown", "Filling")
    assert "1 of 3" in filling.message
    stale = cache_condition(_ds(3, 3, 3, generation=2), [])
    assert stale is not None and stale.status == "Unknown"
    nowhere = cache_condition(_ds(0, 0, 0), [])
    assert nowhere is not None and (nowhere.status, nowhere.reason) == ("False", "NoMatchingNodes")
    failed_pod = {
        "metadata": {"name": "m-model-cache-x"},
        "status": {
            "initContainerStatuses": [
                {
                    "name": FETCH_CONTAINER,
                    "ready": False,
                    "state": {"terminated": {"exitCode": 6, "message": "DiskFull: the cache volume is full"}},
                }
            ]
        },
    }
    full = cache_condition(_ds(2, 1, 2), [failed_pod])
    assert full is not None and (full.status, full.reason) == ("False", "DiskFull")
    assert "m-model-cache-x" in full.message


def test_the_compile_cache_lives_on_the_node_beside_a_node_local_model_cache() -> None:
    """A replica from zero on a node that served the model maps the weights an earlier one stored."""
    svc = _svc()
    pod = build_deployment(svc, SETTINGS)["spec"]["template"]["spec"]
    (engine,) = pod["containers"]
    args = engine["args"]
    cache_dir = args[args.index("--compilation-cache-dir") + 1]
    (mount,) = [m for m in engine["volumeMounts"] if m["mountPath"] == cache_dir]
    assert mount == {"name": "model-cache", "mountPath": cache_dir, "subPath": "compile"}, "writable, on the node"
    models = next(m for m in engine["volumeMounts"] if m["name"] == "model-cache" and "subPath" not in m)
    assert models["readOnly"] is True, "the models beside it stay read-only to the engine"
    assert "engine-compile-cache" not in {v["name"] for v in pod["volumes"]}, "no per-pod copy beside it"
    # The fetch (and the DaemonSet's, the same container) makes the subdirectory as the image's user
    # before the engine mounts it: a subPath the kubelet creates would be root's.
    (fetch,) = pod["initContainers"]
    made = fetch["args"][fetch["args"].index("--make-dir") + 1]
    assert made == f"{fetch['volumeMounts'][0]['mountPath']}/compile"
    (fill,) = build_model_cache_daemonset(svc, SETTINGS)["spec"]["template"]["spec"]["initContainers"]
    assert fill["args"] == fetch["args"]


@pytest.mark.parametrize(
    ("model", "engine"),
    [
        ({"uri": "hf://org/model@v1", "cache": {"sizeLimit": "20Gi"}}, {}),
        ({"uri": "hf://org/model@v1", "cache": NODE_CACHE}, {"args": ["--compilation-cache-dir", "/mine"]}),
    ],
    ids=["pod-cache", "user-cache-dir"],
)
def test_the_compile_cache_stays_per_pod_without_a_node_cache_or_with_the_users_own(
    model: dict[str, Any], engine: dict[str, Any]
) -> None:
    pod = build_deployment(_svc(model=model, engine=engine), SETTINGS)["spec"]["template"]["spec"]
    (fetch,) = pod["initContainers"]
    assert "--make-dir" not in fetch["args"]
    (container,) = pod["containers"]
    assert not any(m.get("subPath") == "compile" for m in container["volumeMounts"])
