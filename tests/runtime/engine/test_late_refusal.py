"""Refusing from the queue an admitted request that can no longer meet its TTFT bound: pure, on a clock the test sets."""

import pytest

from plimsoll.runtime.engine.late_refusal import late_refusals
from plimsoll.runtime.engine.request import Request
from plimsoll.runtime.engine.sampling_params import SamplingParams
from plimsoll.ttft_prediction import QueueSnapshot, ServiceRates, TTFTDeadline

# 20 ms decode steps, 1000 prompt tokens a second, one slot; slow steps up to 3× the means (what
# admission promised at; the queue is judged again at the means).
RATES = ServiceRates(prefill_tokens_per_s=1000.0, decode_step_s=0.02, max_num_seqs=1, slow_step_factor=3.0)
NOW = 100.0


def waiting(rid: str, prompt: int, deadline: TTFTDeadline | None) -> Request:
    seq = Request(rid, rid, 0, [1] * prompt, SamplingParams(max_tokens=4), frozenset())
    seq.ttft_deadline = deadline
    return seq


def snapshot(running_left: int, seqs: list[Request]) -> QueueSnapshot:
    return QueueSnapshot(running=((0, running_left),), waiting=tuple((s.num_prompt_tokens, 4) for s in seqs))


def test_a_request_whose_bound_the_mean_rates_no_longer_allow_is_refused_with_retry_after() -> None:
    # At the mean steps (20 ms; prefill 1 ms a token) the one running sequence's 30 tokens take 0.6 s,
    # then 20 prompt tokens 0.02 s and a step 0.02 s: first token 0.64 s from now.
    a = waiting("a", 20, TTFTDeadline(at=NOW + 0.5, bound_s=1.0))
    refused = late_refusals(snapshot(30, [a]), [a], RATES, NOW)
    assert list(refused) == ["a"]
    assert refused["a"].predicted_s == pytest.approx(0.64)
    assert refused["a"].retry_after_s == 1  # at least a second
    assert "500 ms of its TTFT bound left" in str(refused["a"])
    # With 0.7 s left it still makes it; a request with no bound is never judged.
    b = waiting("b", 20, TTFTDeadline(at=NOW + 0.7, bound_s=1.0))
    assert late_refusals(snapshot(30, [b]), [b], RATES, NOW) == {}
    c = waiting("c", 20, None)
    assert late_refusals(snapshot(1000, [c]), [c], RATES, NOW) == {}


def test_a_stall_that_raised_the_slow_step_factor_refuses_only_what_the_means_say_is_late() -> None:
    # One stall made the slowest recent step 10× the means: at that factor the running sequence's 10
    # tokens alone would take 2 s and everything behind it would look late. At the means: 0.2 + 0.02
    # + 0.02 = 0.24 s, within the 0.5 s left, so it stays (its promise's margin absorbs the stall).
    stalled = ServiceRates(1000.0, 0.02, 1, slow_step_factor=10.0)
    a = waiting("a", 20, TTFTDeadline(at=NOW + 0.5, bound_s=1.0))
    assert late_refusals(snapshot(10, [a]), [a], stalled, NOW) == {}
    # A stall long enough to eat the time it had left still refuses it.
    b = waiting("b", 20, TTFTDeadline(at=NOW + 0.2, bound_s=1.0))
    assert list(late_refusals(snapshot(10, [b]), [b], stalled, NOW)) == ["b"]


def test_retry_after_is_how_far_past_its_bound_the_request_now_would_be() -> None:
    # 300 running tokens at 20 ms: 6 s to a free slot; a 1 s bound is 5+ s short.
    a = waiting("a", 20, TTFTDeadline(at=NOW + 0.9, bound_s=1.0))
    assert late_refusals(snapshot(300, [a]), [a], RATES, NOW)["a"].retry_after_s == 6


def test_a_request_that_has_started_or_a_replica_without_rates_refuses_nothing() -> None:
    a = waiting("a", 20, TTFTDeadline(at=NOW - 1.0, bound_s=1.0))  # already past its deadline
    assert late_refusals(snapshot(10, [a]), [a], None, NOW) == {}
    a.num_computed_tokens = 16  # part of its prompt computed (a chunk, or a prefix-cache hit scheduled)
    assert late_refusals(snapshot(10, [a]), [a], RATES, NOW) == {}


def test_a_late_request_does_not_make_the_one_behind_it_late() -> None:
    # Running: 30 tokens (0.6 s at the means). a (20 tokens) first: 0.64 s; behind it b would
    # wait for a's 4 tokens too, but a leaves, so b takes its place: 0.64 s, within its 0.7 s.
    a = waiting("a", 20, TTFTDeadline(at=NOW + 0.5, bound_s=1.0))
    b = waiting("b", 20, TTFTDeadline(at=NOW + 0.7, bound_s=1.0))
    assert list(late_refusals(snapshot(30, [a, b]), [a, b], RATES, NOW)) == ["a"]
