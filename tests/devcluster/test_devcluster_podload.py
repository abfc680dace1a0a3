"""podload's pure parts: which pods it sends to, and its config checks (the load itself runs in
tests/operator/handlers/test_autoscale_real_k8s.py against real replicas)."""

from typing import Any

import pytest

from plimsoll.devcluster.podload import LoadConfig, ready_url


def pod(
    ready: str = "True", ip: str | None = "127.1.0.7", deleting: bool = False, port: int | None = 8000
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "p"}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    ports = [{"name": "http", "containerPort": port}] if port else []
    status: dict[str, Any] = {"conditions": [{"type": "Ready", "status": ready}]}
    if ip:
        status["podIP"] = ip
    return {"metadata": meta, "spec": {"containers": [{"ports": ports}]}, "status": status}


def test_only_ready_pods_with_an_ip_that_are_not_being_deleted_drained_or_parked_get_load() -> None:
    assert ready_url(pod()) == "http://127.1.0.7:8000"
    assert ready_url(pod(port=9001)) == "http://127.1.0.7:9001"
    assert ready_url(pod(port=None)) == "http://127.1.0.7:8000"  # the engine's default port
    assert ready_url(pod(ready="False")) is None
    assert ready_url(pod(ip=None)) is None
    assert ready_url(pod(deleting=True)) is None
    assert ready_url(pod(ip="10.0.0.7")) is None  # never load outside 127.0.0.0/8
    # As the router: nothing new to a pod the operator drains or parks asleep (autoscaling.standby).
    for label in ("plimsoll.dev/draining", "plimsoll.dev/standby"):
        labelled = pod()
        labelled["metadata"]["labels"] = {label: "true"}
        assert ready_url(labelled) is None
        labelled["metadata"]["labels"] = {label: "false"}
        assert ready_url(labelled) == "http://127.1.0.7:8000"


def test_config_refuses_what_cannot_work() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        LoadConfig(model="m", max_tokens=0)
    with pytest.raises(ValueError, match="poll_interval_s"):
        LoadConfig(model="m", poll_interval_s=0)
