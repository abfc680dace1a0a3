"""The child side of the chat-template pool: renders client-supplied templates, one at a time.

What it is: :func:`main`, the target of each worker process. It imports the
renderer the model's own template uses (``models/chat_template.py``: transformers'
sandboxed Jinja environment, so a template renders here as it would in the tokenizer), caps its own
address space, lowers its CPU priority, says ``ready``, then answers one job per message on its pipe:
``("ok", text)``, ``("too_long", num_chars)`` or ``("error", message)``.

What it is not: the time budget. A render that runs too long is not stopped here;
the parent (``template_pool.py``) kills the whole process.
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
from collections.abc import MutableMapping
from multiprocessing.connection import Connection
from typing import Any

Job = tuple[str, dict[str, Any], int]  # (template, context, max_chars)
# PLIMSOLL_API_KEY, PLIMSOLL_ADMIN_API_KEY, VLLM_API_KEY, HF_TOKEN, AWS_SECRET_ACCESS_KEY, *_PASSWORD ...
_SECRET_NAME = re.compile(r"(API_KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL)", re.IGNORECASE)


def _cap_memory(extra_bytes: int) -> None:
    """Limit the address space to what the process uses now plus ``extra_bytes`` (Linux)."""
    try:
        with open("/proc/self/statm") as f:
            used = int(f.read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (used + extra_bytes, used + extra_bytes))
    except (OSError, ValueError):
        pass  # no /proc or no permission: the parent's time budget still bounds the work


def render(job: Job) -> tuple[str, Any]:
    from plimsoll.runtime.models.chat_template import render as render_chat

    template, context, max_chars = job
    messages = context.pop("messages")
    add_generation_prompt = bool(context.pop("add_generation_prompt", False))
    try:
        text = render_chat(template, messages, add_generation_prompt, **context)
    except MemoryError:
        return "too_long", -1
    except Exception as exc:  # jinja raises TemplateError and plain exceptions alike
        return "error", f"{type(exc).__name__}: {exc}"
    if len(text) > max_chars:
        return "too_long", len(text)
    return "ok", text


def drop_secrets(environ: MutableMapping[str, str]) -> list[str]:
    """Remove the credentials a spawned worker inherits (API keys, tokens); return their names.

    A client's template runs here; whatever escapes Jinja's sandbox should find no key
    in this process's environment (the server's own keys included).
    """
    names = [name for name in environ if _SECRET_NAME.search(name)]
    for name in names:
        del environ[name]
    return names


def main(conn: Connection, memory_bytes: int) -> None:
    drop_secrets(os.environ)
    import plimsoll.runtime.models.chat_template  # noqa: F401  (paid once, before "ready")

    _cap_memory(memory_bytes)
    with contextlib.suppress(OSError):
        os.nice(10)  # a hostile render yields the CPU to the server process it would slow down
    conn.send(("ready", None))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return  # the server closed the pipe: it is shutting down
        conn.send(render(job))
