"""CUDA graphs of the decode forward (engine/cuda_graphs.py).

On a CPU no graph can be captured: ``capture=False`` runs the very buffers, padding and
row selection the graphs replay, eagerly, with the Triton kernels in Triton's
interpreter, and greedy output must equal the plain (unpadded, per-step tensors) path.
On a GPU (skipped here; scripts/gpu_check.py runs it) the real capture is checked the
same way against ``enforce_eager``.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from plimsoll.runtime import LLM, SamplingParams
from plimsoll.runtime.engine.cuda_graphs import capture_sizes, ineligible_reason


def test_capture_sizes_follow_vllm_and_always_cover_max_num_seqs() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(4096)[-1] == 512


def test_ineligible_reasons_name_what_to_change() -> None:
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert ineligible_reason(cuda, "triton", False) is None
    assert "enforce_eager" in str(ineligible_reason(cuda, "triton", True))
    assert "cpu" in str(ineligible_reason(cpu, "triton", False))
    assert "triton" in str(ineligible_reason(cuda, "torch", False))
    assert "tensor parallelism" in str(ineligible_reason(cuda, "triton", False, tensor_parallel=True))


def test_cpu_engine_captures_nothing(tiny_model_dir: Any) -> None:
    llm = LLM(model=str(tiny_model_dir("llama")), kv_cache_memory="4MiB", max_model_len=256)
    assert llm.engine.runner.decode_graphs is None


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.choice([1, 3, 9, 17, 30]))] for _ in range(n)]


def test_padded_static_buffers_match_the_plain_path(tiny_model_dir: Any, triton_interpret: None) -> None:
    # max_num_seqs 6 -> graphs of 1, 2, 4 and 6 rows: 10 prompts of different lengths finish at
    # different steps, so decode batches of 6 down to 1 replay with 0-3 padding rows; a token
    # budget of 12 chunks the longer prompts, so some steps mix in prefill and run plainly.
    common: dict[str, Any] = dict(
        model=str(tiny_model_dir("llama")),
        attention_backend="triton",
        kv_cache_memory="4MiB",
        max_model_len=256,
        max_num_seqs=6,
        max_num_batched_tokens=12,
        block_size=4,
    )
    batch = prompts(10, seed=1)
    params = [
        SamplingParams(temperature=0, max_tokens=random.Random(i).choice([3, 8, 14]), ignore_eos=True)
        for i in range(10)
    ]
    plain = LLM(**common)
    want = [o.outputs[0].token_ids for o in plain.generate(batch, params)]
    padded = LLM(**common)
    runner = padded.engine.runner
    runner.enable_cuda_graphs(6, padded.engine.max_model_len, capture=False)
    assert runner.decode_graphs is not None and runner.decode_graphs.sizes == [1, 2, 4, 6]
    got = [o.outputs[0].token_ids for o in padded.generate(batch, params)]
    assert got == want
    assert runner.graph_replays > 0  # decode steps went through the static buffers


@pytest.mark.gpu
def test_captured_graphs_equal_eager_on_gpu(tiny_model_dir: Any) -> None:
    common: dict[str, Any] = dict(
        model=str(tiny_model_dir("llama")),
        device="cuda",
        dtype="float32",
        attention_backend="triton",
        kv_cache_memory="64MiB",
        max_model_len=512,
        max_num_seqs=24,
        max_num_batched_tokens=64,
    )
    batch = prompts(32, seed=2)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    eager = LLM(**common, enforce_eager=True)
    assert eager.engine.runner.decode_graphs is None
    want = [o.outputs[0].token_ids for o in eager.generate(batch, params)]
    graphs = LLM(**common)
    assert graphs.engine.runner.decode_graphs is not None
    got = [o.outputs[0].token_ids for o in graphs.generate(batch, params)]
    assert got == want
    assert graphs.engine.runner.graph_replays > 0


def booked(rid: str, prompt: list[int], outputs: list[int], blocks: list[int]) -> tuple[Any, int]:
    """A decoding request as the scheduler leaves it: this step's one token already booked."""
    from plimsoll.runtime.engine.request import Request

    req = Request(rid, rid, 0, prompt, SamplingParams(), frozenset())
    for t in outputs:
        req.append_token(t)
    req.num_computed_tokens = req.num_tokens
    req.block_ids = blocks
    return req, 1


def test_one_padded_step_writes_only_its_slots_and_matches_the_plain_step(
    tiny_model_dir: Any, triton_interpret: None
) -> None:
    # 3 sequences replay the 4-row buffers: the padding row must store nothing (every other
    # slot of every layer's cache keeps its value, block 0 included) and read nothing, and the
    # logits and caches must equal the plain path's on the same step.
    from plimsoll.runtime.engine.scheduler import SchedulerOutput

    llm = LLM(
        model=str(tiny_model_dir("llama")),
        attention_backend="triton",
        kv_cache_memory="1MiB",
        max_model_len=64,
        max_num_seqs=4,
        block_size=4,
    )
    runner = llm.engine.runner
    gen = torch.Generator().manual_seed(3)
    for k, v in runner.kv_caches:
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    start = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    sched = SchedulerOutput(
        scheduled=[
            booked("a", [5, 6, 7, 8, 9], [10, 11], [3, 1]),  # 7 tokens: slot 1*4 + 2
            booked("b", [12], [], [2]),  # a one-token prompt's first decode: slot 8
            booked("c", list(range(20, 33)), [40], [6, 4, 5, 7]),  # 14 tokens: slot 7*4 + 1
        ]
    )
    plain_reqs, plain_logits = runner.execute(sched)
    plain_caches = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    for (k, v), (k0, v0) in zip(runner.kv_caches, start, strict=True):
        k.copy_(k0)
        v.copy_(v0)
    runner.enable_cuda_graphs(4, 64, capture=False)
    assert runner.decode_graphs is not None and runner.decode_graphs.size_for(3) == 4
    reqs, logits = runner.execute(sched)
    assert runner.graph_replays == 1
    assert [r.request_id for r in reqs] == [r.request_id for r in plain_reqs] == ["a", "b", "c"]
    torch.testing.assert_close(logits, plain_logits, rtol=1e-5, atol=1e-5)
    written = {6, 8, 29}
    for (k, v), (pk, pv), (k0, v0) in zip(runner.kv_caches, plain_caches, start, strict=True):
        assert torch.equal(k, pk) and torch.equal(v, pv)
        changed = {
            int(s) for s in ((k != k0).flatten(2).any(-1) | (v != v0).flatten(2).any(-1)).flatten().nonzero()
        }
        assert changed == written


def test_fixed_k_verify_steps_replay_their_own_graphs(tiny_model_dir: Any, triton_interpret: None) -> None:
    # Three sequences each verifying k = 2 proposals (3 query tokens) replay the 3-token buffers
    # of size 4 (the prefill kernel over a fixed grid, one padding sequence with no context): the
    # same logits (3 rows a sequence) and the same caches as the plain step.
    from plimsoll.runtime.engine.scheduler import SchedulerOutput

    def verifying(rid: str, prompt: list[int], outputs: list[int], spec: list[int], blocks: list[int]) -> Any:
        req, _ = booked(rid, prompt, outputs, blocks)
        req.spec_token_ids = spec
        req.num_computed_tokens = req.num_tokens + len(spec)
        return req, 1 + len(spec)

    common: dict[str, Any] = dict(
        model=str(tiny_model_dir("llama")),
        attention_backend="triton",
        kv_cache_memory="1MiB",
        max_model_len=64,
        max_num_seqs=4,
        block_size=4,
    )
    sched = SchedulerOutput(
        scheduled=[
            verifying("a", [5, 6, 7, 8, 9], [10], [11, 12], [3, 1]),
            verifying("b", [12, 13], [], [14, 15], [2]),
            verifying("c", list(range(20, 31)), [40], [41, 42], [6, 4, 5, 7]),
        ]
    )
    plain = LLM(**common).engine.runner
    graphed = LLM(**common).engine.runner
    graphed.enable_cuda_graphs(4, 64, capture=False, num_speculative_tokens=2)
    assert graphed.verify_graphs is not None and graphed.verify_graphs.eligible(sched.scheduled)
    assert graphed.decode_graphs is not None and not graphed.decode_graphs.eligible(sched.scheduled)
    plain_reqs, plain_logits = plain.execute(sched)
    reqs, logits = graphed.execute(sched)
    assert graphed.verify_graphs.replays == 1 and graphed.decode_graphs.replays == 0
    assert [r.request_id for r in reqs] == [r.request_id for r in plain_reqs] == ["a", "b", "c"]
    assert logits.shape == plain_logits.shape == (9, 259)
    torch.testing.assert_close(logits, plain_logits, rtol=1e-5, atol=1e-5)
    for (k, v), (pk, pv) in zip(graphed.kv_caches, plain.kv_caches, strict=True):
        assert torch.equal(k, pk) and torch.equal(v, pv)
    # One sequence with a single proposal makes the step non-uniform: it runs without the graphs.
    sched.scheduled[1] = verifying("b", [12, 13], [], [14], [2])
    assert not graphed.verify_graphs.eligible(sched.scheduled)


def test_lora_servers_replay_graphs_for_base_only_steps(
    tiny_model_dir: Any, triton_interpret: None, tmp_path: Any
) -> None:
    from plimsoll.runtime.testing import write_random_lora

    base = tiny_model_dir("llama")
    adapter = write_random_lora(base, tmp_path / "lora", 4, ("q_proj", "v_proj", "down_proj"), 8.0, 3)
    common: dict[str, Any] = dict(
        model=str(base),
        attention_backend="triton",
        kv_cache_memory="4MiB",
        max_model_len=128,
        max_num_seqs=4,
        block_size=4,
        enable_lora=True,
        max_lora_rank=8,
        lora_modules=[{"name": "ad", "path": str(adapter)}],
    )
    batch = prompts(4, seed=6)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = LLM(**common)
    want_base = [o.outputs[0].token_ids for o in plain.generate(batch, params)]
    want_ad = [o.outputs[0].token_ids for o in plain.engine.generate(batch, params, ["ad"] * 4)]
    llm = LLM(**common)
    runner = llm.engine.runner
    runner.enable_cuda_graphs(4, llm.engine.max_model_len, capture=False)
    graphs = runner.decode_graphs
    assert graphs is not None
    assert [o.outputs[0].token_ids for o in llm.generate(batch, params)] == want_base
    base_replays = graphs.replays
    assert base_replays > 0  # base-only decode steps went through the graph buffers
    assert [o.outputs[0].token_ids for o in llm.engine.generate(batch, params, ["ad"] * 4)] == want_ad
    assert graphs.replays == base_replays  # adapter steps never replay a graph captured without LoRA
