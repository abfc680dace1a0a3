"""Sampled speculative decoding keeps the target distribution (chi-square tests).

First the rejection sampler alone against known distributions (n-gram point
masses and a draft distribution), then the whole engine: the joint distribution
of the first two tokens of 3,000 seeded requests, whose second token always
passes through verification, against the exact one computed with transformers.
A test fails when the chi-square p-value is below 1e-4; with the fixed seeds
here each run gives the same counts, so the test is deterministic.
"""

from typing import Any

import pytest
import torch

from plimsoll.runtime.engine.sampler_reference import chi_square_p
from plimsoll.runtime.engine.spec_decode.rejection_sampler import rejection_sample

P_MIN = 1e-4


@pytest.mark.parametrize("kind", ["point_mass", "draft_distribution"])
def test_rejection_sampler_emits_the_target_distribution(kind: str) -> None:
    gen = torch.Generator().manual_seed(0)
    vocab, trials = 6, 20_000
    p = torch.tensor(
        [[0.05, 0.3, 0.0, 0.25, 0.1, 0.3], [0.2, 0.2, 0.2, 0.1, 0.1, 0.2], [0.5, 0.1, 0.1, 0.1, 0.1, 0.1]]
    )
    q = torch.tensor([[0.4, 0.1, 0.3, 0.1, 0.1, 0.0], [0.1, 0.5, 0.1, 0.1, 0.1, 0.1]])
    # Every trial is one row of a single batch: the rows are decided together.
    if kind == "point_mass":
        proposals, draft = torch.tensor([[3, 1]]).repeat(trials, 1), None  # an n-gram guess
    else:
        proposals = torch.stack(
            [torch.multinomial(q[j], trials, replacement=True, generator=gen) for j in range(2)], 1
        )
        draft = q.expand(trials, 2, vocab)
    accepted, next_token = rejection_sample(
        p.expand(trials, 3, vocab),
        p.argmax(-1).expand(trials, 3),
        proposals,
        torch.full((trials,), 2),
        draft,
        torch.rand(trials, 3, generator=gen),
        torch.zeros(trials, dtype=torch.bool),
    )
    first_tokens = torch.where(accepted >= 1, proposals[:, 0], next_token)
    after_first = accepted >= 1  # the token after an accepted first proposal
    second_tokens = torch.where(accepted >= 2, proposals[:, 1], next_token)[after_first]
    first = torch.bincount(first_tokens, minlength=vocab).float()
    second = torch.bincount(second_tokens, minlength=vocab).float()
    print(f"{kind}: first-token p={chi_square_p(first, p[0]):.3f}, second p={chi_square_p(second, p[1]):.3f}")
    assert chi_square_p(first, p[0]) > P_MIN
    assert chi_square_p(second, p[1]) > P_MIN
    assert 0 < int(after_first.sum()) < trials  # both branches ran
    third = torch.bincount(next_token[accepted == 2], minlength=vocab).float()  # the bonus token
    assert chi_square_p(third, p[2]) > P_MIN


def test_greedy_rows_keep_the_longest_argmax_prefix() -> None:
    target = torch.tensor([[4, 2, 7], [4, 2, 7], [4, 2, 7]])  # [R, K + 1] argmax
    proposals = torch.tensor([[4, 2], [4, 9], [1, 2]])
    probs = torch.full((3, 3, 10), 0.1)
    accepted, next_token = rejection_sample(
        probs,
        target,
        proposals,
        torch.tensor([2, 2, 2]),
        None,
        torch.rand(3, 3),
        torch.ones(3, dtype=torch.bool),
    )
    assert accepted.tolist() == [2, 1, 0]
    assert next_token.tolist() == [7, 2, 4]


def exact_first_two(model_dir: str, prompt: list[int], top_k: int) -> dict[tuple[int, int], float]:
    """P(t1, t2) under temperature 1 and top-k, from transformers' float32 logits."""
    from transformers import AutoModelForCausalLM

    from plimsoll.runtime.engine.sampler_reference import filter_logits

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")

    def probs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        return torch.softmax(filter_logits(logits, top_k, 1.0, 0.0), dim=-1)

    p1 = probs(prompt)
    joint = {}
    for t1 in torch.nonzero(p1).flatten().tolist():
        p2 = probs([*prompt, t1])
        for t2 in torch.nonzero(p2).flatten().tolist():
            joint[(t1, t2)] = float(p1[t1] * p2[t2])
    return joint


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_engine_sampling_keeps_the_target_distribution(tiny_model_dir: Any, method: str) -> None:
    from test_spec_greedy import SpecCounter

    from plimsoll.runtime import LLM, SamplingParams

    target = str(tiny_model_dir("llama"))
    # Every token occurs in the n-gram prompt, so whatever the first token is, a second one is
    # proposed (on this random model always one the target's top-4 excludes: the rejection and
    # residual path; the draft run covers acceptance). Draft proposals come from another model.
    prompt = list(range(3, 259)) if method == "ngram" else [5, 17, 99, 140, 33]
    cfg: dict[str, Any] = (
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
        if method == "ngram"
        else {"model": str(tiny_model_dir("mistral")), "num_speculative_tokens": 2}
    )
    n, top_k = 3000, 4
    seen = SpecCounter()
    llm = LLM(model=target, observer=seen, kv_cache_memory="16MiB", max_num_seqs=256, speculative_config=cfg)
    # max_tokens=3: after the first token one proposal fits, so every second token is verified.
    params = [
        SamplingParams(temperature=1.0, top_k=top_k, max_tokens=3, ignore_eos=True, seed=s) for s in range(n)
    ]
    outs = llm.generate([prompt] * n, params)
    joint = exact_first_two(target, prompt, top_k)
    cells = sorted(joint)
    counts = torch.zeros(len(cells) + 1)
    index = {c: i for i, c in enumerate(cells)}
    for o in outs:
        t = o.outputs[0].token_ids
        counts[index.get((t[0], t[1]), len(cells))] += 1
    probs = torch.tensor([joint[c] for c in cells] + [0.0])
    p_value = chi_square_p(counts, probs)
    print(f"{method}: {seen.accepted}/{seen.draft_tokens} accepted, chi-square p={p_value:.3f}")
    assert seen.draft_tokens >= n // 2  # speculation really ran
    if method == "draft":
        assert 0 < seen.accepted < seen.draft_tokens  # both accepted and rejected proposals
    assert p_value > P_MIN
