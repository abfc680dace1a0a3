"""Fixtures for the server tests: a tiny chat-capable model and a real server around it.

Imported by the test modules (``from server_fixtures import ...``); the reusable
parts live in ``plimsoll.runtime.testing`` so router and bench tests can use them.
"""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from plimsoll.runtime.testing import ThreadedServer, write_tiny_model

# Small enough to load in a second, big enough for 200 concurrent short streams.
ENGINE_ARGS: dict[str, Any] = dict(max_model_len=256, kv_cache_memory="4MiB", max_num_seqs=32)


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A fixed path under the session's base temp dir: modules that import this
    # fixture each get their own FixtureDef, and write_tiny_model is idempotent.
    return write_tiny_model(tmp_path_factory.getbasetemp() / "plimsoll-chat-tiny")


def start_server(
    model_dir: Path, server: dict[str, Any] | None = None, step_delay: float = 0.0, **engine: Any
) -> ThreadedServer:
    """A started server; ``step_delay`` makes every engine step sleep that long (slow on any CPU)."""
    return ThreadedServer(
        model_dir, server=server, step_delay=step_delay, **{**ENGINE_ARGS, **engine}
    ).start()


@pytest.fixture(scope="module")
def server(chat_model_dir: Path) -> Iterator[ThreadedServer]:
    srv = start_server(chat_model_dir)
    yield srv
    srv.stop()


def scrape(url: str) -> dict[str, float]:
    """Every sample of /metrics as ``name{label=value,...}`` -> value, parsed by prometheus_client."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            samples[f"{s.name}{{{labels}}}"] = s.value
    return samples


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    key = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    return samples.get(f"{name}{{{key}}}", 0.0)
