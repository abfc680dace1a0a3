"""The stream ledger, pure: what the client has received, and each event as the client sees it."""

from __future__ import annotations

import json
from typing import Any

from plimsoll.router.migration import DONE, StreamLedger, unsupported


def sse(obj: Any) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def chunk(i: int, text: str, ids: list[int], *, rid: str = "cmpl-a", created: int = 1, **extra: Any) -> bytes:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": None, "token_ids": ids, **extra}
    return sse(
        {"id": rid, "object": "text_completion", "created": created, "model": "m", "choices": [choice]}
    )


def events(out: bytes) -> list[Any]:
    return [json.loads(e[6:]) if e[6:] != b"[DONE]" else "[DONE]" for e in out.split(b"\n\n") if e]


BODY = {
    "model": "m",
    "prompt": "p",
    "stream": True,
    "max_tokens": 9,
    "stream_options": {"include_usage": True},
}


def test_which_requests_can_be_carried_on() -> None:
    assert unsupported("/v1/completions", BODY) is None
    assert unsupported("/v1/chat/completions", {"messages": [], "stream": True}) is None
    assert unsupported("/v1/completions", {**BODY, "stream": False}) == "not a stream"
    assert unsupported("/v1/completions", {**BODY, "n": 2}) == "several choices"
    assert unsupported("/v1/completions", {**BODY, "prompt": ["a", "b"]}) == "several prompts"
    assert unsupported("/v1/completions", {**BODY, "prompt": [1, 2, 3]}) is None  # one token-id prompt
    assert unsupported("/v1/models", BODY) == "not a generation endpoint"


def test_events_split_anywhere_are_tracked_and_stripped_of_token_ids_not_asked_for() -> None:
    ledger = StreamLedger("/v1/completions", BODY)
    assert json.loads(ledger.first_body())["return_token_ids"] is True
    raw = chunk(0, "He", [5, 6], prompt_token_ids=[1, 2, 3]) + chunk(1, "", [7]) + chunk(2, "y", [8])
    out = b""
    for i in range(0, len(raw), 7):  # bytes arrive in arbitrary pieces
        piece, failure = ledger.feed(raw[i : i + 7])
        assert failure is None
        out += piece
    sent = events(out)
    assert [e["choices"][0]["text"] for e in sent] == ["He", "", "y"]
    assert all("token_ids" not in e["choices"][0] and "prompt_token_ids" not in e["choices"][0] for e in sent)
    assert ledger.token_ids == [5, 6, 7, 8] and ledger.num_chars == 3 and ledger.prompt_token_ids == [1, 2, 3]
    cont = json.loads(ledger.continuation_body())
    assert cont["continuation"] == {"token_ids": [5, 6, 7, 8], "num_chars": 3}
    assert cont["max_tokens"] == 9 and cont["prompt"] == "p"  # the rest of the request unchanged


def test_a_5xx_error_event_is_a_failure_after_the_events_before_it() -> None:
    ledger = StreamLedger("/v1/completions", {**BODY, "return_token_ids": True})
    first = chunk(0, "a", [4])
    error = sse({"error": {"message": "drain deadline", "type": "ServiceUnavailableError", "code": 503}})
    out, failure = ledger.feed(first + error + DONE)
    assert out == first  # asked for token ids and nothing to rewrite: the replica's own bytes
    assert failure is not None and "503" in str(failure)
    assert not ledger.done
    four_hundred = sse({"error": {"message": "bad", "type": "BadRequestError", "code": 400}})
    out, failure = ledger.feed(four_hundred)
    assert failure is None and out == four_hundred  # the request's own fault reaches the client


def test_a_carried_on_stream_keeps_the_first_id_and_sends_role_and_prompt_ids_once() -> None:
    body = {"model": "m", "messages": [], "stream": True, "return_token_ids": True}
    ledger = StreamLedger("/v1/chat/completions", body)

    def chat(rid: str, delta: dict[str, Any], ids: list[int] | None, **top: Any) -> bytes:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": None}
        if ids is not None:
            choice["token_ids"] = ids
        return sse({"id": rid, "object": "chat.completion.chunk", "created": 7 if rid == "a" else 9,
                    "model": "m", "choices": [choice], **top})  # fmt: skip

    out, _ = ledger.feed(chat("a", {"role": "assistant", "content": ""}, None, prompt_token_ids=[1, 2]))
    out += ledger.feed(chat("a", {"content": "hi"}, [10, 11]))[0]
    ledger.begin_leg()  # the first replica failed; this one was sent no tokens' worth of a continuation
    out += ledger.feed(chat("b", {"role": "assistant", "content": ""}, None, prompt_token_ids=[1, 2]))[0]
    out += ledger.feed(chat("b", {"content": "!"}, [12]))[0]
    sent = events(out)
    assert [e["id"] for e in sent] == ["a", "a", "a"] and {e["created"] for e in sent} == {7}
    assert sum("role" in e["choices"][0]["delta"] for e in sent) == 1
    assert sum("prompt_token_ids" in e for e in sent) == 1
    assert ledger.token_ids == [10, 11, 12] and ledger.migrations == 1


def test_the_end_of_a_finished_stream_is_written_by_the_ledger() -> None:
    ledger = StreamLedger("/v1/completions", BODY)
    ledger.feed(
        chunk(0, "ab", [5, 6], prompt_token_ids=[1, 2, 3]) + chunk(1, "c", [7], finish_reason="length")
    )
    assert ledger.finished and not ledger.done
    usage, done = events(ledger.ending())
    assert usage["choices"] == [] and usage["id"] == "cmpl-a"
    assert usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert done == "[DONE]"


def test_text_without_token_ids_cannot_be_carried_on() -> None:
    ledger = StreamLedger("/v1/completions", BODY)
    ledger.feed(sse({"id": "x", "object": "text_completion", "created": 1, "model": "m",
                     "choices": [{"index": 0, "text": "hi", "finish_reason": None}]}))  # fmt: skip
    assert ledger.untracked
