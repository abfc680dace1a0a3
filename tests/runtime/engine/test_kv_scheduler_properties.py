"""Property tests (hypothesis) for the block pool, KV cache manager and scheduler.

A pure-Python simulation drives the real ``Scheduler`` and ``KVCacheManager`` with
random arrivals, steps and aborts over a small token alphabet (so prefixes collide
and the prefix cache is hit), and "writes" each scheduled token into a fake KV
store so the test can check that every token a step attends to is really there —
including prefix-cache hits and blocks filled by another request in the same step.
"""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from plimsoll.runtime.engine.kv_cache_manager import KVCacheManager
from plimsoll.runtime.engine.request import Request, RequestStatus
from plimsoll.runtime.engine.sampling_params import SamplingParams
from plimsoll.runtime.engine.scheduler import Scheduler

BLOCK_SIZE = 4


def check_invariants(kv: KVCacheManager, sched: Scheduler) -> None:
    pool = kv.pool
    holders: dict[int, int] = {}
    for blocks in kv.req_blocks.values():
        for b in blocks:
            holders[b.block_id] = holders.get(b.block_id, 0) + 1
    for b in pool.blocks:
        assert b.ref_cnt >= 0, f"block {b.block_id} has a negative refcount"
        in_free = b.block_id in pool.free_queue
        assert in_free == (b.ref_cnt == 0), f"block {b.block_id} free={in_free} but ref_cnt={b.ref_cnt}"
        assert b.ref_cnt == holders.get(b.block_id, 0), f"block {b.block_id} refcount != number of holders"
    for h, b in pool.cached.items():
        assert b.block_hash == h
    for req in sched.running:
        assert req.status is RequestStatus.RUNNING
        assert len(req.block_ids) * BLOCK_SIZE >= req.num_computed_tokens
    for req in sched.waiting:
        assert req.request_id not in kv.req_blocks, "a waiting request holds blocks"
    assert len(sched.running) <= sched.max_num_seqs


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 12), st.integers(0, 2)),
        st.tuples(st.just("step"), st.integers(0, 0), st.integers(0, 0), st.integers(0, 0)),
        st.tuples(st.just("abort"), st.integers(0, 1000), st.integers(0, 0), st.integers(0, 0)),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(
    ops=ops,
    num_blocks=st.integers(8, 40),
    budget=st.integers(1, 48),
    max_seqs=st.integers(1, 6),
    caching=st.booleans(),
    policy=st.sampled_from(["continuous", "static"]),
    seed=st.integers(0, 2**16),
)
def test_kv_and_scheduler_invariants(
    ops: list[tuple[str, int, int, int]],
    num_blocks: int,
    budget: int,
    max_seqs: int,
    caching: bool,
    policy: str,
    seed: int,
) -> None:
    rng = random.Random(seed)
    max_model_len = num_blocks * BLOCK_SIZE
    kv = KVCacheManager(num_blocks, BLOCK_SIZE)
    sched = Scheduler(kv, max_seqs, budget, max_model_len, policy)
    # slot -> the context its KV was computed from: a token's K/V depend on every
    # token up to and including it, so that whole prefix is what must match.
    store: dict[int, tuple[int, ...]] = {}
    live: list[Request] = []
    counter = 0

    def step() -> None:
        out = sched.schedule()
        check_invariants(kv, sched)
        for req, n in out.scheduled:  # all writes of a step land before any read
            for p in range(req.num_computed_tokens - n, req.num_computed_tokens):
                store[req.block_ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE] = tuple(
                    req.all_token_ids[: p + 1]
                )
        for req, _ in out.scheduled:
            for p in range(req.num_computed_tokens):
                slot = req.block_ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                assert store.get(slot) == tuple(req.all_token_ids[: p + 1]), (
                    f"{req.request_id} reads a wrong KV at {p}"
                )
        for req, _ in out.scheduled:
            if req.num_computed_tokens == req.num_tokens:
                req.append_token(rng.randrange(3))
                if req.num_output_tokens >= (req.params.max_tokens or 0) or req.num_tokens >= max_model_len:
                    sched.finish(req, "length")
                    live.remove(req)

    for kind, a, b, c in ops:
        if kind == "add":
            prompt_len = min(a, max_model_len - 1)
            # A tiny alphabet (and some all-zero prompts) makes shared prefixes common.
            prompt = [0] * prompt_len if c == 0 else [rng.randrange(2) for _ in range(prompt_len)]
            params = SamplingParams(max_tokens=b)
            salt = "" if caching else None
            req = Request(f"r{counter}", f"r{counter}", 0, prompt, params, frozenset(), cache_salt=salt)
            counter += 1
            sched.add_request(req)
            live.append(req)
        elif kind == "step":
            step()
        elif live:
            victim = live.pop(a % len(live))
            sched.abort(victim.request_id)
        check_invariants(kv, sched)

    # Drain: run to completion (abort a third of what is left on the way).
    for req in list(live)[::3]:
        sched.abort(req.request_id)
        live.remove(req)
    for _ in range(10_000):
        if not sched.num_unfinished:
            break
        step()
    assert not sched.num_unfinished, "requests left after draining: the scheduler stalled"
    check_invariants(kv, sched)
    assert kv.num_free_blocks == num_blocks, "blocks still referenced after every request ended"
    assert not kv.req_blocks
