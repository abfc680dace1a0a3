"""A step's inputs without host syncs (engine/model_runner.py): staged uploads, logit rows, counts.

On a CPU the staging path runs unpinned (``StepInputs(staged=True)``): the same metadata as a
plain step, written into buffers that persist between steps. A step through the Triton backend
(its kernels in Triton's interpreter) reads no scalar back from a tensor: counted at the
dispatcher (``aten._local_scalar_dense`` is what ``.item()``, ``int(t)`` and ``.tolist()`` run,
and what makes a CUDA host wait for the GPU); the old path (the longest query read back from
``cu_seqlens_q``) is counted as the positive control.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from plimsoll.runtime import LLM
from plimsoll.runtime.engine.model_runner import StepInputs
from plimsoll.runtime.engine.request import Request
from plimsoll.runtime.engine.sampling_params import SamplingParams
from plimsoll.runtime.engine.scheduler import SchedulerOutput


def booked(
    rid: str, tokens: list[int], computed: int, blocks: list[int], spec: list[int] | None = None
) -> Request:
    req = Request(rid, rid, 0, tokens, SamplingParams(), frozenset())
    req.spec_token_ids = spec or []
    req.num_computed_tokens, req.block_ids = computed, blocks
    return req


def steps() -> list[SchedulerOutput]:
    a = booked("a", [5, 9, 13, 2, 7, 7, 1], 7, [0, 1])
    b = booked("b", [30, 31, 32, 33, 34], 3, [2, 3])
    c = booked("c", list(range(40, 50)), 10, [4, 5, 6])
    d = booked("d", [8, 8, 8, 8], 4 + 2, [7, 8], spec=[8, 8])
    return [
        SchedulerOutput(scheduled=[(a, 7), (b, 3)]),  # a prefill that samples, a chunk that does not
        SchedulerOutput(scheduled=[(c, 1), (a, 1)]),  # decode only
        SchedulerOutput(scheduled=[(d, 3), (c, 2), (b, 3)]),  # a verify row group, a last chunk, a chunk
    ]


class ScalarReads(TorchDispatchMode):
    """Counts the ops that read a tensor's value back to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_staged_uploads_equal_plain_ones_and_reuse_their_buffers(tiny_model_dir: Any) -> None:
    llm = LLM(model=str(tiny_model_dir("llama")), kv_cache_memory="1MiB", max_model_len=64, block_size=4)
    runner = llm.engine.runner
    staged = StepInputs(torch.device("cpu"), staged=True)
    pointers = []
    for sched in steps():
        plan, _ = runner.plan(sched)
        runner.inputs = staged
        up = runner.upload(plan)
        assert up.input_ids is not plan.input_ids
        for name in ("slot_mapping", "block_tables", "cu_seqlens_q", "context_lens"):
            assert torch.equal(getattr(up.meta, name), getattr(plan.meta, name)), name
        assert torch.equal(up.input_ids, plan.input_ids) and torch.equal(up.positions, plan.positions)
        assert up.meta.max_q_len == plan.meta.max_q_len
        pointers.append(up.input_ids.data_ptr())
    assert len(set(pointers)) == 1  # one persistent buffer, not an allocation a step
    big = staged.upload("input_ids", torch.arange(100))
    assert torch.equal(big, torch.arange(100)) and staged._device["input_ids"].numel() == 128  # grown


def test_verify_rows_and_samples_come_from_the_plan(tiny_model_dir: Any) -> None:
    llm = LLM(model=str(tiny_model_dir("llama")), kv_cache_memory="1MiB", max_model_len=64, block_size=4)
    plan, last_rows = llm.engine.runner.plan(steps()[2])
    assert last_rows == [2, 4, -1]  # d after its last proposal, c at its prompt's end; b is mid-prompt
    assert plan.logit_rows == [0, 1, 2, 4]  # d's last known token and both proposals, then c's
    assert plan.meta.max_q_len == 3 and plan.meta.cu_seqlens_q.tolist() == [0, 3, 5, 8]


def test_logit_rows_are_sliced_when_contiguous_and_gathered_otherwise(tiny_model_dir: Any) -> None:
    llm = LLM(model=str(tiny_model_dir("llama")), kv_cache_memory="1MiB", max_model_len=64)
    runner = llm.engine.runner
    hidden = torch.randn(10, 4)
    rows = runner._select_rows(hidden, [3, 4, 5])
    assert rows.data_ptr() == hidden[3].data_ptr()  # a view: no index tensor, no copy
    picked = runner._select_rows(hidden, [1, 4, 9])
    assert torch.equal(picked, hidden[[1, 4, 9]])


def test_a_triton_step_reads_nothing_back_from_the_device(
    tiny_model_dir: Any, triton_interpret: None
) -> None:
    llm = LLM(
        model=str(tiny_model_dir("llama")),
        attention_backend="triton",
        kv_cache_memory="1MiB",
        max_model_len=64,
        block_size=4,
    )
    runner = llm.engine.runner
    for sched in steps():
        with ScalarReads() as reads:
            runner.execute(sched)
        assert reads.count == 0, f"{reads.count} host reads in a step of {[n for _, n in sched.scheduled]}"
    # The control: the longest query read back from cu_seqlens_q (what the step used to do) counts.
    from plimsoll.runtime.attention import triton_backend

    ids, _, meta, _ = runner.prepare(steps()[0])
    q = torch.randn(ids.shape[0], 4, 16)
    k_cache, v_cache = runner.kv_caches[0]
    triton_backend._q_len_memo = None
    with ScalarReads() as reads:
        triton_backend.paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.context_lens, 0.25
        )
    assert reads.count >= 1
