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

All rows of a step, verified and plain, are decided on the device in one pass and
come to the host in one transfer (``sampler.fetch``).

Requests that speculate: greedy or temperature sampling (top-k, top-p, min-p)
without logprobs, penalties, logit bias, allowed ids or an unmet ``min_tokens``; the
rest decode one token a step, as without speculation. What it is not: scheduling (``scheduler.py``
fits proposals into the token budget and trims them) or HTTP.
"""

from dataclasses import dataclass, field
from typing import Any

import torch

from plimsoll.runtime.engine.outputs import Logprob
from plimsoll.runtime.engine.request import Request, RequestStatus
from plimsoll.runtime.engine.sampler import Sampler, fetch
from plimsoll.runtime.engine.sampling_tensors import RowParams, device_index
from plimsoll.runtime.engine.spec_decode.config import SpeculativeConfig
from plimsoll.runtime.engine.spec_decode.draft_proposer import DraftProposer
from plimsoll.runtime.engine.spec_decode.ngram_proposer import NgramProposer
from plimsoll.runtime.engine.spec_decode.rejection_sampler import rejection_sample

Result = list[tuple[int, dict[int, Logprob] | None]] | Exception


def can_speculate(req: Request) -> bool:
    p = req.params
    return (
        p.logprobs is None
        and not p.has_penalties
        and not p.logit_bias
        and p.allowed_token_ids is None
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
                engine.sampler.randomness,
            )
        self.max_model_len = int(engine.max_model_len)
        self.proposal_probs: dict[str, torch.Tensor] = {}  # request id -> q [n, V] (draft, sampled)
        self.step_stats = SpecDecodeStats()

    # -- after the forward: tokens from logits --------------------------------------------

    def sample(self, reqs: list[Request], logits: torch.Tensor, sampler: Sampler) -> list[Result]:
        """``logits`` holds ``1 + len(req.spec_token_ids)`` rows per request, in order.

        Per request the accepted tokens, or the exception its verification or sampling
        raised (the engine fails that request alone, as without speculation): when the
        batch raises, each request is decided alone.
        """
        spans, row = [], 0
        for req in reqs:
            spans.append((row, 1 + len(req.spec_token_ids)))
            row += spans[-1][1]
        assert row == logits.shape[0], (row, logits.shape)
        self.step_stats = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * self.k)
        try:
            with sampler.randomness.rewind_on_error(reqs):
                return self._decide(reqs, logits, spans, sampler)
        except Exception:
            self.step_stats = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * self.k)
            results: list[Result] = []
            for req, (start, count) in zip(reqs, spans, strict=True):
                try:
                    with sampler.randomness.rewind_on_error([req]):
                        results += self._decide([req], logits[start : start + count], [(0, count)], sampler)
                except Exception as exc:  # this request's fault: the others carry on
                    results.append(exc)
            return results

    def _decide(
        self, reqs: list[Request], logits: torch.Tensor, spans: list[tuple[int, int]], sampler: Sampler
    ) -> list[Result]:
        """Plain rows through the sampler, proposals through the rejection sampler; one transfer."""
        device = logits.device
        plain = [i for i, r in enumerate(reqs) if not r.spec_token_ids]
        spec = [i for i, r in enumerate(reqs) if r.spec_token_ids]
        parts: list[torch.Tensor] = []
        plain_samples = None
        if plain:
            rows = device_index([spans[i][0] for i in plain], device)
            plain_samples = sampler.sample_device([reqs[i] for i in plain], logits[rows])
            parts += plain_samples.parts()
        if spec:
            parts += self._verify([reqs[i] for i in spec], logits, [spans[i] for i in spec], sampler)
        values = fetch(parts)
        results: list[Result] = [[] for _ in reqs]
        at = 0
        if plain_samples is not None:
            size = plain_samples.size()
            for i, sample in zip(plain, plain_samples.results(values[:size], sampler.decode), strict=True):
                results[i] = [sample]
            at = size
        accepted, next_tokens = values[at : at + len(spec)], values[at + len(spec) :]
        stats = self.step_stats
        for j, i in enumerate(spec):
            proposals = reqs[i].spec_token_ids
            count = int(accepted[j])
            results[i] = [(t, None) for t in [*proposals[:count], int(next_tokens[j])]]
            stats.num_drafts += 1
            stats.num_draft_tokens += len(proposals)
            stats.num_accepted_tokens += count
            for pos in range(count):
                stats.num_accepted_tokens_per_pos[pos] += 1
            self.proposal_probs.pop(reqs[i].request_id, None)
        return results

    def _verify(
        self, reqs: list[Request], logits: torch.Tensor, spans: list[tuple[int, int]], sampler: Sampler
    ) -> list[torch.Tensor]:
        """The target's verdict on every proposing request, on the device: ``[num_accepted, next_token]``."""
        device = logits.device
        vocab = logits.shape[1]
        k_max = max(len(r.spec_token_ids) for r in reqs)
        # [R, K + 1] rows of ``logits``; a shorter request repeats its last row as padding.
        index = device_index(
            [start + min(j, count - 1) for start, count in spans for j in range(k_max + 1)], device
        )
        rows = logits[index]  # [R * (K + 1), V]
        params = RowParams.build([r for r in reqs for _ in range(k_max + 1)], device, vocab)
        target = params.probs(rows).view(len(reqs), k_max + 1, vocab)
        argmax = rows.argmax(dim=-1).view(len(reqs), k_max + 1)
        padded = [[*r.spec_token_ids, *[0] * (k_max - len(r.spec_token_ids))] for r in reqs]
        proposals = torch.tensor(padded, dtype=torch.long).to(device)  # [R, K]
        num_proposals = device_index([len(r.spec_token_ids) for r in reqs], device)
        greedy = torch.tensor([r.params.is_greedy for r in reqs]).to(device)
        draft = None
        if self.draft is not None:  # proposals drawn from the draft's distribution (greedy rows: unused)
            draft = torch.zeros(len(reqs), k_max, vocab, dtype=target.dtype, device=device)
            for j, req in enumerate(reqs):
                q = self.proposal_probs.get(req.request_id)
                if q is not None:
                    draft[j, : q.shape[0]] = q
        # A seeded row draws one number per proposal and one for its own token.
        uniforms = sampler.randomness.ragged(
            reqs, [len(r.spec_token_ids) + 1 for r in reqs], k_max + 1, device
        )
        num_accepted, next_token = rejection_sample(
            target, argmax, proposals, num_proposals, draft, uniforms, greedy
        )
        return [num_accepted, next_token]

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
