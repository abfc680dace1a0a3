"""Incremental detokenisation with stop strings.

What it is: per-sequence text assembly that (1) never emits a broken UTF-8
character (a multi-byte character split over tokens is held until complete),
(2) finds stop strings even when they span token boundaries, and (3) holds back
the last ``len(longest stop) - 1`` characters until they cannot start a stop
string, so a stop string is never streamed out. What it is not: tokenisation.
"""

from typing import Any

# Prompt tokens kept as left context: some tokenizers decode a lone token
# differently (leading spaces) than inside a sequence.
CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Any, prompt_token_ids: list[int], stop: list[str], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.num_emitted_chars = 0

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens))

    def append(self, token_id: int) -> str:
        """Add one token; return the text it completes ('' while a character is incomplete)."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def prime(self, token_ids: tuple[int, ...] | list[int], num_chars: int) -> None:
        """Replay output already produced elsewhere, of which the client has ``num_chars`` characters.

        Token by token, as if generated here, so offsets and held-back characters are
        exactly what the first detokenizer had; stop strings are not searched (that
        output did not stop). The rest of its text goes out with the next delta.
        """
        for token_id in token_ids:
            self.append(token_id)
        if not 0 <= num_chars <= len(self.text):
            raise ValueError(
                f"continuation.num_chars is {num_chars} but its token_ids decode to {len(self.text)} "
                "characters; send how many characters of their text the client received"
            )
        self.num_emitted_chars = num_chars

    def find_stop(self, num_new_chars: int) -> str | None:
        """Look for a stop string touching the last ``num_new_chars``; truncate the text before it."""
        if not self.stop or not num_new_chars:
            return None
        start = max(0, len(self.text) - num_new_chars - self.holdback)
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = self.text.find(s, start)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        return best[1]

    def visible_text(self, finished: bool) -> str:
        """Text safe to show: all of it once finished, else minus a possible stop-string start."""
        if finished or not self.holdback:
            return self.text
        return self.text[: max(self.num_emitted_chars, len(self.text) - self.holdback)]

    def take_delta(self, finished: bool) -> str:
        visible = self.visible_text(finished)
        delta = visible[self.num_emitted_chars :]
        self.num_emitted_chars = len(visible)
        return delta
