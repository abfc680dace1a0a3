"""spec.adapters on the local control plane: declared → loaded on every replica → one removed → unloaded, no restart.

Each replica is a real `plimsoll serve --enable-lora` on a tiny random Llama, started by the
devcluster pod runner as a local process bound to its pod IP (as a kubelet would start the
container); the operator is the real process with the chart's RBAC. The adapters are random
PEFT adapters written by peft itself (``write_random_lora``: different ranks and target
modules), declared as file:// URIs under ``~/.cache/plimsoll`` (not /tmp, which is an
emptyDir in a replica pod). The runtime's LoRA arithmetic is tested in tests/runtime; this
test is about the two halves together: what the operator loads, where, that the engine
serves it, that changing the list restarts nothing, and that an engine that does restart
(SIGKILLed; the pod runner restarts the container as a kubelet would) gets its adapters back
from the operator, since they are not in its command line.
"""

import json
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
from llms_k8s import apply, condition, get_json, llmservice, wait_for, wait_for_passes

from plimsoll.devcluster.podrunner import pod_processes

pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.timeout(480)]

NAME = "chat"
REPLICAS = 2
STARTUP_LIMIT_S = 240  # two engines starting at once on a CPU shared with everything else


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    from plimsoll.runtime.testing import pod_model

    return pod_model()


@pytest.fixture(scope="module")
def adapters(tiny_model: Path) -> dict[str, dict[str, str]]:
    """Two random PEFT adapters for the tiny model (rank 8 on q/v, rank 4 on o/down), as spec entries."""
    from plimsoll.runtime.testing import write_random_lora

    root = tiny_model.parent / f"{tiny_model.name}-loras"
    sql = write_random_lora(tiny_model, root / "sql", r=8, target_modules=("q_proj", "v_proj"), seed=1)
    fr = write_random_lora(tiny_model, root / "fr", r=4, target_modules=("o_proj", "down_proj"), seed=2)
    return {p.name: {"name": p.name, "uri": f"file://{p}"} for p in (sql, fr)}


def replica_pods(cluster: Any, ns: str) -> list[dict[str, Any]]:
    items = get_json(cluster, "pods", "-n", ns, "-l", f"plimsoll.dev/llmservice={NAME}")["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def served(pod_ip: str) -> dict[str, Any]:
    """What the replica's /v1/models lists: model id → parent."""
    cards = httpx.get(f"http://{pod_ip}:8000/v1/models", timeout=10, trust_env=False).json()["data"]
    return {c["id"]: c.get("parent") for c in cards}


def complete(pod_ip: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "hello there", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"http://{pod_ip}:8000/v1/completions", json=body, timeout=120, trust_env=False)


def status_adapters(cluster: Any, ns: str) -> dict[str, list[str]]:
    obj = get_json(cluster, "llms", NAME, "-n", ns) or {}
    return {row["name"]: row.get("loadedOn", []) for row in (obj.get("status") or {}).get("adapters") or []}


def restarts(pods: list[dict[str, Any]]) -> dict[str, tuple[str, int]]:
    """Pod name → (uid, the engine container's restart count)."""
    return {
        p["metadata"]["name"]: (
            p["metadata"]["uid"],
            sum(c.get("restartCount", 0) for c in p["status"].get("containerStatuses") or []),
        )
        for p in pods
    }


def events(cluster: Any, ns: str, reason: str) -> list[dict[str, Any]]:
    items = get_json(cluster, "events", "-n", ns, "--field-selector", f"involvedObject.name={NAME}")["items"]
    return [e for e in items if e.get("reason") == reason]


def mentions(found: list[dict[str, Any]], text: str) -> int:
    return sum(e["message"].count(text) * e.get("count", 1) for e in found)


def test_adapters_load_on_real_replicas_and_unload_live_without_restarting_pods(
    devcluster: Any, llms_namespace: str, running_operator: Any, adapters: dict[str, dict[str, str]], tiny_model: Path
) -> None:
    ns = llms_namespace
    sql, fr = adapters["sql"], adapters["fr"]
    broken = {"name": "broken", "uri": f"file://{tiny_model.parent}/no-such-adapter"}
    manifest = llmservice(
        NAME, model={"uri": f"file://{tiny_model}"}, replicas=REPLICAS, adapters=[sql, fr],
        # file:// adapters are loaded only from directories the spec allows (the replicas' --lora-allowed-roots).
        engine={"maxNumSeqs": 4, "maxLoras": 2, "maxLoraRank": 8, "loraAllowedRoots": [str(tiny_model.parent)]},
        podAnnotations={},  # real replicas
    )  # fmt: skip
    apply(devcluster, ns, manifest)

    def all_ready() -> list[dict[str, Any]] | None:
        found = replica_pods(devcluster, ns)
        ready = [p for p in found if (condition(p, "Ready") or {}).get("status") == "True"]
        return found if len(found) == REPLICAS and len(ready) == REPLICAS else None

    running = wait_for(all_ready, STARTUP_LIMIT_S, f"{REPLICAS} Ready replica pods", interval=1)
    names = sorted(p["metadata"]["name"] for p in running)
    before = restarts(running)
    ips = [p["status"]["podIP"] for p in running]
    deployment = get_json(devcluster, "deployment", NAME, "-n", ns)
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--enable-lora" in args and "--lora-modules" not in args

    # Declared → loaded on each replica through the API, the status says where, the engine serves them.
    wait_for(lambda: status_adapters(devcluster, ns) == {"sql": names, "fr": names}, 120, "both adapters on both pods")
    for ip in ips:
        assert served(ip) == {NAME: None, "sql": NAME, "fr": NAME}
        for model in ("sql", "fr", NAME):
            answer = complete(ip, model)
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"] == model and answer.json()["choices"][0]["text"]
    loaded = condition(get_json(devcluster, "llms", NAME, "-n", ns), "AdaptersReady")
    assert loaded is not None and (loaded["status"], loaded["reason"]) == ("True", "AdaptersLoaded")

    # One removed, one that cannot load added: fr is unloaded live, broken is a condition and an Event.
    patch = {"spec": {"adapters": [sql, broken]}}
    devcluster.kubectl("patch", "llms", NAME, "-n", ns, "--type", "merge", "-p", json.dumps(patch))
    wait_for(lambda: all("fr" not in served(ip) for ip in ips), 120, "fr unloaded from every replica")
    for ip in ips:
        assert served(ip) == {NAME: None, "sql": NAME}
        gone = complete(ip, "fr")
        assert gone.status_code == 404, gone.text
        assert gone.json()["error"]["type"] == "NotFoundError"

    def refused() -> dict[str, Any] | None:
        c = condition(get_json(devcluster, "llms", NAME, "-n", ns), "AdaptersReady")
        return c if c and c["reason"] == "AdapterLoadFailed" else None

    failed = wait_for(refused, 90, "AdaptersReady=False AdapterLoadFailed")
    assert failed["status"] == "False", failed
    assert "broken on" in failed["message"] and "HTTP 400" in failed["message"], failed
    assert "is not a directory" in failed["message"], failed
    warnings = wait_for(lambda: events(devcluster, ns, "AdapterLoadFailed"), 30, "a Warning Event AdapterLoadFailed")
    assert warnings[0]["type"] == "Warning" and "no-such-adapter" in warnings[0]["message"]
    assert status_adapters(devcluster, ns) == {"sql": names, "broken": []}

    # The engines keep serving the base model and the adapter still declared.
    for ip in ips:
        assert served(ip) == {NAME: None, "sql": NAME}
        for model in ("sql", NAME):
            answer = complete(ip, model)
            assert answer.status_code == 200, answer.text

    # The operator looks again (two resyncs) and changes nothing: each adapter was loaded once per
    # pod (the path the engine reports back is the one it was given), the refusal is not re-announced.
    wait_for_passes(running_operator, "Timer 'resync_llmservice'", ns, NAME)
    loads = events(devcluster, ns, "AdapterLoaded")
    assert [mentions(loads, f"{a} on {pod}") for a in ("sql", "fr") for pod in names] == [1] * 2 * REPLICAS, loads
    unloads = events(devcluster, ns, "AdapterUnloaded")
    assert [mentions(unloads, f"fr from {pod}") for pod in names] == [1] * REPLICAS, unloads
    assert mentions(events(devcluster, ns, "AdapterLoadFailed"), "broken on") == REPLICAS

    # No pod was restarted or replaced, and the Deployment's template never changed.
    assert restarts(replica_pods(devcluster, ns)) == before
    again = get_json(devcluster, "deployment", NAME, "-n", ns)
    assert again["metadata"]["generation"] == deployment["metadata"]["generation"]

    # An engine that does restart comes back without adapters (they are not in its flags); the
    # operator loads the declared one onto it again, and only there.
    victim, other = running[0]["metadata"]["name"], running[1]["metadata"]["name"]
    records = pod_processes(Path(devcluster.state_dir) / "pods", ns, victim)
    assert "engine" in records, f"the pod runner recorded no live engine process for {victim}: {records}"
    os.kill(records["engine"].pid, signal.SIGKILL)

    def restarted() -> dict[str, tuple[str, int]] | None:
        now = {p["metadata"]["name"]: p for p in replica_pods(devcluster, ns)}
        back = victim in now and (condition(now[victim], "Ready") or {}).get("status") == "True"
        return restarts(list(now.values())) if back and restarts([now[victim]])[victim][1] == 1 else None

    counts = wait_for(restarted, STARTUP_LIMIT_S, f"{victim}'s engine restarted and Ready", interval=1)
    assert counts == {victim: (before[victim][0], 1), other: before[other]}
    victim_ip = next(p["status"]["podIP"] for p in running if p["metadata"]["name"] == victim)
    wait_for(lambda: served(victim_ip) == {NAME: None, "sql": NAME}, 60, f"sql loaded again on {victim}")
    assert complete(victim_ip, "sql").status_code == 200
    assert mentions(events(devcluster, ns, "AdapterLoaded"), f"sql on {victim}") == 2
    assert mentions(events(devcluster, ns, "AdapterLoaded"), f"sql on {other}") == 1
