"""``POST /v1/chat/completions``: messages through the chat template, ``chat.completion`` out.

Streaming follows OpenAI and vLLM: one chunk per choice carrying the assistant
role (``content: ""``) first, then content deltas, the finish reason on each
choice's last chunk, an optional usage chunk with ``choices: []``, and
``data: [DONE]``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from plimsoll.runtime.engine.outputs import CompletionOutput, RequestOutput
from plimsoll.runtime.serving.errors import APIError
from plimsoll.runtime.serving.kv_transfer import answer_params
from plimsoll.runtime.serving.logprobs import chat_logprobs
from plimsoll.runtime.serving.prompts import (
    MAX_CHARS_PER_TOKEN,
    client_template,
    client_template_context,
    encode_chat,
    encode_text,
    off_loop,
    resolve_max_tokens,
    truncate_prompt,
)
from plimsoll.runtime.serving.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    response_body,
)
from plimsoll.runtime.serving.request_intake import (
    admit_tokenised,
    check_before_tokenising,
    stream_head_after_promise,
)
from plimsoll.runtime.serving.requests import (
    Admission,
    ServingContext,
    until_disconnect,
)
from plimsoll.runtime.serving.sse import DONE, ChunkFrame, SSEResponse, sse


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, raw: Request) -> Response:
    engine = ctx.engine
    check_before_tokenising(ctx, req, raw, 1)
    max_chars = engine.max_model_len * MAX_CHARS_PER_TOKEN
    timeout = ctx.settings.tokenize_timeout
    template = client_template(req, ctx.settings.allow_client_chat_template)
    if template is None:
        prompt_ids = await off_loop(lambda: encode_chat(engine.tokenizer, req, max_chars), timeout)
    else:
        assert ctx.templates is not None, "--allow-client-chat-template builds the template pool"
        context = client_template_context(engine.tokenizer, req, max_chars)
        text = await ctx.templates.render(template, context, max_chars, timeout)
        prompt_ids = await off_loop(lambda: encode_text(engine.tokenizer, text, max_chars), timeout)
    prompt_ids = truncate_prompt(
        prompt_ids, req.truncate_prompt_tokens, req.truncation_side, engine.max_model_len
    )
    max_tokens = resolve_max_tokens(
        len(prompt_ids),
        req.requested_max_tokens(),
        engine.max_model_len,
        "messages",
        ctx.settings.max_new_tokens,
    )
    params = req.to_sampling_params(max_tokens)
    adm, options = admit_tokenised(ctx, req, raw, "chatcmpl", [len(prompt_ids)], [max_tokens])
    stream = ctx.outputs(prompt_ids, params, adm.request_id, "chat", ctx.lora_of(req.model), **options)
    if req.stream:
        (stream,) = await stream_head_after_promise(raw, adm, options, [stream])
        streaming: Response = SSEResponse(
            _stream(ctx, req, adm, stream, prompt_ids), on_close=adm.release, headers=adm.headers()
        )
        return streaming
    try:
        final = await until_disconnect(raw, lambda: _last(stream))
    finally:
        adm.release()
    response = _response(ctx, req, adm.request_id, final)
    response.kv_transfer_params = answer_params(final.kv_transfer_params, raw)
    return JSONResponse(response_body(response, req.return_token_ids), headers=adm.headers())


async def _last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    final: RequestOutput | None = None
    async with contextlib.aclosing(stream):  # type: ignore[type-var]
        async for out in stream:
            final = out
    assert final is not None, "the engine finished a request without any output"
    return final


def _num_top(req: ChatCompletionRequest) -> int:
    return req.top_logprobs or 0


def _response(
    ctx: ServingContext, req: ChatCompletionRequest, request_id: str, final: RequestOutput
) -> ChatCompletionResponse:
    tokenizer = ctx.engine.tokenizer
    choices = []
    for o in sorted(final.outputs, key=lambda o: o.index):
        lp = None
        if req.logprobs and o.logprobs is not None:
            lp = chat_logprobs(o.token_ids, o.logprobs, _num_top(req), tokenizer)
        choices.append(
            ChatChoice(
                index=o.index,
                message=ChatResponseMessage(content=o.text),
                logprobs=lp,
                finish_reason=o.finish_reason,
                stop_reason=o.stop_reason,
                token_ids=o.token_ids,
            )
        )
    return ChatCompletionResponse(
        id=request_id, model=ctx.model_of(req.model), choices=choices,
        usage=ctx.usage([final]), prompt_token_ids=final.prompt_token_ids,
    )  # fmt: skip


async def _stream(
    ctx: ServingContext,
    req: ChatCompletionRequest,
    adm: Admission,
    stream: AsyncIterator[RequestOutput],
    prompt_ids: list[int],
) -> AsyncIterator[str]:
    chunk = ChunkFrame(adm.request_id, "chat.completion.chunk", ctx.model_of(req.model)).event
    tokenizer = ctx.engine.tokenizer
    finish_sent: set[int] = set()
    continuous = bool(req.stream_options and req.include_usage and req.stream_options.continuous_usage_stats)

    def choice(o: CompletionOutput) -> dict[str, Any] | None:
        finishing = o.finish_reason is not None and o.index not in finish_sent
        if not o.delta_text and not o.delta_token_ids and not finishing:
            return None  # a chunk whenever token ids advance (text may be empty), as vLLM does
        lp = None
        if req.logprobs and o.delta_logprobs is not None:
            lp = chat_logprobs(o.delta_token_ids, o.delta_logprobs, _num_top(req), tokenizer).model_dump()
        if finishing:
            finish_sent.add(o.index)
        body = {
            "index": o.index,
            "delta": {"content": o.delta_text},
            "logprobs": lp,
            "finish_reason": o.finish_reason if finishing else None,
            "stop_reason": o.stop_reason if finishing else None,
        }
        if req.return_token_ids:
            body["token_ids"] = o.delta_token_ids
        return body

    # A continuation carries on a stream whose role chunks (and prompt_token_ids) were sent.
    for i in range(0 if req.continuation else req.n):
        yield chunk(
            [
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
            extra={"prompt_token_ids": prompt_ids} if req.return_token_ids and i == 0 else None,
        )
    last: RequestOutput | None = None
    try:
        async with contextlib.aclosing(stream):  # type: ignore[type-var]
            async for out in stream:
                last = out
                choices = [c for o in out.outputs if (c := choice(o)) is not None]
                if choices:
                    yield chunk(
                        choices,
                        ctx.usage([out]) if continuous else None,
                    )
        if req.include_usage and last is not None:
            yield chunk([], ctx.usage([last]))
    except APIError as err:
        yield sse(err.body())
    yield DONE
