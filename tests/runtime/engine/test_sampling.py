"""Sampling and stopping: seeds independent of batch-mates, stop strings, min_tokens, n, logprobs."""

import random
from typing import Any

import pytest
import torch

from plimsoll.runtime.engine.outputs import RequestOutput, StepStats
from plimsoll.runtime.engine.sampler_reference import apply_penalties, filter_logits
from plimsoll.runtime.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Any) -> Any:
    from plimsoll.runtime import LLM

    return LLM(model=str(tiny_model_dir("llama")), kv_cache_memory="8MiB", max_num_batched_tokens=128)


def rand_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 259) for _ in range(n)]


def test_seed_gives_same_output_whatever_the_batch(llm: Any) -> None:
    rng = random.Random(5)
    prompt = rand_prompt(rng, 30)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate([prompt], params)[0].outputs[0].token_ids
    mates = [rand_prompt(rng, rng.randrange(5, 80)) for _ in range(7)]
    mate_params = [
        SamplingParams(temperature=1.0, max_tokens=rng.randrange(5, 30), ignore_eos=True) for _ in mates
    ]
    batch = llm.generate([*mates[:3], prompt, *mates[3:]], [*mate_params[:3], params, *mate_params[3:]])
    assert batch[3].outputs[0].token_ids == alone
    other_seed = llm.generate([prompt], SamplingParams(**{**params.__dict__, "seed": 99}))[0]
    assert other_seed.outputs[0].token_ids != alone, "a different seed should sample differently"


def stream(llm: Any, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
    llm.engine.add_request("stream-test", prompt, params)
    outs = []
    while llm.engine.has_unfinished_requests():
        outs.extend(o for o in llm.engine.step() if o.request_id == "stream-test")
    return outs


def test_stop_string_across_token_boundaries_is_not_emitted(llm: Any) -> None:
    prompt = rand_prompt(random.Random(6), 20)
    base = (
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
        .outputs[0]
        .text
    )
    # Byte-level tokens: any 3-character stop string spans 3 tokens.
    start = next(
        i
        for i in range(6, len(base) - 3)
        if "\ufffd" not in base[i : i + 3] and base.find(base[i : i + 3]) == i
    )
    stop = base[start : start + 3]
    outs = stream(llm, prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))
    final = outs[-1].outputs[0]
    assert final.text == base[:start]
    assert (final.finish_reason, final.stop_reason) == ("stop", stop)
    assert "".join(o.outputs[0].delta_text for o in outs) == final.text
    assert all(stop not in o.outputs[0].text for o in outs)
    assert sum(len(o.outputs[0].delta_token_ids) for o in outs) == len(final.token_ids)


def test_min_tokens_masks_stop_tokens(llm: Any) -> None:
    prompt = rand_prompt(random.Random(7), 25)
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    stop_id = greedy.outputs[0].token_ids[1]
    early = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id]))[0]
    assert early.outputs[0].token_ids[-1] == stop_id and len(early.outputs[0].token_ids) <= 2
    assert early.outputs[0].stop_reason == stop_id
    held = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, min_tokens=6, stop_token_ids=[stop_id])
    )[0].outputs[0]
    assert len(held.token_ids) >= 6
    assert stop_id not in held.token_ids[:6]


def test_n_2_gives_two_completions_sharing_prompt_blocks(tiny_model_dir: Any) -> None:
    from plimsoll.runtime import LLM

    class Hits:
        hits = 0

        def on_step(self, stats: StepStats) -> None:
            self.hits += stats.prefix_cache_hits

        def on_request_finished(self, output: RequestOutput) -> None:
            pass

    hits = Hits()
    # Prefix caching off: siblings still share their prompt blocks (salted hashes).
    llm = LLM(
        model=str(tiny_model_dir("llama")), kv_cache_memory="8MiB", enable_prefix_caching=False, observer=hits
    )
    out = llm.generate(
        [rand_prompt(random.Random(8), 64)],
        SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=16, ignore_eos=True),
    )[0]
    assert [c.index for c in out.outputs] == [0, 1]
    assert all(len(c.token_ids) == 16 and c.finish_reason == "length" for c in out.outputs)
    assert out.outputs[0].token_ids != out.outputs[1].token_ids
    assert hits.hits == 48  # (64 - 1) // 16 full blocks of the prompt, reused by the second sibling
    assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.num_blocks


def test_logprobs_match_transformers(llm: Any, tiny_model_dir: Any) -> None:
    from transformers import AutoModelForCausalLM

    prompt = rand_prompt(random.Random(9), 15)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True))[0]
    comp = out.outputs[0]
    assert comp.logprobs is not None and len(comp.logprobs) == 4
    hf = AutoModelForCausalLM.from_pretrained(
        str(tiny_model_dir("llama")), attn_implementation="eager", dtype=torch.float32
    )
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + comp.token_ids])).logits[0]
    ref = torch.log_softmax(logits.float(), dim=-1)
    for i, (token, entry) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True)):
        assert token in entry and len(entry) == 3  # greedy: the chosen token is the top one
        row = ref[len(prompt) - 1 + i]
        top = torch.topk(row, 3).indices.tolist()
        assert sorted(entry) == sorted(top)
        for tid, lp in entry.items():
            assert abs(lp.logprob - float(row[tid])) < 1e-4
        assert entry[token].decoded == llm.tokenizer.decode([token])
    only_chosen = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, logprobs=0))[0]
    assert all(len(e) == 1 for e in only_chosen.outputs[0].logprobs or [])


def test_penalties_and_filters() -> None:
    from plimsoll.runtime.engine.request import Request

    req = Request(
        "r",
        "r",
        0,
        [0],
        SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
        frozenset(),
    )
    req.append_token(1)
    req.append_token(1)
    logits = apply_penalties(torch.tensor([2.0, -2.0, 1.0]), req)
    # token 0: prompt only -> 2/2; token 1: -2*2, then -0.5 presence -2*0.25 frequency; token 2 untouched
    assert logits.tolist() == pytest.approx([1.0, -5.0, 1.0])
    x = torch.tensor([3.0, 2.0, 1.0, 0.0])
    assert torch.isinf(filter_logits(x, 2, 1.0, 0.0)).tolist() == [False, False, True, True]
    probs = torch.softmax(x, -1)  # [0.64, 0.24, 0.09, 0.03]
    assert torch.isinf(filter_logits(x, -1, 0.7, 0.0)).tolist() == [False, False, True, True]
    assert torch.isinf(filter_logits(x, -1, 1.0, 0.2)).tolist() == (probs < 0.2 * probs.max()).tolist()


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"top_p": 0.0}, "top_p"),
        ({"temperature": -1}, "temperature"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": 50}, "logprobs"),
        ({"min_p": 2}, "min_p"),
        ({"stop": [""]}, "stop"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
    ],
)
def test_bad_params_name_the_parameter(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs).validate()


def test_prompt_longer_than_max_model_len_is_refused(tiny_model_dir: Any) -> None:
    from plimsoll.runtime import LLM

    llm = LLM(model=str(tiny_model_dir("llama")), kv_cache_memory="1MiB", max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[5] * 64], SamplingParams())
    assert not llm.engine.has_unfinished_requests()


def test_stop_none_means_no_stop_strings_as_in_vllm() -> None:
    from plimsoll.runtime.engine.sampling_params import SamplingParams

    params = SamplingParams(stop=None, stop_token_ids=None)  # type: ignore[arg-type]
    params.validate()  # was a TypeError from iterating None
    assert params.stop == [] and params.stop_token_ids == []
    assert SamplingParams(stop="END").stop == ["END"]
