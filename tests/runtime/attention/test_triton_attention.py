"""The Triton attention kernels against the torch backend (the oracle), on a CPU.

The kernels run in Triton's interpreter (TRITON_INTERPRET=1, set by a fixture for
this module only), in fp32 — bf16 arithmetic is wrong there — plus one bf16-cache
case that checks the kernels' cast-after-load. Shapes are small (the interpreter
runs each program in Python) but cover what the engine sends: ragged batches,
GQA, shuffled non-contiguous block tables padded with -1, prefix hits (context
longer than the queries), decode-only, mixed and empty-query batches.

A slow test compiles every kernel for sm_90 (H200) without a GPU, which catches
what the interpreter lets through, and checks ptxas spills no registers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from triton_sm90 import assert_no_spills, run_sm90

from plimsoll.runtime.attention import reference as attention_torch
from plimsoll.runtime.attention import triton_backend as attention_triton

pytestmark = pytest.mark.usefixtures("triton_interpret")


@dataclass
class Batch:
    """One attention call's inputs, with a KV cache already filled."""

    query: torch.Tensor  # [N, H, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32, -1 padded
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    context_lens: torch.Tensor  # [B] int32
    scale: float

    def args(
        self,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]:
        return (
            self.query,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.cu_seqlens_q,
            self.context_lens,
            self.scale,
        )


def make_batch(
    context_lens: list[int],
    q_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    spare_blocks: int = 7,
    seed: int = 0,
) -> Batch:
    """Random cache whose blocks are handed out to sequences in shuffled order."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks  # spare blocks hold garbage nobody may read
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.full((len(context_lens), max(blocks_per_seq) + 2), -1, dtype=torch.int32)
    for b, n in enumerate(blocks_per_seq):
        block_tables[b, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    query = torch.randn((int(cu[-1]), num_heads, head_dim), generator=gen).to(dtype)
    return Batch(
        query,
        k_cache,
        v_cache,
        block_tables,
        cu,
        torch.tensor(context_lens, dtype=torch.int32),
        head_dim**-0.5,
    )


def report(capsys: pytest.CaptureFixture[str], what: str, err: float) -> None:
    with capsys.disabled():
        print(f"\n[triton vs torch] {what}: max abs error {err:.3e}")


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.isfinite(a).all(), "kernel output has NaN/inf"
    return (a.float() - b.float()).abs().max().item()


def test_store_kv_writes_slots_and_skips_padding() -> None:
    num_blocks, block_size, hkv, d = 6, 4, 3, 16  # 3 KV heads: a non-power-of-two tile
    gen = torch.Generator().manual_seed(1)
    key, value = torch.randn((2, 9, hkv, d), generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:9]
    slots[[2, 7]] = -1  # padding tokens
    for dtype in (torch.float32, torch.bfloat16):  # a copy: bit-exact in either dtype
        caches = [torch.zeros((num_blocks, block_size, hkv, d), dtype=dtype) for _ in range(4)]
        attention_torch.store_kv(key.to(dtype), value.to(dtype), caches[0], caches[1], slots)
        attention_triton.store_kv(key.to(dtype), value.to(dtype), caches[2], caches[3], slots)
        assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
        # exactly the 7 real tokens were written, padding left nothing behind
        assert int((caches[2].abs().sum(dim=(2, 3)) != 0).sum()) == 7


def test_prefill_ragged_gqa_prefix_hits(capsys: pytest.CaptureFixture[str]) -> None:
    # full prefill (q == ctx), prefix hits (q < ctx), a query longer than one 16-row
    # tile, and a decoding sequence in the same batch (mixed)
    batch = make_batch(
        [37, 29, 24, 11], [37, 5, 17, 1], num_heads=6, num_kv_heads=2, head_dim=32, block_size=4
    )
    expected = attention_torch.paged_attention(*batch.args())
    got = attention_triton.paged_attention(*batch.args())
    err = max_err(got, expected)
    report(capsys, "prefill/mixed fp32 (ctx 37,29,24,11; q 37,5,17,1; 6:2 heads; d 32; block 4)", err)
    assert err < 1e-5


def test_chunked_prefill_block16_matches_one_shot(capsys: pytest.CaptureFixture[str]) -> None:
    # Block size 16, 4:2 GQA, head_dim 16; the same sequence prefilled in one go and
    # as the second chunk after a 21-token prefix must give the same last rows.
    full = make_batch(
        [40, 19, 33], [40, 19, 12], num_heads=4, num_kv_heads=2, head_dim=16, block_size=16, seed=3
    )
    got = attention_triton.paged_attention(*full.args())
    err = max_err(got, attention_torch.paged_attention(*full.args()))
    report(capsys, "prefill fp32 (ctx 40,19,33; q 40,19,12; 4:2 heads; d 16; block 16)", err)
    assert err < 1e-5
    chunk = Batch(
        full.query[19:40],
        full.k_cache,
        full.v_cache,
        full.block_tables[:1],
        torch.tensor([0, 21], dtype=torch.int32),
        full.context_lens[:1],
        full.scale,
    )
    assert max_err(attention_triton.paged_attention(*chunk.args()), got[19:40]) < 1e-5


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "num_kv_splits"), [(4, 2, 1), (4, 2, 3), (2, 2, 2), (8, 1, 16)]
)
def test_decode_splits_gqa(
    num_heads: int, num_kv_heads: int, num_kv_splits: int, capsys: pytest.CaptureFixture[str]
) -> None:
    # contexts from 1 token (fewer tokens than splits) to several 64-token tiles;
    # GQA, plain multi-head (group 1) and multi-query (one KV head)
    batch = make_batch(
        [1, 70, 130, 16],
        [1, 1, 1, 1],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=16,
        block_size=16,
    )
    expected = attention_torch.paged_attention(*batch.args())
    got = attention_triton.paged_attention(*batch.args(), num_kv_splits=num_kv_splits)  # all decode rows
    err = max_err(got, expected)
    what = f"{num_kv_splits} KV split(s) (ctx 1,70,130,16; {num_heads}:{num_kv_heads} heads; d 16)"
    report(capsys, f"decode fp32, {what}", err)
    assert err < 1e-5


def test_paged_attention_dispatches_decode_and_skips_empty_queries(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # a sequence with no query this step (q_len 0) sits between decoding ones
    batch = make_batch([9, 33, 5], [1, 0, 1], num_heads=6, num_kv_heads=2, head_dim=32, block_size=4, seed=5)
    got = attention_triton.paged_attention(*batch.args())
    assert got.shape == (2, 6, 32)
    err = max_err(got, attention_torch.paged_attention(*batch.args()))
    report(capsys, "decode via paged_attention with an empty query (6:2 heads; d 32; block 4)", err)
    assert err < 1e-5


def test_strided_views_as_the_model_makes_them(capsys: pytest.CaptureFixture[str]) -> None:
    # q, k, v as views of one fused projection [N, (H + 2 Hkv) * D]; block tables a
    # column slice of a wider table. Only the last axis is contiguous.
    batch = make_batch([14, 6], [3, 6], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, seed=9)
    n, h, hkv, d = 9, 4, 2, 16
    fused = torch.randn(n, (h + 2 * hkv) * d)
    q = fused[:, : h * d].view(n, h, d)
    k = fused[:, h * d : (h + hkv) * d].view(n, hkv, d)
    v = fused[:, (h + hkv) * d :].view(n, hkv, d)
    assert not q.is_contiguous() and not k.is_contiguous()
    wide = torch.full((2, 12), -1, dtype=torch.int32)
    wide[:, 3 : 3 + batch.block_tables.shape[1]] = batch.block_tables
    tables = wide[:, 3 : 3 + batch.block_tables.shape[1]]
    # the new tokens' slots: positions 11..13 of sequence 0, 0..5 of sequence 1
    new_positions = [(0, p) for p in range(11, 14)] + [(1, p) for p in range(6)]
    slots = torch.tensor([int(batch.block_tables[b, p // 4]) * 4 + p % 4 for b, p in new_positions])
    caches = [c.clone() for c in (batch.k_cache, batch.v_cache, batch.k_cache, batch.v_cache)]
    attention_torch.store_kv(k, v, caches[0], caches[1], slots)
    attention_triton.store_kv(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    args = (q, caches[0], caches[1], tables, batch.cu_seqlens_q, batch.context_lens, batch.scale)
    err = max_err(attention_triton.paged_attention(*args), attention_torch.paged_attention(*args))
    report(capsys, "strided q/k/v views and a sliced block table", err)
    assert err < 1e-5


def test_bf16_cache_is_computed_in_fp32(capsys: pytest.CaptureFixture[str]) -> None:
    # bf16 in, bf16 out; the kernels must cast to fp32 right after loading, or the
    # interpreter's bf16 arithmetic returns garbage. Compare with the oracle run in fp32.
    batch = make_batch(
        [20, 45], [1, 1], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.bfloat16, seed=7
    )
    got = attention_triton.paged_attention(*batch.args())
    assert got.dtype == torch.bfloat16
    f32 = Batch(
        batch.query.float(),
        batch.k_cache.float(),
        batch.v_cache.float(),
        batch.block_tables,
        batch.cu_seqlens_q,
        batch.context_lens,
        batch.scale,
    )
    err = max_err(got.float(), attention_torch.paged_attention(*f32.args()))
    report(capsys, "decode bf16 cache vs fp32 oracle", err)
    assert err < 1e-2  # bf16 rounding of the output only


def test_store_then_attend_equals_dense_causal_attention() -> None:
    # Independent of attention_torch: keys written by the Triton store kernel, read
    # by the Triton attention, compared with plain softmax(QK^T)V on dense tensors.
    gen = torch.Generator().manual_seed(11)
    seq_len, h, hkv, d, block_size = 23, 4, 2, 16, 4
    q, k, v = (torch.randn((seq_len, n, d), generator=gen) for n in (h, hkv, hkv))
    cache_k, cache_v = torch.zeros((2, 12, block_size, hkv, d))
    blocks = torch.tensor([9, 2, 11, 0, 5, 7], dtype=torch.int32)  # shuffled, non-contiguous
    slots = blocks.long().repeat_interleave(block_size) * block_size + torch.arange(block_size).repeat(6)
    attention_triton.store_kv(k, v, cache_k, cache_v, slots[:seq_len])
    out = attention_triton.paged_attention(
        q,
        cache_k,
        cache_v,
        blocks[None, :],
        torch.tensor([0, seq_len], dtype=torch.int32),
        torch.tensor([seq_len], dtype=torch.int32),
        d**-0.5,
    )
    kk, vv = k.repeat_interleave(h // hkv, dim=1), v.repeat_interleave(h // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, kk) * d**-0.5
    scores.masked_fill_(torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1), float("-inf"))
    dense = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)
    assert max_err(out, dense) < 1e-5


def test_cpu_without_interpreter_is_refused_with_advice(monkeypatch: pytest.MonkeyPatch) -> None:
    batch = make_batch([4], [1], num_heads=2, num_kv_heads=1, head_dim=16, block_size=4)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="attention_backend='torch'"):
        attention_triton.paged_attention(*batch.args())


def test_bad_shapes_are_named() -> None:
    batch = make_batch([4], [1], num_heads=3, num_kv_heads=2, head_dim=16, block_size=4)
    with pytest.raises(ValueError, match=r"num_heads \(3\) must be a multiple of num_kv_heads \(2\)"):
        attention_triton.paged_attention(*batch.args())
    with pytest.raises(ValueError, match="one slot per token"):
        attention_triton.store_kv(
            torch.zeros(3, 2, 16),
            torch.zeros(3, 2, 16),
            batch.k_cache[:, :, :2],
            batch.v_cache[:, :, :2],
            torch.zeros(2, dtype=torch.int64),
        )


def test_longest_query_is_computed_once_per_step_tensor() -> None:
    cu = torch.tensor([0, 1, 4, 5], dtype=torch.int32)
    assert attention_triton._max_q_len(cu) == 3
    cu[2] = 2  # an in-place change bumps the version: recomputed, not remembered
    assert attention_triton._max_q_len(cu) == 3
    cu[3] = 9
    assert attention_triton._max_q_len(cu) == 7
    assert attention_triton._max_q_len(torch.tensor([0, 1, 2], dtype=torch.int32)) == 1
    with torch.inference_mode():  # no version counter: remembered by identity alone
        assert attention_triton._max_q_len(torch.tensor([0, 2, 3], dtype=torch.int32)) == 2


@pytest.mark.slow
def test_engine_greedy_tokens_equal_with_triton_backend(tiny_model_dir: Any) -> None:
    # The engine's own metadata (slot mapping, block tables, cu_seqlens) through the
    # kernels: a small token budget chunks prefills into mixed prefill+decode steps,
    # and two prompts share a 20-token prefix (a prefix-cache hit).
    from plimsoll.runtime import LLM, SamplingParams

    directory = tiny_model_dir("llama")
    shared = list(range(40, 60))
    prompts = [[*shared, 7, 8, 9], list(range(100, 137)), shared + list(range(200, 211)), [5]]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            model=str(directory), attention_backend=backend, max_num_batched_tokens=24, kv_cache_memory="2MiB"
        )
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens["triton"] == tokens["torch"]


_COMPILE_SCRIPT = """
    from plimsoll.runtime.attention import triton_backend as at

    kernels = at._kernels(False)
    INT_PTRS = {"slot_mapping_ptr": "*i64", "block_tables_ptr": "*i32",
                "cu_seqlens_q_ptr": "*i32", "context_lens_ptr": "*i32"}
    F32_PTRS = {"part_acc_ptr", "part_max_ptr", "part_sum_ptr", "k_scale_ptr", "v_scale_ptr"}

    def compile_one(fn, dtype, constexprs):
        sig = {}
        for name in inspect.signature(fn.fn).parameters:
            sig[name] = ("constexpr" if name in constexprs else INT_PTRS.get(name)
                         or ("*i8" if constexprs.get("KV_INT8") and name in ("k_cache_ptr", "v_cache_ptr") else None)
                         or ("*fp32" if name in F32_PTRS else None)
                         or ("*" + dtype if name.endswith("_ptr") else "fp32" if name == "scale" else "i32"))
        usage = compile_sm90(fn, sig, constexprs, at._GPU_NUM_WARPS)
        print(fn.fn.__name__, dtype, "int8 KV" if constexprs.get("KV_INT8") else "", usage, flush=True)

    d, page = 128, 16
    for dtype in ("bf16", "fp32"):
        compile_one(kernels.prefill, dtype, dict(GROUP=4, HEAD_DIM=d, PAGE_SIZE=page, BLOCK_M=at._GPU_PREFILL_BLOCK_M,
                    BLOCK_N=at._GPU_PREFILL_BLOCK_N, BLOCK_D=d, COMPUTE_F32=dtype == "fp32", KV_INT8=False))
        compile_one(kernels.decode, dtype, dict(GROUP=4, HEAD_DIM=d, PAGE_SIZE=page, BLOCK_G=16, BLOCK_D=d,
                    BLOCK_N=at._GPU_DECODE_BLOCK_N, COMPUTE_F32=dtype == "fp32", KV_INT8=False))
    for kernel, extra in ((kernels.prefill, dict(BLOCK_M=at._GPU_PREFILL_BLOCK_M, BLOCK_N=at._GPU_PREFILL_BLOCK_N)),
                          (kernels.decode, dict(BLOCK_G=16, BLOCK_N=at._GPU_DECODE_BLOCK_N))):
        compile_one(kernel, "bf16", dict(GROUP=4, HEAD_DIM=d, PAGE_SIZE=page, BLOCK_D=d, COMPUTE_F32=False,
                    KV_INT8=True, **extra))  # --kv-cache-dtype int8
    compile_one(kernels.merge, "bf16", dict(HEAD_DIM=d, BLOCK_S=at._MAX_KV_SPLITS, BLOCK_D=d))
    for kv_int8 in (False, True):  # --kv-cache-dtype int8: quantised in the kernel
        compile_one(kernels.store_kv, "bf16", dict(NUM_KV_HEADS=8, HEAD_DIM=d, PAGE_SIZE=page, BLOCK_H=8, BLOCK_D=d,
                    KV_INT8=kv_int8))
    """


@pytest.mark.slow
def test_kernels_compile_for_sm90_without_spills() -> None:
    compiled = run_sm90(_COMPILE_SCRIPT)
    assert len(compiled) == 9, compiled
    assert_no_spills(compiled)
