"""Picks the next token of every sequence that samples this step.

What it is: penalties (repetition over prompt and output, presence and frequency
over output), ``min_tokens`` masking of stop tokens, greedy or temperature
sampling with top-k, top-p and min-p, and logprobs of the chosen and top tokens
(from the raw model distribution, like vLLM's default). Every sequence draws from
its own ``torch.Generator``, so a seeded request samples the same tokens whatever
else is in the batch; a seeded one is reseeded each step from its seed and output
position (``draw_generator``), so a sequence continued on another replica draws what
it would have drawn uninterrupted. ``sample_each`` keeps one bad row from failing the batch.
What it is not: stop-string or length handling.
"""

from collections.abc import Callable

import torch

from plimsoll.runtime.engine.outputs import Logprob
from plimsoll.runtime.engine.request import Request, position_seed


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


def draw_generator(req: Request) -> torch.Generator | None:
    """The generator of this step's draws; a seeded sequence's restarts at its output position."""
    if req.params.seed is not None and req.generator is not None:
        req.generator.manual_seed(position_seed(req.params.seed, req.index, req.num_output_tokens))
    return req.generator


def is_plain_greedy(req: Request) -> bool:
    """Greedy with nothing that edits the logits or reads them beyond the argmax."""
    p = req.params
    return (
        p.is_greedy
        and p.logprobs is None
        and p.repetition_penalty == 1.0
        and not p.presence_penalty
        and not p.frequency_penalty
        and (
            req.num_output_tokens >= p.min_tokens
            or (not p.stop_token_ids and (p.ignore_eos or not req.eos_token_ids))
        )
    )


Sample = tuple[int, dict[int, Logprob] | None]


def sample_each(
    sampler: Callable[[list[Request], torch.Tensor], list[Sample]], reqs: list[Request], logits: torch.Tensor
) -> list[Sample | Exception]:
    """The batch's samples; if the batch raises, each row alone, so one bad row fails only itself.

    A row that still raises alone comes back as its exception, for the engine to fail
    that request with; the rows around it are sampled as usual.
    """
    try:
        return list(sampler(reqs, logits))
    except Exception:
        results: list[Sample | Exception] = []
        for i, req in enumerate(reqs):
            try:
                results.append(sampler([req], logits[i : i + 1])[0])
            except Exception as exc:
                results.append(exc)
        return results


class Sampler:
    def __init__(self, tokenizer: object | None = None) -> None:
        self.tokenizer = tokenizer

    def _decode(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return str(self.tokenizer.decode([token_id]))  # type: ignore[attr-defined]

    def __call__(
        self, reqs: list[Request], logits: torch.Tensor
    ) -> list[tuple[int, dict[int, Logprob] | None]]:
        """``logits`` is fp32 ``[len(reqs), V]``; returns ``(token_id, logprobs or None)`` per request."""
        results: list[tuple[int, dict[int, Logprob] | None]] = []
        plain = [is_plain_greedy(req) for req in reqs]
        # One argmax for the whole batch instead of a clone and an argmax per row:
        # most served requests are plain greedy and this loop runs every step.
        greedy = logits.argmax(dim=-1).tolist() if any(plain) else []
        for i, req in enumerate(reqs):
            if plain[i]:
                results.append((int(greedy[i]), None))
                continue
            p = req.params
            raw = logits[i]
            x = raw.clone()
            if req.num_output_tokens < p.min_tokens:
                banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(req.eos_token_ids))
                if banned:
                    x[torch.tensor(sorted(banned), dtype=torch.long)] = float("-inf")
            apply_penalties(x, req)
            if p.is_greedy:
                token = int(torch.argmax(x))
            else:
                x = filter_logits(x / p.temperature, p.top_k, p.top_p, p.min_p)
                probs = torch.softmax(x, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=draw_generator(req)))
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
