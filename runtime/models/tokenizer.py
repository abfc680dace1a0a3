"""A model's tokenizer read straight from its ``tokenizer.json`` with the ``tokenizers`` library.

What it is: :func:`load_tokenizer`, which returns a :class:`FastTokenizer` when the model directory
holds the plain kind of tokenizer files — a ``tokenizer.json`` that transformers would use as it is
(a ``TokenizersBackend`` or ``PreTrainedTokenizerFast`` class, no BOS/EOS switches or truncation
that transformers rewrites the file's post-processor for, every special token already in the
vocabulary) — and ``None`` otherwise, so the loader falls back to transformers' ``AutoTokenizer``.
A :class:`FastTokenizer` answers what the engine and the server ask of a tokenizer (``encode``,
``decode``, ``__call__(...).input_ids``, ``len``, the special-token ids and map, the chat template
and ``apply_chat_template``) with the same token ids and text as transformers' tokenizer (tests
compare them on the embedded and a tiny model). Why: importing transformers is the largest part of
a replica's start (seconds); ``tokenizers`` and ``jinja2`` load in milliseconds.

What it is not: a tokenizer implementation (``tokenizers`` is), nor a reader of the slow kinds
(SentencePiece, tiktoken files): those go through transformers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The special tokens transformers names in ``special_tokens_map`` (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# Tokenizer classes whose loading in transformers is ``Tokenizer.from_file`` plus the settings below.
PLAIN_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# Settings under which transformers changes the tokenizer.json it loads (post-processor, regex, splitting).
REWRITING_SETTINGS = (
    "add_bos_token",
    "add_eos_token",
    "split_special_tokens",
    "fix_mistral_regex",
    "add_prefix_space",
)
# Above this vocabulary transformers may patch a Mistral pre-tokenizer regex at load time.
MISTRAL_PATCH_VOCAB = 100_000


@dataclass
class Encoded:
    """What ``tokenizer(text)`` returns, as far as the engine reads it."""

    input_ids: list[int]


def _token_text(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])  # an AddedToken serialised
    raise TypeError(f"unexpected special token value {value!r}")


class FastTokenizer:
    def __init__(self, backend: Any, special_tokens: dict[str, str], chat_template: str | None) -> None:
        self.backend = backend  # a tokenizers.Tokenizer
        self.special_tokens_map = special_tokens
        self.chat_template = chat_template
        self.eos_token_id = self._id(special_tokens.get("eos_token"))
        self.bos_token_id = self._id(special_tokens.get("bos_token"))
        self.pad_token_id = self._id(special_tokens.get("pad_token"))

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def __len__(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def __call__(self, text: str, add_special_tokens: bool = True) -> Encoded:
        return Encoded(self.encode(text, add_special_tokens))

    def decode(self, ids: int | list[int], skip_special_tokens: bool = False) -> str:
        return str(
            self.backend.decode(
                [ids] if isinstance(ids, int) else list(ids), skip_special_tokens=skip_special_tokens
            )
        )

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """transformers' ``apply_chat_template`` for one conversation with the model's own template."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if not messages:
            raise ValueError(
                "Cannot apply chat template to an empty conversation. Provide at least one message."
            )
        from plimsoll.runtime.models.chat_template import render

        text = render(self.chat_template, messages, add_generation_prompt, self.special_tokens_map, **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _chat_template(directory: Path, config: dict[str, Any]) -> tuple[bool, str | None]:
    """(whether the model has at most one chat template, that template or None)."""
    if (directory / "additional_chat_templates").exists() or (directory / "chat_template.json").exists():
        return False, None
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return True, jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return True, template
    return False, None  # a list of named templates: transformers picks among them


def load_tokenizer(directory: Path) -> FastTokenizer | None:
    """The tokenizer of a model directory without transformers, or None where transformers must load it."""
    tokenizer_file, config_file = directory / "tokenizer.json", directory / "tokenizer_config.json"
    if not tokenizer_file.is_file() or not config_file.is_file():
        return None
    config = json.loads(config_file.read_text(encoding="utf-8"))
    if config.get("tokenizer_class") not in PLAIN_CLASSES or any(config.get(k) for k in REWRITING_SETTINGS):
        return None
    if (
        (directory / "special_tokens_map.json").exists()
        or config.get("extra_special_tokens")
        or config.get("additional_special_tokens")
    ):
        return None  # special tokens merged from elsewhere: transformers' rules
    if config.get("clean_up_tokenization_spaces"):
        return None
    single, template = _chat_template(directory, config)
    if not single:
        return None
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(tokenizer_file))
    if backend.truncation is not None or backend.padding is not None or backend.post_processor is None:
        return None
    if backend.get_vocab_size(with_added_tokens=False) > MISTRAL_PATCH_VOCAB:
        return None
    try:
        special = {name: _token_text(config.get(name)) for name in SPECIAL_TOKEN_NAMES}
    except TypeError:
        return None
    special_tokens = {name: token for name, token in special.items() if token is not None}
    added = {
        token.content: (index, token.special) for index, token in backend.get_added_tokens_decoder().items()
    }
    # transformers adds a named special token that the file lacks (a new id) or that is not marked
    # special; both change ids or decoding, so they stay with transformers.
    if any(not added.get(token, (None, False))[1] for token in special_tokens.values()):
        return None
    for index, entry in (config.get("added_tokens_decoder") or {}).items():
        if added.get(str(entry.get("content")), (None, None))[0] != int(index):
            return None
    return FastTokenizer(backend, special_tokens, template)


def read_generation_config(directory: Path) -> dict[str, Any] | None:
    """``generation_config.json`` as a dict, or None when there is none (or it is not a JSON object)."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
