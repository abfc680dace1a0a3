"""Capacity profiling on the local control plane: a real sweep of a real replica, then a re-profile.

The replica runs `plimsoll serve` on a tiny random model as a local process bound
to its pod IP (the devcluster pod runner), and so does the profiling Job's
`plimsoll bench sweep`, with the Job's own ServiceAccount token: the report
reaches the operator only through the ConfigMap its Role lets it write. The
operator runs with the chart's RBAC (``running_operator``). The engine is held to
two sequences so the sweep over 1,2,4,8 saturates inside its range on any CPU;
the client gates are loosened (annotation ``plimsoll.dev/profile-args``) because
the CPU is shared with the replica.
"""

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
from llms_k8s import apply, condition, get_json, llmservice, wait_for, wait_for_passes

from plimsoll.operator.local import OperatorProcess
from plimsoll.operator.resources.profile_job import PROFILE_ARGS_ANNOTATION, REPORT_KEY, SPEC_HASH_ANNOTATION
from plimsoll.operator.scaling.profile import CapacityProfile, read_profile

pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.timeout(480)]

LEVELS = [1, 2, 4, 8]


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    """The tiny random model for pods the pod runner starts (see ``pod_model``)."""
    from plimsoll.runtime.testing import pod_model

    return pod_model()


def _profiled(cluster: Any, ns: str, name: str, not_hash: str | None = None) -> dict[str, Any] | None:
    obj = get_json(cluster, "llms", name, "-n", ns)
    c = condition(obj, "Profiled")
    if c is None:
        return None
    if c["status"] == "False" and c["reason"] not in ("Profiling", "WaitingForReplica"):
        pytest.fail(f"profiling failed: {c['reason']}: {c['message']}")
    capacity = (obj.get("status") or {}).get("capacity") or {}
    if c["status"] == "True" and capacity.get("specHash") not in (None, not_hash):
        return dict(obj)
    return None


def _events(cluster: Any, ns: str, name: str) -> list[dict[str, Any]]:
    items = get_json(cluster, "events", "-n", ns, "--field-selector", f"involvedObject.name={name}")
    return list((items or {}).get("items", []))


def test_profile_measures_a_real_replica_and_reprofiles_when_engine_args_change(
    devcluster: Any, llms_namespace: str, tiny_model: Path
) -> None:
    ns, name = llms_namespace, "prof"
    manifest = llmservice(
        name,
        model={"uri": f"file://{tiny_model}"},
        engine={"maxNumSeqs": 2},
        podAnnotations={},  # run the replica for real
        capacity={
            "mode": "Profile",
            "headroom": 0.75,
            "verifySeconds": 3,  # the hold after the sweep, short here
            "profile": {
                "workload": {
                    "inputTokens": 16,
                    "outputTokens": 8,
                    "concurrency": LEVELS,
                    "requestsPerLevel": 8,
                    "minSecondsPerLevel": 0,  # the floor would make this sweep minutes long
                }
            },
        },
    )
    manifest["metadata"]["annotations"] = {
        PROFILE_ARGS_ANNOTATION: "--max-client-lag-ms 1000 --min-concurrency-ratio 0.8 --warmup-requests 1"
    }
    started = time.monotonic()
    apply(devcluster, ns, manifest)

    obj = wait_for(lambda: _profiled(devcluster, ns, name), 240, "Profiled=True", interval=1)
    first_s = time.monotonic() - started
    capacity = obj["status"]["capacity"]
    print(f"\nfirst profile after {first_s:.0f} s: {json.dumps(capacity)}")

    # What status says is exactly what the Job published, read back through the operator's own reader.
    jobs = get_json(devcluster, "jobs", "-n", ns, "-l", "app.kubernetes.io/component=profile")["items"]
    assert len(jobs) == 1 and jobs[0]["status"].get("succeeded") == 1
    job_name = jobs[0]["metadata"]["name"]
    report = get_json(devcluster, "configmap", job_name, "-n", ns)["data"][REPORT_KEY]
    profile = read_profile(report)
    assert isinstance(profile, CapacityProfile), profile
    assert capacity["concurrencyPerReplica"] == profile.concurrency_per_replica >= 1
    knees = {
        kind: (capacity["knees"].get(kind) or {}).get("concurrency") for kind in ("throughput", "latency")
    }
    assert knees == {"throughput": profile.throughput_knee, "latency": profile.latency_knee}
    found = [k for k in knees.values() if k is not None]
    assert found, "a recommendation needs a knee"
    # The sweep recommends ⌊0.75 × knee⌋; the hold may step that down, and status says what it tried.
    swept = max(1, math.floor(0.75 * min(found)))
    verification = capacity["verification"]
    assert verification["sweptConcurrency"] == swept and verification["holdSeconds"] == 3
    assert capacity["concurrencyPerReplica"] == verification["verifiedConcurrency"] <= swept
    assert verification["tried"][0]["concurrency"] == swept and verification["tried"][-1]["passed"] is True
    assert verification["windowsMeasured"] == 3 * len(verification["tried"])
    assert [lv.concurrency for lv in profile.levels], "the sweep measured no valid level"
    assert json.loads(report)["server"]["model"] == name, "the Job measured another model"
    assert capacity["specHash"].startswith("sha256:") and capacity["measuredAt"]
    # What was measured, level by level, and where: the Job on the other node than the replica.
    measured = capacity["measured"]
    assert [lv["concurrency"] for lv in measured["levels"]] == LEVELS
    assert all(lv["requests"] >= 8 for lv in measured["levels"]) and measured["requestsPerLevel"] == 8
    assert measured["requests"] == sum(lv["requests"] for lv in measured["levels"])
    assert measured["loadGeneratorNode"] and measured["replicaNode"] and measured["sameNode"] is False
    assert f"{measured['requests']} requests over" in condition(obj, "Profiled")["message"]
    assert condition(obj, "ProfileStale")["status"] == "False"
    reasons = {e.get("reason") for e in _events(devcluster, ns, name)}
    assert {"ProfilingStarted", "Profiled"} <= reasons

    # New engine args: the profile is stale, and (reprofile Auto) measured again on a replica of the new spec.
    old_hash = capacity["specHash"]
    devcluster.kubectl(
        "patch",
        "llms",
        name,
        "-n",
        ns,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"engine": {"maxNumSeqs": 3}}}),
    )

    def stale_condition() -> dict[str, Any] | None:
        c = condition(get_json(devcluster, "llms", name, "-n", ns), "ProfileStale")
        return c if c and c["status"] == "True" else None

    stale = wait_for(stale_condition, 30, "ProfileStale=True")
    assert stale["reason"] == "SpecChanged" and old_hash in stale["message"]
    changed = time.monotonic()
    obj = wait_for(
        lambda: _profiled(devcluster, ns, name, not_hash=old_hash), 240, "a new profile", interval=1
    )
    print(f"re-profile after {time.monotonic() - changed:.0f} s: {json.dumps(obj['status']['capacity'])}")
    assert condition(obj, "ProfileStale")["status"] == "False"
    new_hash = obj["status"]["capacity"]["specHash"]
    maps = get_json(devcluster, "configmap", "-n", ns, "-l", "app.kubernetes.io/component=profile")["items"]
    new_map = next(m for m in maps if m["metadata"]["annotations"][SPEC_HASH_ANNOTATION] == new_hash)
    again = read_profile(new_map["data"][REPORT_KEY])
    assert isinstance(again, CapacityProfile)
    assert obj["status"]["capacity"]["concurrencyPerReplica"] == again.concurrency_per_replica


def test_failed_profile_is_reported_without_capacity_and_not_retried(
    devcluster: Any, llms_namespace: str, running_operator: OperatorProcess
) -> None:
    # A kwok-simulated replica: Ready with a pod IP, but nothing listens there, so the sweep fails.
    ns, name = llms_namespace, "noengine"
    manifest = llmservice(
        name,
        capacity={
            "mode": "Profile",
            "profile": {"workload": {"concurrency": [1, 2], "requestsPerLevel": 2, "minSecondsPerLevel": 0}},
        },
    )
    apply(devcluster, ns, manifest)

    def failed() -> dict[str, Any] | None:
        c = condition(get_json(devcluster, "llms", name, "-n", ns), "Profiled")
        return c if c and c["reason"] == "ProfileJobFailed" else None

    c = wait_for(failed, 120, "Profiled=False, reason ProfileJobFailed", interval=1)
    print(f"\nfailed profile: {c['message']}")
    assert c["status"] == "False" and "exit code 1" in c["message"]
    obj = get_json(devcluster, "llms", name, "-n", ns)
    assert "capacity" not in obj["status"], "a failed profile must not leave a capacity"
    warnings = [e for e in _events(devcluster, ns, name) if e.get("reason") == "ProfileFailed"]
    assert warnings and warnings[0]["type"] == "Warning"

    def jobs() -> list[dict[str, Any]]:
        items = get_json(devcluster, "jobs", "-n", ns, "-l", "app.kubernetes.io/component=profile")["items"]
        return list(items)

    first = jobs()
    assert len(first) == 1
    # Two more profiler ticks: the failed Job is the back-off, no new attempt.
    wait_for_passes(running_operator, "Timer 'profile_llmservice'", ns, name)
    assert [j["metadata"]["uid"] for j in jobs()] == [first[0]["metadata"]["uid"]]

    # The annotation asks for another attempt now, and is consumed.
    devcluster.kubectl("annotate", "llms", name, "-n", ns, "plimsoll.dev/reprofile=now")

    def retried() -> bool:
        uids = [j["metadata"]["uid"] for j in jobs()]
        return bool(uids) and first[0]["metadata"]["uid"] not in uids

    wait_for(retried, 60, "a new profile Job after the reprofile annotation", interval=1)
    wait_for(
        lambda: (
            "plimsoll.dev/reprofile"
            not in (get_json(devcluster, "llms", name, "-n", ns)["metadata"].get("annotations") or {})
        ),
        30,
        "the reprofile annotation to be consumed",
    )
