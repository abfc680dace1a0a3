"""Per-sequence token counts kept on the logits' device, for the repetition, presence and
frequency penalties.

What it is: two pooled tables, ``[slots, V]``, one row per sequence that asked for a
penalty: how often each token occurs in its output (``int32``) and whether it occurs
in its prompt (``bool``). A row is filled once, when the sequence first samples (one
copy of its tokens to the device), and grows on the device with each sampled token, so
a step reads the batch's rows with one gather and never sends a sequence's history
again. The tables double when full; a finished sequence's row goes back to the pool.
What it is not: the penalty arithmetic (``sampler.py``), or anything for sequences
without penalties (they hold no row).
"""

import torch

from plimsoll.runtime.engine.request import Request


class TokenCounts:
    def __init__(self) -> None:
        self.output: torch.Tensor | None = None  # [slots, V] int32: occurrences in the output
        self.prompt: torch.Tensor | None = None  # [slots, V] bool: occurs in the prompt
        self.slot_of: dict[str, int] = {}
        self.free: list[int] = []

    def slots(self, reqs: list[Request], vocab_size: int, device: torch.device) -> torch.Tensor:
        """The rows of ``reqs`` (``[len(reqs)]`` on ``device``), filling the rows of newcomers."""
        new = [r for r in reqs if r.request_id not in self.slot_of]
        if new:
            self._reserve(len(new), vocab_size, device)
            for req in new:
                self._fill(req, self.free.pop(), device)
        return torch.tensor([self.slot_of[r.request_id] for r in reqs], dtype=torch.long).to(device)

    def add(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Count one sampled token per row (both on the device: nothing goes to the host)."""
        assert self.output is not None
        ones = torch.ones_like(token_ids, dtype=self.output.dtype)
        self.output.index_put_((slots, token_ids), ones, accumulate=True)

    def release(self, request_id: str) -> None:
        slot = self.slot_of.pop(request_id, None)
        if slot is not None:
            self.free.append(slot)

    def _reserve(self, count: int, vocab_size: int, device: torch.device) -> None:
        used = len(self.slot_of)
        if self.output is not None and len(self.free) >= count:
            return
        capacity = max(8, used + count, 2 * used)  # doubles as sequences arrive; one batch at most at once
        output = torch.zeros(capacity, vocab_size, dtype=torch.int32, device=device)
        prompt = torch.zeros(capacity, vocab_size, dtype=torch.bool, device=device)
        if self.output is not None and self.prompt is not None:
            old = self.output.shape[0]
            output[:old] = self.output
            prompt[:old] = self.prompt
            self.free = [s for s in range(old, capacity)][::-1] + self.free
        else:
            self.free = list(range(capacity - 1, -1, -1))
        self.output, self.prompt = output, prompt

    def _fill(self, req: Request, slot: int, device: torch.device) -> None:
        assert self.output is not None and self.prompt is not None
        self.slot_of[req.request_id] = slot
        self.output[slot].zero_()
        self.prompt[slot].zero_()
        # One copy of this sequence's tokens, prompt then output (its output is not empty
        # when it resumes after a preemption or joins penalties late).
        tokens = torch.tensor(req.all_token_ids, dtype=torch.long).to(device)
        num_prompt = req.num_prompt_tokens
        self.prompt[slot].index_fill_(0, tokens[:num_prompt], True)
        if req.num_output_tokens:
            out = tokens[num_prompt:]
            self.output[slot].index_add_(0, out, torch.ones_like(out, dtype=self.output.dtype))
