"""`plimsoll route` from the command line: bad options fail clearly; good ones serve."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
from router_harness import free_port
from typer.testing import CliRunner

from plimsoll.cli import app


def test_route_rejects_bad_options_with_a_fix() -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["route"])
    assert result.exit_code == 2
    assert "either --backend URL" in result.output
    result = runner.invoke(app, ["route", "--backend", "127.0.0.1:8000"])
    assert result.exit_code == 2
    assert "--backend http://HOST:PORT" in result.output
    result = runner.invoke(app, ["route", "--backend", "http://127.0.0.1:1", "--policy", "random"])
    assert result.exit_code == 2


def test_route_serves_in_front_of_a_replica(fake_replicas) -> None:  # type: ignore[no-untyped-def]
    (replica,) = fake_replicas([{}])
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-c", "from plimsoll.cli import main; main()", "route", "--port", str(port),
         "--backend", replica.url, "--policy", "prefix-affinity", "--scrape-interval", "0.2",
         "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.communicate()[0].decode()
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "plimsoll route never became ready"
            time.sleep(0.1)
        answer = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "hello", "max_tokens": 2})
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == " tok tok"
        metrics = httpx.get(url + "/metrics").text
        assert 'policy="prefix_affinity",reason="prefix_affinity"' in metrics
    finally:
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=30)[0].decode()
    # uvicorn shuts down gracefully, then re-raises SIGTERM so the parent sees it.
    assert process.returncode in (0, -signal.SIGTERM), output
    assert "Traceback" not in output, output
