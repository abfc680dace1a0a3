"""Speculative decoding inside the engine step: propose before, verify after the target forward.

What it is: ``Speculator`` owns a proposer (n-gram or draft model), the
acceptance statistics, and the two hooks the engine calls. ``sample`` turns a
step's logits into tokens: a sequence that carried k proposals has k + 1 logits
rows (the scheduler gave it a decode row of k + 1 query tokens) and gets 1..k+1
tokens from the rejection sampler; every other sequence goes through the plain
``Sampler``. ``after_step`` rolls ``num_computed_tokens`` back over rejected
proposals (their KV slots are simply overwritten by the next step, and no
prefix-cache hash ever covers them: hashes are built from accepted tokens only)
and proposes for the next step.

Requests that speculate: greedy or temperature sampling (top-k, top-p, min-p)
without logprobs, penalties or an unmet ``min_tokens``; the rest decode one token
a step, as without speculation. What it is not: scheduling (``scheduler.py``
fits proposals into the token budget and trims them) or HTTP.
"""

from dataclasses import dataclass, field
from typing import Any

import torch

from plimsoll.runtime.engine.outputs import Logprob
from plimsoll.runtime.engine.request import Request, RequestStatus
from plimsoll.runtime.engine.sampler import Sampler, draw_generator, filter_logits, sample_each
from plimsoll.runtime.engine.spec_decode.config import SpeculativeConfig
from plimsoll.runtime.engine.spec_decode.draft_proposer import DraftProposer
from plimsoll.runtime.engine.spec_decode.ngram_proposer import NgramProposer
from plimsoll.runtime.engine.spec_decode.rejection_sampler import verify_greedy, verify_sampled


def target_probs(req: Request, logits: torch.Tensor) -> torch.Tensor:  # [..., V] -> [..., V]
    p = req.params
    if logits.dim() == 1:
        return torch.softmax(filter_logits(logits / p.temperature, p.top_k, p.top_p, p.min_p), dim=-1)
    return torch.stack([target_probs(req, row) for row in logits])


def can_speculate(req: Request) -> bool:
    p = req.params
    return (
        p.logprobs is None
        and p.repetition_penalty == 1.0
        and not p.presence_penalty
        and not p.frequency_penalty
        and req.num_output_tokens >= p.min_tokens
    )


@dataclass
class SpecDecodeStats:
    """One step's counts, named after vLLM's ``spec_decode_*`` counters."""

    num_drafts: int = 0  # sequences that carried at least one proposal
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)


class Speculator:
    def __init__(self, config: SpeculativeConfig, engine: Any) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.ngram: NgramProposer | None = None
        self.draft: DraftProposer | None = None
        if config.method == "ngram":
            assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
            self.ngram = NgramProposer(self.k, config.prompt_lookup_min, config.prompt_lookup_max)
        else:
            assert config.model is not None
            ec = engine.config
            self.draft = DraftProposer(
                config.model,
                self.k,
                engine.hf_config,
                engine.num_blocks,
                ec.block_size,
                ec.torch_dtype,
                engine.device,
                ec.attention_backend,
                target_probs,
            )
        self.max_model_len = int(engine.max_model_len)
        self.proposal_probs: dict[str, torch.Tensor] = {}  # request id -> q [n, V] (draft, sampled)
        self.step_stats = SpecDecodeStats()

    # -- after the forward: tokens from logits --------------------------------------------

    def sample(
        self, reqs: list[Request], logits: torch.Tensor, sampler: Sampler
    ) -> list[list[tuple[int, dict[int, Logprob] | None]] | Exception]:
        """``logits`` holds ``1 + len(req.spec_token_ids)`` rows per request, in order.

        Per request the accepted tokens, or the exception its verification or sampling
        raised (the engine fails that request alone, as without speculation).
        """
        stats = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * self.k)
        results: list[list[tuple[int, dict[int, Logprob] | None]] | Exception] = [[] for _ in reqs]
        plain_idx, plain_rows = [], []
        row = 0
        for i, req in enumerate(reqs):
            proposals = req.spec_token_ids
            rows = logits[row : row + 1 + len(proposals)]
            row += 1 + len(proposals)
            if not proposals:
                plain_idx.append(i)
                plain_rows.append(rows[0])
                continue
            try:
                tokens = self._verify(req, rows, proposals)
            except Exception as exc:  # this request's fault: the others in the batch carry on
                results[i] = exc
                continue
            accepted = len(tokens) - 1
            stats.num_drafts += 1
            stats.num_draft_tokens += len(proposals)
            stats.num_accepted_tokens += accepted
            for pos in range(accepted):
                stats.num_accepted_tokens_per_pos[pos] += 1
            results[i] = [(t, None) for t in tokens]
        assert row == logits.shape[0], (row, logits.shape)
        if plain_idx:
            plain = sample_each(sampler, [reqs[i] for i in plain_idx], torch.stack(plain_rows))
            for i, out in zip(plain_idx, plain, strict=True):
                results[i] = out if isinstance(out, Exception) else [out]
        self.step_stats = stats
        return results

    def _verify(self, req: Request, rows: torch.Tensor, proposals: list[int]) -> list[int]:
        """The target's verdict on ``proposals``: 1..k+1 tokens (``rows`` is ``[k + 1, V]``)."""
        if req.params.is_greedy:
            return verify_greedy(rows.argmax(dim=-1).tolist(), proposals)
        q = self.proposal_probs.pop(req.request_id, None)
        return verify_sampled(target_probs(req, rows), proposals, q, draw_generator(req))

    # -- after the tokens are appended: roll back, then propose ----------------------------

    def after_step(self, reqs: list[Request], running: list[Request]) -> None:
        for req in reqs:
            if req.spec_token_ids:
                req.spec_token_ids = []
                if req.status is RequestStatus.RUNNING:
                    # KV is valid up to the last accepted token; the newest token is computed next step.
                    req.num_computed_tokens = req.num_tokens - 1
        alive = {r.request_id for r in running}
        for rid in [r for r in self.proposal_probs if r not in alive]:
            del self.proposal_probs[rid]
        self.propose(running)

    def propose(self, running: list[Request]) -> None:
        ready, limits = [], []
        for req in running:
            if req.spec_token_ids or req.num_computed_tokens != req.num_tokens - 1 or not can_speculate(req):
                continue
            p = req.params
            left = (p.max_tokens - req.num_output_tokens) if p.max_tokens is not None else self.k + 1
            # Room for the proposals plus the target's own token, within max_tokens and max_model_len.
            limit = min(self.k, left - 1, self.max_model_len - 1 - req.num_tokens)
            if limit > 0:
                ready.append(req)
                limits.append(limit)
        if self.ngram is not None:
            for req, limit in zip(ready, limits, strict=True):
                req.spec_token_ids = self.ngram.propose(req.all_token_ids, limit)
            return
        assert self.draft is not None
        self.draft.release_except({r.request_id for r in running})
        for req, (tokens, q) in zip(ready, self.draft.propose(ready, limits), strict=True):
            req.spec_token_ids = tokens
            if q is not None:
                self.proposal_probs[req.request_id] = q
            else:
                self.proposal_probs.pop(req.request_id, None)
