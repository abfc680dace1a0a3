"""`plimsoll demo` end to end on a tiny random model: real control plane, chart-run operator, real replica.

The demo starts its own control plane (state dir under tmp_path) rather than
reusing the session ``devcluster``: the operator tests keep a local operator
watching every namespace of that one, and two operators with different settings
would fight over the demo's Deployment. The demo's cluster hands pods IPs from
127.3.0.0/16 so they never collide with the session cluster's 127.1.0.0/16 pods.
The demo runs as its own process, as a user runs it.
"""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

# `plimsoll demo` with kwok's pod pool moved (Cluster reads POD_CIDR when it starts kwok).
DEMO = (
    "import sys; import plimsoll.devcluster.cluster as c; c.POD_CIDR = '127.3.0.0/16'; "
    "from plimsoll.cli import main; sys.argv[0] = 'plimsoll'; main()"
)


def run_demo(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    proc = subprocess.run(
        [sys.executable, "-c", DEMO, "demo", *args], capture_output=True, text=True, env=env, timeout=420
    )
    print(proc.stdout, proc.stderr[-3000:])
    return proc


def _curl_request(output: str) -> tuple[str, dict[str, object]]:
    """URL and JSON body of the `curl` line the demo printed."""
    line = next(line for line in output.splitlines() if line.startswith("curl "))
    argv = shlex.split(line)
    url = next(a for a in argv if a.startswith("http://"))
    body = json.loads(argv[argv.index("-d") + 1])
    return url, body


@pytest.mark.parametrize("profile", [True, False])
def test_demo_manifest_is_a_valid_llmservice(profile: bool) -> None:
    from plimsoll.demo import service_manifest
    from plimsoll.operator.api.llmservice import LLMService

    svc = LLMService.model_validate(service_manifest("embedded://smollm2-135m", profile))
    assert svc.spec.capacity.mode == ("Profile" if profile else "Manual")
    assert svc.spec.autoscaling.mode == "builtin" and svc.spec.scaling is not None
    assert svc.spec.scaling.min <= (svc.spec.replicas or 0) <= svc.spec.scaling.max


@pytest.mark.parametrize(
    ("uri", "says"),
    [
        ("hf://org/name", "use embedded://smollm2-135m or file:///"),
        ("file:///nonexistent/model", "does not exist"),
        ("file:///tmp", "cannot see a model under /tmp"),
    ],
)
def test_demo_refuses_a_model_before_starting_anything(tmp_path: Path, uri: str, says: str) -> None:
    proc = run_demo("--model-uri", uri, "--state-dir", str(tmp_path / "plane"))
    assert proc.returncode == 1 and says in proc.stdout, proc.stdout
    assert not (tmp_path / "plane").exists()  # no control plane was started


@pytest.mark.k8s
@pytest.mark.slow
@pytest.mark.timeout(480)
def test_demo_serves_a_tiny_model_and_prints_a_working_curl(tmp_path: Path) -> None:
    from plimsoll.demo import profiling_available
    from plimsoll.devcluster import paths
    from plimsoll.devcluster.cluster import Cluster
    from plimsoll.runtime.testing import write_tiny_model

    if paths.missing_products():
        pytest.fail(
            f"control-plane binaries missing {paths.missing_products()}: run `plimsoll dev up --build-only`"
        )
    # Not under /tmp: replica pods mount an emptyDir there. The model cache is what pods see.
    model = write_tiny_model(paths.model_cache_dir() / "tiny-llama-demo-test")
    # The bench calibrates with a 64-word probe: ~290 byte-level tokens, past the tiny
    # config's 256 positions. RoPE has no learned positions, so a longer window is harmless.
    config = json.loads((model / "config.json").read_text())
    if config["max_position_embeddings"] < 1024:
        config["max_position_embeddings"] = 1024
        (model / "config.json").write_text(json.dumps(config, indent=2))
    state_dir = tmp_path / "plane"
    args = ["--state-dir", str(state_dir), "--model-uri", f"file://{model}", "--timeout", "240"]
    try:
        result = run_demo(*args, "--requests", "4", "--concurrency", "2")
        assert result.returncode == 0, result.stdout + result.stderr[-3000:]

        cluster = Cluster.load(state_dir)
        assert cluster.pod_runner and cluster.is_running()
        svc = cluster.get_json("llms", "smollm2", "-n", "plimsoll-demo")
        ready = {c["type"]: c for c in svc["status"]["conditions"]}["Ready"]
        assert ready["status"] == "True", ready
        assert svc["spec"]["model"]["uri"] == f"file://{model}"
        if profiling_available()[0]:
            # Profile mode: the benchmark Job measured the replica before the load.
            assert svc["status"].get("capacity", {}).get("knees") is not None, svc["status"]
            assert svc["spec"]["capacity"]["mode"] == "Profile"
            assert {c["type"]: c for c in svc["status"]["conditions"]}["Profiled"]["status"] == "True"
            assert "knee: " in result.stdout and "knees: none measured" not in result.stdout
        else:
            assert "profiling is not available" in result.stdout
        # The operator ran as the chart's pod (a local process on a pod IP), not in the test.
        operator_pods = cluster.get_json(
            "pods", "-n", "plimsoll-system", "-l", "app.kubernetes.io/instance=plimsoll"
        )["items"]
        assert [p["status"]["podIP"].startswith("127.3.") for p in operator_pods] == [True]

        load = re.search(r"load: (\d+)/(\d+) completed, (\d+) failed", result.stdout)
        assert load is not None and load.groups() == ("4", "4", "0"), result.stdout

        url, body = _curl_request(result.stdout)
        assert url.startswith("http://127.3.") and url.endswith("/v1/completions"), url
        response = httpx.post(url, json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] > 0

        # A second run reuses the running control plane and the installed release.
        again = run_demo(*args, "--requests", "2", "--concurrency", "1")
        assert again.returncode == 0, again.stdout + again.stderr[-3000:]
        assert "reusing the running control plane" in again.stdout
    finally:
        down = run_demo("--down", "--state-dir", str(state_dir))
    assert down.returncode == 0, down.stdout + down.stderr
    assert not (state_dir / "state.json").exists()
