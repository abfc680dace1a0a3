"""Server-sent events the way OpenAI and vLLM frame them, with a response that always cleans up.

Each event is ``data: <json>\\n\\n``; the stream ends with ``data: [DONE]\\n\\n``;
an error after the headers went out is a ``data:`` error object, then ``[DONE]``.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


@dataclass(frozen=True)
class ChunkFrame:
    """What every chunk of one stream repeats (id, object, created, model); ``event`` adds the choices."""

    request_id: str
    object: str  # "text_completion" or "chat.completion.chunk"
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def event(
        self,
        choices: list[dict[str, Any]],
        usage: BaseModel | None = None,
        extra: dict[str, Any] | None = None,
    ) -> str:
        """One chunk; ``extra`` adds top-level fields (a chat stream's ``prompt_token_ids``)."""
        body: dict[str, Any] = {
            "id": self.request_id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **(extra or {}),
        }
        if usage is not None:
            body["usage"] = usage.model_dump(mode="json")
        return sse(body)


class SSEResponse(StreamingResponse):
    """A ``text/event-stream`` response that closes its generator and runs ``on_close`` on every exit.

    Starlette cancels the sending task when the client disconnects; a generator
    suspended at ``yield`` at that moment would only be finalised by the garbage
    collector, keeping its engine request (and KV blocks) alive until then.
    Closing it here aborts the request at once.
    """

    def __init__(
        self,
        content: AsyncIterator[str],
        on_close: Callable[[], None],
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
        )
        self._content = content
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True), contextlib.suppress(RuntimeError):
                await self._content.aclose()  # type: ignore[attr-defined]
            self._on_close()
