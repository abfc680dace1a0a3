"""Scheduler behaviour on pure-Python requests: budgets, FCFS, preemption order, static policy."""

from plimsoll.runtime.engine.kv_cache_manager import KVCacheManager
from plimsoll.runtime.engine.request import Request, RequestStatus
from plimsoll.runtime.engine.sampling_params import SamplingParams
from plimsoll.runtime.engine.scheduler import Scheduler


def req(i: int, n: int) -> Request:
    return Request(f"r{i}", f"r{i}", 0, [i % 7 + 1] * n, SamplingParams(), frozenset(), cache_salt=None)


def finish_prefills(s: Scheduler) -> None:
    for r, _ in s.schedule().scheduled:
        if r.num_computed_tokens == r.num_tokens:
            r.append_token(0)


def test_token_budget_chunks_prefill_and_running_go_first() -> None:
    s = Scheduler(KVCacheManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10, max_model_len=256)
    s.add_request(req(0, 25))
    assert [(r.request_id, n) for r, n in s.schedule().scheduled] == [("r0", 10)]
    s.add_request(req(1, 3))
    out = s.schedule()  # r0 (running) takes the whole budget first
    assert [(r.request_id, n) for r, n in out.scheduled] == [("r0", 10)]
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("r0", 5), ("r1", 3)]
    assert (out.num_prefill_tokens, out.num_decode_tokens) == (8, 0)


def test_preempts_newest_running_and_frees_its_blocks() -> None:
    s = Scheduler(KVCacheManager(4, 4), max_num_seqs=8, max_num_batched_tokens=100, max_model_len=16)
    a, b = req(0, 4), req(1, 4)
    s.add_request(a)
    s.add_request(b)
    finish_prefills(s)
    # Each step both decode; at 9 tokens each would need a third block and only 4 exist.
    while b.status is RequestStatus.RUNNING:
        finish_prefills(s)
        assert a.num_tokens <= 12
    assert b.status is RequestStatus.PREEMPTED and b.num_preemptions == 1 and a.num_preemptions == 0
    assert b.num_computed_tokens == 0 and b.request_id not in s.kv.req_blocks
    assert s.waiting[0] is b  # first in line to come back, recomputing its tokens


def test_static_policy_admits_only_after_drain() -> None:
    s = Scheduler(
        KVCacheManager(64, 4), max_num_seqs=8, max_num_batched_tokens=100, max_model_len=64, policy="static"
    )
    first = [req(0, 5), req(1, 5)]
    for r in first:
        s.add_request(r)
    finish_prefills(s)
    late = req(2, 5)
    s.add_request(late)
    for _ in range(3):
        finish_prefills(s)
        assert late.status is RequestStatus.WAITING  # the running batch has not drained
    for r in first:
        s.finish(r, "length")
    finish_prefills(s)
    assert late.status is RequestStatus.RUNNING

    cont = Scheduler(KVCacheManager(64, 4), max_num_seqs=8, max_num_batched_tokens=100, max_model_len=64)
    cont.add_request(req(0, 5))
    finish_prefills(cont)
    joiner = req(1, 5)
    cont.add_request(joiner)
    finish_prefills(cont)
    assert joiner.status is RequestStatus.RUNNING  # continuous: joins the running batch at once


def test_max_num_seqs_caps_the_batch_fcfs() -> None:
    s = Scheduler(KVCacheManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100, max_model_len=64)
    rs = [req(i, 3) for i in range(4)]
    for r in rs:
        s.add_request(r)
    out = s.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["r0", "r1"]
    for r, _ in out.scheduled:
        r.append_token(0)
    s.abort("r0")
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("r1", 1), ("r2", 3)]
    assert rs[0].status is RequestStatus.FINISHED and rs[0].finish_reason == "abort"
