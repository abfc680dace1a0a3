"""Scale to zero and back with requests held, and a scale-down that cuts nothing, on real engines.

Replicas are `plimsoll serve` on a tiny random model and the router is `plimsoll
route`, all started by the devcluster pod runner as local processes bound to
their pod IPs; the operator is the real process with the chart's RBAC. Requests
go to the router pod's loopback IP (``zero_k8s``).

1. ``scaling.min: 0`` with a short ``idleSeconds``: the replica goes to 0 with the
   status and an Event; 8 concurrent requests (half streaming) at 0 are held and
   all answered 200 once a replica is Ready; with ``router.holdQueue: 4`` the other
   4 get 429 with a Retry-After taken from the measured cold starts.
2. 3 → 1 under continuous streaming load through the router: the two pods the
   operator drained are the two that go, and no stream is cut.
"""

import json
import math
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from llms_k8s import apply, condition, get_json, llmservice
from zero_k8s import (
    Outcome,
    StreamLoad,
    Watch,
    _wall,
    burst,
    events,
    hold_state,
    is_ready,
    pods,
    router_ip,
    wait_until,
)

pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.timeout(1200)]

IDLE_S = 8
STARTUP_S = 240  # a replica's start on a CPU shared with the control plane and other replicas
TARGET = 2


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    from plimsoll.runtime.testing import pod_model

    return pod_model()


@pytest.fixture(scope="module")
def namespace(devcluster: Any, running_operator: Any) -> Iterator[str]:
    ns = f"zero-{uuid.uuid4().hex[:6]}"
    devcluster.kubectl("create", "namespace", ns)
    try:
        yield ns
    finally:
        devcluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def _replicas(cluster: Any, ns: str, name: str) -> int:
    return int(((get_json(cluster, "llms", name, "-n", ns) or {}).get("spec") or {}).get("replicas") or 0)


def _at_zero(cluster: Any, ns: str, name: str) -> bool:
    return _replicas(cluster, ns, name) == 0 and not pods(cluster, ns, name)


def _patch(cluster: Any, ns: str, name: str, spec: dict[str, Any]) -> None:
    cluster.kubectl("patch", "llms", name, "-n", ns, "--type=merge", "-p", json.dumps({"spec": spec}))


@dataclass
class ZeroRun:
    at_zero: dict[str, Any] = field(default_factory=dict)
    zero_events: list[dict[str, Any]] = field(default_factory=list)
    sent_at: float = 0.0
    sent_wall: float = 0.0
    held: list[Outcome] = field(default_factory=list)
    watch: Watch | None = None
    bounded: list[Outcome] = field(default_factory=list)
    cold_samples: list[float] = field(default_factory=list)
    cold_last: dict[str, Any] = field(default_factory=dict)


def last_cold_start(cluster: Any, ns: str, name: str) -> dict[str, Any]:
    status = (get_json(cluster, "llms", name, "-n", ns) or {}).get("status") or {}
    return dict((status.get("coldStart") or {}).get("last") or {})


def new_cold_start(cluster: Any, ns: str, name: str, before: dict[str, Any]) -> dict[str, Any]:
    """The operator's record of the cold start that followed ``before`` (written on the tick that saw Ready)."""
    found: dict[str, Any] = wait_until(
        lambda: (last := last_cold_start(cluster, ns, name)).get("decidedAt") != before.get("decidedAt") and last,
        60, "the operator's record of this cold start",
    )  # fmt: skip
    return found


def zero_manifest(name: str, model: Path, hold_queue: int) -> dict[str, Any]:
    return llmservice(
        name,
        model={"uri": f"file://{model}"},
        engine={"maxNumSeqs": TARGET, "kvCacheMemory": "32Mi"},
        podAnnotations={},  # run replicas and router for real
        replicas=1,
        scaling={"min": 0, "max": 1, "idleSeconds": IDLE_S, "drainSeconds": 30},
        capacity={"mode": "Manual", "concurrencyPerReplica": TARGET},
        autoscaling={"mode": "builtin", "intervalSeconds": 1, "scaleDownStabilizationSeconds": 5},
        # An explicit hold limit: the default (2 × cold-start p95) would tie the test to this CPU's speed.
        # One router: the test reads its hold queue and sends through it.
        router={"replicas": 1, "holdQueue": hold_queue, "holdTimeoutSeconds": 500},
    )


def play_zero(cluster: Any, ns: str, name: str, model: Path) -> ZeroRun:
    run = ZeroRun()
    apply(cluster, ns, zero_manifest(name, model, hold_queue=8))
    # The first start is measured too (from creation), so the router has a cold start to go by.
    wait_until(lambda: ((get_json(cluster, "llms", name, "-n", ns) or {}).get("status") or {})
               .get("coldStart", {}).get("samplesSeconds"), STARTUP_S, "the first cold start measured")  # fmt: skip
    wait_until(lambda: _at_zero(cluster, ns, name), IDLE_S + 120, "scale to zero after the idle window")
    run.at_zero = wait_until(
        lambda: (obj := get_json(cluster, "llms", name, "-n", ns))
        and (condition(obj, "Ready") or {}).get("reason") == "ScaledToZero"
        and (condition(obj, "ScalingLimited") or {}).get("reason") == "ScaledToZero"
        and obj, 60, "ScaledToZero in status",
    )  # fmt: skip
    run.zero_events = events(cluster, ns, name)

    ip = wait_until(lambda: router_ip(cluster, ns, name), 60, "a ready router pod at zero replicas")
    wait_until(lambda: hold_state(ip)["coldStartMeasured"], 30, "the router to read the measured cold start")
    before = last_cold_start(cluster, ns, name)
    with Watch(cluster, ns, name) as watch:
        run.sent_wall = time.time()
        run.sent_at, run.held = burst(f"http://{ip}:8000", name, 8, lambda i: i % 2 == 1)
    run.watch = watch
    run.cold_last = new_cold_start(cluster, ns, name, before)

    # Back to zero, then a hold bound of 4 for the same 8 requests.
    wait_until(lambda: _at_zero(cluster, ns, name), IDLE_S + 120, "scale to zero again")
    _patch(cluster, ns, name, {"router": {"holdQueue": 4}})
    ip = wait_until(
        lambda: (ip := router_ip(cluster, ns, name)) and hold_state(ip)["capacity"] == 4
        and hold_state(ip)["coldStartMeasured"] and ip, 120, "the router with holdQueue 4",
    )  # fmt: skip
    _, run.bounded = burst(f"http://{ip}:8000", name, 8, lambda i: i % 2 == 1)
    cold = ((get_json(cluster, "llms", name, "-n", ns) or {}).get("status") or {}).get("coldStart") or {}
    run.cold_samples = list(cold.get("samplesSeconds") or [])
    return run


def phases(run: ZeroRun) -> dict[str, float]:
    """Seconds per phase of the cold start from 0: operator's decision record, the pod's own timestamps."""
    w = run.watch
    assert w is not None and w.container_started and w.ready_transition, w
    decided = _wall(run.cold_last.get("decidedAt"))
    held = run.cold_last.get("heldBeforeDecisionSeconds")
    assert decided is not None and held is not None, run.cold_last
    first = min(o.first_byte_wall for o in run.held if o.first_byte_wall)
    return {
        "decision": float(held),  # the oldest held request's wait when the operator wrote spec.replicas 1
        "pod start": w.container_started - decided,  # to the engine container running (whole seconds)
        "engine start-up": w.ready_transition - w.container_started,  # to the pod Ready (whole seconds)
        "release": first - w.ready_transition,  # to the first byte of a held request's answer
        "total": first - run.sent_wall,
    }


@pytest.fixture(scope="module")
def zero(devcluster: Any, namespace: str, tiny_model: Path) -> ZeroRun:
    run = play_zero(devcluster, namespace, "zero", tiny_model)
    split = phases(run)
    print(
        "\ncold start from 0 (8 held requests): " + ", ".join(f"{k} {v:.1f} s" for k, v in split.items())
        + f"\noperator: {run.cold_last}; cold starts measured {run.cold_samples}"
        f"\nholdQueue 4: {[(o.status, o.retry_after) for o in run.bounded]}"
    )  # fmt: skip
    return run


def test_idle_service_scales_to_zero_with_status_and_event(zero: ZeroRun) -> None:
    obj = zero.at_zero
    ready = condition(obj, "Ready") or {}
    assert ready["status"] == "False" and "router holds requests" in ready["message"], ready
    limited = condition(obj, "ScalingLimited") or {}
    assert limited["status"] == "False" and f"{IDLE_S} s without requests" in limited["message"], limited
    assert obj["status"]["replicas"] == 0 and obj["status"]["endpoint"].startswith("http://zero-router."), obj
    said = [(e["reason"], e["message"]) for e in zero.zero_events]
    # The autoscaler's Event, and the Ready transition's under the same reason.
    assert any(r == "ScaledToZero" and "1 → 0" in m for r, m in said), said
    assert any(r == "ScaledToZero" and m.startswith("Ready=False") for r, m in said), said
    assert any(r == "DrainStarted" and "no request seen" in m for r, m in said), said


def test_requests_held_at_zero_are_all_answered_once_a_replica_is_ready(zero: ZeroRun) -> None:
    assert [o.status for o in zero.held] == [200] * 8, [(o.status, o.message, o.error) for o in zero.held]
    assert all(o.complete for o in zero.held), [o for o in zero.held if not o.complete]
    assert sum(o.stream for o in zero.held) == 4
    w = zero.watch
    assert w is not None and w.ready_transition is not None
    # Nobody was answered before the replica was Ready (a whole-second timestamp, so never late).
    assert all(o.first_byte_wall and o.first_byte_wall >= w.ready_transition for o in zero.held)


def test_beyond_the_hold_bound_429_with_retry_after_from_measured_cold_starts(zero: ZeroRun) -> None:
    codes = sorted(o.status for o in zero.bounded)
    assert codes == [200] * 4 + [429] * 4, [(o.status, o.message) for o in zero.bounded]
    assert zero.cold_samples, "no cold start was measured"
    longest = math.ceil(max(zero.cold_samples))
    for o in zero.bounded:
        if o.status == 429:
            assert o.retry_after is not None and 1 <= int(o.retry_after) <= longest, (o.retry_after, longest)
            assert "measured cold start" in o.message and "router.holdQueue" in o.message, o.message
    assert all(o.complete for o in zero.bounded if o.status == 200)


@dataclass
class DrainRun:
    before: list[str] = field(default_factory=list)
    victims: list[str] = field(default_factory=list)
    remaining: list[str] = field(default_factory=list)
    load: StreamLoad | None = None
    removed_at: float = 0.0
    status: dict[str, Any] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)


def play_drain(cluster: Any, ns: str, name: str, model: Path, clients: int = 2) -> DrainRun:
    run = DrainRun()
    manifest = llmservice(
        name,
        model={"uri": f"file://{model}"},
        engine={"maxNumSeqs": TARGET, "kvCacheMemory": "32Mi"},
        podAnnotations={},
        replicas=3,
        scaling={"min": 1, "max": 3, "drainSeconds": 120},
        capacity={"mode": "Manual", "concurrencyPerReplica": TARGET},
        # No scale-down until the load runs on all three (the window is shortened then).
        autoscaling={"mode": "builtin", "intervalSeconds": 1, "scaleDownStabilizationSeconds": 3600},
        router={"enabled": True, "replicas": 1},  # the load goes through this one router
    )
    apply(cluster, ns, manifest)
    wait_until(lambda: sum(is_ready(p) for p in pods(cluster, ns, name)) == 3, STARTUP_S, "3 ready replicas")
    ip = wait_until(lambda: router_ip(cluster, ns, name), 120, "a ready router")
    import httpx

    wait_until(lambda: httpx.get(f"http://{ip}:8000/ready", timeout=5, trust_env=False)
               .json()["ready_replicas"] == 3, 60, "the router to see 3 ready replicas")  # fmt: skip
    run.before = sorted(p["metadata"]["name"] for p in pods(cluster, ns, name))
    with StreamLoad(f"http://{ip}:8000", name, clients) as load:
        run.load = load
        wait_until(lambda: sum(o.complete for o in load.outcomes) >= 4, 120, "streams flowing")
        _patch(cluster, ns, name, {"autoscaling": {"scaleDownStabilizationSeconds": 3}})
        status = wait_until(
            lambda: (((get_json(cluster, "llms", name, "-n", ns) or {}).get("status") or {}).get("scaleDown") or {})
            .get("pods"), 120, "the drain to start",
        )  # fmt: skip
        run.victims = sorted(status)
        wait_until(lambda: _replicas(cluster, ns, name) == 1 and len(pods(cluster, ns, name)) == 1,
                   300, "3 → 1 with the drained pods gone")  # fmt: skip
        run.removed_at = time.monotonic()
        run.remaining = sorted(p["metadata"]["name"] for p in pods(cluster, ns, name))
        wait_until(lambda: sum(1 for o in load.outcomes if o.done_at and o.done_at > run.removed_at) >= 3,
                   120, "streams after the scale-down")  # fmt: skip
    run.status = ((get_json(cluster, "llms", name, "-n", ns) or {}).get("status") or {}).get(
        "scaleDown"
    ) or {}
    run.events = events(cluster, ns, name)
    return run


@pytest.fixture(scope="module")
def drained(devcluster: Any, namespace: str, tiny_model: Path, zero: ZeroRun) -> DrainRun:
    # After the zero scenario (``zero`` as a dependency): one service's replicas at a time on this CPU.
    run = play_drain(devcluster, namespace, "drain3", tiny_model)
    assert run.load is not None
    print(
        f"\n3 → 1 under {run.load.clients} streaming clients: drained {run.victims}, kept {run.remaining}; "
        f"streams {len(run.load.outcomes)}, failed {len(run.load.failed())}; "
        f"requestsCutTotal {run.status.get('requestsCutTotal')}; {run.status.get('message')}"
    )
    return run


def test_scale_down_under_streaming_load_removes_the_drained_pods_and_cuts_nothing(drained: DrainRun) -> None:
    load = drained.load
    assert load is not None
    assert not load.failed(), [(o.status, o.message, o.error) for o in load.failed()][:5]
    assert len(drained.victims) == 2 and set(drained.victims) <= set(drained.before)
    assert drained.remaining == sorted(set(drained.before) - set(drained.victims)), (
        drained.before,
        drained.victims,
    )
    assert drained.status.get("requestsCutTotal") == 0, drained.status
    assert drained.status.get("reason") in ("Drained", "DrainTimeout"), drained.status
    said = [(e["reason"], e["message"]) for e in drained.events]
    assert any(r == "DrainStarted" and "3 → 1" in m for r, m in said), said
    assert any(r == "ScaledDown" and "removing exactly those pods" in m for r, m in said), said
