"""hf:// on the local control plane: the fetch init container, the token Secret, ModelReady and Events.

No hub is reachable from test machines: ``HubMirror`` (plimsoll.devcluster.hubmirror), an
HTTP server on 127.0.0.1 in this test process serving the tiny test model in the hub's
REST layout, stands in for huggingface.co. The LLMService points the pods at it the way
a user points them at a mirror, with ``HF_ENDPOINT`` in ``engine.env``. Everything
else is real: the operator (chart RBAC) builds the pod, the devcluster pod runner runs
the ``fetch-model`` init container (`plimsoll fetch`, huggingface_hub) and then
`plimsoll serve` on the downloaded directory, and the operator reads the init
container's status back into ``ModelReady``.
"""

import shutil
import uuid
from typing import Any

import httpx
import pytest
from llms_k8s import apply, condition, get_json, llmservice, wait_for

from plimsoll.devcluster.hubmirror import HubMirror, HubRepo
from plimsoll.devcluster.paths import model_cache_dir

pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.timeout(420)]


@pytest.fixture
def hub() -> Any:
    from plimsoll.runtime.testing import pod_model

    org = f"plimsoll-test-{uuid.uuid4().hex[:6]}"  # a fresh repository: the pod runner's cache is shared
    repos = {
        f"{org}/tiny-gated": HubRepo({"main": pod_model()}, gated=True, tokens=frozenset({"hf_test_token"}))
    }
    with HubMirror(repos) as mirror:
        mirror.org = org  # type: ignore[attr-defined]
        yield mirror
    # The pod runner maps the model-cache volume onto its local model cache.
    shutil.rmtree(model_cache_dir() / "hf" / org, ignore_errors=True)


def _events(cluster: Any, ns: str, name: str) -> list[dict[str, Any]]:
    found = get_json(cluster, "events", "-n", ns, "--field-selector", f"involvedObject.name={name}")
    return list((found or {}).get("items", []))


def test_gated_model_is_fetched_with_the_token_and_a_missing_one_is_named(
    devcluster: Any, llms_namespace: str, hub: HubMirror
) -> None:
    ns, org = llms_namespace, hub.org  # type: ignore[attr-defined]
    devcluster.kubectl(
        "create", "secret", "generic", "hf-token", "-n", ns, "--from-literal=token=hf_test_token"
    )
    env = [{"name": "HF_ENDPOINT", "value": hub.endpoint}]
    apply(
        devcluster,
        ns,
        llmservice(
            "gated",
            model={"uri": f"hf://{org}/tiny-gated", "tokenSecretRef": {"name": "hf-token"}},
            engine={"env": env, "maxNumSeqs": 2},
            podAnnotations={},  # run the pod for real
        ),
    )
    apply(
        devcluster,
        ns,
        llmservice(
            "missing", model={"uri": f"hf://{org}/no-such-model"}, engine={"env": env}, podAnnotations={}
        ),
    )

    def model_ready(name: str, status: str) -> dict[str, Any] | None:
        found = condition(get_json(devcluster, "llms", name, "-n", ns), "ModelReady")
        return found if found and found["status"] == status else None

    done = wait_for(
        lambda: model_ready("gated", "True"), 180, "ModelReady=True for the gated model", interval=1
    )
    assert done["reason"] == "Downloaded"
    obj = wait_for(
        lambda: (
            (o := get_json(devcluster, "llms", "gated", "-n", ns))
            and (condition(o, "Ready") or {}).get("status") == "True"
            and o
        ),
        180,
        "Ready=True after the download",
        interval=1,
    )
    assert obj["status"]["readyReplicas"] == 1
    files = sorted(p.rsplit("/", 1)[-1] for p in hub.downloads())
    assert "model.safetensors" in files and "config.json" in files
    pod = next(
        p
        for p in get_json(devcluster, "pods", "-n", ns, "-l", obj["status"]["selector"])["items"]
        if (condition(p, "Ready") or {}).get("status") == "True"
    )
    served = httpx.get(f"http://{pod['status']['podIP']}:8000/v1/models", timeout=10).json()
    assert [m["id"] for m in served["data"]] == ["gated"]
    assert any(e["reason"] == "ModelDownloaded" for e in _events(devcluster, ns, "gated"))

    def not_found() -> dict[str, Any] | None:
        # A loaded host can make one attempt a transient DownloadFailed (the hub stand-in runs in this
        # test's process); the init container is retried with back-off and the next attempt names it.
        cond = model_ready("missing", "False")
        return cond if cond is not None and cond["reason"] == "RepositoryNotFound" else None

    failed = wait_for(not_found, 180, "ModelReady=False, RepositoryNotFound, for the missing model", interval=1)
    assert f"repository {org}/no-such-model not found" in failed["message"]
    warning = wait_for(
        lambda: [e for e in _events(devcluster, ns, "missing") if e["reason"] == "RepositoryNotFound"],
        60,
        "a RepositoryNotFound Warning Event",
    )
    assert warning[0]["type"] == "Warning"
    # Retried with back-off, not hot: the init container waits in CrashLoopBackOff between tries.
    wait_for(
        lambda: any(
            (s.get("state") or {}).get("waiting", {}).get("reason") == "CrashLoopBackOff"
            for p in get_json(devcluster, "pods", "-n", ns, "-l", "plimsoll.dev/llmservice=missing")["items"]
            for s in (p.get("status") or {}).get("initContainerStatuses") or []
        ),
        60,
        "the fetch init container in back-off",
    )
    ready = condition(get_json(devcluster, "llms", "missing", "-n", ns), "Ready")
    assert ready is not None and ready["status"] == "False"
