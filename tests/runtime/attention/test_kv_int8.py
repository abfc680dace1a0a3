"""``--kv-cache-dtype int8``: the block layout, every reader of an int8 cache against the oracle (the
CPU decode kernel on several block sizes, GQA and partly filled last blocks whose unused slots hold NaN),
the error against a float32 cache within a bound derived from the rounding, the engine end to
end, and the KV bytes the engine allocates against `plimsoll plan`'s arithmetic.

The bound: each stored value is within half a step ``s / 2`` of its float (``s = max|row| / 127``).
A key off by ``Δk`` moves a score by at most ``δ = scale · Σ|q| · max(s_k) / 2``, so each softmax
weight moves by a factor within ``e^{±2δ}`` and the output by at most
``max|Δv| + (e^{2δ} − 1) · max|v|``; the test checks every output element against it.
"""

from typing import Any

import pytest
import torch
from attention_batches import CASES, make_batch

from plimsoll.runtime.attention import kv_int8
from plimsoll.runtime.attention import reference as attention_torch
from plimsoll.runtime.attention import sdpa as attention_sdpa
from plimsoll.runtime.kernels import cpu_kernels


def test_rows_round_trip_within_half_a_step() -> None:
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn((50, 4, 64), generator=gen) * torch.rand((50, 4, 1), generator=gen) * 10
    rows[0, 0] = 0.0  # an all-zero row keeps a tiny positive scale, not a division by zero
    q, s = kv_int8.quantize_rows(rows)
    assert q.dtype == torch.int8 and q.shape == (50, 4, 64) and s.shape == (50, 4)
    back = q.float() * s[..., None]
    assert bool(((back - rows).abs() <= kv_int8.scale_error_bound(rows) * (1 + 1e-6)).all())
    assert bool((back[0, 0] == 0).all())


def test_block_layout_keeps_values_then_scales_in_each_block() -> None:
    # [num_blocks 3, block_size 4, Hkv 2, D 16]: each block is 4*2*16 value bytes, then 4*2 float32
    # scales; the value rows are D bytes apart (aligned), the views write into the one tensor.
    gen = torch.Generator().manual_seed(4)
    cache = torch.randn((3, 4, 2, 16), generator=gen)
    packed = kv_int8.quantize_cache(cache)
    assert packed.shape == (3, 4, 2, 20) and packed.dtype == torch.int8
    assert kv_int8.head_dim_of(packed) == 16
    values, scales = kv_int8.values(packed), kv_int8.scales(packed)
    assert values.stride() == (4 * 2 * 20, 2 * 16, 16, 1) and scales.stride() == (4 * 2 * 20 // 4, 2, 1)
    block = packed.view(3, -1)[1]
    q, s = kv_int8.quantize_rows(cache[1])
    assert torch.equal(block[: 4 * 2 * 16].view(4, 2, 16), q)
    assert torch.equal(block[4 * 2 * 16 :].view(torch.float32).view(4, 2), s)
    back = kv_int8.dequantize_cache(packed, torch.float32)
    assert bool(((back - cache).abs() <= kv_int8.scale_error_bound(cache) * (1 + 1e-6)).all())
    # store() writes one slot's values and scale and nothing else.
    before = packed.clone()
    row = torch.randn((1, 2, 16), generator=gen)
    kv_int8.store(packed, torch.tensor([6]), row)  # block 1, offset 2
    changed = (packed != before).view(3, -1).any(dim=1)
    assert changed.tolist() == [False, True, False]
    assert torch.allclose(
        kv_int8.read_blocks(packed, torch.tensor([1]), torch.float32)[0, 2], row[0], atol=0.05
    )
    with pytest.raises(ValueError, match="divisible by 4"):
        kv_int8.quantize_cache(torch.zeros((1, 4, 1, 6)))


def int8_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return kv_int8.quantize_cache(k_cache), kv_int8.quantize_cache(v_cache)


def error_bound(args: tuple[Any, ...], kq: torch.Tensor, vq: torch.Tensor) -> torch.Tensor:
    """Per query row and head: the bound of the module docstring, over that row's context."""
    query, k_cache, v_cache, *_, scale = args
    dk = (kv_int8.dequantize_cache(kq, torch.float32) - k_cache).abs().amax()
    dv = (kv_int8.dequantize_cache(vq, torch.float32) - v_cache).abs().amax()
    delta = scale * query.abs().sum(dim=-1, keepdim=True) * dk  # [N, H, 1]
    return dv + torch.expm1(2 * delta) * v_cache.abs().amax() + 1e-5


@pytest.mark.parametrize("case", sorted(CASES))
def test_int8_cache_readers_equal_the_oracle_and_stay_within_the_bound_of_fp32(case: str) -> None:
    ctx, q_lens = CASES[case]
    args = make_batch(ctx, q_lens, head_dim=64)
    query, k_cache, v_cache, tables, cu, lens, scale = args
    kq, vq = int8_caches(k_cache, v_cache)
    exact = attention_torch.paged_attention(*args)  # float32 cache
    oracle = attention_torch.paged_attention(query, kq, vq, tables, cu, lens, scale)
    sdpa = attention_sdpa.paged_attention(query, kq, vq, tables, cu, lens, scale)
    assert torch.allclose(sdpa, oracle, atol=2e-5), float((sdpa - oracle).abs().max())
    err = (oracle - exact).abs()
    bound = error_bound(args, kq, vq)
    assert bool((err <= bound).all()), f"max error / bound {float((err / bound).max()):.3f}"
    # The bound is not vacuous: the int8 cache does change the output, by well under the bound.
    assert 0 < float(err.max()) < float(bound.min())
    print(f"{case}: int8 vs fp32 KV max abs error {float(err.max()):.2e}, bound {float(bound.min()):.2e}")


# context lengths (decode rows), (query heads, KV heads), head_dim, block size: every context's last
# block is partly filled except where noted; head_dim 64 and 128 take the unrolled path, 36 the
# generic one.
KERNEL_CASES = {
    "block size 1, GQA 3": ([37, 5, 1, 90], (9, 3), 64, 1),
    "block size 4, GQA 3": ([37, 5, 16, 1, 90, 64], (6, 2), 64, 4),
    "block size 16, SmolLM2 heads": ([160, 171, 3, 17, 224, 96, 128], (9, 3), 64, 16),
    "block size 32, head_dim 128, GQA 4": ([33, 1, 70, 64], (8, 2), 128, 32),
    "block size 5, MHA": ([21, 7, 33], (4, 4), 64, 5),
    "block size 8, one KV head, head_dim 36": ([19, 8, 1], (4, 1), 36, 8),
}


def poison_unused_slots(cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor) -> None:
    """Every slot past a context's end in its last block, and every block no table names: values
    127, scales NaN, so a kernel that reads one returns NaN."""
    values, scales = kv_int8.values(cache), kv_int8.scales(cache)
    used = torch.zeros(cache.shape[:2], dtype=torch.bool)
    block_size = cache.shape[1]
    for b, ctx in enumerate(lens.tolist()):
        for t in range(ctx):
            used[int(tables[b, t // block_size]), t % block_size] = True
    values[~used] = 127
    scales[~used] = float("nan")


@pytest.mark.skipif(cpu_kernels.library() is None, reason="no C++ compiler: the kernel cannot be built here")
@pytest.mark.parametrize("case", sorted(KERNEL_CASES))
def test_compiled_decode_kernel_reads_the_block_layout(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ctx, heads, head_dim, block_size = KERNEL_CASES[case]
    args = make_batch(
        ctx,
        [1] * len(ctx),
        num_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        block_size=block_size,
    )
    query, k_cache, v_cache, tables, cu, lens, scale = args
    kq, vq = int8_caches(k_cache, v_cache)
    poison_unused_slots(kq, tables, lens)
    poison_unused_slots(vq, tables, lens)
    oracle = attention_torch.paged_attention(query, kq, vq, tables, cu, lens, scale)
    assert bool(torch.isfinite(oracle).all())
    assert cpu_kernels.supports_attention(query, kq, vq)
    got = cpu_kernels.decode_attention(query, kq, vq, tables, lens, scale)
    print(
        f"{case}: C++ int8-KV decode vs oracle on the same cache, max abs error {float((got - oracle).abs().max()):.2e}"
    )
    torch.testing.assert_close(got, oracle, rtol=1e-5, atol=1e-5)
    # Against the float32 cache it was quantised from: within the rounding's bound.
    err = (got - attention_torch.paged_attention(*args)).abs()
    assert bool((err <= error_bound(args, *int8_caches(k_cache, v_cache))).all())
    # The torch backend's decode hands the int8 cache to the kernel, and its SDPA fallback agrees.
    calls: list[int] = []
    real = cpu_kernels.decode_attention
    monkeypatch.setattr(cpu_kernels, "decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.testing.assert_close(
        attention_sdpa.paged_attention(*args[:1], kq, vq, *args[3:]), got, rtol=0, atol=0
    )
    assert calls == [1]
    clean_k, clean_v = int8_caches(k_cache, v_cache)  # SDPA gathers whole blocks (0 x NaN is NaN)
    fallback = attention_sdpa.sdpa_decode_attention(query, clean_k, clean_v, tables, lens, scale)
    torch.testing.assert_close(fallback, oracle, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(cpu_kernels.library() is None, reason="no C++ compiler: the kernel cannot be built here")
def test_compiled_decode_kernel_refuses_an_int8_head_dim_off_the_layout() -> None:
    query = torch.randn((1, 2, 6))
    cache = torch.zeros((2, 4, 1, 10), dtype=torch.int8)
    with pytest.raises(ValueError, match="divisible by 4"):
        cpu_kernels.decode_attention(
            query, cache, cache, torch.zeros((1, 1), dtype=torch.int32), torch.tensor([3]), 1.0
        )
    with pytest.raises(ValueError, match="rows hold 10 elements for a head_dim of 8"):
        cpu_kernels.decode_attention(
            torch.randn((1, 2, 8)),
            cache,
            cache,
            torch.zeros((1, 1), dtype=torch.int32),
            torch.tensor([3]),
            1.0,
        )


def test_store_kv_quantises_into_an_int8_cache_like_the_oracle() -> None:
    gen = torch.Generator().manual_seed(5)
    key, value = torch.randn((7, 2, 32), generator=gen), torch.randn((7, 2, 32), generator=gen)
    slots = torch.tensor([3, 0, 9, -1, 14, 15, 4])
    caches = [torch.zeros((4, 4, 2, 36), dtype=torch.int8) for _ in range(4)]
    attention_sdpa.store_kv(key, value, caches[0], caches[1], slots)
    attention_torch.store_kv(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    flat = kv_int8.dequantize_cache(caches[0], torch.float32).view(-1, 2, 32)
    keep = slots >= 0
    assert bool(((flat[slots[keep]] - key[keep]).abs() <= kv_int8.scale_error_bound(key[keep]) + 1e-7).all())


def test_engine_with_an_int8_cache_allocates_what_plan_computes(tiny_model_dir: Any) -> None:
    from plimsoll.plan import make_plan, read_model_config
    from plimsoll.runtime import LLM, SamplingParams

    directory = tiny_model_dir("llama")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 9, 13, 2, 7, 7, 1], [30, 31, 32], list(range(40, 80))]
    outs = {}
    for kv_dtype, plan_dtype in (("auto", "fp32"), ("int8", "int8")):
        llm = LLM(model=str(directory), kv_cache_dtype=kv_dtype, kv_cache_memory="2MiB", max_model_len=256)
        engine = llm.engine
        steps = {
            s.name: s.value
            for s in make_plan(
                read_model_config(directory),
                gpu_memory=2**30,
                dtype="fp32",
                kv_dtype=plan_dtype,
                context_length=256,
            )
        }
        allocated = engine.runner.kv_cache_bytes()
        tokens = engine.num_blocks * engine.config.block_size
        print(
            f"kv {kv_dtype}: engine {allocated} B for {tokens} tokens, plan {steps['KV bytes per token']} B/token"
        )
        assert allocated == steps["KV bytes per token"] * tokens
        assert engine.runner.kv_caches[0][0].dtype == (torch.int8 if kv_dtype == "int8" else torch.float32)
        outs[kv_dtype] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    # The tiny random model has near-ties everywhere, so only the first token is held equal;
    # SmolLM2's agreement is measured in docs/quantization.md.
    assert [o[0] for o in outs["int8"]] == [o[0] for o in outs["auto"]]
    assert all(len(o) == 12 for o in outs["int8"])


def test_unknown_kv_cache_dtype_is_refused_with_the_choices() -> None:
    from pydantic import ValidationError

    from plimsoll.runtime.engine.config import EngineConfig

    with pytest.raises(ValidationError, match="int8"):
        EngineConfig(kv_cache_dtype="fp4")


@pytest.mark.parametrize("case", ["decode only", "mixed", "prefix hits"])
def test_triton_kernels_read_and_write_the_int8_cache(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    from plimsoll.runtime.attention import triton_backend

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the kernels in Triton's interpreter, on the CPU
    ctx, q_lens = CASES[case]
    query, k_cache, v_cache, tables, cu, lens, scale = make_batch(ctx, q_lens, head_dim=32, block_size=16)
    kq, vq = int8_caches(k_cache, v_cache)
    oracle = attention_torch.paged_attention(query, kq, vq, tables, cu, lens, scale)
    got = triton_backend.paged_attention(query, kq, vq, tables, cu, lens, scale)
    assert torch.allclose(got, oracle, atol=2e-5), float((got - oracle).abs().max())
    # store_kv: the same packed bytes as the torch backend writes.
    key, value = torch.randn((5, kq.shape[2], 32)), torch.randn((5, kq.shape[2], 32))
    slots = torch.tensor([0, 17, -1, 3, 40])
    mine, theirs = (kq.clone(), vq.clone()), (kq.clone(), vq.clone())
    triton_backend.store_kv(key, value, *mine, slots)
    attention_sdpa.store_kv(key, value, *theirs, slots)
    assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[1], theirs[1])
