"""The sampler's batched greedy fast path: same tokens as the per-row path, and only
for requests whose logits nothing edits (no penalties, no logprobs, no min_tokens ban)."""

import torch

from plimsoll.runtime.engine.request import Request
from plimsoll.runtime.engine.sampler import Sampler, is_plain_greedy
from plimsoll.runtime.engine.sampling_params import SamplingParams

EOS = 3


def req(**params: object) -> Request:
    return Request("r", "r", 0, [5, 6, 7], SamplingParams(**params), frozenset({EOS}))  # type: ignore[arg-type]


def test_plain_greedy_is_recognised() -> None:
    assert is_plain_greedy(req(temperature=0))
    assert is_plain_greedy(req(temperature=0, min_tokens=4, ignore_eos=True))
    assert not is_plain_greedy(req(temperature=1.0))
    assert not is_plain_greedy(req(temperature=0, logprobs=2))
    assert not is_plain_greedy(req(temperature=0, repetition_penalty=1.2))
    assert not is_plain_greedy(req(temperature=0, presence_penalty=0.5))
    assert not is_plain_greedy(req(temperature=0, frequency_penalty=0.5))
    assert not is_plain_greedy(req(temperature=0, min_tokens=2))  # EOS must be banned for now
    done = req(temperature=0, min_tokens=1)
    done.append_token(9)
    assert is_plain_greedy(done)


def test_batch_mixes_fast_and_per_row_paths() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.rand(4, 50, generator=gen)  # all in [0, 1)
    logits[1, EOS], logits[1, 11] = 100.0, 50.0  # min_tokens bans EOS: 11 wins
    logits[2, 7], logits[2, 20] = 3.0, 2.0  # prompt token 7 penalised to 1.5: 20 wins
    reqs = [
        req(temperature=0),
        req(temperature=0, min_tokens=2),
        req(temperature=0, repetition_penalty=2.0),
        req(temperature=0, logprobs=1),
    ]
    out = Sampler()(reqs, logits.clone())
    assert out[0] == (int(logits[0].argmax()), None)
    assert out[1] == (11, None)
    assert out[2] == (20, None)
    assert out[3][0] == int(logits[3].argmax())
    assert out[3][1] is not None and out[3][0] in out[3][1]
