"""The batched device sampler against the per-row reference (``sampler_reference.py``).

Greedy rows give the reference's tokens (with penalties, biases, bans, allowed ids) and
its logprobs; a seeded row gives the same tokens across runs and whatever batch it
sits in; sampled rows follow the reference's distribution per setting (chi-square,
fixed seeds, so each run gives the same counts); a step reads back from the device
once, whatever the batch size; and every tensor a step builds is on the logits'
device (checked on the ``meta`` device, where a tensor left on the CPU is an error).
"""

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from plimsoll.runtime.engine import sampling_tensors
from plimsoll.runtime.engine.request import Request
from plimsoll.runtime.engine.sampler import Sampler
from plimsoll.runtime.engine.sampler_reference import ReferenceSampler, chi_square_p, reference_probs
from plimsoll.runtime.engine.sampling_params import SamplingParams

EOS = 3
P_MIN = 1e-4


def seq(
    rid: str, prompt: list[int] | None = None, output: list[int] = (), index: int = 0, **params: Any
) -> Request:  # type: ignore[assignment]
    req = Request(rid, rid, index, prompt or [5, 6, 7, 5], SamplingParams(**params), frozenset({EOS}))
    for t in output:
        req.append_token(t)
    return req


EDITS: list[dict[str, Any]] = [
    {},
    {"repetition_penalty": 1.5},
    {"presence_penalty": 0.7, "frequency_penalty": 0.4},
    {"repetition_penalty": 0.8, "frequency_penalty": -0.5},
    {"logit_bias": {9: 4.0, 1: -100.0}},
    {"allowed_token_ids": [2, 9, 11, 30]},
    {"min_tokens": 5, "stop_token_ids": [9]},
    {"logprobs": 3},
    {"logprobs": 0, "repetition_penalty": 1.3},
]


def test_greedy_rows_equal_the_reference_step_after_step() -> None:
    gen = torch.Generator().manual_seed(1)
    vocab = 40
    reqs = [seq(f"g{i}", output=[9, 9, 12][: i % 4], temperature=0, **edit) for i, edit in enumerate(EDITS)]
    reqs += [seq("plain", temperature=0)]
    batched = Sampler()
    for _ in range(6):  # the penalties read a history that grows each step
        logits = torch.randn(len(reqs), vocab, generator=gen) * 3
        logits[:, 9] += 4  # the banned / biased ids matter
        got = batched(reqs, logits.clone())
        want = ReferenceSampler()(reqs, logits.clone())
        assert [t for t, _ in got] == [t for t, _ in want]
        for (_, lp_got), (_, lp_want) in zip(got, want, strict=True):
            assert (lp_got is None) == (lp_want is None)
            if lp_got is not None and lp_want is not None:
                assert sorted(lp_got) == sorted(lp_want)
                for t in lp_got:
                    assert lp_got[t].logprob == pytest.approx(lp_want[t].logprob, abs=1e-5)
        for req, (token, _) in zip(reqs, got, strict=True):
            req.append_token(token)


def seeded_tokens(
    sampler: Sampler, target: Request, mates: list[Request], at: int, steps: int, seed: int
) -> list[int]:
    """The target's tokens over ``steps`` steps, at batch position ``at`` among ``mates``."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for step in range(steps):
        torch.manual_seed(1000 + step)
        row = torch.randn(1, 64) * 2  # the target's logits: the same each run
        mate_rows = torch.randn(len(mates), 64, generator=gen)  # the mates': different each run
        batch = [*mates[:at], target, *mates[at:]]
        logits = torch.cat([mate_rows[:at], row, mate_rows[at:]])
        token = sampler(batch, logits)[at][0]
        target.append_token(token)
        out.append(token)
    return out


def test_seeded_rows_repeat_token_for_token_whatever_the_batch() -> None:
    params = {"temperature": 0.9, "top_p": 0.95, "top_k": 40, "seed": 1234}
    alone = seeded_tokens(Sampler(seed=0), seq("t", **params), [], 0, 12, 0)
    again = seeded_tokens(Sampler(seed=5), seq("t", **params), [], 0, 12, 0)
    mates = [seq(f"m{i}", temperature=1.0) for i in range(5)] + [seq("s", temperature=0.7, seed=99)]
    crowded = seeded_tokens(Sampler(seed=7), seq("t", **params), mates, 3, 12, 42)
    other_mates = [seq(f"o{i}", temperature=0.5, top_p=0.5, repetition_penalty=1.2) for i in range(9)]
    other = seeded_tokens(Sampler(seed=8), seq("t", **params), other_mates, 9, 12, 43)
    assert alone == again == crowded == other
    sibling = seeded_tokens(Sampler(seed=0), seq("t", index=1, **params), [], 0, 12, 0)
    assert sibling != alone  # n > 1: each sibling has its own stream
    reseeded = seeded_tokens(Sampler(seed=0), seq("t", **{**params, "seed": 4321}), [], 0, 12, 0)
    assert reseeded != alone


SETTINGS: list[dict[str, Any]] = [
    {"temperature": 1.0},
    {"temperature": 0.5},
    {"temperature": 1.7},
    {"temperature": 1.0, "top_k": 3},
    {"temperature": 1.0, "top_p": 0.6},
    {"temperature": 0.8, "top_k": 5, "top_p": 0.8},
    {"temperature": 1.0, "min_p": 0.2},
    {"temperature": 1.2, "top_k": 6, "top_p": 0.9, "min_p": 0.1},
    {"temperature": 1.0, "repetition_penalty": 1.8},
    {"temperature": 1.0, "presence_penalty": 1.0, "frequency_penalty": 0.5},
    {"temperature": 1.0, "logit_bias": {0: 2.0, 4: -100.0}},
    {"temperature": 1.0, "allowed_token_ids": [1, 2, 6, 7]},
]


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_sampled_rows_follow_the_reference_distribution(setting: dict[str, Any]) -> None:
    vocab, trials = 8, 6000
    logits = torch.tensor([2.0, 1.5, 1.2, 0.3, 0.0, -0.5, -1.0, 1.0])
    # A history for the penalties: tokens 1 and 2 in the output, 0 in the prompt.
    reqs = [seq(f"r{i}", prompt=[0, 3], output=[1, 1, 2], **setting) for i in range(trials)]
    sampler = Sampler(seed=0)
    tokens = [t for t, _ in sampler(reqs, logits.expand(trials, vocab).clone())]
    counts = torch.bincount(torch.tensor(tokens), minlength=vocab).float()
    probs = reference_probs(reqs[0], logits.clone())
    p_value = chi_square_p(counts, probs)
    assert p_value > P_MIN, (setting, counts.tolist(), probs.tolist(), p_value)


class CountHostReads:
    """Counts every call that reads a tensor's value back to the host."""

    NAMES = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__", "numpy", "cpu")

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        for name in self.NAMES:
            monkeypatch.setattr(torch.Tensor, name, self._counting(name, getattr(torch.Tensor, name)))

    def _counting(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            return real(tensor, *args, **kwargs)

        return counted


def mixed_batch(size: int) -> list[Request]:
    kinds = [*SETTINGS, *EDITS, {"temperature": 0}, {"temperature": 0.7, "seed": 3, "logprobs": 2}]
    return [seq(f"x{i}", output=[4, 9], **{"temperature": 0.0, **kinds[i % len(kinds)]}) for i in range(size)]


@pytest.mark.parametrize("size", [2, 40])
def test_a_step_reads_the_device_once_whatever_the_batch(size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    reqs = mixed_batch(size)
    sampler = Sampler(seed=0)
    logits = torch.randn(size, 50)
    sampler(reqs, logits)  # the first step also fills the penalty tables: count a later one
    reads = CountHostReads(monkeypatch)
    sampler(reqs, logits)
    assert reads.calls == ["tolist"]


class OnlyOnDevice(TorchFunctionMode):
    """Fails any torch call that takes a tensor off ``device``; host lists enter only through
    ``torch.tensor(...)`` followed at once by ``.to(device)``."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.host_made: set[int] = set()
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.calls += 1
        tensors = [a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)]
        tensors += [t for a in args if isinstance(a, list | tuple) for t in a if isinstance(t, torch.Tensor)]
        is_copy_in = func in (torch.Tensor.to,) and len(tensors) == 1 and id(tensors[0]) in self.host_made
        if not is_copy_in and getattr(func, "__name__", "") not in (
            "__get__",
            "device",
            "shape",
            "dim",
            "size",
        ):
            off = [t.device for t in tensors if t.device != self.device]
            assert not off, f"{getattr(func, '__name__', func)} got a tensor on {off[0]}, not {self.device}"
        result = func(*args, **kwargs)
        if func is torch.tensor:
            self.host_made.add(id(result))
        return result


def test_every_tensor_a_step_builds_is_on_the_logits_device() -> None:
    meta = torch.device("meta")
    reqs = mixed_batch(30)
    for r in reqs:  # the meta device has no generators: unseeded rows use its default one
        r.params.seed = None
    sampler = Sampler(seed=None)
    logits = torch.empty(30, 50, device=meta)
    with OnlyOnDevice(meta) as mode:
        samples = sampler.sample_device(reqs, logits)
    assert mode.calls > 20
    assert all(p.device == meta for p in samples.parts())
    assert sampler.counts.output is not None and sampler.counts.output.device == meta


def test_a_seeded_rows_generator_is_made_on_the_logits_device(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[torch.device] = []
    real = torch.Generator

    def recording(device: Any = "cpu") -> torch.Generator:
        made.append(torch.device(device))
        return real(device="cpu")

    monkeypatch.setattr(sampling_tensors.torch, "Generator", recording)
    sampler = Sampler(seed=None)
    reqs = [seq("a", temperature=1.0, seed=1), seq("b", temperature=1.0), seq("c", temperature=1.0, seed=2)]
    sampler(reqs, torch.randn(3, 20))
    sampler(reqs, torch.randn(3, 20))
    assert made == [torch.device("cpu")] * 2  # one per seeded sequence, kept across steps
    assert all(r.generator is not None for r in (reqs[0], reqs[2])) and reqs[1].generator is None


def test_finished_sequences_give_their_penalty_rows_back() -> None:
    sampler = Sampler(seed=0)
    reqs = [seq(f"p{i}", temperature=1.0, repetition_penalty=1.2) for i in range(20)]
    sampler(reqs, torch.randn(20, 30))
    assert len(sampler.counts.slot_of) == 20
    for r in reqs:
        sampler.release(r.request_id)
    assert not sampler.counts.slot_of
    capacity = sampler.counts.output.shape[0]  # type: ignore[union-attr]
    sampler([seq(f"q{i}", temperature=1.0, presence_penalty=1.0) for i in range(20)], torch.randn(20, 30))
    assert sampler.counts.output.shape[0] == capacity  # type: ignore[union-attr]  # rows reused


def test_top_p_inside_top_k_equals_the_full_sort() -> None:
    from plimsoll.runtime.engine.sampling_tensors import RowParams

    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(3)) * 2
    both = [seq("a", top_k=20, top_p=0.7), seq("b", top_k=5, top_p=0.9, min_p=0.1), seq("c", top_k=40)]
    fast = RowParams.build(both, torch.device("cpu"), 300)
    assert fast.top_p_within_k  # the topk path
    with_sort = RowParams.build([*both, seq("d", top_p=0.5)], torch.device("cpu"), 300)
    assert not with_sort.top_p_within_k  # a top-p row without top-k: the full sort
    slow = with_sort.probs(torch.cat([logits, logits[:1]]))[:3]
    assert torch.allclose(fast.probs(logits), slow, atol=1e-6)
    for i, req in enumerate(both):
        assert torch.allclose(fast.probs(logits)[i], reference_probs(req, logits[i].clone()), atol=1e-6)
