"""How one streamed answer becomes a request record: tokens that decode to no text are still an answer.

The SSE bodies are what an OpenAI-compatible server sends for a one-token request (the chunks, the
usage chunk with ``stream_options.include_usage``, ``[DONE]``), fed through httpx's transport hook.
"""

import asyncio
import json

import httpx

from plimsoll.bench.client import OpenAIClient, RequestRecord
from plimsoll.bench.config import BenchConfig
from plimsoll.bench.workload import RequestSpec


def sse(*events: dict[str, object]) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


def send(body: bytes) -> RequestRecord:
    async def run() -> RequestRecord:
        client = OpenAIClient(BenchConfig(url="http://127.0.0.1:9"), "m")
        await client.http.aclose()
        client.http = httpx.AsyncClient(
            base_url="http://127.0.0.1:9",
            transport=httpx.MockTransport(lambda _: httpx.Response(200, content=body)),
        )
        try:
            spec = RequestSpec(prompt="x", input_tokens=1, max_tokens=1, shared_prefix=False)
            return await client.send(spec, RequestRecord(request_id=0, scheduled=0.0))
        finally:
            await client.aclose()

    return asyncio.run(run())


def test_a_token_that_decodes_to_no_text_is_an_answer_not_an_error() -> None:
    # Half of a UTF-8 character: the server held its byte back, so the one chunk carries no text.
    held = sse(
        {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
        {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}},
    )
    record = send(held)
    assert record.ok and record.error_kind is None and record.ttft is not None and record.n_output == 1
    # Nothing generated at all: still an error, saying so.
    nothing = sse(
        {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]},
        {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 0}},
    )
    record = send(nothing)
    assert record.error_kind == "empty" and "without streaming any token" in (record.error_message or "")
    # Text: the first chunk with text is the first token.
    text = sse({"choices": [{"index": 0, "text": "Hi", "finish_reason": None}]},
               {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}})  # fmt: skip
    record = send(text)
    assert record.ok and len(record.chunk_times) == 1
