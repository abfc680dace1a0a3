"""The prompt's token ids as the replicas will see them, and its block hashes, for precise routing.

What it is: the router's copy of the engine's tokenizer (``--kv-tokenizer``: a model directory,
a .gguf file or ``smollm2-135m``; transformers' tokenizer only, no weights, no torch) and the
serving rules for turning a request body into tokens: a completion's text with the tokenizer's
special tokens, a token-id prompt as it is, a chat rendered with the model's chat template and
the generation prompt, then encoded without special tokens (the template wrote them). The block
hashes come from the engine's own chain rule (``plimsoll.runtime.kv.blocks``), so they are the
ones the replicas announce. What it is not: a validator; a body it cannot read gives no hashes
and the request is routed by the approximate policy.

Requests it does not hash: adapter requests (LoRA salts are process-local) and requests that
carry a ``cache_salt`` (their chain starts from a salt the router does not compute).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from plimsoll.runtime.kv.blocks import chain_hashes_fast, event_hash


def load_tokenizer(model: str) -> Any:
    from transformers import AutoTokenizer

    from plimsoll.runtime.models import embedded

    if model in embedded.EMBEDDED_MODELS:
        return AutoTokenizer.from_pretrained(str(embedded.ensure_embedded_model(model)))
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if path.is_dir():
        return AutoTokenizer.from_pretrained(str(path))
    raise ValueError(
        f"--kv-tokenizer {model!r} is neither a model directory, a .gguf file nor 'smollm2-135m'"
    )


class PromptTokens:
    def __init__(self, tokenizer: Any, base_model: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.base_model = base_model  # requests naming another model (an adapter) are not hashed

    def token_ids(self, body: Any) -> list[int] | None:
        if not isinstance(body, dict) or body.get("cache_salt") is not None:
            return None
        model = body.get("model")
        if self.base_model and isinstance(model, str) and model and model != self.base_model:
            return None
        if isinstance(body.get("messages"), list):
            return self._chat(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        return None

    def _chat(self, body: dict[str, Any]) -> list[int] | None:
        messages = []
        for m in body["messages"]:
            if not isinstance(m, dict):
                return None
            content = m.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            entry = {"role": m.get("role"), "content": content if isinstance(content, str) else ""}
            if m.get("name"):
                entry["name"] = m["name"]
            messages.append(entry)
        kwargs = body.get("chat_template_kwargs") or {}
        if (
            body.get("chat_template")
            or not isinstance(kwargs, dict)
            or not getattr(self.tokenizer, "chat_template", None)
        ):
            return None
        kwargs = {k: v for k, v in kwargs.items() if k != "chat_template"}
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=body.get("add_generation_prompt", True),
                **kwargs,
            )
        except Exception:  # the replica will say what is wrong with these messages
            return None
        return list(self.tokenizer.encode(str(text), add_special_tokens=False))

    def block_hashes(self, body: Any, block_size: int) -> tuple[int, ...] | None:
        ids = self.token_ids(body)
        if not ids:
            return None
        # As the engine caps a prefix hit: at least one token is computed for logits.
        usable = ids[: max(len(ids) - 1, 0)]
        return tuple(event_hash(h) for h in chain_hashes_fast(usable, block_size))
