"""Prompts to token ids, and the context-length checks that turn into 400s.

The server tokenizes (the engine gets token ids) so it can check lengths before
anything is queued, report ``usage.prompt_tokens`` and validate ids a client sent.
"""

from __future__ import annotations

from typing import Any

from plimsoll.runtime.serving.errors import bad_request
from plimsoll.runtime.serving.protocol import ChatCompletionRequest


def vocab_size(tokenizer: Any) -> int:
    return len(tokenizer)


def encode_prompt(tokenizer: Any, prompt: str | list[int]) -> list[int]:
    """A completions prompt as token ids; client-sent ids must exist in the vocabulary."""
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt, add_special_tokens=True))
    size = vocab_size(tokenizer)
    bad = [t for t in prompt if not 0 <= t < size]
    if bad:
        raise bad_request(
            f"Token ids {bad[:5]} are outside this model's vocabulary (0..{size - 1}); send ids in that range.",
            "prompt",
        )
    return list(prompt)


def encode_chat(tokenizer: Any, request: ChatCompletionRequest) -> list[int]:
    """Render the messages with the tokenizer's chat template and tokenize the result."""
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request(
            "This model's tokenizer has no chat template; use /v1/completions with a plain prompt.",
            "messages",
        )
    messages = [
        {"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
        for m in request.messages
    ]
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=request.add_generation_prompt,
            **(request.chat_template_kwargs or {}),
        )
    except Exception as exc:  # jinja raises TemplateError and plain exceptions alike
        raise bad_request(f"The chat template rejected these messages: {exc}", "messages") from None
    # The template already wrote any BOS it wants; adding special tokens again would double it.
    return list(tokenizer.encode(str(text), add_special_tokens=False))


def resolve_max_tokens(prompt_len: int, requested: int | None, max_model_len: int, prompt_param: str) -> int:
    """The max_tokens to use, or a 400 that says which of prompt or max_tokens to shrink."""
    if prompt_len == 0:
        raise bad_request("The prompt is empty; send at least one token.", prompt_param)
    if prompt_len >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{prompt_len} tokens; shorten the {prompt_param} to at most {max_model_len - 1} tokens.",
            prompt_param,
        )
    room = max_model_len - prompt_len
    if requested is None:
        return room
    if requested > room:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the {prompt_param}, {requested} in the completion). "
            f"Lower max_tokens to at most {room} or shorten the {prompt_param}.",
            "max_tokens",
        )
    return requested
