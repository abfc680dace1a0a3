"""``POST /v1/completions``: prompts in, ``text_completion`` objects or SSE chunks out.

A request may carry several prompts (strings or token-id lists); each is its own
engine request with ``n`` sequences, and choice ``i * n + k`` is prompt ``i``'s
``k``-th completion, as in OpenAI's API.
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
from plimsoll.runtime.serving.logprobs import completion_logprobs
from plimsoll.runtime.serving.prompts import (
    MAX_CHARS_PER_TOKEN,
    encode_prompt,
    off_loop,
    resolve_max_tokens,
    truncate_prompt,
)
from plimsoll.runtime.serving.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
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
    merge,
    until_disconnect,
)
from plimsoll.runtime.serving.sse import DONE, ChunkFrame, SSEResponse, sse


async def create_completion(ctx: ServingContext, req: CompletionRequest, raw: Request) -> Response:
    engine = ctx.engine
    tokenizer = engine.tokenizer
    prompts = req.prompts()
    check_before_tokenising(ctx, req, raw, len(prompts))
    max_chars = engine.max_model_len * MAX_CHARS_PER_TOKEN
    prompt_ids = await off_loop(
        lambda: [encode_prompt(tokenizer, p, engine.vocab_size, max_chars) for p in prompts],
        ctx.settings.tokenize_timeout,
    )
    prompt_ids = [
        truncate_prompt(ids, req.truncate_prompt_tokens, req.truncation_side, engine.max_model_len)
        for ids in prompt_ids
    ]
    limit = ctx.settings.max_new_tokens
    max_tokens = [
        resolve_max_tokens(len(ids), req.max_tokens, engine.max_model_len, "prompt", limit)
        for ids in prompt_ids
    ]
    params = [req.to_sampling_params(m) for m in max_tokens]
    adm, options = admit_tokenised(ctx, req, raw, "cmpl", [len(ids) for ids in prompt_ids], max_tokens)
    streams = [
        ctx.outputs(ids, p, f"{adm.request_id}-{i}", "completions", ctx.lora_of(req.model), **options)
        for i, (ids, p) in enumerate(zip(prompt_ids, params, strict=True))
    ]
    if req.stream:
        streams = await stream_head_after_promise(raw, adm, options, streams)
        streaming: Response = SSEResponse(
            _stream(ctx, req, adm, streams), on_close=adm.release, headers=adm.headers()
        )
        return streaming
    try:
        finals = await until_disconnect(raw, lambda: _collect(streams))
    finally:
        adm.release()
    texts = None
    if req.echo:  # the prompt the model saw: after truncate_prompt_tokens, when a request sets it
        cut = req.truncate_prompt_tokens is not None
        texts = [
            p if isinstance(p, str) and not cut else tokenizer.decode(ids)
            for p, ids in zip(prompts, prompt_ids, strict=True)
        ]
    response = _response(ctx, req, adm.request_id, finals, texts)
    response.kv_transfer_params = answer_params(finals[0].kv_transfer_params, raw)
    return JSONResponse(response_body(response, req.return_token_ids), headers=adm.headers())


async def _collect(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    finals: dict[int, RequestOutput] = {}
    async for i, out in merge(streams):
        finals[i] = out
    return [finals[i] for i in range(len(streams))]


def _response(
    ctx: ServingContext,
    req: CompletionRequest,
    request_id: str,
    finals: list[RequestOutput],
    echo: list[str] | None,
) -> CompletionResponse:
    tokenizer = ctx.engine.tokenizer
    choices: list[CompletionChoice] = []
    for i, final in enumerate(finals):
        for o in sorted(final.outputs, key=lambda o: o.index):
            prefix = echo[i] if echo is not None else ""
            lp = None
            if req.logprobs is not None and o.logprobs is not None:
                lp = completion_logprobs(o.token_ids, o.logprobs, req.logprobs, tokenizer, len(prefix))
            choices.append(
                CompletionChoice(
                    index=i * req.n + o.index,
                    text=prefix + o.text,
                    logprobs=lp,
                    finish_reason=o.finish_reason,
                    stop_reason=o.stop_reason,
                    prompt_token_ids=final.prompt_token_ids,
                    token_ids=o.token_ids,
                )
            )
    return CompletionResponse(
        id=request_id,
        model=ctx.model_of(req.model),
        choices=choices,
        usage=ctx.usage(finals),
    )


async def _stream(
    ctx: ServingContext, req: CompletionRequest, adm: Admission, streams: list[AsyncIterator[RequestOutput]]
) -> AsyncIterator[str]:
    chunk = ChunkFrame(adm.request_id, "text_completion", ctx.model_of(req.model)).event
    tokenizer = ctx.engine.tokenizer
    latest: dict[int, RequestOutput] = {}
    finish_sent: set[int] = set()
    # A continuation's text offsets go on from the characters the client already has.
    text_offsets: dict[int, int] = {0: req.continuation.num_chars} if req.continuation else {}
    # prompt_token_ids go out once per choice; a continuation's stream already sent them.
    prompt_ids_sent: set[int] = set(range(req.num_seqs)) if req.continuation else set()

    def choice(i: int, out: RequestOutput, o: CompletionOutput) -> dict[str, Any] | None:
        index = i * req.n + o.index
        finishing = o.finish_reason is not None and index not in finish_sent
        if not o.delta_text and not o.delta_token_ids and not finishing:
            return None  # a chunk whenever token ids advance (text may be empty), as vLLM does
        lp = None
        if req.logprobs is not None and o.delta_logprobs is not None:
            start = text_offsets.get(index, 0)
            lp = completion_logprobs(
                o.delta_token_ids, o.delta_logprobs, req.logprobs, tokenizer, start
            ).model_dump()
            text_offsets[index] = start + len(o.delta_text)
        if finishing:
            finish_sent.add(index)
        body = {
            "index": index,
            "text": o.delta_text,
            "logprobs": lp,
            "finish_reason": o.finish_reason if finishing else None,
            "stop_reason": o.stop_reason if finishing else None,
        }
        if req.return_token_ids:
            if index not in prompt_ids_sent:
                prompt_ids_sent.add(index)
                body["prompt_token_ids"] = out.prompt_token_ids
            body["token_ids"] = o.delta_token_ids
        return body

    merged = merge(streams)
    try:
        async with contextlib.aclosing(merged):
            async for i, out in merged:
                latest[i] = out
                choices = [c for o in out.outputs if (c := choice(i, out, o)) is not None]
                if choices:
                    usage = ctx.usage(list(latest.values())) if _continuous(req) else None
                    yield chunk(choices, usage)
        if req.include_usage:
            yield chunk([], ctx.usage(list(latest.values())))
    except APIError as err:
        yield sse(err.body())
    yield DONE


def _continuous(req: CompletionRequest) -> bool:
    return bool(
        req.stream_options and req.stream_options.include_usage and req.stream_options.continuous_usage_stats
    )
