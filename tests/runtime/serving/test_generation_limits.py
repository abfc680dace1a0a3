"""--max-new-tokens (vLLM's override-generation-config max_new_tokens) and truncate_prompt_tokens."""

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_fixtures import chat_model_dir, start_server  # noqa: F401

from plimsoll.runtime.serve_args import ServeArgError, max_new_tokens
from plimsoll.runtime.testing import ThreadedServer, byte_level_tokenizer

LIMIT = 7


@pytest.fixture(scope="module")
def capped(chat_model_dir: Path) -> Iterator[ThreadedServer]:  # noqa: F811
    srv = start_server(chat_model_dir, server={"max_new_tokens": LIMIT})
    yield srv
    srv.stop()


def _post(srv: ThreadedServer, path: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{srv.url}{path}", json=body, timeout=60)


def test_a_chat_request_without_max_tokens_gets_the_server_default(capped: ThreadedServer) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    r = _post(capped, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == LIMIT  # not the rest of the 256-token context


def test_a_larger_max_tokens_is_lowered_to_the_limit(capped: ThreadedServer) -> None:
    r = _post(capped, "/v1/completions", {"prompt": "abc", "max_tokens": 50, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == LIMIT
    assert r.json()["choices"][0]["finish_reason"] == "length"
    r = _post(capped, "/v1/completions", {"prompt": "abc", "max_tokens": 3, "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 3  # a smaller one is the client's to choose


def test_truncate_prompt_tokens_keeps_the_last_tokens_by_default(capped: ThreadedServer) -> None:
    long = "x" * 400  # past the 256-token context with the byte tokenizer
    r = _post(capped, "/v1/completions", {"prompt": long, "max_tokens": 1})
    assert r.status_code == 400 and "maximum context length" in r.text
    tokenizer = byte_level_tokenizer()
    for side, ids in ((None, [5] * 4), ("left", [5] * 4), ("right", [1, 2, 3, 4])):
        kept = tokenizer.decode(ids)
        body = {
            "prompt": [1, 2, 3, 4, *[5] * 300],
            "max_tokens": 1,
            "truncate_prompt_tokens": 4,
            "echo": True,
        }
        if side:
            body["truncation_side"] = side
        r = _post(capped, "/v1/completions", body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 4
        assert r.json()["choices"][0]["text"].startswith(kept)  # echo: the prompt the model saw
    r = _post(capped, "/v1/completions", {"prompt": long, "max_tokens": 1, "truncate_prompt_tokens": -1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 255
    body = {"messages": [{"role": "user", "content": long}], "max_tokens": 1, "truncate_prompt_tokens": 20}
    r = _post(capped, "/v1/chat/completions", body)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 20


def test_truncate_prompt_tokens_beyond_the_context_is_a_400(capped: ThreadedServer) -> None:
    r = _post(capped, "/v1/completions", {"prompt": "abc", "truncate_prompt_tokens": 1000})
    assert r.status_code == 400
    assert (
        r.json()["error"]["param"] == "truncate_prompt_tokens"
        and "at most 255" in r.json()["error"]["message"]
    )


def test_the_flag_and_vllms_override_generation_config() -> None:
    assert max_new_tokens(None, None) is None
    assert max_new_tokens(64, None) == 64
    assert max_new_tokens(None, '{"max_new_tokens": 64}') == 64
    for flag, text, words in (
        (None, '{"temperature": 0.5}', "reads only max_new_tokens, not temperature"),
        (None, '{"max_new_tokens": 0}', "must be an integer >= 1"),
        (None, "[1]", "JSON object"),
        (None, "{", "not valid JSON"),
        (32, '{"max_new_tokens": 64}', "disagree; pass one"),
    ):
        with pytest.raises(ServeArgError, match=words):
            max_new_tokens(flag, text)
