"""Prompt-lookup (n-gram) proposals: the tokens that followed the last earlier match of the suffix.

What it is: for n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, find the
most recent earlier place where the sequence's last n tokens occurred and propose
the (up to) k tokens that came after them. Costs no model run, and pays off on
outputs that quote their input (summaries, rewrites, code edits). What it is not:
verification; a proposal is only a guess the target model checks.
"""

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, lookup_min: int, lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """Up to ``min(k, max_tokens)`` proposed next tokens; ``[]`` when nothing matches."""
        limit = min(self.k, max_tokens)
        if limit <= 0 or len(token_ids) < self.lookup_min + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.lookup_max, len(tokens) - 1), self.lookup_min - 1, -1):
            pattern = tokens[-n:]
            # Windows starting at 0 .. len-n-1: every earlier occurrence, never the suffix itself.
            windows = sliding_window_view(tokens[:-1], n)  # [len - n, n]
            hits = np.flatnonzero((windows == pattern).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return [int(t) for t in tokens[start : start + limit]]
        return []
