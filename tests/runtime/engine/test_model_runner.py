"""ModelRunner.prepare: the tensor-built step metadata equals a per-token Python reference."""

from typing import Any

import torch

from plimsoll.runtime.engine.model_runner import ModelRunner, StepInputs
from plimsoll.runtime.engine.request import Request
from plimsoll.runtime.engine.sampling_params import SamplingParams
from plimsoll.runtime.engine.scheduler import SchedulerOutput


def booked(
    prompt_len: int, outputs: int, computed_after: int, num_new: int, blocks: list[int]
) -> tuple[Request, int]:
    """A request as the scheduler leaves it: this step's ``num_new`` tokens already booked."""
    req = Request("r", "r", 0, list(range(10, 10 + prompt_len)), SamplingParams(), frozenset())
    for t in range(outputs):
        req.append_token(500 + t)
    req.num_computed_tokens = computed_after
    req.block_ids = blocks
    return req, num_new


def test_prepare_matches_per_token_reference() -> None:
    bs = 4
    runner = ModelRunner.__new__(ModelRunner)  # prepare needs no model or KV tensors
    runner.block_size, runner.device = bs, torch.device("cpu")
    runner.inputs = StepInputs(runner.device)
    sched = SchedulerOutput(
        scheduled=[
            booked(10, 0, 10, 10, [7, 2, 9]),  # fresh prefill, samples
            booked(9, 3, 12, 1, [4, 0, 5]),  # decode
            booked(20, 0, 12, 4, [1, 3, 6, 8, 11]),  # a middle chunk after a prefix hit: no sample
            booked(6, 0, 6, 2, [10, 12]),  # last chunk of a prompt: samples
        ]
    )
    _, _, meta, last_rows = check_against_reference(runner, sched, bs)
    assert meta.block_tables.tolist() == [
        [7, 2, 9, -1, -1],
        [4, 0, 5, -1, -1],
        [1, 3, 6, 8, 11],
        [10, 12, -1, -1, -1],
    ]
    assert meta.max_q_len == 10
    assert last_rows == [9, 10, -1, 16]


def test_decode_only_steps_take_the_list_path_and_match_too() -> None:
    # One token per sequence: positions and slots are built from the lists, not tensor ops.
    bs = 4
    runner = ModelRunner.__new__(ModelRunner)
    runner.block_size, runner.device = bs, torch.device("cpu")
    runner.inputs = StepInputs(runner.device)
    sched = SchedulerOutput(
        scheduled=[
            booked(9, 3, 12, 1, [4, 0, 5]),  # the last slot of a block
            booked(9, 4, 13, 1, [4, 0, 5, 8]),  # the first slot of a new block
            booked(1, 0, 1, 1, [6]),  # a one-token prompt
        ]
    )
    _, _, meta, last_rows = check_against_reference(runner, sched, bs)
    assert meta.max_q_len == 1 and last_rows == [0, 1, 2]
    assert meta.slot_mapping.tolist() == [5 * 4 + 3, 8 * 4 + 0, 6 * 4 + 0]


def check_against_reference(runner: ModelRunner, sched: SchedulerOutput, bs: int) -> tuple[Any, ...]:
    ids, pos, meta, last_rows = runner.prepare(sched)
    exp_ids, exp_pos, exp_slots, cu, exp_last = [], [], [], [0], []
    for req, n in sched.scheduled:
        end = req.num_computed_tokens
        exp_ids += req.all_token_ids[end - n : end]
        exp_pos += list(range(end - n, end))
        exp_slots += [req.block_ids[p // bs] * bs + p % bs for p in range(end - n, end)]
        cu.append(cu[-1] + n)
        exp_last.append(cu[-1] - 1 if end == req.num_tokens else -1)
    assert ids.tolist() == exp_ids
    assert pos.tolist() == exp_pos
    assert meta.slot_mapping.tolist() == exp_slots and meta.slot_mapping.dtype == torch.int64
    assert meta.cu_seqlens_q.tolist() == cu
    assert meta.context_lens.tolist() == [req.num_computed_tokens for req, _ in sched.scheduled]
    assert last_rows == exp_last
    return ids, pos, meta, last_rows
