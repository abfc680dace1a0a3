"""The built-in autoscaler with replicas that really run: real load, a scale-up, a killed engine, a scale-down.

Every replica is `plimsoll serve` on a tiny random model, started by the devcluster
pod runner as a local process bound to its pod IP (as a kubelet would start the
container); the operator is the real process with the chart's RBAC and scrapes
those engines' own /metrics. The load is real too: closed-loop streaming
completions with ``ignore_eos`` against the ready pods' loopback IPs
(``plimsoll.devcluster.podload``), each client sending to the pod with the fewest
of its requests outstanding.

One timeline, run once for the module (``run``), checked by the tests below:

1. one replica, then a step to ``CLIENTS`` closed-loop clients (3× the target of
   ``TARGET`` in flight per replica; the engine holds ``TARGET`` sequences, so a
   queue really forms): the operator scales up within the stabilisation window,
   the new pods come up Ready and take load;
2. at a steady replica count, SIGKILL one pod's engine process: the pod runner
   reports the exit and restarts the container, the pod comes back Ready and takes
   load, and the replica count does not thrash while it is out;
3. the load stops: the service scales down only after the scale-down window,
   monotonically.

Windows are shortened in the spec (scale-up ``UP_WINDOW_S``, scale-down
``DOWN_WINDOW_S``) so the whole timeline takes two to three minutes on a shared CPU.
"""

import itertools
import math
import os
import re
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from llms_k8s import apply, get_json, llmservice

from plimsoll.devcluster.podload import Completion, LoadConfig, PodLoad, ReplicaSample
from plimsoll.devcluster.podrunner import pod_processes

pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.timeout(600)]

NAME = "realscale"
TARGET = 2  # capacity.concurrencyPerReplica, and the engine's maxNumSeqs
CLIENTS = 6  # 3 × TARGET: ceil(1 × 6 / 2) = 3 replicas
MAX_REPLICAS = 4  # above what the load needs, so an over-eager scale-up would show
UP_WINDOW_S = 3
DOWN_WINDOW_S = 20
STARTUP_LIMIT_S = 180  # a replica's start on a CPU shared with the other replicas and the load
MAX_TOKENS = 48


@dataclass
class Timeline:
    """What the run observed; times are ``time.monotonic()``."""

    load: PodLoad
    step_at: float = 0.0
    scaled_up_at: float = 0.0
    first_new_ready_at: float = 0.0
    all_ready_at: float = 0.0
    replicas_at_kill: int = 0
    killed_pod: str = ""
    killed_pid: int = 0
    kill_at: float = 0.0
    back_ready_at: float = 0.0
    back_serving_at: float = 0.0
    killed_pod_status: dict[str, Any] = field(default_factory=dict)
    stop_at: float = 0.0
    scaled_down_at: float = 0.0
    described: str = ""
    events: list[dict[str, Any]] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)

    def desired_between(self, start: float, end: float) -> list[int]:
        return [s.desired for s in self.load.samples if start <= s.at <= end]

    def ok_between(self, start: float, end: float) -> list[Completion]:
        return [c for c in self.load.completions if start <= c.sent_at <= end and c.error is None]


def _until(
    predicate: Callable[[], Any], timeout: float, what: str, load: PodLoad, interval: float = 0.25
) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        load.check()
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


def _last(load: PodLoad) -> ReplicaSample | None:
    return load.samples[-1] if load.samples else None


def _changes(values: list[int]) -> list[int]:
    """The values with consecutive repeats collapsed: [1, 1, 3, 3, 1] → [1, 3, 1]."""
    return [v for i, v in enumerate(values) if i == 0 or v != values[i - 1]]


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    """The tiny random model for pods the pod runner starts (see ``pod_model``)."""
    from plimsoll.runtime.testing import pod_model

    return pod_model()


@pytest.fixture(scope="module")
def run(devcluster: Any, running_operator: Any, tiny_model: Path) -> Iterator[Timeline]:
    ns = f"realscale-{uuid.uuid4().hex[:6]}"
    devcluster.kubectl("create", "namespace", ns)
    manifest = llmservice(
        NAME,
        model={"uri": f"file://{tiny_model}"},
        engine={"maxNumSeqs": TARGET, "kvCacheMemory": "32Mi"},  # 64 Ki tokens: plenty, and light on RAM
        podAnnotations={},  # run the replicas for real
        replicas=1,
        scaling={"min": 1, "max": MAX_REPLICAS},
        capacity={"mode": "Manual", "concurrencyPerReplica": TARGET},
        autoscaling={
            "mode": "builtin",
            "intervalSeconds": 1,
            "scaleUpStabilizationSeconds": UP_WINDOW_S,
            "scaleDownStabilizationSeconds": DOWN_WINDOW_S,
        },
    )
    apply(devcluster, ns, manifest)
    config = LoadConfig(model=NAME, max_tokens=MAX_TOKENS)
    try:
        with PodLoad(Path(devcluster.kubeconfig), ns, NAME, config) as load:
            t = Timeline(load)
            _play(devcluster, ns, t)
            yield t
    finally:
        devcluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)



def _event_time(event: dict[str, Any]) -> float:
    """When an Event happened: its eventTime (microseconds), else its first timestamp (seconds)."""
    stamp = event.get("eventTime") or event.get("firstTimestamp") or event.get("lastTimestamp")
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() if stamp else 0.0

def _play(cluster: Any, ns: str, t: Timeline) -> None:
    load = t.load
    _until(
        lambda: (s := _last(load)) and s.ready == 1 and len(s.ready_pods) == 1,
        STARTUP_LIMIT_S,
        "1 ready replica",
        load,
    )
    first_pod = _last(load).ready_pods[0]  # type: ignore[union-attr]

    # 1. A light load first, so the autoscaler has low recommendations inside its scale-up window
    #    (a step right after the first Ready would meet an empty window), then the step.
    load.set_clients(1)
    time.sleep(UP_WINDOW_S + 3)
    load.set_clients(CLIENTS)
    t.step_at = time.monotonic()
    _until(lambda: (s := _last(load)) and s.desired > 1, UP_WINDOW_S + 30, "a scale-up decision", load)
    t.scaled_up_at = _last(load).at  # type: ignore[union-attr]
    _until(lambda: (s := _last(load)) and len(s.ready_pods) > 1, STARTUP_LIMIT_S, "a new replica Ready", load)
    t.first_new_ready_at = time.monotonic()
    _until(
        lambda: (s := _last(load)) and len(s.ready_pods) == s.desired and s.ready == s.desired,
        STARTUP_LIMIT_S,
        "every desired replica Ready",
        load,
    )
    t.all_ready_at = time.monotonic()
    # The new pods take load: each ready pod completes requests sent after it was ready.
    steady = _last(load).ready_pods  # type: ignore[union-attr]
    _until(
        lambda: set(steady) <= {c.pod for c in t.ok_between(t.all_ready_at, time.monotonic())},
        60,
        "every ready replica serving",
        load,
    )

    # 2. SIGKILL one engine process (not the first replica's: that one started before the load).
    t.replicas_at_kill = _last(load).desired  # type: ignore[union-attr]
    t.killed_pod = next(p for p in steady if p != first_pod)
    records = pod_processes(Path(cluster.state_dir) / "pods", ns, t.killed_pod)
    assert "engine" in records, (
        f"the pod runner recorded no live engine process for {t.killed_pod}: {records}"
    )
    t.killed_pid = records["engine"].pid
    t.kill_at = time.monotonic()
    os.kill(t.killed_pid, signal.SIGKILL)
    _until(lambda: t.killed_pod not in load.ready_pods(), 30, f"{t.killed_pod} to turn unready", load)
    _until(lambda: t.killed_pod in load.ready_pods(), STARTUP_LIMIT_S, f"{t.killed_pod} Ready again", load)
    t.back_ready_at = time.monotonic()
    _until(
        lambda: any(c.pod == t.killed_pod for c in t.ok_between(t.back_ready_at, time.monotonic())),
        60,
        f"{t.killed_pod} serving again",
        load,
    )
    t.back_serving_at = time.monotonic()
    t.killed_pod_status = get_json(cluster, "pod", t.killed_pod, "-n", ns)["status"]
    time.sleep(3)  # a few more ticks at the steady count after the recovery

    # 3. The load stops: one replica is enough, but only after the scale-down window.
    load.set_clients(0)
    t.stop_at = time.monotonic()
    _until(lambda: (s := _last(load)) and s.desired == 1, DOWN_WINDOW_S + 60, "the scale-down to 1", load)
    t.scaled_down_at = _last(load).at  # type: ignore[union-attr]
    time.sleep(2)  # and it stays there

    t.described = cluster.kubectl("describe", "llms", NAME, "-n", ns).stdout
    items = get_json(cluster, "events", "-n", ns, "--field-selector", f"involvedObject.name={NAME}")
    # The API lists events in name order, not time order: sort them by when they happened.
    t.events = sorted((items or {}).get("items", []), key=_event_time)
    t.status = get_json(cluster, "llms", NAME, "-n", ns)["status"]
    _print(t)


def _print(t: Timeline) -> None:
    load = t.load
    print(
        f"\nload step 1 → {CLIENTS} clients (target {TARGET}/replica): scale-up decision after "
        f"{t.scaled_up_at - t.step_at:.1f} s, first new replica Ready after {t.first_new_ready_at - t.step_at:.1f} s, "
        f"all {t.replicas_at_kill} Ready after {t.all_ready_at - t.step_at:.1f} s"
        f"\nSIGKILL of {t.killed_pod} PID {t.killed_pid}: Ready again after {t.back_ready_at - t.kill_at:.1f} s, "
        f"serving after {t.back_serving_at - t.kill_at:.1f} s; replicas in that window "
        f"{_changes(t.desired_between(t.kill_at, t.back_serving_at))}"
        f"\nload stop → 1 replica after {t.scaled_down_at - t.stop_at:.1f} s (window {DOWN_WINDOW_S} s)"
        f"\nrequests: {sum(c.error is None for c in load.completions)} ok, "
        f"{sum(c.error is not None for c in load.completions)} failed"
    )
    t0 = t.step_at
    print("replicas over time (s since the step: desired/ready): " + ", ".join(
        f"{s.at - t0:.0f}:{s.desired}/{s.ready}"
        for i, s in enumerate(load.samples)
        if i == 0 or (s.desired, s.ready) != (load.samples[i - 1].desired, load.samples[i - 1].ready)
    ))  # fmt: skip
    for d in load.decisions:
        print(f"  {d.seen_at - t0:6.1f} s {d.reason}: {d.current} → {d.desired}; {d.formula}; "
              f"unready {d.inputs.get('unreadyPods')}, without metrics {d.inputs.get('podsWithoutMetrics')}")  # fmt: skip


def test_scales_up_within_the_window_and_new_pods_take_load(run: Timeline) -> None:
    t = run
    took = t.scaled_up_at - t.step_at
    # The decision needs the load to persist for the window; the rest is ticks (1 s) and scrape time.
    assert UP_WINDOW_S - 1 <= took <= UP_WINDOW_S + 15, f"scale-up decision {took:.1f} s after the step"
    assert t.first_new_ready_at - t.scaled_up_at <= STARTUP_LIMIT_S
    # HPA formula on one replica with CLIENTS in flight: ceil(1 × 6 / 2) = 3; a scrape that lands
    # between two requests of a client sees 5 (still 3) — never more than the load can justify.
    up = t.desired_between(t.step_at, t.kill_at)
    assert _changes(up)[0] == 1 and max(up) == math.ceil(CLIENTS / TARGET), _changes(up)
    assert up == sorted(up), f"replicas went down under a steady load: {_changes(up)}"
    # The new pods really run: each served requests once Ready.
    served = {c.pod for c in t.ok_between(t.all_ready_at, t.kill_at)}
    assert len(served) == t.replicas_at_kill, served
    # (Requests the kill cut short were sent before it, so count by when they ended.)
    errors = [c for c in t.load.completions if c.error is not None and c.sent_at + c.e2e_s < t.kill_at]
    assert not errors, f"requests failed before any process was killed: {errors[:3]}"
    # One jump 1 → 3, or steps (1 → 2 → 3) when a scrape inside the window saw a client between
    # two requests: the stabilised recommendation is the window's lowest (HPA's rule).
    ups = [e for e in t.events if e.get("reason") == "ScaledUp"]
    steps = [tuple(map(int, m.groups())) for e in ups if (m := re.search(r"(\d+) → (\d+)", e.get("message", "")))]
    assert steps and steps[0][0] == 1 and steps[-1][1] == max(up), ups
    assert all(a[1] == b[0] for a, b in itertools.pairwise(steps)), steps


def test_killed_engine_is_restarted_and_the_autoscaler_does_not_thrash(run: Timeline) -> None:
    t = run
    # The pod runner reported the exit as a kubelet does: SIGKILL is exit code 137, one restart.
    engine = next(c for c in t.killed_pod_status["containerStatuses"] if c["name"] == "engine")
    assert engine["restartCount"] >= 1, engine
    assert engine["lastState"]["terminated"]["exitCode"] == 128 + signal.SIGKILL, engine
    assert engine["ready"] is True
    assert t.back_ready_at - t.kill_at <= STARTUP_LIMIT_S

    # While the pod was out the others carried the load (2 pods × 3 in flight against a target of 2),
    # but the unready pod counts as 0 on a scale-up: ceil(3 × 6/3 / 2) = 3, so nothing changes. It
    # must never count as zero load on a scale-down either.
    during = t.desired_between(t.kill_at, t.back_serving_at + 3)
    assert len(_changes(during)) <= 2, f"replicas changed more than once around the kill: {_changes(during)}"
    assert min(during) >= t.replicas_at_kill, f"scaled down during the outage: {_changes(during)}"
    assert max(during) <= math.ceil(CLIENTS / TARGET), f"scaled up beyond the formula: {_changes(during)}"
    failed = [c for c in t.load.completions if c.error is not None]
    assert all(c.pod == t.killed_pod and c.sent_at <= t.back_ready_at for c in failed), failed[:3]
    # status.autoscaler while the pod was out (written on change, at most every 15 s otherwise):
    # the unready pod is reported as such, and none of those decisions moved the count.
    seen = [d for d in t.load.decisions if t.kill_at <= d.seen_at <= t.back_ready_at]
    print(
        f"\ndecisions seen during the outage: {[(d.reason, d.formula, d.inputs.get('unreadyPods')) for d in seen]}"
    )
    for d in seen:
        if d.inputs.get("unreadyPods"):
            assert d.desired == d.current == t.replicas_at_kill, d


def test_scales_down_only_after_the_window_without_flapping(run: Timeline) -> None:
    t = run
    waited = t.scaled_down_at - t.stop_at
    # The window runs from the last high recommendation, up to one tick (1 s) before the stop was
    # recorded, and the recorder polls every 0.5 s.
    assert waited >= DOWN_WINDOW_S - 2, f"scaled down {waited:.1f} s after the load stopped"
    assert waited <= DOWN_WINDOW_S + 30, f"scale-down took {waited:.1f} s"
    after = t.desired_between(t.stop_at, time.monotonic())
    assert after == sorted(after, reverse=True) and after[-1] == 1, _changes(after)
    # The whole run: up while loaded, down once unloaded, never back and forth.
    loaded = t.desired_between(0, t.stop_at)
    assert loaded == sorted(loaded), _changes(loaded)
    assert {"ScaledUp", "ScaledDown"} <= {e.get("reason") for e in t.events}


def test_decisions_are_visible_in_kubectl_describe(run: Timeline) -> None:
    described = run.described
    for needle in (
        "ScaledUp",
        "ScaledDown",
        "ceil(",
        "Autoscaler",
        "Desired Replicas",
        "Target In Flight Per Replica",
    ):
        assert needle in described, f"{needle!r} missing from kubectl describe llms:\n{described}"


def test_the_scale_up_timeline_has_every_phase_in_order(run: Timeline) -> None:
    from plimsoll.operator.scaling.scale_up_timeline import PHASES, parse_time

    last = run.status["autoscaler"]["lastScaleUp"]
    print(f"\nstatus.autoscaler.lastScaleUp: {last}")
    # The last scale-up of the step: from 1, or from 2 when the scale-up came in two steps.
    assert last["complete"] is True and 1 <= last["fromReplicas"] < last["toReplicas"] == CLIENTS // TARGET, last
    assert [p["phase"] for p in last["phases"]] == list(PHASES), last["phases"]
    # Pod timestamps have one-second resolution: a mark may read up to 1 s before the one before it.
    times = [parse_time(p["at"]) or 0.0 for p in last["phases"]]
    for (earlier, a), (later, b) in zip(zip(PHASES, times, strict=True), zip(PHASES[1:], times[1:], strict=True), strict=False):
        assert b >= a - 1.0, f"{later} at {b} before {earlier} at {a}"
    assert last["decisionToReadySeconds"] <= STARTUP_LIMIT_S + 10
    # The Event tells the same scale-up as the status: 1 → 3, or 2 → 3 when it came in two steps
    # (the second step's timeline replaces the first's before that one completes).
    sentences = [e["message"] for e in run.events if e.get("reason") == "ScaleUpTimeline"]
    told = [m for m in sentences if m.startswith(f"scale-up {last['fromReplicas']}→{last['toReplicas']}")]
    assert told, (last["fromReplicas"], last["toReplicas"], sentences)
    assert "weights loaded at +" in told[-1] and "first request answered at +" in told[-1]
