"""spec.adapters on the local control plane: declared → loaded on every replica → one removed → unloaded, no restart.

The replica pods are scheduled by the real scheduler and made Ready by kwok; their engine is
the bench simulator (vLLM's adapter API: load/unload endpoints, ``/v1/models`` parents),
started by the test bound to each pod's loopback IP and port, which is where the operator
reaches a replica. The runtime's own LoRA serving is tested in tests/runtime; this test is
about the operator: what it loads, where, and that changing the list restarts nothing.
"""

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from llms_k8s import apply, condition, get_json, llmservice, wait_for

from plimsoll.bench.simulator import ServiceCurve, SimulatorProcess, spawn_simulator

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(300)]

NAME = "chat"


def adapter(root: Path, name: str) -> dict[str, str]:
    folder = root / name
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    return {"name": name, "uri": f"file://{folder}"}


@pytest.fixture
def engines() -> Iterator[list[SimulatorProcess]]:
    started: list[SimulatorProcess] = []
    yield started
    for sim in started:
        sim.stop()


def pods(cluster: Any, ns: str) -> list[dict[str, Any]]:
    items = get_json(cluster, "pods", "-n", ns, "-l", f"plimsoll.dev/llmservice={NAME}")["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def served(pod_ip: str) -> dict[str, Any]:
    """What the replica's /v1/models lists: model id → parent."""
    cards = httpx.get(f"http://{pod_ip}:8000/v1/models", timeout=5).json()["data"]
    return {c["id"]: c.get("parent") for c in cards}


def status_adapters(cluster: Any, ns: str) -> dict[str, list[str]]:
    obj = get_json(cluster, "llms", NAME, "-n", ns) or {}
    return {row["name"]: row.get("loadedOn", []) for row in (obj.get("status") or {}).get("adapters") or []}


def test_adapters_load_and_unload_live_without_restarting_pods(
    devcluster: Any, llms_namespace: str, tmp_path: Path, engines: list[SimulatorProcess]
) -> None:
    ns = llms_namespace
    sql, fr = adapter(tmp_path, "sql"), adapter(tmp_path, "fr")
    broken = {"name": "broken", "uri": f"file://{tmp_path}/none"}
    apply(devcluster, ns, llmservice(NAME, replicas=2, adapters=[sql, fr]))

    def two_pods() -> list[dict[str, Any]] | None:
        found = pods(devcluster, ns)
        return found if len(found) == 2 and all(p["status"].get("podIP") for p in found) else None

    running = wait_for(two_pods, 90, "two replica pods with IPs")
    for pod in running:
        sim = spawn_simulator(ServiceCurve(model=NAME, enable_lora=True), host=pod["status"]["podIP"], port=8000)
        engines.append(sim)
        sim.wait_ready(timeout_s=60)
    names = sorted(p["metadata"]["name"] for p in running)
    uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in running}
    ips = [p["status"]["podIP"] for p in running]

    # Declared → loaded on each replica, and the status says where.
    wait_for(lambda: status_adapters(devcluster, ns) == {"sql": names, "fr": names}, 90, "both adapters on both pods")
    for ip in ips:
        assert served(ip) == {NAME: None, "sql": NAME, "fr": NAME}
    loaded = condition(get_json(devcluster, "llms", NAME, "-n", ns), "AdaptersReady")
    assert loaded is not None and (loaded["status"], loaded["reason"]) == ("True", "AdaptersLoaded")
    deployment = get_json(devcluster, "deployment", NAME, "-n", ns)
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--enable-lora" in args and "--lora-modules" not in args

    # One removed, one that cannot load added: fr is unloaded live, broken is a condition and an Event.
    patch = {"spec": {"adapters": [sql, broken]}}
    devcluster.kubectl("patch", "llms", NAME, "-n", ns, "--type", "merge", "-p", json.dumps(patch))
    wait_for(lambda: all("fr" not in served(ip) for ip in ips), 90, "fr unloaded from every replica")
    for ip in ips:
        assert served(ip) == {NAME: None, "sql": NAME}

    def refused() -> dict[str, Any] | None:
        c = condition(get_json(devcluster, "llms", NAME, "-n", ns), "AdaptersReady")
        return c if c and c["reason"] == "AdapterLoadFailed" else None

    failed = wait_for(refused, 60, "AdaptersReady=False AdapterLoadFailed")
    assert failed["status"] == "False" and "broken on" in failed["message"] and "not a directory" in failed["message"]
    warnings = wait_for(
        lambda: [
            e
            for e in get_json(devcluster, "events", "-n", ns)["items"]
            if e.get("reason") == "AdapterLoadFailed" and e["involvedObject"]["name"] == NAME
        ],
        30,
        "a Warning Event AdapterLoadFailed",
    )
    assert warnings[0]["type"] == "Warning"
    assert status_adapters(devcluster, ns) == {"sql": names, "broken": []}

    # No pod was restarted or replaced, and the Deployment's template never changed.
    after = pods(devcluster, ns)
    assert {p["metadata"]["name"]: p["metadata"]["uid"] for p in after} == uids
    assert all(c.get("restartCount", 0) == 0 for p in after for c in p["status"].get("containerStatuses") or [])
    again = get_json(devcluster, "deployment", NAME, "-n", ns)
    assert again["metadata"]["generation"] == deployment["metadata"]["generation"]
