"""Prompts to token ids, and the context-length checks that turn into 400s.

The server tokenizes (the engine gets token ids) so it can check lengths before
anything is queued, report ``usage.prompt_tokens`` and validate ids a client sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from plimsoll.runtime.engine.request import Continuation
from plimsoll.runtime.serving.errors import bad_request
from plimsoll.runtime.serving.protocol import ChatCompletionRequest, ContinuationField

T = TypeVar("T")

# No tokenizer we serve packs more characters than this into one token on average, so a
# prompt longer than max_model_len x this cannot fit; refusing it first bounds tokenising work.
MAX_CHARS_PER_TOKEN = 32


async def off_loop(work: Callable[[], T], timeout: float) -> T:
    """Run tokenising or the model's own template in a worker thread, so ``/health`` keeps answering.

    Past ``timeout`` the request gets a 400; the thread cannot be interrupted and
    finishes on its own, but the event loop never waits for it.
    """
    try:
        return await asyncio.wait_for(asyncio.to_thread(work), timeout)
    except TimeoutError:
        raise bad_request(
            f"Preparing this prompt took longer than {timeout:g}s (tokenising or rendering the chat "
            "template); send a shorter prompt or simpler chat_template_kwargs."
        ) from None


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    """Client-sent ids must exist in the vocabulary (the engine indexes logits with them)."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(
            f"{param}: token ids {bad[:5]} are outside this model's vocabulary (0..{vocab_size - 1}); "
            "send ids in that range.",
            param,
        )


def continuation_of(
    field: ContinuationField | None, vocab_size: int, prompt_len: int, max_tokens: int, max_model_len: int
) -> Continuation | None:
    """The engine's ``Continuation`` for a request's ``continuation`` field, or a 400 if it leaves
    nothing to generate. Whether ``num_chars`` fits the ids' text is the engine's check (it decodes)."""
    if field is None:
        return None
    check_token_ids(field.token_ids, vocab_size, "continuation.token_ids")
    done = len(field.token_ids)
    if done >= max_tokens or prompt_len + done >= max_model_len:
        raise bad_request(
            f"The continuation holds {done} tokens: with the prompt's {prompt_len} that leaves nothing to "
            f"generate (max_tokens {max_tokens}, context {max_model_len}); the request is already complete.",
            "continuation",
        )
    return Continuation(tuple(field.token_ids), field.num_chars)


def check_prompt_chars(text: str, max_chars: int, param: str) -> None:
    """Refuse a text longer than any prompt the model can hold before paying to tokenise it."""
    if len(text) > max_chars:
        raise bad_request(
            f"The {param} has {len(text)} characters; this server tokenises at most {max_chars} "
            f"(a prompt this long cannot fit the model's context); shorten the {param}.",
            param,
        )
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # JSON allows lone surrogates ("\ud800"); tokenizers do not
        raise bad_request(
            f"The {param} is not valid Unicode (a lone surrogate at character {exc.start}); "
            "send UTF-8 text.",
            param,
        ) from None


def encode_prompt(tokenizer: Any, prompt: str | list[int], vocab_size: int, max_chars: int) -> list[int]:
    """A completions prompt as token ids; client-sent ids must exist in the vocabulary."""
    if isinstance(prompt, str):
        check_prompt_chars(prompt, max_chars, "prompt")
        return list(tokenizer.encode(prompt, add_special_tokens=True))
    check_token_ids(prompt, vocab_size, "prompt")
    return list(prompt)


def client_template(request: ChatCompletionRequest, allow_client_template: bool) -> str | None:
    """The chat_template a client sent in chat_template_kwargs, or None; refused unless allowed."""
    template = (request.chat_template_kwargs or {}).get("chat_template")
    if template is None:
        return None
    if not allow_client_template:
        raise bad_request(
            "A client-supplied chat_template is refused on this server (rendering one costs unbounded "
            "CPU); leave chat_template out of chat_template_kwargs, or start the server with "
            "--allow-client-chat-template.",
            "chat_template_kwargs",
        )
    if not isinstance(template, str):
        raise bad_request("chat_template_kwargs.chat_template must be a string (a Jinja template).",
                          "chat_template_kwargs")
    return template


def chat_messages(request: ChatCompletionRequest, max_chars: int) -> list[dict[str, str]]:
    """The messages as a chat template reads them, after the length check that bounds the work."""
    check_prompt_chars("".join(m.text() for m in request.messages), max_chars, "messages")
    return [
        {"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
        for m in request.messages
    ]


def client_template_context(tokenizer: Any, request: ChatCompletionRequest, max_chars: int) -> dict[str, Any]:
    """What a client template renders with: messages, the generation flag, special tokens, the kwargs."""
    kwargs = {k: v for k, v in (request.chat_template_kwargs or {}).items() if k != "chat_template"}
    return {
        **dict(getattr(tokenizer, "special_tokens_map", {}) or {}),
        **kwargs,  # as in transformers: kwargs overwrite special tokens
        "messages": chat_messages(request, max_chars),
        "add_generation_prompt": request.add_generation_prompt,
    }


def encode_text(tokenizer: Any, text: str, max_chars: int) -> list[int]:
    """A rendered chat as token ids; the template already wrote any BOS it wants."""
    check_prompt_chars(text, max_chars, "messages")
    return list(tokenizer.encode(text, add_special_tokens=False))


def encode_chat(tokenizer: Any, request: ChatCompletionRequest, max_chars: int) -> list[int]:
    """Render the messages with the model's own chat template and tokenize the result.

    A client-supplied template never comes here: it renders in a worker process
    (``template_pool.py``).
    """
    kwargs = {k: v for k, v in (request.chat_template_kwargs or {}).items() if k != "chat_template"}
    messages = chat_messages(request, max_chars)
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request(
            "This model's tokenizer has no chat template; use /v1/completions with a plain prompt.",
            "messages",
        )
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=request.add_generation_prompt,
            **kwargs,
        )
    except Exception as exc:  # jinja raises TemplateError and plain exceptions alike
        raise bad_request(f"The chat template rejected these messages: {exc}", "messages") from None
    # The template already wrote any BOS it wants; adding special tokens again would double it.
    return encode_text(tokenizer, str(text), max_chars)


def truncate_prompt(ids: list[int], keep: int | None, side: str | None, max_model_len: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the last ``keep`` ids (``side`` left, the default) or the
    first (right); -1 keeps as many as the context holds beside one completion token."""
    if keep is None:
        return ids
    if keep == -1:
        keep = max_model_len - 1
    if keep > max_model_len:
        raise bad_request(
            f"truncate_prompt_tokens={keep} is longer than this model's maximum context length "
            f"({max_model_len}); send at most {max_model_len - 1}, or -1 for as many as fit.",
            "truncate_prompt_tokens",
        )
    if keep == 0:
        raise bad_request(
            "truncate_prompt_tokens=0 leaves no prompt; send 1 or more.", "truncate_prompt_tokens"
        )
    if len(ids) <= keep:
        return ids
    return ids[:keep] if side == "right" else ids[-keep:]


def resolve_max_tokens(
    prompt_len: int, requested: int | None, max_model_len: int, prompt_param: str, limit: int | None = None
) -> int:
    """The max_tokens to use, or a 400 that says which of prompt or max_tokens to shrink.

    ``limit`` is the server's ``--max-new-tokens``: what a request without max_tokens gets, and
    the most any request gets (a larger max_tokens is lowered to it, as vLLM's
    ``--override-generation-config '{"max_new_tokens": N}'`` does).
    """
    if limit is not None:
        requested = limit if requested is None else min(requested, limit)
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
