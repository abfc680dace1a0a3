"""``kubectl annotate llms NAME plimsoll.dev/profile=3s`` end to end on the local control plane.

The replica is a real `plimsoll serve --enable-profiling` on a tiny random model
(the devcluster pod runner starts it on its pod IP); the real operator, with the
chart's permissions, profiles it. A slow trickle of requests keeps the engine
stepping while it records, so the stored trace must hold ``engine_step`` spans;
the trace is read back from the ConfigMap exactly as the ``fetch`` command in
``status.lastProfile`` says (base64, gzip). Then a request the operator cannot
serve gets a Warning Event and ``lastProfile.error``, and its annotation goes too.
"""

import base64
import gzip
import json
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from llms_k8s import apply, condition, get_json, llmservice, wait_for

pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.timeout(420)]


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    from plimsoll.runtime.testing import pod_model

    return pod_model()


def _events(cluster: Any, ns: str, name: str, reason: str) -> list[dict[str, Any]]:
    items = get_json(cluster, "events", "-n", ns, "--field-selector", f"involvedObject.name={name}")
    return [e for e in (items or {}).get("items", []) if e.get("reason") == reason]


def _annotations(cluster: Any, ns: str, name: str) -> dict[str, str]:
    return dict((get_json(cluster, "llms", name, "-n", ns) or {})["metadata"].get("annotations") or {})


def test_the_profile_annotation_profiles_a_ready_replica_and_says_where_it_is(
    devcluster: Any, llms_namespace: str, tiny_model: Path
) -> None:
    ns, name = llms_namespace, "profiled"
    apply(
        devcluster,
        ns,
        llmservice(
            name, model={"uri": f"file://{tiny_model}"}, engine={"profiling": True, "maxNumSeqs": 4},
            podAnnotations={},  # a real replica
        ),
    )  # fmt: skip

    def ready() -> dict[str, Any] | None:
        obj = get_json(devcluster, "llms", name, "-n", ns)
        return obj if (condition(obj, "Ready") or {}).get("status") == "True" else None

    obj = wait_for(ready, 180, "Ready=True", interval=1)
    pods = get_json(devcluster, "pods", "-n", ns, "-l", obj["status"]["selector"])["items"]
    pod = next(p for p in pods if (condition(p, "Ready") or {}).get("status") == "True")
    url = f"http://{pod['status']['podIP']}:8000"

    stop = threading.Event()

    def trickle() -> None:  # a few steps per second: the engine is busy, the trace stays small
        while not stop.is_set():
            httpx.post(
                f"{url}/v1/completions",
                json={"model": name, "prompt": "hi", "max_tokens": 4, "ignore_eos": True},
                timeout=30,
            )
            stop.wait(0.3)

    sender = threading.Thread(target=trickle, daemon=True)
    sender.start()
    try:
        devcluster.kubectl("annotate", "llms", name, "-n", ns, "plimsoll.dev/profile=3s")

        def recorded() -> dict[str, Any] | None:
            status = (get_json(devcluster, "llms", name, "-n", ns) or {}).get("status") or {}
            last = status.get("lastProfile") or {}
            return last if last.get("configMap") or last.get("error") else None

        last = wait_for(recorded, 120, "status.lastProfile", interval=1)
    finally:
        stop.set()
        sender.join(30)
    assert "error" not in last, last
    assert (last["pod"], last["kind"], last["seconds"]) == (pod["metadata"]["name"], "torch", 3)
    assert last["fetch"].startswith(f"kubectl get configmap {last['configMap']} -n {ns}")
    assert "plimsoll.dev/profile" not in _annotations(devcluster, ns, name)
    assert _events(devcluster, ns, name, "RuntimeProfiled")

    cm = get_json(devcluster, "configmap", last["configMap"], "-n", ns)
    assert cm["metadata"]["ownerReferences"][0]["name"] == name
    trace = json.loads(gzip.decompress(base64.b64decode(cm["binaryData"][last["key"]])))
    steps = [e for e in trace["traceEvents"] if e.get("name") == "engine_step" and e.get("ph") == "X"]
    assert steps, "the stored trace has no engine_step span"

    # A request that cannot be served: said in status and an Event, and the annotation goes.
    devcluster.kubectl("annotate", "llms", name, "-n", ns, "plimsoll.dev/profile=forever")
    failed = wait_for(
        lambda: ((get_json(devcluster, "llms", name, "-n", ns) or {}).get("status") or {})
        .get("lastProfile", {})
        .get("error"),
        60,
        "lastProfile.error",
    )
    assert "is not a duration" in failed
    assert _events(devcluster, ns, name, "RuntimeProfileFailed")
    wait_for(
        lambda: "plimsoll.dev/profile" not in _annotations(devcluster, ns, name), 30, "the annotation removed"
    )
