"""Picks the next token of every sequence that samples this step: one pass over the batch, on
the logits' device.

What it is: ``Sampler.sample_device`` edits the batch's logits in a few batched
operations — ``allowed_token_ids``, ``logit_bias``, the ``min_tokens`` ban of stop
tokens, repetition/presence/frequency penalties (from ``token_counts.py``) — takes the
argmax for greedy rows and, for the others, divides by the temperature, applies top-k,
top-p and min-p and draws (``sampling_tensors.py``); logprobs of the chosen and of the
top-n tokens (one ``topk``) come from the raw model distribution, as vLLM's default.
Every per-request tensor is built on the logits' device. Nothing reads a value back per
row: ``fetch`` brings the step's sampled ids and logprobs to the host in one transfer.
Seeded sequences draw from their own generator on the device, reseeded for each output
position, so a seed gives the same tokens whatever the batch around it, and a sequence
continued on another replica draws what it would have drawn uninterrupted. ``sample_each``
keeps one bad row from failing the batch. What it is not: stop-string or length handling,
speculative verification (``spec_decode/``), or the per-row reference the tests check it
against (``sampler_reference.py``).
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from plimsoll.runtime.engine.outputs import Logprob
from plimsoll.runtime.engine.request import Request
from plimsoll.runtime.engine.sampling_tensors import Randomness, RowParams, device_index, sample_from
from plimsoll.runtime.engine.token_counts import TokenCounts

Sample = tuple[int, dict[int, Logprob] | None]


def banned_ids(req: Request) -> list[int]:
    """Tokens this sequence may not sample yet: its stop tokens (and EOS) until ``min_tokens``."""
    p = req.params
    if req.num_output_tokens >= p.min_tokens:
        return []
    banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(req.eos_token_ids))
    return sorted(banned)


def is_plain_greedy(req: Request) -> bool:
    """Greedy with nothing that edits the logits or reads them beyond the argmax."""
    p = req.params
    return (
        p.is_greedy
        and p.logprobs is None
        and not p.has_penalties
        and not p.logit_bias
        and p.allowed_token_ids is None
        and not banned_ids(req)
    )


def fetch(parts: Sequence[torch.Tensor]) -> list[float]:
    """The step's one device-to-host transfer: every part, flattened, as float64 (exact for
    token ids below 2**53)."""
    if not parts:
        return []
    flat = torch.cat([p.reshape(-1).to(torch.float64) for p in parts])
    values: list[float] = flat.tolist()
    return values


@dataclass
class DeviceSamples:
    """One batch's samples, still on the device; ``results`` reads them from ``fetch``'s values."""

    token_ids: torch.Tensor  # [B]
    num_top: list[int | None] = field(default_factory=list)  # per row: logprobs asked (None: none)
    chosen_logprobs: torch.Tensor | None = None  # [R] rows that asked, in row order
    top_logprobs: torch.Tensor | None = None  # [R, n]
    top_ids: torch.Tensor | None = None  # [R, n]

    def parts(self) -> list[torch.Tensor]:
        extra = [t for t in (self.chosen_logprobs, self.top_logprobs, self.top_ids) if t is not None]
        return [self.token_ids, *extra]

    def size(self) -> int:
        return sum(p.numel() for p in self.parts())

    def results(self, values: Sequence[float], decode: Callable[[int], str | None]) -> list[Sample]:
        batch = self.token_ids.shape[0]
        tokens = [int(v) for v in values[:batch]]
        if self.chosen_logprobs is None:
            return [(t, None) for t in tokens]
        asked = [i for i, n in enumerate(self.num_top) if n is not None]
        width = self.top_ids.shape[1] if self.top_ids is not None else 0
        chosen = values[batch : batch + len(asked)]
        top_at = batch + len(asked)
        top_values = values[top_at : top_at + len(asked) * width]
        top_ids = values[top_at + len(asked) * width : top_at + 2 * len(asked) * width]
        out: list[Sample] = [(t, None) for t in tokens]
        for r, i in enumerate(asked):
            token = tokens[i]
            entry = {token: Logprob(token, chosen[r], decode(token))}
            for j in range(self.num_top[i] or 0):
                t = int(top_ids[r * width + j])
                entry.setdefault(t, Logprob(t, top_values[r * width + j], decode(t)))
            out[i] = (token, entry)
        return out


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
    """``seed`` seeds the generator rows without a seed of their own share (None: the
    device's default generator)."""

    def __init__(self, tokenizer: object | None = None, seed: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.randomness = Randomness(seed)
        self.counts = TokenCounts()

    def decode(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return str(self.tokenizer.decode([token_id]))  # type: ignore[attr-defined]

    def release(self, request_id: str) -> None:
        """Forget a finished sequence's device state (its penalty counts)."""
        self.counts.release(request_id)

    def __call__(self, reqs: list[Request], logits: torch.Tensor) -> list[Sample]:
        """``logits`` is fp32 ``[len(reqs), V]``; returns ``(token_id, logprobs or None)`` per request."""
        with self.randomness.rewind_on_error(reqs):
            samples = self.sample_device(reqs, logits)
            values = fetch(samples.parts())
        return samples.results(values, self.decode)

    def sample_device(self, reqs: list[Request], logits: torch.Tensor) -> DeviceSamples:
        """The batch's tokens (and logprobs), computed on ``logits.device`` without reading
        anything back; ``logits`` is not modified."""
        device = logits.device
        batch, vocab = logits.shape
        if all(is_plain_greedy(r) for r in reqs):
            return DeviceSamples(logits.argmax(dim=-1))
        params = [r.params for r in reqs]
        num_top = [p.logprobs for p in params]
        asked = [i for i, n in enumerate(num_top) if n is not None]
        raw_logprobs = torch.log_softmax(logits[device_index(asked, device)], dim=-1) if asked else None
        x, slots = self._edited(reqs, logits)
        token_ids = x.argmax(dim=-1)  # the greedy rows' tokens (and a placeholder for the others)
        sampled = [i for i, p in enumerate(params) if not p.is_greedy]
        if sampled:
            rows = [reqs[i] for i in sampled]
            if len(sampled) < batch:
                index = device_index(sampled, device)
                probs = RowParams.build(rows, device, vocab).probs(x[index])
            else:
                probs = RowParams.build(rows, device, vocab).probs(x)
            drawn = sample_from(probs, self.randomness.uniforms(rows, 1, device)[:, 0])
            token_ids = drawn if len(sampled) == batch else token_ids.index_copy(0, index, drawn)
        if slots is not None:  # the penalised rows' counts grow by the token they drew, on the device
            penalised = [i for i, p in enumerate(params) if p.has_penalties]
            self.counts.add(slots, token_ids[device_index(penalised, device)])
        samples = DeviceSamples(token_ids, num_top)
        if raw_logprobs is not None:
            index = device_index(asked, device)
            samples.chosen_logprobs = raw_logprobs.gather(1, token_ids[index][:, None])[:, 0]
            width = max(n or 0 for n in num_top)
            if width:
                samples.top_logprobs, samples.top_ids = torch.topk(raw_logprobs, width, dim=-1)
        return samples

    def _edited(self, reqs: list[Request], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A copy of ``logits`` with allowed ids, biases, bans and penalties applied (vLLM's order),
        and the penalised rows' slots in ``TokenCounts`` (None when no row has a penalty)."""
        device = logits.device
        vocab = logits.shape[1]
        x = logits
        allowed = [(i, r.params.allowed_token_ids) for i, r in enumerate(reqs) if r.params.allowed_token_ids]
        bias = [(i, t, b) for i, r in enumerate(reqs) for t, b in (r.params.logit_bias or {}).items()]
        bans = [(i, t) for i, r in enumerate(reqs) for t in banned_ids(r)]
        penalised = [i for i, r in enumerate(reqs) if r.params.has_penalties]
        if allowed or bias or bans or penalised:
            x = logits.clone()
        if allowed:
            rows = device_index([i for i, _ in allowed], device)
            pairs = [(j, t) for j, (_, ids) in enumerate(allowed) for t in ids or []]
            where = torch.tensor(pairs, dtype=torch.long).to(device)  # [M, 2]
            outside = torch.ones(len(allowed), vocab, dtype=torch.bool, device=device)
            outside[where[:, 0], where[:, 1]] = False
            x[rows] = x[rows].masked_fill(outside, float("-inf"))
        if bias:
            where = torch.tensor([(i, t) for i, t, _ in bias], dtype=torch.long).to(device)
            values = torch.tensor([b for _, _, b in bias], dtype=x.dtype).to(device)
            x.index_put_((where[:, 0], where[:, 1]), values, accumulate=True)
        if bans:
            where = torch.tensor(bans, dtype=torch.long).to(device)
            x[where[:, 0], where[:, 1]] = float("-inf")
        if not penalised:
            return x, None
        slots = self.counts.slots([reqs[i] for i in penalised], vocab, device)
        self._penalise(x, [reqs[i] for i in penalised], device_index(penalised, device), slots)
        return x, slots

    def _penalise(
        self, x: torch.Tensor, reqs: list[Request], rows: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """Repetition penalty over prompt and output, presence and frequency over output (as vLLM), in place.
        Only the terms some row uses are computed: each is a few passes over ``[P, V]``."""
        assert self.counts.output is not None and self.counts.prompt is not None
        params = [r.params for r in reqs]
        table = torch.tensor(
            [(p.repetition_penalty, p.frequency_penalty, p.presence_penalty) for p in params], dtype=x.dtype
        ).to(x.device)  # [P, 3]
        whole = len(reqs) == x.shape[0]  # every row is penalised: work on x itself, no gather/scatter
        y = x if whole else x[rows]
        counts = self.counts.output[slots]  # [P, V]
        in_output = counts > 0
        if any(p.repetition_penalty != 1.0 for p in params):
            rep = table[:, 0:1]
            seen = self.counts.prompt[slots] | in_output
            # Divide positive logits, multiply negative ones (exactly as written: greedy rows stay the reference's).
            y.copy_(torch.where(seen, torch.where(y > 0, y / rep, y * rep), y))
        if any(p.frequency_penalty for p in params):
            y.sub_(table[:, 1:2] * counts)
        if any(p.presence_penalty for p in params):
            y.sub_(table[:, 2:3] * in_output)
        if not whole:
            x[rows] = y
