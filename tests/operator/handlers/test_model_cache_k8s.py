"""A node-local model cache on the local control plane: filled ahead by the DaemonSet, used by a replica.

``HubMirror`` (an HTTP server on 127.0.0.1 in this test process) stands in for the Hugging
Face Hub, found through ``HF_ENDPOINT`` in ``engine.env`` as a user's mirror would be. The
operator (chart RBAC) creates ``<name>-model-cache``, a DaemonSet on both simulated nodes; the
pod runner maps their ``hostPath`` onto one local directory, so the two fills race for one
directory as two pods on one node would, and ``plimsoll fetch``'s lock makes it one download.
A replica started afterwards finds the files present and verified and downloads nothing.
A hostPath cache for a model that needs no download is refused with InvalidSpec and an Event.
"""

import uuid
from pathlib import Path
from typing import Any

import pytest
from llms_k8s import apply, condition, get_json, llmservice, wait_for
from zero_k8s import events

from plimsoll.devcluster.hubmirror import HubMirror, HubRepo

pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.timeout(420)]


def test_prefill_fills_the_node_cache_once_and_a_replica_downloads_nothing(
    devcluster: Any, llms_namespace: str, tmp_path: Path
) -> None:
    from plimsoll.runtime.testing import pod_model

    ns, repo = llms_namespace, f"plimsoll-test-{uuid.uuid4().hex[:6]}/tiny"
    node_cache = tmp_path / "node-cache"
    with HubMirror({repo: HubRepo({"main": pod_model()})}) as hub:
        model = {"uri": f"hf://{repo}", "cache": {"hostPath": {"path": str(node_cache)}, "prefill": True}}
        env = [{"name": "HF_ENDPOINT", "value": hub.endpoint}]
        apply(devcluster, ns, llmservice("cached", model=model, engine={"env": env, "maxNumSeqs": 2},
                                         replicas=0, podAnnotations={}))  # fmt: skip

        def cached() -> dict[str, Any] | None:
            found = condition(get_json(devcluster, "llms", "cached", "-n", ns), "ModelCached")
            return found if found and found["status"] == "True" else None

        done = wait_for(cached, 240, "ModelCached=True", interval=1)
        assert done["reason"] == "Filled" and "on 2 node(s)" in done["message"], done
        ds = get_json(devcluster, "daemonset", "cached-model-cache", "-n", ns)
        assert ds["status"]["numberReady"] == 2
        filled = sorted(p.rsplit("/", 1)[-1] for p in hub.downloads())
        assert filled.count("model.safetensors") == 1, f"two fills of one directory downloaded once: {filled}"
        assert (node_cache / "hf" / repo / "main" / "model.safetensors").is_file()
        assert any(e["reason"] == "ModelCached" for e in events(devcluster, ns, "cached"))

        devcluster.kubectl(
            "patch", "llms", "cached", "-n", ns, "--type=merge", "-p", '{"spec":{"replicas":1}}'
        )
        obj = wait_for(
            lambda: (
                (o := get_json(devcluster, "llms", "cached", "-n", ns))
                and (condition(o, "Ready") or {}).get("status") == "True"
                and o
            ),
            240,
            "the replica Ready on the filled cache",
            interval=1,
        )
        assert obj["status"]["readyReplicas"] == 1
        assert sorted(p.rsplit("/", 1)[-1] for p in hub.downloads()) == filled, (
            "the replica downloaded nothing"
        )
        (replica,) = [
            p
            for p in get_json(devcluster, "pods", "-n", ns, "-l", obj["status"]["selector"])["items"]
            if not p["metadata"].get("deletionTimestamp")
        ]
        log = devcluster.state_dir / "pods" / "logs" / f"{ns}_{replica['metadata']['name']}_fetch-model.log"
        assert "nothing to download" in log.read_text()

    # A node cache holds downloads; a model baked into the image needs none: refused, not crash-looped.
    bad = {"uri": "embedded://smollm2-135m", "cache": {"hostPath": {"path": str(node_cache)}}}
    apply(devcluster, ns, llmservice("nocache", model=bad))
    ready = wait_for(
        lambda: (
            (c := condition(get_json(devcluster, "llms", "nocache", "-n", ns), "Ready"))
            and c["reason"] == "InvalidSpec"
            and c
        ),
        60,
        "Ready=False, InvalidSpec",
    )
    assert "model.cache.hostPath caches downloads of hf:// models" in ready["message"]
    warning = wait_for(
        lambda: [e for e in events(devcluster, ns, "nocache") if e["reason"] == "InvalidSpec"],
        60,
        "an Event",
    )
    assert warning[0]["type"] == "Warning"
