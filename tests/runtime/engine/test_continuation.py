"""A request continued from output it produced elsewhere ends exactly as the uninterrupted one.

The router's in-flight migration sends the tokens a failed replica already streamed as a
``Continuation``; the engine must then produce the same remaining tokens (greedy and
seeded sampling), the text the client has not seen yet, stop strings that span the
boundary, and ``max_tokens``/``min_tokens`` counted over the whole output.
"""

import itertools
import random
from dataclasses import replace
from typing import Any

import pytest

from plimsoll.runtime.engine.outputs import RequestOutput
from plimsoll.runtime.engine.request import Continuation, position_seed
from plimsoll.runtime.engine.sampling_params import SamplingParams

_ids = itertools.count()


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Any) -> Any:
    from plimsoll.runtime import LLM

    return LLM(model=str(tiny_model_dir("llama")), kv_cache_memory="8MiB", max_num_batched_tokens=64)


def run(
    llm: Any, prompt: list[int], params: SamplingParams, cont: Continuation | None = None
) -> list[RequestOutput]:
    """Every output of one request, stepped to the end."""
    request_id = f"cont-{next(_ids)}"
    llm.engine.add_request(request_id, prompt, params, continuation=cont)
    outs = []
    while llm.engine.has_unfinished_requests():
        outs.extend(o for o in llm.engine.step() if o.request_id == request_id)
    return outs


def streamed(outs: list[RequestOutput]) -> tuple[list[int], str]:
    """What a stream would have sent: the delta token ids and the delta text, joined."""
    ids = [t for o in outs for t in o.outputs[0].delta_token_ids]
    return ids, "".join(o.outputs[0].delta_text for o in outs)


def prompt(seed: int, n: int = 12) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 259) for _ in range(n)]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_continuing_at_any_token_gives_the_uninterrupted_output(llm: Any, temperature: float) -> None:
    params = SamplingParams(temperature=temperature, seed=7, max_tokens=20, ignore_eos=True)
    p = prompt(1)
    whole = run(llm, p, params)
    ids, text = streamed(whole)
    final = whole[-1].outputs[0]
    assert len(ids) == 20
    # Cut after k tokens: the client has the first k ids and the text the first stream sent with them.
    sent_text = ""
    for k, out in enumerate(whole[:-1], start=1):
        sent_text += out.outputs[0].delta_text
        rest = run(llm, p, params, Continuation(tuple(ids[:k]), len(sent_text)))
        rest_ids, rest_text = streamed(rest)
        assert ids[:k] + rest_ids == ids, f"cut after {k} tokens"
        assert sent_text + rest_text == text, f"cut after {k} tokens"
        last = rest[-1]
        assert last.outputs[0].token_ids == final.token_ids  # usage counts the whole output
        assert last.outputs[0].finish_reason == final.finish_reason == "length"
        assert last.metrics.num_generation_tokens == 20 - k  # this engine generated only the rest


def test_text_held_back_before_the_cut_is_sent_first(llm: Any) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    p = prompt(2)
    ids, text = streamed(run(llm, p, params))
    # The client got the 6 tokens' ids but only 2 characters of their text.
    rest = run(llm, p, params, Continuation(tuple(ids[:6]), 2))
    rest_ids, rest_text = streamed(rest)
    assert ids[:6] + rest_ids == ids
    assert text[:2] + rest_text == text


def test_a_stop_string_spanning_the_cut_is_found(llm: Any) -> None:
    p = prompt(3)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    ids, text = streamed(run(llm, p, params))
    # Byte-level tokens: one character per token (for ASCII), so a 3-character stop starting
    # one token before the cut spans it.
    cut = next(
        i for i in range(8, 25) if text[i - 1 : i + 2].isascii() and text.find(text[i - 1 : i + 2]) == i - 1
    )
    stop = text[cut - 1 : cut + 2]
    stopped = replace(params, stop=[stop])
    whole = run(llm, p, stopped)
    whole_ids, whole_text = streamed(whole)
    # What the client had at the cut: the ids, and the text not held back for the stop string.
    sent = "".join(o.outputs[0].delta_text for o in whole[:cut])
    rest = run(llm, p, stopped, Continuation(tuple(ids[:cut]), len(sent)))
    rest_ids, rest_text = streamed(rest)
    assert rest[-1].outputs[0].finish_reason == "stop" and rest[-1].outputs[0].stop_reason == stop
    assert ids[:cut] + rest_ids == whole_ids
    assert sent + rest_text == whole_text == text[: cut - 1]


def test_min_and_max_tokens_count_the_continued_output(llm: Any) -> None:
    p = prompt(4)
    eos = next(iter(llm.engine.eos_token_ids))
    params = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=8, stop_token_ids=[eos])
    ids, _ = streamed(run(llm, p, params))
    rest = run(llm, p, params, Continuation(tuple(ids[:7]), 0))
    rest_ids, _ = streamed(rest)
    assert len(ids[:7] + rest_ids) == len(ids) <= 10
    assert ids[:7] + rest_ids == ids


def test_bad_continuations_are_refused_before_anything_is_queued(llm: Any) -> None:
    p = prompt(5)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match="nothing is left to generate"):
        llm.engine.add_request("bad-1", p, greedy, continuation=Continuation((5, 6, 7, 8), 0))
    with pytest.raises(ValueError, match="num_chars"):
        llm.engine.add_request("bad-2", p, greedy, continuation=Continuation((70, 71), 3))
    with pytest.raises(ValueError, match="n=1"):
        llm.engine.add_request("bad-3", p, replace(greedy, n=2), continuation=Continuation((70,), 0))
    with pytest.raises(ValueError, match="token_ids"):
        llm.engine.add_request("bad-4", p, greedy, continuation=Continuation((10_000,), 0))
    assert not llm.engine.has_unfinished_requests()


def test_position_seeds_differ_by_seed_index_and_position() -> None:
    seeds = {position_seed(s, i, pos) for s in (0, 1, -1, 2**64 - 1) for i in range(3) for pos in range(50)}
    assert len(seeds) == 4 * 3 * 50 - 3 * 50  # -1 and 2**64 - 1 are the same 64-bit seed
    assert all(0 <= s < 2**63 for s in seeds)
