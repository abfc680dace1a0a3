"""Engine logprobs -> the two OpenAI logprob shapes (legacy completions, chat).

The engine gives, per generated token, a ``dict[token_id, Logprob]`` holding the
chosen token and the top-k alternatives. Completions want parallel arrays with
text offsets; chat wants one object per token with its own ``top_logprobs`` list.
"""

from __future__ import annotations

from collections.abc import Sequence

from plimsoll.runtime.engine.outputs import Logprob
from plimsoll.runtime.serving.protocol import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob


def _token_text(lp: Logprob | None, tokenizer: object, token_id: int) -> str:
    if lp is not None and lp.decoded is not None:
        decoded: str = lp.decoded
        return decoded
    return str(tokenizer.decode([token_id]))  # type: ignore[attr-defined]


def _finite(x: float) -> float:
    # JSON has no -Infinity; vLLM reports impossible tokens as -9999.0 too.
    return x if x > -9999.0 else -9999.0


def _top(entries: dict[int, Logprob], k: int) -> list[Logprob]:
    return sorted(entries.values(), key=lambda lp: lp.logprob, reverse=True)[:k]


def completion_logprobs(
    token_ids: Sequence[int],
    per_token: Sequence[dict[int, Logprob]],
    num_top: int,
    tokenizer: object,
    text_offset_start: int = 0,
) -> CompletionLogprobs:
    """Legacy completions logprobs for ``token_ids`` (parallel arrays, offsets into the text)."""
    out = CompletionLogprobs()
    offset = text_offset_start
    for token_id, entries in zip(token_ids, per_token, strict=False):
        chosen = entries.get(token_id)
        text = _token_text(chosen, tokenizer, token_id)
        out.tokens.append(text)
        out.token_logprobs.append(_finite(chosen.logprob) if chosen is not None else None)
        out.text_offset.append(offset)
        offset += len(text)
        if num_top > 0:
            top = {
                _token_text(lp, tokenizer, lp.token_id): _finite(lp.logprob) for lp in _top(entries, num_top)
            }
            out.top_logprobs.append(top)
        else:
            out.top_logprobs.append(None)
    return out


def chat_logprobs(
    token_ids: Sequence[int], per_token: Sequence[dict[int, Logprob]], num_top: int, tokenizer: object
) -> ChatLogprobs:
    """Chat logprobs: one entry per generated token, each with its top alternatives."""
    content: list[TokenLogprob] = []
    for token_id, entries in zip(token_ids, per_token, strict=False):
        chosen = entries.get(token_id)
        text = _token_text(chosen, tokenizer, token_id)
        top = [
            TopLogprob(
                token=_token_text(lp, tokenizer, lp.token_id),
                logprob=_finite(lp.logprob),
                bytes=list(_token_text(lp, tokenizer, lp.token_id).encode()),
            )
            for lp in _top(entries, num_top)
        ]
        content.append(
            TokenLogprob(
                token=text,
                logprob=_finite(chosen.logprob) if chosen is not None else -9999.0,
                bytes=list(text.encode()),
                top_logprobs=top,
            )
        )
    return ChatLogprobs(content=content)
