"""In-flight migration: what the router keeps of a stream so another replica can carry it on.

What it is: the rules and the per-stream ledger, without I/O. :func:`unsupported` says
whether a request can be migrated at all (a streamed completion or chat request for one
sequence; others keep the first replica's fate). :class:`StreamLedger` asks the replica
for vLLM's ``return_token_ids``, reads every SSE event the replica sends, keeps what the
client has received (output token ids, characters of text, the role chunk, the finish),
and returns each event as the client should see it: with the stream's first ``id`` and
``created`` however many replicas served it, and without the token-id fields the client
did not ask for. When the replica fails, :meth:`StreamLedger.continuation_body` is the
same request with a ``continuation`` (the tokens and characters already delivered),
which a plimsoll replica answers with the rest of the stream and usage counting the
whole request (``runtime/engine/request.py``'s ``Continuation``).

What it is not: the HTTP (``proxy.py`` sends, watches the replica and switches), or a
place that generates anything: only the end of a stream whose last token already
arrived (usage and ``[DONE]``) is written here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

GENERATION_ENDPOINTS = frozenset({"/v1/completions", "/v1/chat/completions"})
# Error events that mean "this replica failed", not "this request is wrong": the stream
# carries on elsewhere. 504 is the request's own --request-timeout and 4xx its own fault.
REPLICA_FAILURE_CODES = frozenset({500, 502, 503})
DONE = b"data: [DONE]\n\n"

# plimsoll_router_migrations_total{outcome}: what became of each started request whose replica failed.
MIGRATED = "migrated"  # sent to another replica (a stream from its last delivered token)
COMPLETED = "completed"  # the output was all there; the router wrote the stream's end itself
LIMIT_REACHED = "limit_reached"  # already migrated --migration-limit times (or the limit is 0)
NO_REPLICA = "no_replica"  # no other replica could take it
REFUSED = "refused"  # the other replica refused the continuation
UNSUPPORTED = "unsupported"  # a request migration cannot carry on (see ``unsupported``)
OUTCOMES = (MIGRATED, COMPLETED, LIMIT_REACHED, NO_REPLICA, REFUSED, UNSUPPORTED)


class ReplicaFailed(Exception):
    """The replica serving a stream failed: it broke off, sent a 5xx error event, or was lost.

    ``transport``: the connection itself failed (the replica is gone, not just this request).
    """

    def __init__(self, message: str, *, transport: bool = False) -> None:
        super().__init__(message)
        self.transport = transport


def unsupported(endpoint: str, body: Any) -> str | None:
    """Why this request cannot be carried on by another replica mid-stream, or None if it can.

    Non-streaming requests are not here: nothing of them reaches the client before the
    end, so a failed one is sent again whole (``proxy.py``).
    """
    if endpoint not in GENERATION_ENDPOINTS:
        return "not a generation endpoint"
    if not isinstance(body, dict) or body.get("stream") is not True:
        return "not a stream"
    if body.get("n", 1) != 1 or body.get("best_of") not in (None, 1):
        return "several choices"
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return "several prompts"
    if body.get("echo") or "continuation" in body:
        return "echo or a client continuation"
    return None


def _split_events(buffer: bytearray) -> list[bytes]:
    """Complete SSE events (each ending in a blank line) taken off the front of ``buffer``."""
    events = []
    while (end := buffer.find(b"\n\n")) >= 0:
        events.append(bytes(buffer[: end + 2]))
        del buffer[: end + 2]
    return events


def _data(event: bytes) -> str | None:
    """The ``data:`` payload of one event (lines joined), None when it has none."""
    lines = [
        line[5:].lstrip()
        for line in event.decode("utf-8", "replace").splitlines()
        if line.startswith("data:")
    ]
    return "\n".join(lines) if lines else None


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


@dataclass
class StreamLedger:
    """One migratable stream: what the client asked for and what it has received so far."""

    endpoint: str
    body: dict[str, Any]
    migrations: int = 0  # replicas after the first that served this stream
    token_ids: list[int] = field(default_factory=list)  # output tokens delivered to the client
    num_chars: int = 0  # characters of output text delivered
    prompt_token_ids: list[int] | None = None
    stream_id: str | None = None
    created: int | None = None
    model: str | None = None
    object: str | None = None
    role_sent: bool = False
    finished: bool = False  # the choice's finish_reason was delivered
    usage_sent: bool = False
    done: bool = False  # [DONE] was delivered
    untracked: bool = False  # text arrived without token ids (a replica without return_token_ids)
    _buffer: bytearray = field(default_factory=bytearray)

    @property
    def wants_token_ids(self) -> bool:
        return self.body.get("return_token_ids") is True

    @property
    def wants_usage(self) -> bool:
        options = self.body.get("stream_options")
        return isinstance(options, dict) and options.get("include_usage") is True

    def first_body(self) -> bytes:
        """The request as first sent: the client's, asking for token ids."""
        return json.dumps({**self.body, "return_token_ids": True}).encode()

    def continuation_body(self) -> bytes:
        """The same request, continued after what the client has received (or resent whole if nothing)."""
        body: dict[str, Any] = {**self.body, "return_token_ids": True}
        if self.token_ids:
            body["continuation"] = {"token_ids": self.token_ids, "num_chars": self.num_chars}
        return json.dumps(body).encode()

    def begin_leg(self) -> None:
        """A new replica takes the stream over: its events are parsed from scratch."""
        self.migrations += 1
        self._buffer.clear()

    def feed(self, raw: bytes) -> tuple[bytes, ReplicaFailed | None]:
        """Bytes from the replica in; the bytes for the client out, and the failure a 5xx error event
        reported (the events before it still go out, nothing after it does)."""
        self._buffer += raw
        out = bytearray()
        for event in _split_events(self._buffer):
            try:
                out += self._take(event)
            except ReplicaFailed as failure:
                self._buffer.clear()
                return bytes(out), failure
        return bytes(out), None

    def _take(self, event: bytes) -> bytes:
        data = _data(event)
        if data is None:
            return event  # a comment or a keep-alive: nothing to track
        if data == "[DONE]":
            self.done = True
            return DONE
        try:
            obj = json.loads(data)
        except ValueError:
            return event
        if not isinstance(obj, dict):
            return event
        error = obj.get("error")
        if isinstance(error, dict):
            if error.get("code") in REPLICA_FAILURE_CODES:
                raise ReplicaFailed(f"error event {error.get('code')}: {error.get('message')}")
            return event  # the request's own error: the client gets it, then [DONE]
        return self._take_chunk(obj, event)

    def _take_chunk(self, obj: dict[str, Any], event: bytes) -> bytes:
        first = self.stream_id is None
        if first:
            self.stream_id, self.created = obj.get("id"), obj.get("created")
            self.model, self.object = obj.get("model"), obj.get("object")
        changed = not first and (obj.get("id") != self.stream_id or obj.get("created") != self.created)
        obj["id"], obj["created"] = self.stream_id, self.created
        prompt_ids = obj.pop("prompt_token_ids", None)
        if isinstance(prompt_ids, list):
            changed |= self._note_prompt(prompt_ids, obj)
        choices = obj.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            choice = choices[0]
            prompt_ids = choice.pop("prompt_token_ids", None)
            if isinstance(prompt_ids, list):
                changed |= self._note_prompt(prompt_ids, choice)
            delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else None
            if delta is not None and "role" in delta:
                if self.role_sent:
                    return b""  # a resent request's role chunk: the client has it
                self.role_sent = True
            ids = choice.get("token_ids")
            if isinstance(ids, list):
                self.token_ids += [t for t in ids if isinstance(t, int)]
                if not self.wants_token_ids:
                    del choice["token_ids"]
                    changed = True
            text = delta.get("content") if delta is not None else choice.get("text")
            if isinstance(text, str):
                self.num_chars += len(text)
                self.untracked |= bool(text) and not isinstance(ids, list)
            if choice.get("finish_reason") is not None:
                self.finished = True
        if obj.get("usage") is not None and not choices:
            self.usage_sent = True
        return _event(obj) if changed else event

    def _note_prompt(self, prompt_ids: list[int], where: dict[str, Any]) -> bool:
        """Keep the prompt's ids; put them back for the client once, if it asked. True if the event changed."""
        resent = self.prompt_token_ids is not None
        self.prompt_token_ids = prompt_ids
        if self.wants_token_ids and not resent:
            where["prompt_token_ids"] = prompt_ids
            return False
        return True

    def ending(self) -> bytes:
        """The end of a stream whose output was all delivered: its usage chunk if asked, then [DONE]."""
        out = b""
        if self.wants_usage and not self.usage_sent and self.prompt_token_ids is not None:
            prompt, completion = len(self.prompt_token_ids), len(self.token_ids)
            usage = {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            }
            out += _event({"id": self.stream_id, "object": self.object, "created": self.created,
                           "model": self.model, "choices": [], "usage": usage})  # fmt: skip
        return out + DONE


def error_event(message: str, code: int = 502) -> bytes:
    """vLLM's convention for a stream that fails after it started: one error event (then no [DONE])."""
    kind = {502: "BadGatewayError", 503: "ServiceUnavailableError"}.get(code, "Error")
    return _event({"error": {"message": message, "type": kind, "param": None, "code": code}})
