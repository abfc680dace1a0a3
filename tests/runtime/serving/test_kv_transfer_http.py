"""``kv_transfer_params`` over HTTP: vLLM's request and response fields on a producer replica.

Shows: a ``do_remote_decode`` completion or chat request answers with the parameters a decode
replica needs (``remote_host`` the address the request came in on, the transfer server's port,
the held block ids), and the replica's ``/metrics`` count and hold them (and the CPU time each hold
took); what cannot work is a
400 saying why (a stream, several prompts, a role this replica does not have).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_fixtures import chat_model_dir, metric, scrape, start_server  # noqa: F401  (fixtures)

from plimsoll.runtime.testing import ThreadedServer


@pytest.fixture(scope="module")
def producer(chat_model_dir: Path) -> Iterator[ThreadedServer]:  # noqa: F811
    srv = start_server(chat_model_dir, kv_transfer_config={"kv_role": "kv_producer", "kv_port": 0})
    yield srv
    srv.stop()


DECODE = {"do_remote_decode": True}


def test_do_remote_decode_answers_with_the_remote_parameters(producer: ThreadedServer) -> None:
    body = {"prompt": "x" * 70, "max_tokens": 1, "temperature": 0, "kv_transfer_params": DECODE}
    r = httpx.post(f"{producer.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    remote = producer.engine.engine.kv_connector.remote
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_host"] == "127.0.0.1" and params["remote_port"] == remote.port
    assert len(params["remote_block_ids"]) == r.json()["usage"]["prompt_tokens"] // 16
    chat = {
        "messages": [{"role": "user", "content": "y" * 50}],
        "max_tokens": 1,
        "kv_transfer_params": DECODE,
    }
    r = httpx.post(f"{producer.url}/v1/chat/completions", json=chat, timeout=30)
    assert (
        r.status_code == 200
        and r.json()["kv_transfer_params"]["remote_engine_id"] == params["remote_engine_id"]
    )
    samples = scrape(producer.url)
    assert metric(samples, "plimsoll_kv_transfer_holds_total") == 2
    assert metric(samples, "plimsoll_kv_transfer_held_blocks") == remote.held_blocks > 0
    # Each hold's CPU time on the engine thread, one sample per request; no pull was served yet.
    cpu = "plimsoll_kv_transfer_cpu_seconds"
    hold = {"side": "producer", "stage": "hold", "thread": "engine"}
    assert metric(samples, cpu + "_count", **hold) == 2 and metric(samples, cpu + "_sum", **hold) > 0
    assert metric(samples, cpu + "_count", side="producer", stage="send", thread="transfer") == 0
    # A plain request on the same replica carries no parameters.
    r = httpx.post(f"{producer.url}/v1/completions", json={"prompt": "z", "max_tokens": 1}, timeout=30)
    assert r.json()["kv_transfer_params"] is None


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"prompt": "x", "stream": True, "kv_transfer_params": DECODE}, "send it with stream=false"),
        ({"prompt": ["x", "y"], "kv_transfer_params": DECODE}, "send one prompt, not 2"),
        ({"prompt": "x", "kv_transfer_params": {"do_remote_prefill": True}}, "its kv_role is kv_producer"),
        ({"prompt": "x", "n": 2, "kv_transfer_params": DECODE}, "send n=1"),
    ],
)
def test_what_cannot_work_is_a_400_saying_why(
    producer: ThreadedServer, body: dict[str, object], says: str
) -> None:
    r = httpx.post(f"{producer.url}/v1/completions", json={**body, "max_tokens": 1}, timeout=30)
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"]
