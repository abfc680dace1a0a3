"""The batch's sampling parameters as tensors on the logits' device, and the draws made from them.

What it is: ``RowParams`` packs temperature, top-k, top-p and min-p of every logits row
into one ``[N, 4]`` tensor (one copy to the device) and turns a batch of logits into the
probabilities each row samples from (``probs``); ``sample_from`` draws one token per
row from those probabilities by inverting their cumulative sum at a uniform number,
with no host round trip; ``Randomness`` hands out those uniform numbers: a seeded
sequence draws from its own ``torch.Generator`` on the device, so it samples the same
tokens whatever the batch around it, and every other row draws from one generator the
engine seeds once. Shared by the sampler, the draft proposer and the rejection sampler.
What it is not: the logits edits (penalties, biases, bans: ``sampler.py``) or any
decision about which rows sample.
"""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from plimsoll.runtime.engine.request import Request, position_seed

SEED_STRIDE = 1_000_003  # sibling i of an n > 1 request draws from seed + i * SEED_STRIDE


def device_index(rows: Sequence[int], device: torch.device) -> torch.Tensor:
    """A host list of row numbers as an index tensor on ``device`` (one copy)."""
    return torch.tensor(list(rows), dtype=torch.long).to(device)


@dataclass
class RowParams:
    """``table`` is ``[N, 4]`` float32 on the device: temperature (1 for greedy rows, which
    never divide by it), top_k (0 = off), top_p (2 = off: a cumulative mass never reaches it),
    min_p (0 = off). The flags, known on the host, skip the stages no row uses."""

    table: torch.Tensor
    kmax: int  # the largest top_k in use; 0 when no row uses top-k
    use_top_p: bool
    use_min_p: bool
    top_p_within_k: bool = False  # every top-p row also has a top-k: sort kmax values, not V
    all_top_k: bool = False  # every row has a top-k

    @classmethod
    def build(cls, reqs: Sequence[Request], device: torch.device, vocab_size: int) -> "RowParams":
        rows, kmax, use_top_p, use_min_p, within, every_k = [], 0, False, False, True, True
        for req in reqs:
            p = req.params
            k = p.top_k if 0 < p.top_k < vocab_size else 0
            kmax = max(kmax, k)
            use_top_p |= p.top_p < 1.0
            use_min_p |= p.min_p > 0.0
            within &= p.top_p >= 1.0 or k > 0
            every_k &= k > 0
            rows.append(
                (1.0 if p.is_greedy else p.temperature, float(k), p.top_p if p.top_p < 1.0 else 2.0, p.min_p)
            )
        table = torch.tensor(rows, dtype=torch.float32).to(device).view(-1, 4)
        return cls(table, kmax, use_top_p, use_min_p, within and kmax > 0, every_k and kmax > 0)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` ``[N, V]`` (not modified) → the normalised probabilities each row samples from:
        divided by its temperature, then top-k, top-p and min-p, in that order (as vLLM)."""
        x = logits / self.table[:, 0:1]
        if self.kmax or self.use_top_p:
            x = self._top_k_top_p(x)
        probs = torch.softmax(x, dim=-1)
        if self.use_min_p:
            # Renormalising after top-k/top-p scales every probability alike: p < min_p * max is the same test.
            keep = probs >= self.table[:, 3:4] * probs.amax(dim=-1, keepdim=True)
            probs = probs * keep
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs

    def _top_k_top_p(self, x: torch.Tensor) -> torch.Tensor:
        k = self.table[:, 1:2].long()  # [N, 1]
        if self.use_top_p and self.top_p_within_k:
            # The nucleus lies inside the top k: sort those kmax values (a topk), not the vocabulary.
            # (A value tied with the k-th beyond position kmax is dropped; the full sort keeps it.)
            values, order = torch.topk(x, self.kmax, dim=-1)  # [N, kmax], descending
            kth = values.gather(1, k.clamp(min=1) - 1).masked_fill(k <= 0, float("-inf"))
            values = values.masked_fill(values < kth, float("-inf"))
            probs = torch.softmax(values, dim=-1)
            drop = ((torch.cumsum(probs, dim=-1) - probs) >= self.table[:, 2:3]) | torch.isneginf(values)
            kept = torch.full_like(x, float("-inf")).scatter_(
                1, order, values.masked_fill(drop, float("-inf"))
            )
            return kept if self.all_top_k else torch.where(k > 0, kept, x)  # rows without top-k keep all
        if self.use_top_p:
            sorted_x, order = torch.sort(x, dim=-1, descending=True)
            if self.kmax:
                kth = sorted_x.gather(1, k.clamp(min=1) - 1).masked_fill(k <= 0, float("-inf"))
                # Ties with the k-th value stay, as in a per-row topk threshold.
                sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
            probs = torch.softmax(sorted_x, dim=-1)
            # Drop a token once the mass before it already reaches top_p; the top token always stays.
            drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= self.table[:, 2:3]
            drop_sorted |= torch.isneginf(sorted_x)  # below the k-th value (rows with top-p off too)
            drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
            return x.masked_fill(drop, float("-inf"))
        top = torch.topk(x, self.kmax, dim=-1).values  # [N, kmax], descending
        kth = top.gather(1, k.clamp(min=1, max=self.kmax) - 1).masked_fill(k <= 0, float("-inf"))
        return x.masked_fill(x < kth, float("-inf"))


def sample_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` ``[N, V]`` (non-negative, any scale) at ``uniforms`` ``[N]``
    in ``[0, 1)``: the first token whose cumulative mass exceeds ``u × total`` (inverse CDF).
    A token of probability 0 is never returned; every id is in ``[0, V)``, whatever the input."""
    cdf = torch.cumsum(probs, dim=-1)  # [N, V]
    total = cdf[:, -1:].contiguous()
    picked = torch.searchsorted(cdf, uniforms[:, None].to(cdf.dtype) * total, right=True)
    # Rounding can put u × total on the total itself: take the last token that has mass.
    last = torch.searchsorted(cdf, total, right=False)
    return torch.minimum(picked, last).clamp_(max=probs.shape[-1] - 1).squeeze(1)


class Randomness:
    """Uniform numbers per row, on the logits' device. A seeded sequence draws from its own
    generator (``req.generator``, made on first use on that device from its seed), so its
    numbers depend on its seed and on how many it drew before, never on its batch-mates;
    the others share one generator (seeded with the engine's seed), or the device's
    default generator when ``seed`` is None."""

    def __init__(self, seed: int | None) -> None:
        self.seed = seed
        self.shared: dict[torch.device, torch.Generator] = {}

    def uniforms(self, reqs: Sequence[Request], count: int, device: torch.device) -> torch.Tensor:
        """``[len(reqs), count]`` uniform numbers in ``[0, 1)``."""
        u = torch.rand(len(reqs), count, device=device, generator=self._shared(device))
        seeded = [(i, self._own(r, device)) for i, r in enumerate(reqs) if r.params.seed is not None]
        if seeded:
            own = torch.stack([torch.rand(count, device=device, generator=g) for _, g in seeded])
            u[device_index([i for i, _ in seeded], device)] = own
        return u

    def ragged(
        self, reqs: Sequence[Request], counts: Sequence[int], width: int, device: torch.device
    ) -> torch.Tensor:
        """``[len(reqs), width]`` uniform numbers of which row ``i`` reads ``counts[i]``: columns
        ``0 .. counts[i] - 2`` and the last column. A seeded row draws exactly ``counts[i]`` numbers
        from its generator, so what it draws next does not depend on its batch-mates' widths."""
        u = torch.rand(len(reqs), width, device=device, generator=self._shared(device))
        seeded = [
            (i, c, self._own(r, device))
            for i, (r, c) in enumerate(zip(reqs, counts, strict=True))
            if r.params.seed is not None
        ]
        if seeded:
            own = torch.cat([torch.rand(c, device=device, generator=g) for _, c, g in seeded])
            where = [(i, j) for i, c, _ in seeded for j in [*range(c - 1), width - 1]]
            at = torch.tensor(where, dtype=torch.long).to(device)
            u[at[:, 0], at[:, 1]] = own
        return u

    @contextmanager
    def rewind_on_error(self, reqs: Sequence[Request]) -> Iterator[None]:
        """Put the seeded sequences' generators back where they were if the block raises, so a
        batch that fails and is then sampled row by row (``sample_each``) draws the same numbers."""
        saved = [
            (r, r.generator.get_state() if r.generator is not None else None, r.generator_position)
            for r in reqs
            if r.params.seed is not None
        ]
        try:
            yield
        except BaseException:
            for req, state, position in saved:
                if state is None or req.generator is None:
                    req.generator, req.generator_position = None, -1
                else:
                    req.generator.set_state(state)
                    req.generator_position = position
            raise

    def _shared(self, device: torch.device) -> torch.Generator | None:
        if self.seed is None:
            return None
        if device not in self.shared:
            self.shared[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self.shared[device]

    @staticmethod
    def _own(req: Request, device: torch.device) -> torch.Generator:
        """The sequence's generator, seeded when its output position moves: what a seeded
        sequence draws depends only on (seed, sibling index, position), so a sequence continued
        on another replica (``Continuation``) draws exactly what it would have drawn
        uninterrupted. Draws at one position (a draft's proposals, then their verification)
        continue one stream: reseeding for each would correlate them."""
        gen: torch.Generator | None = req.generator
        position = req.num_output_tokens
        if gen is None or gen.device != device:
            gen = torch.Generator(device=device)
            req.generator, req.generator_position = gen, -1
        if req.generator_position != position:
            assert req.params.seed is not None
            gen.manual_seed(position_seed(req.params.seed, req.index, position))
            req.generator_position = position
        return gen
