"""Sleep mode on a real `plimsoll serve` process: memory freed while asleep, the same output after each wake.

Resident memory is read from the server process's /proc status and the KV cache's own
count of its resident pages from /metrics (plimsoll_kv_cache_resident_bytes); the KV
cache is made large (96 MiB) beside a tiny model so what sleeping frees stands out from
the process's own noise. Level 1 on CPU releases the KV pages in place and keeps the
weights; level 2 also drops the weights and reads them back on wake.
"""

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_fixtures import chat_model_dir, start_server  # noqa: F401

from plimsoll.overload import OVERLOAD_HEADER
from plimsoll.runtime.testing import ServerProcess

KV_BYTES = 96 * 2**20
BODY = {"prompt": "the quick brown fox", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def replica(chat_model_dir: Path) -> Iterator[ServerProcess]:  # noqa: F811
    args = ["--model", str(chat_model_dir), "--kv-cache-memory", "96MiB", "--max-model-len", "256",
            "--max-num-seqs", "4", "--enable-sleep-mode"]  # fmt: skip
    with ServerProcess(args) as server:
        yield server


def _rss(server: ServerProcess) -> int:
    assert server.proc is not None
    status = Path(f"/proc/{server.proc.pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) * 1024


def _kv_resident(server: ServerProcess) -> float:
    metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    line = next(x for x in metrics.splitlines() if x.startswith("plimsoll_kv_cache_resident_bytes{"))
    return float(line.rsplit(" ", 1)[1])


def _text(server: ServerProcess) -> str:
    answer = httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=120)
    assert answer.status_code == 200, answer.text
    return str(answer.json()["choices"][0]["text"])


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_memory_and_wake_gives_the_same_output(replica: ServerProcess, level: int) -> None:
    before = _text(replica)
    assert _kv_resident(replica) >= KV_BYTES
    awake_rss = _rss(replica)
    slept = httpx.post(f"{replica.url}/sleep", params={"level": level}, timeout=120)
    assert slept.status_code == 200, slept.text
    assert slept.json()["is_sleeping"] is True and slept.json()["freedBytes"] >= KV_BYTES
    asleep_rss = _rss(replica)
    assert _kv_resident(replica) == 0  # every KV page went back (the engine's own count, mincore)
    # At least most of the KV cache left the process (the weights of a tiny model are a few KiB).
    assert awake_rss - asleep_rss >= 0.75 * KV_BYTES, (awake_rss, asleep_rss)
    assert httpx.get(f"{replica.url}/is_sleeping", timeout=10).json() == {"is_sleeping": True}
    unready = httpx.get(f"{replica.url}/ready", timeout=10)
    assert unready.status_code == 503 and unready.json()["reason"] == "asleep"
    refused = httpx.post(f"{replica.url}/v1/completions", json=BODY, timeout=30)
    assert refused.status_code == 503 and refused.headers[OVERLOAD_HEADER] == "replica"
    woke = httpx.post(f"{replica.url}/wake_up", timeout=120)
    assert woke.status_code == 200 and woke.json()["is_sleeping"] is False
    assert httpx.get(f"{replica.url}/ready", timeout=10).status_code == 200
    assert _text(replica) == before
    assert _kv_resident(replica) >= KV_BYTES  # the whole cache is the process's again


def test_sleep_needs_the_flag_and_a_valid_level(chat_model_dir: Path) -> None:  # noqa: F811
    server = start_server(chat_model_dir)
    try:
        off = httpx.post(f"{server.url}/sleep", timeout=10)
        assert off.status_code == 400 and "--enable-sleep-mode" in off.json()["error"]["message"]
    finally:
        server.stop()


def test_a_bad_level_is_refused(replica: ServerProcess) -> None:
    bad = httpx.post(f"{replica.url}/sleep", params={"level": 3}, timeout=10)
    assert bad.status_code == 400 and "level must be 1 or 2" in bad.json()["error"]["message"]
    assert httpx.get(f"{replica.url}/is_sleeping", timeout=10).json() == {"is_sleeping": False}
