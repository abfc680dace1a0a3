"""`plimsoll route` from the command line: bad options fail clearly; good ones serve."""

from __future__ import annotations

import signal

import httpx
from router_harness import route_process
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
    args = [
        "--backend",
        replica.url,
        "--policy",
        "prefix-affinity",
        "--scrape-interval",
        "0.2",
        "--log-level",
        "warning",
    ]
    with route_process(args) as (url, process):
        answer = httpx.post(
            url + "/v1/completions", json={"model": "fake", "prompt": "hello", "max_tokens": 2}
        )
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == " tok tok"
        metrics = httpx.get(url + "/metrics").text
        assert 'policy="prefix_affinity",reason="prefix_affinity"' in metrics
    output = process.communicate(timeout=30)[0].decode()
    # uvicorn shuts down gracefully, then re-raises SIGTERM so the parent sees it.
    assert process.returncode in (0, -signal.SIGTERM), output
    assert "Traceback" not in output, output
