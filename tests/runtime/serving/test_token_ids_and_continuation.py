"""vLLM's ``return_token_ids`` and plimsoll's ``continuation`` over HTTP, on the real server.

``return_token_ids`` puts ``token_ids`` on every choice (per chunk when streaming) and
``prompt_token_ids`` once (on the completions choice, at the top of a chat response), as
vLLM does; without it neither field appears. A ``continuation`` (what the router sends
when it migrates a stream) answers with the rest of the stream: no role chunk, no
``prompt_token_ids``, the remaining tokens, and usage counting the whole request.
"""

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_fixtures import chat_model_dir, start_server  # noqa: F401  (fixture)

from plimsoll.runtime.testing import ThreadedServer

CHAT = {
    "messages": [{"role": "user", "content": "carry on"}],
    "max_tokens": 14,
    "temperature": 0,
    "ignore_eos": True,
}
COMPLETION = {"prompt": "carry on", "max_tokens": 14, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def url(chat_model_dir: Path) -> Iterator[str]:  # noqa: F811
    srv: ThreadedServer = start_server(chat_model_dir)
    yield srv.url
    srv.stop()


def events(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON events of a stream, checked to end with [DONE]."""
    r = httpx.post(url + path, json={**body, "stream": True}, timeout=60)
    assert r.status_code == 200, r.text
    data = [line.removeprefix("data: ") for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_completion_token_ids(url: str) -> None:
    plain = httpx.post(url + "/v1/completions", json=COMPLETION, timeout=60).json()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]
    body = httpx.post(
        url + "/v1/completions", json={**COMPLETION, "return_token_ids": True}, timeout=60
    ).json()
    choice = body["choices"][0]
    # The byte-level tokenizer: one token per byte, no BOS.
    assert len(choice["prompt_token_ids"]) == body["usage"]["prompt_tokens"] == len(b"carry on")
    assert len(choice["token_ids"]) == body["usage"]["completion_tokens"] == 14
    chunks = events(url, "/v1/completions", {**COMPLETION, "return_token_ids": True})
    assert chunks[0]["choices"][0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == choice["token_ids"]


def test_chat_token_ids(url: str) -> None:
    body = httpx.post(
        url + "/v1/chat/completions", json={**CHAT, "return_token_ids": True}, timeout=60
    ).json()
    assert len(body["prompt_token_ids"]) == body["usage"]["prompt_tokens"]
    assert len(body["choices"][0]["token_ids"]) == 14
    chunks = events(url, "/v1/chat/completions", {**CHAT, "return_token_ids": True})
    assert chunks[0]["prompt_token_ids"] == body["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks[1:] for t in c["choices"][0]["token_ids"]] == body["choices"][0]["token_ids"]
    plain = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=60).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_continuation_streams_the_rest_of_the_request(url: str, path: str) -> None:
    base = {**(CHAT if "chat" in path else COMPLETION), "return_token_ids": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    whole = [c for c in events(url, path, base) if c["choices"]]
    ids = [t for c in whole for t in c["choices"][0].get("token_ids", [])]

    def text(chunks: list[dict[str, Any]]) -> str:
        return "".join(c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content", "")
                       for c in chunks if c["choices"])  # fmt: skip

    cut = 5
    sent = whole[: cut + 1] if "chat" in path else whole[:cut]  # chat: the role chunk comes first
    assert sum(len(c["choices"][0].get("token_ids", [])) for c in sent) == cut
    rest = events(url, path, {**base, "continuation": {"token_ids": ids[:cut], "num_chars": len(text(sent))}})
    assert "prompt_token_ids" not in rest[0] and "prompt_token_ids" not in rest[0]["choices"][0]
    assert all("role" not in c["choices"][0].get("delta", {}) for c in rest if c["choices"])
    assert ids[:cut] + [t for c in rest if c["choices"] for t in c["choices"][0]["token_ids"]] == ids
    assert text(sent) + text(rest) == text(whole)
    usage = rest[-1]["usage"]
    assert rest[-1]["choices"] == [] and usage["completion_tokens"] == 14  # the whole request's usage


def test_a_continuation_must_stream_one_sequence(url: str) -> None:
    cont = {"continuation": {"token_ids": [70, 71], "num_chars": 0}}
    r = httpx.post(url + "/v1/completions", json={**COMPLETION, **cont}, timeout=60)
    assert r.status_code == 400 and "stream=true" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/chat/completions", json={**CHAT, **cont, "stream": True, "n": 2}, timeout=60)
    assert r.status_code == 400 and "n=1" in r.json()["error"]["message"]
    done = {"token_ids": [70] * 14, "num_chars": 0}
    r = httpx.post(
        url + "/v1/completions", json={**COMPLETION, "stream": True, "continuation": done}, timeout=60
    )
    assert r.status_code == 400 and "already complete" in r.json()["error"]["message"]
    # Whether num_chars fits is known once the engine decoded the ids: an error event, as vLLM streams them.
    too_long = {"token_ids": [70, 71], "num_chars": 99}
    r = httpx.post(
        url + "/v1/completions", json={**COMPLETION, "stream": True, "continuation": too_long}, timeout=60
    )
    error = json.loads(r.text.split("\n\n")[0].removeprefix("data: "))["error"]
    assert error["code"] == 400 and "num_chars" in error["message"]
