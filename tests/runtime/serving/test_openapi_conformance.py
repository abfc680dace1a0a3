"""The server's OpenAPI schema documents every response it gives: a schemathesis run with every check.

One server (tiny model, LoRA on, a small waiting queue) and `schemathesis run --checks all` over
its own /openapi.json, bounded by a few examples per operation and a fixed seed. The settings in
``schemathesis.toml`` beside this file say what the schema cannot express (a lora_path that
exists on the replica, a prompt that fits the model's context). Any undocumented status, content
type or header, a schema-valid request refused, a schema-violating one accepted, a 5xx, or an
``Allow`` header that misses a method fails the test with schemathesis' own report.
"""

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_fixtures import chat_model_dir, start_server  # noqa: F401

from plimsoll.runtime.testing import ThreadedServer

CONFIG = Path(__file__).with_name("schemathesis.toml")


@pytest.fixture(scope="module")
def server(chat_model_dir: Path) -> Iterator[ThreadedServer]:  # noqa: F811
    srv = start_server(chat_model_dir, server={"max_waiting": 4}, enable_lora=True)
    yield srv
    srv.stop()


@pytest.mark.slow
def test_schemathesis_all_checks_pass(server: ThreadedServer, tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "schemathesis.cli", "--config-file", str(CONFIG), "run", f"{server.url}/openapi.json",
        "--checks", "all", "--max-examples", "5", "--seed", "1", "--generation-deterministic",
        "--workers", "1", "--request-timeout", "60", "--suppress-health-check", "all", "--no-color",
    ]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    report = run.stdout[-8000:] + run.stderr[-2000:]
    assert run.returncode == 0, report
    assert " passed" in run.stdout and "failures" not in run.stdout.rsplit("SUMMARY", 1)[-1].lower(), report


def test_every_error_status_is_documented_with_the_error_body(server: ThreadedServer) -> None:
    schema = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
    completions = schema["paths"]["/v1/completions"]["post"]["responses"]
    assert {"400", "401", "404", "413", "429", "503", "504"} <= set(completions)
    assert "422" not in completions  # FastAPI's default; validation errors are OpenAI's 400 here
    assert completions["429"]["headers"]["Retry-After"]
    error = completions["400"]["content"]["application/json"]["schema"]
    assert error == {"$ref": "#/components/schemas/ErrorResponse"}
    assert set(completions["200"]["content"]) == {"application/json", "text/event-stream"}
    assert "401" not in schema["paths"]["/health"]["get"]["responses"]  # probes stay open
    assert "503" in schema["paths"]["/ready"]["get"]["responses"]
    assert "text/plain" in schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert {"400", "413"} <= set(schema["paths"]["/slo"]["put"]["responses"])


def test_a_wrong_method_lists_every_method_of_the_path(server: ThreadedServer) -> None:
    r = httpx.request("OPTIONS", f"{server.url}/drain", timeout=10)
    assert r.status_code == 405 and r.headers["Allow"] == "DELETE, POST"
    r = httpx.get(f"{server.url}/slo", timeout=10)
    assert r.status_code == 200
    r = httpx.patch(f"{server.url}/slo", timeout=10)
    assert r.status_code == 405 and r.headers["Allow"] == "GET, PUT"
