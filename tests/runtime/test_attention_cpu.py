"""The compiled CPU decode-attention kernel (``attention_cpu``) against the einsum oracle.

Ragged decode batches with GQA (and without), shuffled non-contiguous block tables
padded with -1, contexts that end mid-block and exactly on a block edge, one
sequence and many; the fallback when the kernel is switched off or cannot be built;
and the kernel's own check of impossible context lengths.
"""

import subprocess
from pathlib import Path

import pytest
import torch
from test_attention_sdpa import make_batch

from plimsoll.runtime import attention_cpu, attention_sdpa, attention_torch

pytestmark = pytest.mark.skipif(attention_cpu.kernel() is None, reason="no C++ compiler to build the kernel")

DECODE_CASES = {
    "ragged GQA": ([37, 5, 16, 1, 90, 64], (6, 2), 32, 4),
    "MHA": ([20, 7, 33], (4, 4), 32, 4),
    "one sequence, block edge": ([64], (8, 2), 64, 16),
    "SmolLM2 shape": ([160, 171, 200, 3, 17, 224, 96, 128], (9, 3), 64, 16),
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
    got = attention_cpu.decode_attention(query, kc, vc, tables, lens, scale)
    err = (got - expected).abs().max().item()
    print(f"{case}: max abs error vs oracle {err:.2e}")
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # The torch path it replaces agrees too, so switching either way changes nothing.
    torch.testing.assert_close(
        attention_sdpa.sdpa_decode_attention(query, kc, vc, tables, lens, scale), got, rtol=1e-5, atol=1e-5
    )


def test_kernel_is_used_for_float32_and_not_for_other_dtypes() -> None:
    query, kc, vc, *_ = make_batch([9, 4], [1, 1])
    assert attention_cpu.supports(query, kc, vc)
    assert not attention_cpu.supports(query.double(), kc.double(), vc.double())
    assert not attention_cpu.supports(query, kc.transpose(1, 2), vc)  # a non-contiguous cache view


def test_kernel_rejects_a_context_longer_than_its_block_table() -> None:
    query, kc, vc, tables, _cu, _lens, scale = make_batch([9, 4], [1, 1])
    too_long = torch.tensor([9, tables.shape[1] * kc.shape[1] + 1], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"context lengths must be 1\.\."):
        attention_cpu.decode_attention(query, kc, vc, tables, too_long, scale)


def test_switched_off_or_unbuildable_kernel_falls_back_to_torch(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    args = make_batch([37, 5, 16], [1, 1, 1])
    expected = attention_torch.paged_attention(*args)
    attention_cpu.kernel.cache_clear()
    try:
        monkeypatch.setenv("PLIMSOLL_CPU_KERNELS", "0")
        assert attention_cpu.kernel() is None
        torch.testing.assert_close(attention_sdpa.paged_attention(*args), expected, rtol=1e-5, atol=1e-5)
        attention_cpu.kernel.cache_clear()
        monkeypatch.delenv("PLIMSOLL_CPU_KERNELS")
        monkeypatch.setenv("PLIMSOLL_CACHE_DIR", str(tmp_path))
        broken = tmp_path / "broken.cpp"
        broken.write_text("this is not C++\n")
        monkeypatch.setattr(attention_cpu, "SOURCE", broken)
        with pytest.raises(RuntimeError, match="failed"):
            attention_cpu.build(attention_cpu.shutil.which("c++") or "g++")
        assert attention_cpu.kernel() is None  # logged, not raised
        torch.testing.assert_close(attention_sdpa.paged_attention(*args), expected, rtol=1e-5, atol=1e-5)
    finally:
        attention_cpu.kernel.cache_clear()


def test_build_reuses_the_compiled_library(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PLIMSOLL_CACHE_DIR", str(tmp_path))
    compiler = attention_cpu.shutil.which("c++") or "g++"
    first = attention_cpu.build(compiler)
    stamp = first.stat().st_mtime_ns
    calls: list[list[str]] = []
    real_run = subprocess.run

    def spy(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        return real_run(cmd, **kwargs)  # type: ignore[call-overload, no-any-return]

    monkeypatch.setattr(attention_cpu.subprocess, "run", spy)
    assert attention_cpu.build(compiler) == first
    assert first.stat().st_mtime_ns == stamp
    assert all("-o" not in cmd for cmd in calls)  # only `--version`, no second compile
