"""ProfileDrift on the local control plane: a profiled replica slows down mid-run, drifts, is re-profiled, matches.

The replica pod is scheduled by the real scheduler and made Ready by kwok; its
engine is bench's simulator (real HTTP, the runtime's metric names) bound to the
pod IP, where the operator scrapes it and where the profile Job's real
``plimsoll bench sweep`` (run by the devcluster pod runner) measures it. The
traffic is bench's closed-loop generator at four clients. Mid-run the
simulator's step cost is switched to four times its value (``PUT
/sim/step-cost``): the operator must set ``ProfileDrift=True`` with the numbers,
post a Warning Event and (``capacity.reprofile: Auto``) start a new profile Job;
once that profile is recorded the condition goes ``False`` (``Reprofiled``), and
with the traffic back the replica matches the new profile (``MatchesProfile``).
The traffic is paused while the new sweep runs, as a platform engineer would
not measure a replica beside other clients. The factor and the margin are far
apart (×4 against 50%), so a busy CPU, which slows profile and traffic alike,
does not decide the outcome; the windows are short (5 s, 5 requests).
"""

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from llms_k8s import apply, condition, get_json, llmservice, wait_for

from plimsoll.bench.client import OpenAIClient
from plimsoll.bench.config import BenchConfig, LengthSpec
from plimsoll.bench.loadgen import run_concurrency
from plimsoll.bench.simulator import ServiceCurve, SimulatorProcess, spawn_simulator
from plimsoll.bench.workload import Workload
from plimsoll.operator.local import OperatorProcess
from plimsoll.operator.resources.profile_job import PROFILE_ARGS_ANNOTATION
from plimsoll.operator.scaling.profile_plan import REPROFILE_ANNOTATION

pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.timeout(300)]

NAME = "drifty"
CLIENTS = 4
CURVE = ServiceCurve(model=NAME, batch_cap=4, step_t0_s=0.01, step_k_s=0.001)


class Traffic:
    """Bench's closed loop at ``CLIENTS`` clients on its own thread and event loop, until stopped."""

    def __init__(self, url: str) -> None:
        self.cfg = BenchConfig(
            url=url, model=NAME, levels=(CLIENTS,), input_tokens=LengthSpec(value=16),
            output_tokens=LengthSpec(value=8), duration_per_level_s=600.0,
            max_client_lag_ms=1000.0, min_concurrency_ratio=0.8,
        )  # fmt: skip
        self.thread: threading.Thread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.task: asyncio.Task[Any] | None = None
        self.error: BaseException | None = None
        self.started = threading.Event()

    async def _main(self) -> None:
        client = OpenAIClient(self.cfg, model=NAME)
        self.loop = asyncio.get_running_loop()
        self.task = asyncio.ensure_future(run_concurrency(client, Workload(self.cfg), self.cfg, CLIENTS))
        self.started.set()
        try:
            await self.task
        except asyncio.CancelledError:
            pass
        except BaseException as error:  # kept for the test to raise: the load must not stop silently
            self.error = error
        finally:
            await client.aclose()

    def start(self) -> None:
        self.started.clear()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self.thread.start()
        assert self.started.wait(30), "the load generator did not start"

    def running(self) -> bool:
        if self.error is not None:
            raise AssertionError(f"the traffic stopped: {self.error!r}") from self.error
        return self.thread is not None and self.thread.is_alive()

    def stop(self) -> None:
        if self.thread is None:
            return
        if self.loop is not None and self.task is not None:
            self.loop.call_soon_threadsafe(self.task.cancel)
        self.thread.join(30)
        self.thread = None


@pytest.fixture
def engines() -> Iterator[list[SimulatorProcess]]:
    started: list[SimulatorProcess] = []
    yield started
    for sim in started:
        sim.stop()


def _obj(cluster: Any, ns: str) -> dict[str, Any]:
    return dict(get_json(cluster, "llms", NAME, "-n", ns) or {})


def _drift(cluster: Any, ns: str, status: str, reason: str | None = None) -> dict[str, Any] | None:
    c = condition(_obj(cluster, ns), "ProfileDrift")
    return c if c and c["status"] == status and reason in (None, c["reason"]) else None


def _events(cluster: Any, ns: str) -> list[dict[str, Any]]:
    items = get_json(cluster, "events", "-n", ns, "--field-selector", f"involvedObject.name={NAME}")
    return list((items or {}).get("items", []))


def _profile_jobs(cluster: Any, ns: str) -> list[dict[str, Any]]:
    items = get_json(cluster, "jobs", "-n", ns, "-l", "app.kubernetes.io/component=profile")["items"]
    return [j for j in items if not j["metadata"].get("deletionTimestamp")]


def _capacity(cluster: Any, ns: str, not_measured_at: str | None = None) -> dict[str, Any] | None:
    obj = _obj(cluster, ns)
    c = condition(obj, "Profiled")
    if c is not None and c["status"] == "False" and c["reason"] not in ("Profiling", "WaitingForReplica"):
        pytest.fail(f"profiling failed: {c['reason']}: {c['message']}")
    capacity = (obj.get("status") or {}).get("capacity") or {}
    if c and c["status"] == "True" and capacity.get("measuredAt") not in (None, not_measured_at):
        return dict(capacity)
    return None


def _tokens_per_s_at(capacity: dict[str, Any], level: int) -> float:
    row = next(p for p in capacity["curve"] if p["concurrency"] == level)
    return float(row["outputTokensPerS"])


def test_a_replica_that_slows_down_drifts_is_reprofiled_and_matches_again(
    devcluster: Any, llms_namespace: str, engines: list[SimulatorProcess], running_operator: OperatorProcess
) -> None:
    ns = llms_namespace
    manifest = llmservice(
        NAME,
        replicas=1,
        scaling={"min": 1, "max": 1},  # the drift check runs in the built-in autoscaler's loop
        autoscaling={"mode": "builtin", "intervalSeconds": 1},
        capacity={
            "mode": "Profile",
            "reprofile": "Auto",
            "verifySeconds": 2,
            "drift": {"margin": 0.5, "windowSeconds": 5, "minRequests": 5},
            "profile": {
                "workload": {
                    "inputTokens": 16,
                    "outputTokens": 8,
                    "concurrency": [1, 2, 4, 8, 16],
                    "requestsPerLevel": 24,
                    "minSecondsPerLevel": 0,
                }
            },
        },
    )
    manifest["metadata"]["annotations"] = {
        PROFILE_ARGS_ANNOTATION: "--max-client-lag-ms 1000 --min-concurrency-ratio 0.8 --warmup-requests 1"
    }
    # kwok makes the pod Ready before the simulator below listens on its IP; a replica that is Ready
    # in a cluster answers. So the service starts at a Manual capacity and asks for the profile
    # once its engine is up (the profile Job makes one attempt).
    profiled = manifest["spec"]["capacity"]
    manifest["spec"]["capacity"] = {"mode": "Manual", "concurrencyPerReplica": CLIENTS}
    apply(devcluster, ns, manifest)

    def pod_ip() -> str | None:
        pods = get_json(devcluster, "pods", "-n", ns, "-l", f"plimsoll.dev/llmservice={NAME}")["items"]
        ips = [p["status"].get("podIP") for p in pods if not p["metadata"].get("deletionTimestamp")]
        return ips[0] if len(ips) == 1 and ips[0] else None

    ip = wait_for(pod_ip, 90, "one replica pod with an IP")
    sim = spawn_simulator(CURVE, host=ip, port=8000)
    engines.append(sim)
    sim.wait_ready(timeout_s=60)
    devcluster.kubectl("patch", "llms", NAME, "-n", ns, "--type=merge", "-p",
                       json.dumps({"spec": {"capacity": {**profiled, "concurrencyPerReplica": None}}}))  # fmt: skip
    wait_for(lambda: (condition(_obj(devcluster, ns), "Profiled") or {}).get("reason") not in (None, "ManualCapacity"),
             60, "the operator to take up Profile mode")  # fmt: skip

    first = wait_for(lambda: _capacity(devcluster, ns), 180, "the first profile (Profiled=True)", interval=1)
    print(f"\nfirst profile: {json.dumps(first)}")
    assert first["curve"], "the profile has no curve to compare with"

    traffic = Traffic(sim.url)
    try:
        traffic.start()
        # At the profiled speed the replica matches its profile: compared, within the margin.
        matches = wait_for(
            lambda: traffic.running() and _drift(devcluster, ns, "False", "MatchesProfile"),
            90, "ProfileDrift=False MatchesProfile at the profiled speed",
        )  # fmt: skip
        print(f"steady: {matches['message']}")

        httpx.put(f"{sim.url}/sim/step-cost", json={"scale": 4.0}, timeout=5).raise_for_status()
        drifted = wait_for(
            lambda: traffic.running() and _drift(devcluster, ns, "True"),
            90,
            "ProfileDrift=True after the slow-down",
        )
        traffic.stop()  # the new sweep measures the replica alone
        print(f"drifted: {drifted['message']}")
        assert drifted["reason"] == "BehaviourChanged"
        # The numbers: the live figure against the profile's, at the in-flight level observed.
        assert "output tokens/s" in drifted["message"] and "vs profile" in drifted["message"]
        assert f"pod {NAME}-" in drifted["message"] and "in flight" in drifted["message"]

        warnings = wait_for(
            lambda: [e for e in _events(devcluster, ns) if e.get("reason") == "ProfileDrift"],
            30, "a Warning Event ProfileDrift",
        )  # fmt: skip
        assert (
            warnings[0]["type"] == "Warning"
            and "re-profiling (capacity.reprofile Auto)" in warnings[0]["message"]
        )

        # reprofile Auto: a second profile Job measures the slowed replica and becomes the profile.
        second = wait_for(
            lambda: _capacity(devcluster, ns, not_measured_at=first["measuredAt"]),
            180, "a new profile after ProfileDrift", interval=1,
        )  # fmt: skip
        print(f"second profile: {json.dumps(second)}")
        started = [e["message"] for e in _events(devcluster, ns) if e.get("reason") == "ProfilingStarted"]
        # Listed in no particular order; one Job for the first profile, one the drift asked for.
        assert len(started) == 2 and sum(f"(annotation {REPROFILE_ANNOTATION})" in m for m in started) == 1, (
            started
        )
        assert len(_profile_jobs(devcluster, ns)) == 1, "the re-profile replaces the recorded Job"
        assert REPROFILE_ANNOTATION not in (_obj(devcluster, ns)["metadata"].get("annotations") or {})
        assert _tokens_per_s_at(second, CLIENTS) < _tokens_per_s_at(first, CLIENTS) / 2

        cleared = wait_for(
            lambda: _drift(devcluster, ns, "False", "Reprofiled"), 60, "ProfileDrift=False Reprofiled"
        )
        assert second["measuredAt"] in cleared["message"]
        assert any(e.get("reason") == "ProfileDriftCleared" for e in _events(devcluster, ns))

        # With the traffic back, the slowed replica is compared with the new profile and matches it.
        traffic.start()
        again = wait_for(
            lambda: traffic.running() and _drift(devcluster, ns, "False", "MatchesProfile"),
            90, "ProfileDrift=False MatchesProfile against the new profile",
        )  # fmt: skip
        print(f"after re-profile: {again['message']}")
        assert _capacity(devcluster, ns)["measuredAt"] == second["measuredAt"], "no third profile was needed"
    finally:
        traffic.stop()
    # The loop swallows a failed tick or drift check so scaling goes on; here none may have failed.
    failures = [
        line
        for line in running_operator.log_path.read_text(errors="replace").splitlines()
        if f"[{ns}/{NAME}]" in line
        and ("profile drift or scale-up timeline failed" in line or "autoscaler tick failed" in line)
    ]
    assert not failures, "\n".join(failures[:5])
