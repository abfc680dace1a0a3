"""Request shapes: prompts built to a target token count, and output lengths.

What it is: a seeded generator of :class:`RequestSpec` from the config's length
specs and shared-prefix mix. Prompt length is exact when a tokenizer is at hand
(``transformers.AutoTokenizer`` from a local model directory); otherwise words
are counted and converted with a linear fit ``tokens = offset + per_word * words``
calibrated against the server's own ``usage.prompt_tokens`` (see
:func:`plimsoll.bench.client.calibrate`). What it is not: a dataset loader.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plimsoll.bench.config import BenchConfig

# Short, common English words: one BPE token each (with the leading space) in the
# tokenizers we know, so word counts track token counts closely before calibration.
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "on",
    "for",
    "as",
    "with",
    "at",
    "by",
    "it",
    "an",
    "be",
    "this",
    "that",
    "from",
    "or",
    "are",
    "was",
    "not",
    "but",
    "all",
    "can",
    "one",
    "two",
    "new",
    "time",
    "year",
    "day",
    "way",
    "man",
    "work",
    "life",
    "world",
    "hand",
    "part",
    "place",
    "case",
    "week",
    "point",
    "number",
    "group",
    "water",
    "light",
    "sound",
    "house",
    "music",
    "river",
    "tree",
    "stone",
    "road",
    "city",
    "field",
    "paper",
    "story",
    "line",
    "head",
    "door",
]


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request to send: the prompt text and the lengths it was built for."""

    prompt: str
    input_tokens: int
    max_tokens: int
    shared_prefix: bool


@dataclass(frozen=True, slots=True)
class TokenFit:
    """tokens = offset + per_word * words, fitted from the server's usage counts."""

    offset: float = 0.0
    per_word: float = 1.0
    source: str = "assumed"

    def words_for(self, tokens: int) -> int:
        return max(1, round((tokens - self.offset) / self.per_word))


def load_local_tokenizer(model: str | None) -> Any | None:
    """A tokenizer for ``model`` only when it is a local directory; never touches a hub."""
    if not model or not Path(model).is_dir():
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError):
        return None


class Workload:
    """Seeded request generator for one configuration."""

    def __init__(self, cfg: BenchConfig, fit: TokenFit | None = None, tokenizer: Any | None = None) -> None:
        self.cfg = cfg
        self.fit = fit or TokenFit()
        self.tokenizer = tokenizer
        self.rng = random.Random(cfg.seed)
        prefix_rng = random.Random(cfg.seed + 7919)
        n = self.fit.words_for(cfg.shared_prefix_tokens) if cfg.shared_prefix_tokens else 0
        self.prefix_words = [prefix_rng.choice(WORDS) for _ in range(n)]

    def _words(self, n: int) -> list[str]:
        return [self.rng.choice(WORDS) for _ in range(n)]

    def _exact(self, words: list[str], target: int) -> str:
        """Text that the local tokenizer encodes to exactly ``target`` tokens (special tokens included).

        Cut at a token boundary and round-trip through decode, trimming when a merge
        across the cut changes the count.
        """
        tok = self.tokenizer
        assert tok is not None
        want = max(1, target - len(tok.encode("", add_special_tokens=True)))
        ids = tok.encode(" ".join(words), add_special_tokens=False)
        while len(ids) < want:
            words = words + self._words(want)
            ids = tok.encode(" ".join(words), add_special_tokens=False)
        ids = ids[:want]
        text = str(tok.decode(ids))
        for _ in range(4):
            count = len(tok.encode(text, add_special_tokens=False))
            if count <= want:
                break
            ids = ids[: len(ids) - (count - want)]
            text = str(tok.decode(ids))
        return text

    def next(self) -> RequestSpec:
        cfg = self.cfg
        target = cfg.input_tokens.sample(self.rng)
        shared = cfg.shared_prefix_fraction > 0 and self.rng.random() < cfg.shared_prefix_fraction
        if self.tokenizer is not None:
            words = (list(self.prefix_words) if shared else []) + self._words(target)
            prompt = self._exact(words, target)
        else:
            total = self.fit.words_for(target)
            head = self.prefix_words[:total] if shared else []
            prompt = " ".join(head + self._words(total - len(head)))
        return RequestSpec(prompt, target, cfg.output_tokens.sample(self.rng), shared)

    def describe(self) -> dict[str, Any]:
        cfg = self.cfg
        return {
            "endpoint": cfg.endpoint,
            "input_tokens": cfg.input_tokens.describe(),
            "output_tokens": cfg.output_tokens.describe(),
            "shared_prefix_tokens": cfg.shared_prefix_tokens,
            "shared_prefix_fraction": cfg.shared_prefix_fraction,
            "ignore_eos": cfg.ignore_eos,
            "token_count": "tokenizer" if self.tokenizer is not None else f"words ({self.fit.source})",
            "token_fit": {"offset": self.fit.offset, "per_word": self.fit.per_word},
            "seed": cfg.seed,
        }
