"""What the completion routes do to a request around tokenising it, the same for both.

What it is: :func:`check_before_tokenising` (token ids in range, KV transfer parameters that
fit, and an SLO refusal that needs no prompt) and :func:`admit_tokenised` (the request's
continuation, priority, tenant and prefix-cache salt as the engine's options, the predicted-TTFT
check, then admission against the queue and tenant caps) and :func:`stream_head_after_promise`
(a streamed answer held to a TTFT bound sends its head with its first token). What it is not: tokenising, sampling
parameters or the responses, which differ per route (``chat.py``, ``completions.py``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request

from plimsoll.runtime.engine.client import RequestOptions
from plimsoll.runtime.engine.outputs import RequestOutput
from plimsoll.runtime.serving.kv_transfer import check_transfer_request
from plimsoll.runtime.serving.prompts import MAX_CHARS_PER_TOKEN, check_token_ids, continuation_of
from plimsoll.runtime.serving.protocol import ChatCompletionRequest, CompletionRequest
from plimsoll.runtime.serving.requests import (
    Admission,
    ServingContext,
    cache_salt_of,
    hold_head,
    priority_of,
    tenant_of,
)
from plimsoll.runtime.serving.slo_admission import check_predicted_ttft, refuse_before_tokenising

CompletionsRequest = ChatCompletionRequest | CompletionRequest


def check_before_tokenising(
    ctx: ServingContext, req: CompletionsRequest, raw: Request, num_prompts: int
) -> None:
    """Refuse (400, or 429 for the SLO) what is wrong before any tokenising work is spent on it."""
    for field, ids in req.token_id_fields().items():
        check_token_ids(ids, ctx.engine.vocab_size, field)
    check_transfer_request(req.kv_transfer_params, num_prompts, req.stream)
    refuse_before_tokenising(ctx, raw, req.num_seqs, fewest_prompt_tokens(req))


def fewest_prompt_tokens(req: CompletionsRequest) -> int:
    """The fewest tokens the request's longest prompt can have, known before tokenising: a token-id
    prompt's length, a text prompt's characters over the most any tokenizer packs into a token
    (0 for chat: its template is not rendered yet). A refusal certain for that many is made before
    the hop to the tokeniser's thread."""
    if not isinstance(req, CompletionRequest):
        return 0
    return max(
        (len(p) if isinstance(p, list) else len(p) // MAX_CHARS_PER_TOKEN for p in req.prompts()), default=0
    )


def admit_tokenised(
    ctx: ServingContext,
    req: CompletionsRequest,
    raw: Request,
    kind: str,
    prompt_lens: list[int],
    max_tokens: list[int],
) -> tuple[Admission, RequestOptions]:
    """Admit a tokenised request (``prompt_lens`` and ``max_tokens`` per prompt, ``req.n`` sequences
    each) and return its admission and the options its prompts go to the engine with."""
    engine = ctx.engine
    continuation = continuation_of(
        req.continuation, engine.vocab_size, prompt_lens[0], max_tokens[0], engine.max_model_len
    )
    tenant = tenant_of(raw, req.user)
    options = RequestOptions(
        priority=priority_of(raw, req.priority, ctx.settings),
        fairness_id=tenant,
        continuation=continuation,
        cache_salt=cache_salt_of(raw, req.cache_salt, ctx.settings),
    )
    held = sum((p + m) * req.n for p, m in zip(prompt_lens, max_tokens, strict=True))
    promise = check_predicted_ttft(ctx, raw, prompt_lens, req.num_seqs)
    adm = ctx.admit(kind, tenant, held, req.num_seqs)
    if promise is not None:
        adm.predicted_ttft_s = promise.prediction.ttft_s
        if promise.deadline is not None:
            options["ttft_deadline"] = promise.deadline
    return adm, options


async def stream_head_after_promise(
    raw: Request, adm: Admission, options: RequestOptions, streams: list[AsyncIterator[RequestOutput]]
) -> list[AsyncIterator[RequestOutput]]:
    """The streams a streamed answer sends: as they are, or — for a request held to a TTFT bound
    (``options["ttft_deadline"]``) — with their first outputs read, so that the response head goes
    out with the first token and a refusal from the queue is a clean 429 (``requests.hold_head``).
    The admission is released when the request ends here."""
    if "ttft_deadline" not in options:
        return streams
    try:
        return await hold_head(raw, streams)
    except BaseException:
        adm.release()
        raise
