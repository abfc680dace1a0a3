"""Proposals from a smaller draft model that shares the target's tokenizer.

What it is: a second ``ModelRunner`` with its own paged KV cache (as many tokens
as the target's, at the draft's bytes per token) and a per-sequence shadow
(tokens, computed count, blocks). Each step it catches every proposing sequence up
on the tokens the target accepted since last time (one ragged forward, which
also yields the first proposal), then runs k - 1 one-token forwards. Proposals
are the draft's argmax for greedy requests, else draws from its distribution
under the request's temperature/top-k/top-p/min-p, kept on the device as ``q`` for
the rejection sampler; each forward's proposals for the whole batch come to the
host in one transfer (the next forward's inputs are built there). Draft KV is trusted only up to the target's accepted tokens:
the positions written from proposals are recomputed next time, so rejected
proposals never leak into later steps.

What it is not: verification, or a scheduler: the draft cache has its own free
list, and a sequence it cannot fit simply gets no proposal this step.
"""

from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from plimsoll.runtime.engine.model_runner import ModelRunner, kv_bytes_per_token
from plimsoll.runtime.engine.request import Request
from plimsoll.runtime.engine.sampler import fetch
from plimsoll.runtime.engine.sampling_tensors import Randomness, RowParams, device_index, sample_from
from plimsoll.runtime.engine.scheduler import SchedulerOutput
from plimsoll.runtime.models.loader import load_model


@dataclass(eq=False)
class DraftSeq:
    """What ``ModelRunner.prepare`` reads of a sequence, for the draft's own cache."""

    request_id: str
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)  # always empty: drafts never speculate

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class DraftProposer:
    def __init__(
        self,
        model: str,
        num_speculative_tokens: int,
        target_hf_config: object,
        num_target_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        attention_backend: str,
        randomness: Randomness,
    ) -> None:
        loaded = load_model(model, dtype, device)
        target_vocab = int(target_hf_config.vocab_size)  # type: ignore[attr-defined]
        if int(loaded.hf_config.vocab_size) != target_vocab:
            raise ValueError(
                f"the draft model {model!r} has a vocabulary of {loaded.hf_config.vocab_size} tokens and the "
                f"target {target_vocab}; a draft model must share the target's tokenizer"
            )
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.bytes_per_token = kv_bytes_per_token(loaded.hf_config, dtype)
        self.runner = ModelRunner(
            loaded.model, num_target_blocks, block_size, dtype, device, attention_backend
        )
        self.free_blocks = list(range(num_target_blocks - 1, -1, -1))
        self.seqs: dict[str, DraftSeq] = {}
        self.randomness = randomness  # the sampler's: a seeded request draws from its own generator

    def resize(self, num_blocks: int) -> None:
        """A new, empty draft cache of ``num_blocks`` blocks (when the target's cache is resized at start)."""
        self.runner.allocate_kv_cache(num_blocks)
        self.free_blocks = list(range(num_blocks - 1, -1, -1))
        self.seqs.clear()

    def release_except(self, alive: Collection[str]) -> None:
        """Free the shadows of sequences no longer running (finished, aborted, preempted)."""
        for rid in [r for r in self.seqs if r not in alive]:
            self.free_blocks.extend(self.seqs.pop(rid).block_ids)

    def _fit(self, seq: DraftSeq, num_tokens: int) -> bool:
        need = -(-num_tokens // self.block_size) - len(seq.block_ids)
        if need > len(self.free_blocks):
            return False
        for _ in range(need):
            seq.block_ids.append(self.free_blocks.pop())
        return True

    def _pick(
        self, reqs: list[Request], logits: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """The batch's proposals on the device (``[A]``) and, per sampled row, the ``q`` it drew from."""
        token_ids = logits.argmax(dim=-1)
        sampled = [i for i, r in enumerate(reqs) if not r.params.is_greedy]
        qs: list[torch.Tensor | None] = [None] * len(reqs)
        if sampled:
            index = device_index(sampled, logits.device)
            rows = [reqs[i] for i in sampled]
            probs = RowParams.build(rows, logits.device, logits.shape[1]).probs(logits[index])
            drawn = sample_from(probs, self.randomness.uniforms(rows, 1, logits.device)[:, 0])
            token_ids = token_ids.index_copy(0, index, drawn)
            for j, i in enumerate(sampled):
                qs[i] = probs[j]
        return token_ids, qs

    @torch.inference_mode()
    def propose(self, reqs: list[Request], limits: list[int]) -> list[tuple[list[int], torch.Tensor | None]]:
        """Per request, up to ``limits[i]`` proposals and (sampled requests) their ``q`` ``[n, V]``."""
        results: list[tuple[list[int], list[torch.Tensor]]] = [([], []) for _ in reqs]
        active: list[tuple[int, DraftSeq]] = []
        for i, (req, limit) in enumerate(zip(reqs, limits, strict=True)):
            seq = self.seqs.setdefault(req.request_id, DraftSeq(req.request_id))
            known = seq.num_computed_tokens  # every computed position holds an accepted token
            del seq.all_token_ids[known:]
            seq.all_token_ids.extend(req.all_token_ids[known:])
            if limit > 0 and self._fit(seq, req.num_tokens + limit):
                active.append((i, seq))
        num_real = {id(seq): seq.num_tokens for _, seq in active}
        while active:
            scheduled = []
            for _, seq in active:
                num_new = seq.num_tokens - seq.num_computed_tokens
                seq.num_computed_tokens = seq.num_tokens  # booked, as the scheduler does
                scheduled.append((seq, num_new))
            # A DraftSeq has the fields the runner reads of a Request (ids, computed tokens, blocks).
            _, logits = self.runner.execute(SchedulerOutput(scheduled=scheduled))  # type: ignore[arg-type]
            token_ids, qs = self._pick([reqs[i] for i, _ in active], logits)
            tokens = [int(t) for t in fetch([token_ids])]
            still = []
            for row, (i, seq) in enumerate(active):
                token, probs = tokens[row], qs[row]
                results[i][0].append(token)
                if probs is not None:
                    results[i][1].append(probs)
                seq.all_token_ids.append(token)
                if len(results[i][0]) < limits[i]:
                    still.append((i, seq))
                else:  # trust nothing past the target's tokens: proposals may be rejected
                    seq.num_computed_tokens = num_real[id(seq)]
                    del seq.all_token_ids[num_real[id(seq)] :]
            active = still
        return [(tokens, torch.stack(qs) if qs else None) for tokens, qs in results]
