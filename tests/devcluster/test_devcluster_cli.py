"""`plimsoll dev` from the shell: status and kubeconfig of a running plane, and up/down
across processes leaving no process behind."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from plimsoll.devcluster.cluster import STATE_FILE, Cluster
from plimsoll.devcluster.process import ProcessRecord

pytestmark = pytest.mark.k8s

PLIMSOLL = str(Path(sys.executable).with_name("plimsoll"))


def _dev(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    return subprocess.run([PLIMSOLL, "dev", *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_status_and_kubeconfig_of_a_running_plane(devcluster: Cluster) -> None:
    status = _dev("status", "--state-dir", str(devcluster.state_dir))
    assert status.returncode == 0, status.stderr
    for name in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok"):
        assert name in status.stdout
    kc = _dev("kubeconfig", "--state-dir", str(devcluster.state_dir))
    assert kc.stdout.strip() == str(devcluster.kubeconfig)


def test_status_without_a_plane_says_how_to_start_one(tmp_path: Path) -> None:
    out = _dev("status", "--state-dir", str(tmp_path))
    assert out.returncode == 1
    assert "plimsoll dev up" in out.stderr


@pytest.mark.slow
def test_up_then_down_from_another_process_leaves_nothing_behind(tmp_path: Path) -> None:
    state = tmp_path / "plane"
    up = _dev("up", "--state-dir", str(state), "--no-pod-runner", timeout=300)
    assert up.returncode == 0, up.stdout + up.stderr
    assert "gpu-node-a" in up.stdout and "gpu-node-b" in up.stdout
    records = [ProcessRecord.from_json(r) for r in json.loads((state / STATE_FILE).read_text())["processes"]]
    assert len(records) == 5 and all(r.is_alive() for r in records)

    again = _dev("up", "--state-dir", str(state), "--no-pod-runner")
    assert again.returncode == 0 and "already running" in again.stdout

    down = _dev("down", "--state-dir", str(state))
    assert down.returncode == 0, down.stderr
    assert [r.name for r in records if r.is_alive()] == []
    assert not (state / STATE_FILE).exists()
