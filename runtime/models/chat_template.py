"""Renders a chat template the way transformers' ``apply_chat_template`` does, without transformers.

What it is: :func:`render`, which compiles a Jinja chat template in the same sandboxed
environment transformers builds (``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, a ``{% generation %}`` block that renders its
body, the ``tojson`` filter that does not escape HTML, ``raise_exception``, ``strftime_now``, a
``dict`` and a ``namespace`` that refuse underscore names) and renders one conversation with the
special tokens and the caller's keyword arguments, keys whose value is None dropped from each
message and the reasoning field names aliased, as transformers does. The model's own template and
a client's (in a worker process, ``serving/template_worker.py``) render here, so both render alike;
tests compare the output with transformers' for the embedded and a tiny model.

What it is not: the assistant-token mask (a training aid), tools given as Python functions, or
batches of conversations; nor a tokenizer (``models/tokenizer.py``).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names a message's reasoning comes under; templates read the first (transformers aliases them alike).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Appended to a message that continue_final_message leaves open, to find where it ends once rendered.
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body (it marks assistant text for a
    training mask, which serving does not build)."""

    tags = {"generation"}  # noqa: RUF012  (Jinja's Extension declares it so)

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's own filter escapes HTML characters, which would change what a model sees.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict(...)`` inside a template, without attribute access to the type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's ``namespace`` that refuses underscore-prefixed names (a way to CPython internals).
    Its ``__init__`` takes ``self`` inside ``*args``, as Jinja's does, so ``namespace(self=...)`` works."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        for name in dict(*rest, **kwargs):
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, *rest, **kwargs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}."
            )


@lru_cache(maxsize=16)
def compile_template(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(template)


def _plain(value: Any) -> Any:
    """JSON-typed copies of what the template sees (subclasses stripped to their base type)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


def _messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for message in messages:
        if not isinstance(message, dict):
            raise TypeError(f"Chat messages should be dicts, but got {message!r}.")
        message = _plain({k: v for k, v in message.items() if v is not None})
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render(
    template: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    special_tokens: dict[str, str] | None = None,
    /,
    *,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    continue_final_message: bool | str = False,
    **kwargs: Any,
) -> str:
    """The conversation rendered as text; ``kwargs`` overwrite special tokens of the same name.

    ``continue_final_message`` leaves the last message open for the model to continue (it cannot
    go with ``add_generation_prompt``), cut where transformers cuts it.
    """
    for tool in tools or []:
        if not isinstance(tool, dict):
            raise ValueError("Tools should be JSON schemas (dicts) when given to a chat template.")
    for document in documents or []:
        if not isinstance(document, dict):
            raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    chat = _messages(messages)
    final: Any = ""
    if continue_final_message:
        if add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible.")
        if not chat:
            raise ValueError("continue_final_message is set but the conversation is empty!")
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        final = chat[-1].get(field)
        if not isinstance(final, str):
            raise ValueError(
                f'continue_final_message is set but the final message has no "{field}" to continue!'
            )
        fields = (
            [f for f in REASONING_FIELDS if chat[-1].get(f) == final]
            if field in REASONING_FIELDS
            else [field]
        )
        if not any(f in template for f in fields):
            raise ValueError(
                f'continue_final_message is set to "{field}" but this is not an accepted field in the chat_template'
            )
        for f in fields:
            chat[-1][f] = chat[-1][f] + CONTINUE_TAG
    context = _plain({**(special_tokens or {}), **kwargs})
    text = compile_template(template).render(
        messages=chat,
        tools=_plain(tools),
        documents=_plain(documents),
        add_generation_prompt=add_generation_prompt,
        **context,
    )
    if continue_final_message:
        if final.strip() not in text or CONTINUE_TAG.strip() not in text:
            raise ValueError(
                "continue_final_message is set but the final message does not appear in the rendered chat"
            )
        at = text.rindex(CONTINUE_TAG.strip())
        # A template that keeps spacing ends the message with the whole tag; one that trimmed it, not.
        text = text[:at] if text[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()
    return text
