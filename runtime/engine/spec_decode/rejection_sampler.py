"""Verification of proposed tokens against the target model's distribution (Leviathan et al., 2023),
for a batch of sequences at once, on the logits' device.

What it is: given, per sequence, the target's probabilities at the k+1 positions a step
scored (each proposed token's and the one after the last), keep the longest prefix of
proposals the target accepts and add one token of its own. Greedy rows: a proposal is
accepted when it is the target's argmax, so the output is the one greedy decoding gives.
Sampled rows: proposal ``d`` drawn from ``q`` is accepted with probability
``min(1, p(d) / q(d))``; on rejection the token is drawn from ``max(p - q, 0)``
renormalised; after k acceptances a bonus token is drawn from ``p``. Every emitted token
is then distributed exactly as ``p``. An n-gram proposal is a point mass (``q(d) = 1``):
accepted with probability ``p(d)``, residual ``p`` without ``d``. All rows are decided
together with tensor operations; nothing is read back here.

What it is not: where ``p`` comes from (the speculator applies the request's
temperature, top-k, top-p and min-p) or the uniform numbers (``Randomness``).
"""

import torch

from plimsoll.runtime.engine.sampling_tensors import sample_from


def rejection_sample(
    target_probs: torch.Tensor,  # [R, K + 1, V]; rows past a sequence's k + 1 are padding
    target_argmax: torch.Tensor,  # [R, K + 1] the target's greedy tokens
    proposals: torch.Tensor,  # [R, K] int64, padded with any id
    num_proposals: torch.Tensor,  # [R] k of each sequence, 1..K
    draft_probs: torch.Tensor | None,  # [R, K, V] the proposals were drawn from; None = point masses
    uniforms: torch.Tensor,  # [R, K + 1]: K acceptance tests, then one draw
    greedy: torch.Tensor,  # [R] bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(num_accepted [R], next_token [R])``: each sequence emits its first ``num_accepted``
    proposals and then ``next_token``."""
    num_rows, k_max = proposals.shape
    rows = torch.arange(num_rows, device=proposals.device)
    valid = torch.arange(k_max, device=proposals.device)[None, :] < num_proposals[:, None]  # [R, K]
    p_d = target_probs[:, :k_max].gather(2, proposals[..., None])[..., 0]  # [R, K]
    q_d = (
        draft_probs.gather(2, proposals[..., None])[..., 0]
        if draft_probs is not None
        else torch.ones_like(p_d)
    )
    # u < p / q without dividing by a tiny q.
    sampled_accept = (q_d > 0) & (uniforms[:, :k_max] * q_d < p_d)
    accept = torch.where(greedy[:, None], target_argmax[:, :k_max] == proposals, sampled_accept) & valid
    num_accepted = torch.cumprod(accept.to(torch.int64), dim=1).sum(dim=1)  # leading acceptances
    at = num_accepted  # the position whose distribution gives the next token
    p_at = target_probs[rows, at]  # [R, V]
    rejected = at < num_proposals
    if draft_probs is not None:
        q_at = draft_probs[rows, at.clamp(max=k_max - 1)]
        residual = (p_at - q_at).clamp_(min=0.0)
    else:
        residual = p_at.clone()
        residual[rows, proposals[rows, at.clamp(max=k_max - 1)]] = 0.0
    # p == q up to rounding leaves no residual: rejection had probability ~0, draw from p.
    residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p_at)
    dist = torch.where(rejected[:, None], residual, p_at)  # after k acceptances: the bonus token from p
    drawn = sample_from(dist, uniforms[:, k_max])
    next_token = torch.where(greedy, target_argmax[rows, at], drawn)
    return num_accepted, next_token
