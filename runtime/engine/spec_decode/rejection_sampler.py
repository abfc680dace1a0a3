"""Verification of proposed tokens against the target model's distribution (Leviathan et al., 2023).

What it is: given the target's probabilities at the k+1 positions a step scored
(each proposed token's and the one after the last), keep the longest prefix of
proposals the target accepts and add one token of its own. Greedy: a proposal is
accepted when it is the target's argmax, so the output is the one greedy decoding
gives. Sampled: proposal ``d`` drawn from ``q`` is accepted with probability
``min(1, p(d) / q(d))``; on rejection the token is drawn from ``max(p - q, 0)``
renormalised; after k acceptances a bonus token is drawn from ``p``. Every emitted
token is then distributed exactly as ``p``. An n-gram proposal is a point mass
(``q(d) = 1``): accepted with probability ``p(d)``, residual ``p`` without ``d``.

What it is not: where ``p`` comes from (the speculator applies the request's
temperature, top-k, top-p and min-p) or any batching.
"""

import torch


def verify_greedy(target_argmax: list[int], proposals: list[int]) -> list[int]:
    """``target_argmax`` has ``len(proposals) + 1`` entries; returns 1..k+1 tokens."""
    out: list[int] = []
    for j, token in enumerate(proposals):
        if token != target_argmax[j]:
            break
        out.append(token)
    out.append(target_argmax[len(out)])
    return out


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def verify_sampled(
    target_probs: torch.Tensor,  # [k + 1, V], rows sum to 1
    proposals: list[int],
    draft_probs: torch.Tensor | None,  # [k, V] the proposals were drawn from; None = point masses
    generator: torch.Generator | None,
) -> list[int]:
    """Returns 1..k+1 tokens whose joint distribution is the target's."""
    out: list[int] = []
    for j, token in enumerate(proposals):
        p_row = target_probs[j]
        p = float(p_row[token])
        q = float(draft_probs[j, token]) if draft_probs is not None else 1.0
        u = float(torch.rand((), generator=generator))
        if q > 0.0 and u * q < p:  # u < p / q without dividing by a tiny q
            out.append(token)
            continue
        if draft_probs is not None:
            residual = (p_row - draft_probs[j]).clamp_(min=0.0)
        else:
            residual = p_row.clone()
            residual[token] = 0.0
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: rejection had probability ~0
            residual = p_row
        out.append(_draw(residual, generator))
        return out
    out.append(_draw(target_probs[len(proposals)], generator))
    return out
