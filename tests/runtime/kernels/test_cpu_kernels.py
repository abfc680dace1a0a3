"""The compiled CPU kernels (``cpu_kernels``) against torch.

Decode attention and the ragged (prefill and mixed) kernel against the einsum oracle: ragged batches with GQA (and without),
shuffled non-contiguous block tables padded with -1, contexts that end mid-block and
exactly on a block edge, one sequence and many. The small-batch matmul against
``F.linear`` (with and without bias, shapes too small to split, non-contiguous
input) and the dispatch of ``models.dense.linear``. The other builds this CPU runs (AVX2,
plain) on the same cases where their code differs. The fallback when the kernels are switched
off or a build cannot load; the kernels' own checks of bad input.
"""

import platform
from collections.abc import Iterator

import pytest
import torch
from attention_batches import make_batch
from kernel_builds import RUNNABLE, needs_kernels
from torch.nn import functional as F

from plimsoll.runtime.attention import reference as attention_torch
from plimsoll.runtime.attention import sdpa as attention_sdpa
from plimsoll.runtime.kernels import cpu_kernels, cpu_library, cpu_variants
from plimsoll.runtime.models import dense
from plimsoll.runtime.models.cpu_plan import RowLimits

pytestmark = needs_kernels
ROWS = RowLimits()


def test_the_best_build_this_cpu_runs_is_loaded() -> None:
    # A build is installed (else the module is skipped), so a fallback would hide a broken one.
    selected = cpu_kernels.select()
    assert selected.library is not None, selected.reason
    assert selected.library.variant == RUNNABLE[0]
    # The same choice as torch's own CPU dispatch makes from cpuid (AVX512 / AVX2 / DEFAULT).
    if cpu_variants.is_x86(platform.machine()):
        torch_choice = {"AVX512": "avx512", "AVX2": "avx2"}.get(torch.backends.cpu.get_cpu_capability(), "plain")
        assert cpu_library.best_variants()[0].name == torch_choice


@pytest.fixture
def selected_build(request: pytest.FixtureRequest) -> Iterator[str]:
    """The process's kernels switched to the build named by the test's parameter, then back."""
    name = request.param
    if name not in RUNNABLE:
        pytest.skip(f"the {name} build is not installed or this CPU cannot run it")
    try:
        assert cpu_kernels.select(name).library is not None
        yield name
    finally:
        cpu_kernels.select()


DECODE_CASES = {
    "ragged GQA": ([37, 5, 16, 1, 90, 64], (6, 2), 32, 4),
    "MHA": ([20, 7, 33], (4, 4), 32, 4),
    "one sequence, block edge": ([64], (8, 2), 64, 16),
    "SmolLM2 shape": ([160, 171, 200, 3, 17, 224, 96, 128], (9, 3), 64, 16),
    "head_dim 128, GQA 4": ([33, 1, 70, 16], (8, 2), 128, 16),  # the unrolled path's other width
}


@pytest.mark.parametrize("case", sorted(DECODE_CASES))
def test_kernel_equals_oracle(case: str) -> None:
    ctx, heads, head_dim, block_size = DECODE_CASES[case]
    args = make_batch(
        ctx,
        [1] * len(ctx),
        num_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        block_size=block_size,
    )
    query, kc, vc, tables, _cu, lens, scale = args
    expected = attention_torch.paged_attention(*args)
    got = cpu_kernels.decode_attention(query, kc, vc, tables, lens, scale)
    err = (got - expected).abs().max().item()
    print(f"{case}: max abs error vs oracle {err:.2e}")
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # The torch path it replaces agrees too, so switching either way changes nothing.
    torch.testing.assert_close(
        attention_sdpa.sdpa_decode_attention(query, kc, vc, tables, lens, scale), got, rtol=1e-5, atol=1e-5
    )



@pytest.mark.parametrize("case", ["SmolLM2 shape", "head_dim 128, GQA 4", "ragged GQA"])
def test_kernel_reads_a_bfloat16_cache(case: str) -> None:
    # A --dtype bfloat16 engine's cache and queries: the oracle runs in float32 on the same
    # bfloat16 values, so the only difference is the output's rounding to bfloat16.
    ctx, heads, head_dim, block_size = DECODE_CASES[case]
    args = make_batch(ctx, [1] * len(ctx), num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim, block_size=block_size)
    query, kc, vc, tables, cu, lens, scale = args
    query, kc, vc = query.bfloat16(), kc.bfloat16(), vc.bfloat16()
    assert cpu_kernels.supports_attention(query, kc, vc)
    expected = attention_torch.paged_attention(query.float(), kc.float(), vc.float(), tables, cu, lens, scale)
    # A float32 query over it (the bf16 glued layers'): float32 out, only the sums' order differs.
    assert cpu_kernels.supports_attention(query.float(), kc, vc)
    exact = cpu_kernels.decode_attention(query.float(), kc, vc, tables, lens, scale)
    assert exact.dtype == torch.float32
    torch.testing.assert_close(exact, expected, rtol=1e-5, atol=1e-5)
    got = cpu_kernels.decode_attention(query, kc, vc, tables, lens, scale)
    assert got.dtype == torch.bfloat16
    print(f"{case} bf16: max abs error vs float32 oracle {(got.float() - expected).abs().max().item():.2e}")
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(  # the torch backend's decode path takes it too
        attention_sdpa.decode_attention(query, kc, vc, tables, lens, scale), got, rtol=0, atol=0
    )


RAGGED_CASES = {  # context lengths, query lengths (the last tokens of each context), heads, head_dim, block size
    "SmolLM2 shape: prefills, decodes, a later chunk": (
        [160, 1, 200, 33, 17, 75], [160, 1, 1, 33, 9, 1], (9, 3), 64, 16
    ),
    "prefix hits, block size 5 (tiles across blocks)": ([45, 70, 8, 130], [20, 70, 3, 2], (6, 2), 64, 5),
    "head_dim 128, MHA, at the tiles' edges": ([8, 9, 16, 17, 1], [8, 9, 16, 17, 1], (4, 4), 128, 16),
    "one long prefill": ([700], [700], (8, 2), 64, 16),
}


@pytest.mark.parametrize("case", sorted(RAGGED_CASES))
def test_ragged_kernel_equals_oracle(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ctx, q_lens, heads, head_dim, block_size = RAGGED_CASES[case]
    args = make_batch(ctx, q_lens, num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim, block_size=block_size)
    query, kc, vc, *_ = args
    assert cpu_kernels.supports_paged_attention(query, kc, vc)
    expected = attention_torch.paged_attention(*args)
    got = cpu_kernels.paged_attention(*args)
    print(f"{case}: max abs error vs oracle {(got - expected).abs().max().item():.2e}")
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    out = torch.full_like(query, float("nan"))
    assert cpu_kernels.paged_attention(*args, out=out) is out
    torch.testing.assert_close(out, got, rtol=0, atol=0)
    # The torch backend's CPU path hands prefill and mixed steps to it; with the kernel off, its
    # per-sequence SDPA calls give the same.
    calls: list[int] = []
    real = cpu_kernels.paged_attention
    monkeypatch.setattr(cpu_kernels, "paged_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.testing.assert_close(attention_sdpa.paged_attention(*args), got, rtol=0, atol=0)
    assert calls == ([] if max(q_lens) == 1 else [1])
    monkeypatch.setattr(cpu_kernels, "supports_paged_attention", lambda *a: False)
    torch.testing.assert_close(attention_sdpa.paged_attention(*args), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["SmolLM2 shape: prefills, decodes, a later chunk", "head_dim 128, MHA, at the tiles' edges"])
def test_ragged_kernel_reads_a_bfloat16_cache(case: str) -> None:
    # The bf16 glued layers' prefill: a float32 query over a bfloat16 cache, against the float32
    # oracle on the same (widened) values; a bfloat16 query is left to SDPA.
    ctx, q_lens, heads, head_dim, block_size = RAGGED_CASES[case]
    query, kc, vc, tables, cu, lens, scale = make_batch(
        ctx, q_lens, num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim, block_size=block_size
    )
    kb, vb = kc.bfloat16(), vc.bfloat16()
    assert cpu_kernels.supports_paged_attention(query, kb, vb)
    assert not cpu_kernels.supports_paged_attention(query.bfloat16(), kb, vb)
    expected = attention_torch.paged_attention(query, kb.float(), vb.float(), tables, cu, lens, scale)
    got = cpu_kernels.paged_attention(query, kb, vb, tables, cu, lens, scale)
    print(f"{case} bf16 cache: max abs error vs oracle {(got - expected).abs().max().item():.2e}")
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_ragged_kernel_takes_only_what_it_can_and_rejects_bad_lengths() -> None:
    query, kc, vc, tables, cu, lens, scale = make_batch([9, 4], [9, 1], head_dim=64)
    assert not cpu_kernels.supports_paged_attention(query.double(), kc.double(), vc.double())
    odd = make_batch([9, 4], [9, 1], head_dim=80)
    assert cpu_kernels.supports_attention(*odd[:3]) and not cpu_kernels.supports_paged_attention(*odd[:3])
    from plimsoll.runtime.attention import kv_int8

    int8_cache = kv_int8.quantize(kc)
    assert not cpu_kernels.supports_paged_attention(query, int8_cache, int8_cache)
    with pytest.raises(ValueError, match=r"queries at most its context"):
        cpu_kernels.paged_attention(query, kc, vc, tables, cu, torch.tensor([8, 4]), scale)  # 9 queries, 8 tokens
    with pytest.raises(ValueError, match=r"query offsets"):
        cpu_kernels.paged_attention(query, kc, vc, tables, cu[:2], lens, scale)


@pytest.mark.parametrize("selected_build", ["avx2", "plain"], indirect=True)
def test_kernel_equals_oracle_on_each_instruction_set(selected_build: str) -> None:
    # Each build compiles its own softmax exp, bf16 widening and rounding, ragged tiles and
    # panels (AVX-512 is the default build here, tested above): run the AVX2 and plain ones on the
    # SmolLM2-shaped batch (long contexts: the exp of scores far below the maximum).
    assert cpu_kernels.library().variant == selected_build  # type: ignore[union-attr]
    ctx, heads, head_dim, block_size = DECODE_CASES["SmolLM2 shape"]
    args = make_batch(ctx, [1] * len(ctx), num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim, block_size=block_size)
    query, kc, vc, tables, _cu, lens, scale = args
    query = query * 8  # sharper softmax: weights from 1 down to exp(-80) and below
    expected = attention_torch.paged_attention(query, *args[1:])
    out = cpu_kernels.decode_attention(query, kc, vc, tables, lens, scale)
    print(f"{selected_build}: max abs error vs oracle {(out - expected).abs().max().item():.2e}")
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # A bfloat16 cache in the same build (its widening without AVX-512).
    kb, vb = kc.bfloat16(), vc.bfloat16()
    expected = attention_torch.paged_attention(query, kb.float(), vb.float(), *args[3:])
    torch.testing.assert_close(cpu_kernels.decode_attention(query, kb, vb, tables, lens, scale), expected, rtol=1e-5, atol=1e-5)
    # The ragged kernel in the same build: its tiles of several rows without the AVX-512 path.
    ctx, q_lens, heads, head_dim, block_size = RAGGED_CASES["SmolLM2 shape: prefills, decodes, a later chunk"]
    args = make_batch(ctx, q_lens, num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim, block_size=block_size)
    torch.testing.assert_close(cpu_kernels.paged_attention(*args), attention_torch.paged_attention(*args), rtol=1e-5, atol=1e-5)
    # SiLU * up, the other exp_vec user, in the same build (gates past exp's range included).
    gate_up = torch.randn(5, 2 * 100) * 30
    act = torch.empty(5, 100)
    cpu_kernels.silu_mul(gate_up, act, 5)
    gate, up = gate_up.split(100, dim=1)
    torch.testing.assert_close(act, F.silu(gate) * up, rtol=1e-5, atol=1e-5)
    # The bf16 glue's rounding without AVX-512 (scalar stores), and its SiLU on the scalar path.
    x = torch.randn(1000) * 1e3
    x[:3] = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, float("inf")])
    y = torch.empty(1000, dtype=torch.bfloat16)
    cpu_kernels.to_bf16(x, y)
    assert torch.equal(y.view(torch.int16), x.bfloat16().view(torch.int16))
    gate_up_b, act_b = gate_up.bfloat16(), torch.empty(5, 100, dtype=torch.bfloat16)
    cpu_kernels.silu_mul(gate_up_b, act_b, 5)
    gate, up = gate_up_b.float().split(100, dim=1)
    assert bf16_ulps(act_b, (F.silu(gate) * up).bfloat16()) <= 1
    # The packed matmul's panels of this build (16 columns, 6 or 4 rows a block without AVX-512):
    # two parts with partial panels, 11 rows, a bias, then added to what out held.
    weight, bias, x = torch.randn(58, 23), torch.randn(58), torch.randn(11, 23)
    packed = cpu_kernels.pack_f32(weight, parts=2)
    assert packed.data.numel() == 2 * 2 * 16 * 23
    out = torch.randn(11, 58)
    want = out + F.linear(x, weight, bias)
    cpu_kernels.packed_linear(x, packed, bias, out=out, accumulate=True)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    # And the small-batch matmul's register blocks of this build.
    x, weight = torch.randn(7, 37), torch.randn(13, 37)
    torch.testing.assert_close(cpu_kernels.small_batch_linear(x, weight, None), F.linear(x, weight), rtol=1e-5, atol=1e-5)

def test_kernel_is_used_for_float32_and_not_for_other_dtypes() -> None:
    query, kc, vc, *_ = make_batch([9, 4], [1, 1])
    assert cpu_kernels.supports_attention(query, kc, vc)
    assert not cpu_kernels.supports_attention(query.double(), kc.double(), vc.double())
    assert not cpu_kernels.supports_attention(query, kc.transpose(1, 2), vc)  # a non-contiguous cache view


def test_kernel_rejects_a_context_longer_than_its_block_table() -> None:
    query, kc, vc, tables, _cu, _lens, scale = make_batch([9, 4], [1, 1])
    too_long = torch.tensor([9, tables.shape[1] * kc.shape[1] + 1], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"context lengths must be 1\.\."):
        cpu_kernels.decode_attention(query, kc, vc, tables, too_long, scale)


def test_switched_off_or_unloadable_kernels_fall_back_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    args = make_batch([37, 5, 16], [1, 1, 1])
    expected = attention_torch.paged_attention(*args)
    try:
        off = cpu_kernels.select("off")
        assert off.library is None and cpu_kernels.library() is None and "off" in str(off.reason)
        torch.testing.assert_close(attention_sdpa.paged_attention(*args), expected, rtol=1e-5, atol=1e-5)
        # A build that cannot load: no kernels, the reason kept for the start-up line, torch's path.
        missing = cpu_variants.variants_for(platform.machine())[-1].name

        def unloadable(name: str) -> None:
            raise cpu_library.KernelsUnavailable(f"{name}: not installed here")

        monkeypatch.setattr(cpu_library, "load", unloadable)
        chosen = cpu_kernels.select(missing)
        assert chosen.library is None and chosen.reason == f"{missing}: not installed here"
        assert cpu_kernels.unavailable_reason() == chosen.reason
        torch.testing.assert_close(attention_sdpa.paged_attention(*args), expected, rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match="choose one of auto, avx512, avx2, plain, off"):
            cpu_kernels.select("avx1024")
    finally:
        monkeypatch.undo()
        cpu_kernels.select()
    assert cpu_kernels.library() is not None


@pytest.mark.parametrize(
    ("m", "n", "k", "with_bias"),
    [
        (1, 960, 576, False), (3, 576, 1536, True), (4, 49152, 64, False), (2, 7, 5, True), (1, 1, 1, False),
        # register blocks (2+ rows, no bias): whole and partial blocks of rows and of W, a K tail
        (2, 960, 576, False), (5, 13, 37, False), (7, 3072, 576, False), (16, 960, 576, False), (9, 6, 20, False),
        (16, 4099, 64, False),
    ],
)  # fmt: skip
def test_small_batch_linear_equals_f_linear(m: int, n: int, k: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(m * 7 + n)
    x = torch.randn((m, k), generator=gen)
    weight = torch.randn((n, k), generator=gen) / k**0.5
    bias = torch.randn(n, generator=gen) if with_bias else None
    got = cpu_kernels.small_batch_linear(x, weight, bias)
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double()).float()
    print(f"m={m} n={n} k={k}: max abs error vs float64 {(got - expected).abs().max().item():.2e}")
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


PACKED_CASES = {
    # (m, n, k, parts, bias, accumulate)
    "one row, SmolLM2's qkv": (1, 960, 576, 1, False, False),
    "sixteen rows, two blocks of eight": (16, 960, 576, 1, False, False),
    "twelve rows (6 + 6), gate_up in two parts": (12, 3072, 576, 2, False, False),
    "a 300-row prefill, down_proj": (300, 576, 1536, 1, False, False),
    "partial panel, odd K": (5, 13, 37, 1, False, False),
    "two parts of 50 (each a partial panel), bias": (9, 100, 20, 2, True, False),
    "accumulate with bias, 17 rows": (17, 49, 3, 1, True, True),
    "one column, one input": (3, 1, 1, 1, True, False),
    "head-like, 64 rows": (64, 4099, 64, 1, False, False),
}


@pytest.mark.parametrize("case", sorted(PACKED_CASES))
def test_packed_linear_equals_float64(case: str) -> None:
    m, n, k, parts, with_bias, accumulate = PACKED_CASES[case]
    gen = torch.Generator().manual_seed(m * 31 + n)
    weight = torch.randn((n, k), generator=gen) / k**0.5
    bias = torch.randn(n, generator=gen) if with_bias else None
    # x and out as row views of wider tensors: their row strides are not their widths.
    x = torch.randn((m, k + 3), generator=gen)[:, 1 : k + 1]
    out = torch.randn((m, n + 5), generator=gen)[:, 2 : n + 2]
    before = out.clone()
    packed = cpu_kernels.pack_f32(weight, parts=parts)
    cols = cpu_kernels.library().plimsoll_packed_f32_panel_cols()
    assert packed.data.numel() == parts * -(-n // parts // cols) * cols * k
    got = cpu_kernels.packed_linear(x, packed, bias, out=out, accumulate=accumulate)
    assert got is out
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    if accumulate:
        expected += before.double()
    print(f"{case}: max abs error vs float64 {(got.double() - expected).abs().max().item():.2e}")
    torch.testing.assert_close(got, expected.float(), rtol=1e-5, atol=1e-5)
    fresh = cpu_kernels.packed_linear(x, packed, bias)  # a new [m, n] output
    assert fresh.shape == (m, n)
    torch.testing.assert_close(fresh, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_packed_linear_rejects_what_does_not_fit() -> None:
    weight = torch.randn(10, 8)
    with pytest.raises(ValueError, match="3 parts do not divide a weight of 10 rows"):
        cpu_kernels.pack_f32(weight, parts=3)
    with pytest.raises(ValueError, match="2-D float32 CPU weight"):
        cpu_kernels.pack_f32(weight.double())
    packed = cpu_kernels.pack_f32(weight)
    with pytest.raises(ValueError, match=r"x must be \[M > 0, 8\]"):
        cpu_kernels.packed_linear(torch.randn(2, 7), packed)
    with pytest.raises(ValueError, match="accumulate needs an out"):
        cpu_kernels.packed_linear(torch.randn(2, 8), packed, accumulate=True)
    with pytest.raises(ValueError, match=r"out must be \[>= 2, 10\]"):
        cpu_kernels.packed_linear(torch.randn(2, 8), packed, out=torch.empty(2, 9))


def test_small_batch_linear_takes_a_non_contiguous_input() -> None:
    x = torch.randn(3, 2 * 64)[:, ::2]
    weight = torch.randn(32, 64)
    torch.testing.assert_close(cpu_kernels.small_batch_linear(x, weight, None), x @ weight.T)


def test_dense_linear_uses_the_kernel_for_the_rows_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    weight, bias = torch.randn(96, 48), torch.randn(96)
    calls: list[int] = []
    real = cpu_kernels.small_batch_linear

    def spy(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(x, w, b)

    monkeypatch.setattr(cpu_kernels, "small_batch_linear", spy)
    for rows in range(1, ROWS.small_matmul + 5):
        x = torch.randn(rows, 48)
        torch.testing.assert_close(dense.linear(x, weight, bias, ROWS.small_matmul), F.linear(x, weight, bias))
        torch.testing.assert_close(dense.linear(x, weight, None, ROWS.small_matmul), F.linear(x, weight, None))
        dense.linear(x, weight, None)  # no rows given (a model without a CPU plan): never the kernel
    dense.linear(torch.randn(2, 48).double(), weight.double(), None, ROWS.small_matmul)  # float64 stays with torch
    assert calls == [r for r in range(1, ROWS.small_matmul + 1) for _ in (0, 1)]



@pytest.mark.parametrize(("m", "n", "k", "with_bias"), [(1, 3072, 576, False), (2, 577, 1536, True), (1, 5, 16, True)])
def test_bf16_linear_equals_f_linear_on_the_same_bfloat16_values(m: int, n: int, k: int, with_bias: bool) -> None:
    torch.manual_seed(0)
    x, w = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()
    b = torch.randn(n).bfloat16() if with_bias else None
    assert cpu_kernels.supports_bf16_linear(x, w, b)
    got = cpu_kernels.bf16_linear(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    # float32 sums rounded once: within bfloat16's half ulp of the float32 result, ~0.4% relative
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=1e-2)


def test_dense_linear_sends_a_few_bfloat16_rows_to_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = torch.randn(40, 48).bfloat16()
    calls: list[int] = []
    real = cpu_kernels.bf16_linear
    monkeypatch.setattr(cpu_kernels, "bf16_linear", lambda x, w, b=None: calls.append(x.shape[0]) or real(x, w, b))
    for rows in range(1, 6):
        x = torch.randn(rows, 48).bfloat16()
        got = dense.linear(x, weight, None, ROWS.bf16_matmul)
        torch.testing.assert_close(got.float(), F.linear(x, weight).float(), rtol=8e-3, atol=1e-2)
    assert calls == list(range(1, ROWS.bf16_matmul + 1))
    odd = torch.randn(4, 40).bfloat16()  # inputs not a multiple of 16, a float32 x: torch's
    assert not cpu_kernels.supports_bf16_linear(torch.randn(1, 40).bfloat16(), odd, None)
    assert not cpu_kernels.supports_bf16_linear(torch.randn(1, 48), weight, None)
    with pytest.raises(ValueError, match="multiple of 16 inputs"):
        cpu_kernels.bf16_linear(torch.randn(1, 40).bfloat16(), odd)


@pytest.mark.skipif(not dense._ONEDNN, reason="this torch build has no oneDNN")
def test_dense_linear_runs_every_larger_row_count_on_onednn_in_bucketed_chunks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    weight, bias = torch.randn(96, 48, dtype=torch.float64), torch.randn(96, dtype=torch.float64)
    shapes: list[int] = []
    real = torch.ops.mkldnn._linear_pointwise

    def spy(x: torch.Tensor, *args: object) -> torch.Tensor:
        shapes.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(dense, "_mkldnn_linear", spy)
    step, chunk = dense.ONEDNN_ROW_BUCKET, dense.ONEDNN_CHUNK_ROWS
    for rows in (ROWS.small_matmul + 1, step, step + 1, 64, 65, chunk - 1, chunk, chunk + 1, 3 * chunk + 7):
        x = torch.randn(rows, 2 * 48, dtype=torch.float64)[:, ::2]  # non-contiguous
        shapes.clear()
        got = dense.linear(x.float(), weight.float(), bias.float(), ROWS.small_matmul)
        torch.testing.assert_close(got.double(), F.linear(x, weight, bias), rtol=1e-4, atol=1e-4)
        assert got.shape == (rows, 96)
        assert all(n % step == 0 and n <= chunk for n in shapes), (rows, shapes)
        assert sum(shapes) - rows < step * len(shapes), (rows, shapes)
    # The primitives built at warm-up: one per padded row count per distinct shape, float32 only.
    w2 = torch.randn(96, 48)
    assert dense.prime_onednn([(w2, None), (torch.randn(96, 48), None), (w2, torch.zeros(96))], 10_000) == 2 * (
        chunk // step
    )
    assert dense.prime_onednn([(w2, None)], 40, min_rows=20) == 2  # 32 and 48 rows
    assert dense.prime_onednn([(w2.double(), None)], 64) == 0

def test_small_batch_linear_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="must match"):
        cpu_kernels.small_batch_linear(torch.randn(2, 8), torch.randn(4, 9), None)


# The glue between a layer's matmuls (models/fused_decode.GluedLayers), against the torch ops it replaces.


@pytest.mark.parametrize("rows", [1, 17, 64, 200])
def test_add_rms_norm_equals_torch(rows: int) -> None:
    torch.manual_seed(rows)
    dim, eps = 576, 1e-5
    x, delta, weight = torch.randn(rows + 3, dim), torch.randn(rows + 3, dim), torch.randn(dim)
    expected_x = x[:rows] + delta[:rows]
    expected_h = F.rms_norm(expected_x, (dim,), weight, eps)
    out = torch.full((rows + 3, dim), 7.0)
    cpu_kernels.add_rms_norm(x, delta, weight, out, rows, eps)
    torch.testing.assert_close(x[:rows], expected_x, rtol=0, atol=0)
    torch.testing.assert_close(out[:rows], expected_h, rtol=1e-5, atol=1e-5)
    assert bool((out[rows:] == 7.0).all())  # rows past `rows` untouched (the padding of a step)
    cpu_kernels.add_rms_norm(x, None, weight, out, rows, eps)  # no delta: the norm alone
    torch.testing.assert_close(out[:rows], expected_h, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 33, 100])
def test_rope_store_equals_the_module_path(rows: int) -> None:
    from plimsoll.runtime.models.llama import apply_rope

    torch.manual_seed(rows)
    heads, kv_heads, head_dim, block_size, num_blocks = 9, 3, 64, 16, 12
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim)
    angles = torch.randn(rows, head_dim // 2).repeat(1, 2)
    cos, sin = angles.cos(), angles.sin()
    slots = torch.randperm(num_blocks * block_size)[:rows]
    slots[::5] = -1  # rows that store nothing (padding)
    k_cache, v_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim), torch.zeros(num_blocks, block_size, kv_heads, head_dim)
    q_out = torch.empty(rows, heads, head_dim)
    cpu_kernels.rope_store(qkv, q_out, k_cache, v_cache, cos, sin, slots, rows, (heads, kv_heads, head_dim))
    qk = apply_rope(qkv[:, : (heads + kv_heads) * head_dim].view(rows, heads + kv_heads, head_dim), cos, sin)
    torch.testing.assert_close(q_out, qk[:, :heads], rtol=1e-5, atol=1e-5)
    stored = slots >= 0
    flat_k, flat_v = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
    torch.testing.assert_close(flat_k[slots[stored]], qk[stored, heads:], rtol=1e-5, atol=1e-5)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(rows, kv_heads, head_dim)
    torch.testing.assert_close(flat_v[slots[stored]], v[stored], rtol=0, atol=0)
    assert int((flat_k.abs().sum(dim=(1, 2)) > 0).sum()) == int(stored.sum())  # no other slot written
    bad = slots.clone()
    bad[0] = num_blocks * block_size
    with pytest.raises(ValueError, match="slots must be below"):
        cpu_kernels.rope_store(qkv, q_out, k_cache, v_cache, cos, sin, bad, rows, (heads, kv_heads, head_dim))


@pytest.mark.parametrize("rows", [1, 20, 128])
def test_silu_mul_equals_torch_including_extreme_gates(rows: int) -> None:
    torch.manual_seed(rows)
    inter = 1536
    gate_up = torch.randn(rows, 2 * inter) * 4
    gate_up[0, :4] = torch.tensor([-200.0, -89.0, 90.0, 500.0])  # past exp's float32 range either way
    out = torch.empty(rows, inter)
    cpu_kernels.silu_mul(gate_up, out, rows)
    gate, up = gate_up.split(inter, dim=1)
    expected = F.silu(gate) * up
    assert bool(torch.isfinite(out).all())
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_glue_rejects_wrong_shapes_and_dtypes() -> None:
    with pytest.raises(ValueError, match="float32"):
        cpu_kernels.silu_mul(torch.randn(4, 8, dtype=torch.float64), torch.empty(4, 4), 4)
    with pytest.raises(ValueError, match="2 x out"):
        cpu_kernels.silu_mul(torch.randn(4, 9), torch.empty(4, 4), 4)
    with pytest.raises(ValueError, match="at least 5 rows"):
        cpu_kernels.add_rms_norm(torch.randn(4, 8), None, torch.ones(8), torch.empty(4, 8), 5, 1e-5)
    with pytest.raises(ValueError, match="columns"):
        cpu_kernels.add_rms_norm(torch.randn(4, 8), None, torch.ones(7), torch.empty(4, 8), 4, 1e-5)


# The bf16 glue (a bfloat16 model's glued layers): each kernel against torch in float32 on the same
# bfloat16 inputs, its outputs rounded to bfloat16 once, so they must equal torch's float32 result
# rounded to bfloat16, within one bf16 step where the float32 sums' order moves a tie.
def bf16_ulps(got: torch.Tensor, want: torch.Tensor) -> int:
    """The most bfloat16 steps between two bfloat16 tensors, where either is above 1e-30 (SiLU of a
    gate of -200 is -0 in torch, whose exp overflows, and ~1e-36 where exp's argument is capped)."""

    def ordered(t: torch.Tensor) -> torch.Tensor:  # bit patterns mapped onto the number line
        bits = t.view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    seen = (got.float().abs() > 1e-30) | (want.float().abs() > 1e-30)
    return int((ordered(got) - ordered(want))[seen].abs().max())


@pytest.mark.parametrize("rows", [1, 17, 64])
def test_bf16_add_rms_norm_rounds_the_float32_result(rows: int) -> None:
    torch.manual_seed(rows)
    dim, eps = 576, 1e-5
    x, weight = torch.randn(rows + 3, dim), torch.randn(dim)
    delta = torch.randn(rows + 3, dim).bfloat16()
    expected_x = x[:rows] + delta[:rows].float()
    expected_h = F.rms_norm(expected_x, (dim,), weight, eps).bfloat16()
    out = torch.full((rows + 3, dim), 7.0, dtype=torch.bfloat16)
    cpu_kernels.add_rms_norm(x, delta, weight, out, rows, eps)
    torch.testing.assert_close(x[:rows], expected_x, rtol=0, atol=0)  # the float32 residual
    assert bf16_ulps(out[:rows], expected_h) <= 1
    assert bool((out[rows:] == 7.0).all())
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_kernels.add_rms_norm(x, delta.float(), weight, out, rows, eps)  # delta of another dtype than out


@pytest.mark.parametrize("rows", [1, 33])
def test_bf16_rope_store_writes_a_bfloat16_cache(rows: int) -> None:
    from plimsoll.runtime.models.llama import apply_rope

    torch.manual_seed(rows)
    heads, kv_heads, head_dim, block_size, num_blocks = 9, 3, 64, 16, 12
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim).bfloat16()
    angles = torch.randn(rows, head_dim // 2).repeat(1, 2)
    cos, sin = angles.cos(), angles.sin()
    slots = torch.randperm(num_blocks * block_size)[:rows]
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16)
    q_out = torch.empty(rows, heads, head_dim)
    cpu_kernels.rope_store(qkv, q_out, k_cache, v_cache, cos, sin, slots, rows, (heads, kv_heads, head_dim))
    wide = qkv.float()
    qk = apply_rope(wide[:, : (heads + kv_heads) * head_dim].view(rows, heads + kv_heads, head_dim), cos, sin)
    torch.testing.assert_close(q_out, qk[:, :heads], rtol=1e-5, atol=1e-5)  # q stays float32
    flat_k, flat_v = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
    assert bf16_ulps(flat_k[slots], qk[:, heads:].bfloat16()) <= 1
    v = qkv[:, (heads + kv_heads) * head_dim :].view(rows, kv_heads, head_dim)
    assert torch.equal(flat_v[slots], v)  # v copied as it is


def test_bf16_silu_mul_and_to_bf16_round_as_torch() -> None:
    torch.manual_seed(5)
    rows, inter = 9, 1536 + 8  # a remainder past the 16-lane vectors
    gate_up = (torch.randn(rows, 2 * inter) * 4).bfloat16()
    gate_up[0, :4] = torch.tensor([-200.0, -89.0, 90.0, 500.0])
    out = torch.empty(rows, inter, dtype=torch.bfloat16)
    cpu_kernels.silu_mul(gate_up, out, rows)
    gate, up = gate_up.float().split(inter, dim=1)
    assert bool(torch.isfinite(out.float()).all())
    assert bf16_ulps(out, (F.silu(gate) * up).bfloat16()) <= 1
    # to_bf16: torch's round-to-nearest-even bit for bit, ties, infinities and NaN included.
    x = torch.randn(1000) * 1e3
    x[:6] = torch.tensor([float("inf"), float("-inf"), 1.0 + 2**-8, 1.0 + 3 * 2**-8, 3.4e38, -0.0])
    x[6] = float("nan")
    y = torch.empty(1000, dtype=torch.bfloat16)
    cpu_kernels.to_bf16(x, y)
    want = x.bfloat16()
    assert torch.equal(y[7:].view(torch.int16), want[7:].view(torch.int16)) and torch.equal(y[:6], want[:6])
    assert bool(y[6].isnan())
    with pytest.raises(ValueError, match="as many elements"):
        cpu_kernels.to_bf16(x, torch.empty(999, dtype=torch.bfloat16))
