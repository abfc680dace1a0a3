"""The per-row sampler: the test oracle for ``sampler.py``; the engine never runs it.

What it is: the sampling rules written one row at a time in plain torch — allowed ids,
logit bias, the ``min_tokens`` ban, penalties, then greedy or temperature with top-k,
top-p and min-p, and logprobs from the raw distribution — as the obvious reading of
vLLM's semantics. ``reference_probs`` gives the exact distribution a sampled row draws
from (what the chi-square tests compare the batched sampler's draws against);
``ReferenceSampler`` draws from it with ``torch.multinomial`` and one CPU generator per
sequence, reading each token back to the host (the per-row loop the batched sampler
replaces, with its one batched argmax for plain greedy rows; ``benchmarks/sampler_throughput.py`` times the two side by side);
``chi_square_p`` scores observed token counts against such a distribution.
What it is not: fast, or used when serving.
"""

import torch

from plimsoll.runtime.engine.outputs import Logprob
from plimsoll.runtime.engine.request import Request
from plimsoll.runtime.engine.sampler import Sample, banned_ids, is_plain_greedy
from plimsoll.runtime.engine.sampling_tensors import SEED_STRIDE


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of observed ``counts`` against ``probs``: the p-value (cells with p == 0
    must be empty; an emitted token of probability 0 is an error, not a low p-value)."""
    n = float(counts.sum())
    support = probs > 0
    if int(counts[~support].sum()) != 0:
        raise AssertionError(
            f"tokens of probability 0 were emitted: {torch.nonzero(counts * ~support).flatten().tolist()}"
        )
    expected = probs[support].double() * n / float(probs[support].double().sum())
    stat = float(((counts[support].double() - expected) ** 2 / expected).sum())
    dof = int(support.sum()) - 1
    if dof == 0:
        return 1.0
    return float(
        torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), torch.tensor(stat / 2.0))
    )


def apply_penalties(logits: torch.Tensor, req: Request) -> torch.Tensor:  # logits [V], modified in place
    p = req.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.all_token_ids)), dtype=torch.long, device=logits.device)
        x = logits[seen]
        logits[seen] = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and req.output_token_ids:
        out = torch.tensor(req.output_token_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(out, minlength=logits.shape[0]).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:  # [V]
    if top_k > 0 and top_k < logits.shape[0]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token once the mass before it already reaches top_p; the top token always stays.
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    if min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    return logits


def edited_logits(req: Request, raw: torch.Tensor) -> torch.Tensor:
    """One row's logits after allowed ids, logit bias, the min_tokens ban and penalties."""
    p = req.params
    x = raw.clone()
    if p.allowed_token_ids:
        keep = torch.zeros_like(x, dtype=torch.bool)
        keep[torch.tensor(p.allowed_token_ids, dtype=torch.long)] = True
        x = x.masked_fill(~keep, float("-inf"))
    for token, bias in (p.logit_bias or {}).items():
        x[token] += bias
    banned = banned_ids(req)
    if banned:
        x[torch.tensor(banned, dtype=torch.long)] = float("-inf")
    return apply_penalties(x, req)


def reference_probs(req: Request, raw: torch.Tensor) -> torch.Tensor:
    """The distribution a sampled row draws its next token from (``[V]``)."""
    p = req.params
    x = edited_logits(req, raw)
    return torch.softmax(filter_logits(x / p.temperature, p.top_k, p.top_p, p.min_p), dim=-1)


class ReferenceSampler:
    def __init__(self, tokenizer: object | None = None, seed: int = 0) -> None:
        self.tokenizer = tokenizer
        self.shared = torch.Generator().manual_seed(seed)
        self.generators: dict[str, torch.Generator] = {}

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def _generator(self, req: Request) -> torch.Generator:
        """A seeded sequence's own generator; the others share one."""
        if req.params.seed is None:
            return self.shared
        if req.request_id not in self.generators:
            seed = (req.params.seed + req.index * SEED_STRIDE) % 2**64
            self.generators[req.request_id] = torch.Generator().manual_seed(seed)
        return self.generators[req.request_id]

    def _decode(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return str(self.tokenizer.decode([token_id]))  # type: ignore[attr-defined]

    def __call__(self, reqs: list[Request], logits: torch.Tensor) -> list[Sample]:
        """``logits`` is fp32 ``[len(reqs), V]``; returns ``(token_id, logprobs or None)`` per request."""
        results: list[Sample] = []
        plain = [is_plain_greedy(r) for r in reqs]
        # As the engine's sampler did before it was batched: one argmax for the plain greedy rows.
        greedy = logits.argmax(dim=-1).tolist() if any(plain) else []
        for i, req in enumerate(reqs):
            p = req.params
            raw = logits[i]
            if plain[i]:
                token = int(greedy[i])
            elif p.is_greedy:
                token = int(torch.argmax(edited_logits(req, raw)))
            else:
                probs = reference_probs(req, raw)
                token = int(torch.multinomial(probs, 1, generator=self._generator(req)))
            results.append((token, self._logprobs(raw, token, p.logprobs)))
        return results

    def _logprobs(self, raw: torch.Tensor, token: int, num_top: int | None) -> dict[int, Logprob] | None:
        if num_top is None:
            return None
        lp = torch.log_softmax(raw, dim=-1)
        out = {token: Logprob(token, float(lp[token]), self._decode(token))}
        if num_top > 0:
            values, ids = torch.topk(lp, num_top)
            for v, t in zip(values.tolist(), ids.tolist(), strict=True):
                out.setdefault(t, Logprob(t, v, self._decode(t)))
        return out
