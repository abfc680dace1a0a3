"""The built-in autoscaler on the local control plane: scale up on load, limit at max, scale down after the window.

The operator runs as a real process (``running_operator``); replica pods are
simulated by kwok (scheduled, Ready, a loopback pod IP, no engine). This test
plays each replica's engine: it serves real Prometheus exposition with the
runtime's gauges on ``<podIP>:8000/metrics`` and sets running/waiting from a
total load it controls, so the operator scrapes pods exactly as in a cluster.
Windows are shortened in the spec so the whole timeline takes about a minute.
"""

import time
from typing import Any

import pytest
from engines_k8s import SimulatedEngines
from llms_k8s import apply, condition, get_json, llmservice, wait_for

pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.timeout(420)]

TARGET = 4  # capacity.concurrencyPerReplica
SCALE_DOWN_WINDOW_S = 12


def _events(cluster: Any, ns: str, name: str) -> list[dict[str, Any]]:
    items = get_json(cluster, "events", "-n", ns, "--field-selector", f"involvedObject.name={name}")
    return list((items or {}).get("items", []))


def test_builtin_autoscaler_scales_on_in_flight_and_explains(devcluster: Any, llms_namespace: str) -> None:
    ns, name = llms_namespace, "auto"
    manifest = llmservice(
        name,
        replicas=1,
        scaling={"min": 1, "max": 4},
        capacity={"mode": "Manual", "concurrencyPerReplica": TARGET},
        autoscaling={
            "mode": "builtin",
            "intervalSeconds": 1,
            "scaleUpStabilizationSeconds": 2,
            "scaleDownStabilizationSeconds": SCALE_DOWN_WINDOW_S,
        },
    )
    apply(devcluster, ns, manifest)
    with SimulatedEngines(devcluster, ns, name) as engines:

        def autoscaler_status() -> dict[str, Any] | None:
            obj = get_json(devcluster, "llms", name, "-n", ns)
            return ((obj or {}).get("status") or {}).get("autoscaler")

        status = wait_for(autoscaler_status, 90, "status.autoscaler (is the autoscaling daemon registered?)")
        assert status["inputs"]["targetInFlightPerReplica"] == TARGET
        assert status["inputs"]["targetSource"] == "manual"

        # Step: 14 in flight on one replica → ceil(1 × 14 / 4) = 4.
        engines.total = 14
        step_at = time.monotonic()
        wait_for(
            lambda: get_json(devcluster, "llms", name, "-n", ns)["spec"].get("replicas") == 4,
            60,
            "4 replicas",
        )

        def four_ready() -> bool:
            obj = get_json(devcluster, "llms", name, "-n", ns)
            return bool(obj["status"].get("readyReplicas") == 4)

        wait_for(four_ready, 120, "4 ready replicas")
        print(f"\nload step → 4 replicas ready: {time.monotonic() - step_at:.1f} s (kwok-simulated pods)")
        up = [e for e in _events(devcluster, ns, name) if e.get("reason") == "ScaledUp"]
        assert any("1 → 4: ceil(1 × 14 / 4) = 4" in e.get("message", "") for e in up), up

        # At max and still overloaded: 30 in flight wants ceil(4 × 7.5 / 4) = 8.
        engines.total = 30

        def limited() -> dict[str, Any] | None:
            c = condition(get_json(devcluster, "llms", name, "-n", ns), "ScalingLimited")
            return c if c and c["status"] == "True" else None

        c = wait_for(limited, 30, "ScalingLimited=True")
        assert c["reason"] == "TooManyReplicas"
        assert get_json(devcluster, "llms", name, "-n", ns)["spec"]["replicas"] == 4

        # Load drops to 2: one replica is enough, but only after the scale-down window, in one step.
        engines.total = 2
        drop_at = time.monotonic()
        seen: set[int] = set()

        def one_replica() -> bool:
            replicas = int(get_json(devcluster, "llms", name, "-n", ns)["spec"]["replicas"])
            seen.add(replicas)
            return replicas == 1

        wait_for(one_replica, SCALE_DOWN_WINDOW_S + 60, "scale-down to 1", interval=0.25)
        waited = time.monotonic() - drop_at
        assert waited >= SCALE_DOWN_WINDOW_S - 2, f"scaled down after {waited:.1f}s, before the window"
        assert seen <= {4, 1}, f"replica counts seen while scaling down: {sorted(seen)}"

    for e in _events(devcluster, ns, name):
        if e.get("reason") in ("ScaledUp", "ScaledDown", "ScalingLimited"):
            print(f"event {e['reason']}: {e.get('message')}")
    reasons = {e.get("reason") for e in _events(devcluster, ns, name)}
    assert {"ScaledUp", "ScaledDown", "ScalingLimited"} <= reasons
    described = devcluster.kubectl("describe", "llms", name, "-n", ns).stdout
    assert "ScaledDown" in described and "ceil(" in described
