"""The Triton int8 weight-only matmul (models/quant_triton.py) against float64, on a CPU.

The kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set for this module), where it
computes in float32 whatever the input dtype; a slow test compiles it for sm_90 (H200)
without a GPU and checks ptxas spills no registers. scripts/gpu_check.py runs it on a GPU.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from triton_sm90 import assert_no_spills, run_sm90

from plimsoll.runtime.models import quant_triton
from plimsoll.runtime.models.quant import dequantize, quantize_rows

pytestmark = pytest.mark.usefixtures("triton_interpret")


def reference(
    x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    y = x.double() @ dequantize(q, s, z, torch.float64).T
    return y + bias.double() if bias is not None else y


@pytest.mark.parametrize(
    "m,n,k,layout,with_bias",
    [
        (1, 40, 64, "asymmetric-32", False),  # one decode row, a partial column tile
        (5, 96, 96, "asymmetric-32", True),
        (17, 130, 128, "symmetric-32", False),  # two row tiles (16 + 1), three column tiles
        (64, 64, 256, "asymmetric-32", True),  # the largest decode batch
        (3, 48, 64, "per-row", True),  # one symmetric scale per row: a group of 64 inputs
    ],
)
def test_int8_matmul_matches_float64(m: int, n: int, k: int, layout: str, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n)
    w = torch.randn((n, k), generator=gen)
    group, asymmetric = {"asymmetric-32": (32, True), "symmetric-32": (32, False), "per-row": (0, False)}[
        layout
    ]
    q, s, z = quantize_rows(w, group_size=group, asymmetric=asymmetric, grid=False)
    x = torch.randn((m, k), generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    got = quant_triton.int8_linear(x, q, s, z, bias)
    want = reference(x, q, s, z, bias)
    assert got.shape == (m, n) and got.dtype == torch.float32
    err = (got.double() - want).norm() / want.norm()
    assert err < 1e-6, f"relative error {err:.2e}"


def test_bf16_activations_come_back_in_bf16() -> None:
    gen = torch.Generator().manual_seed(7)
    q, s, z = quantize_rows(torch.randn((72, 96), generator=gen))
    x = torch.randn((4, 96), generator=gen).to(torch.bfloat16)
    got = quant_triton.int8_linear(x, q, s, z)
    assert got.dtype == torch.bfloat16
    want = reference(x, q, s, z, None)
    assert ((got.double() - want).norm() / want.norm()) < 1e-2  # bf16 rounding of the output


def test_what_it_cannot_take_is_named() -> None:
    q, s, z = quantize_rows(torch.randn((8, 64)), group_size=16)
    assert "multiple of 32" in str(quant_triton.unsupported_reason(torch.randn(2, 64), q, s, z))
    q, s, z = quantize_rows(torch.randn((8, 64)))
    assert "1..64 rows" in str(quant_triton.unsupported_reason(torch.randn(65, 64), q, s, z))
    assert quant_triton.unsupported_reason(torch.randn(64, 64), q, s, z) is None
    with pytest.raises(ValueError, match="cannot run this call"):
        quant_triton.int8_linear(torch.randn(2, 64).to(torch.int32), q, s, z)


_COMPILE = """
    from plimsoll.runtime.models import quant_triton as qt

    fn = qt._kernels(False).int8_matmul
    for dtype in ("bf16", "fp32"):
        for block_m in (16,) if dtype == "fp32" else (16, 32, 64):
            consts = dict(GROUP=32, HAS_OFFSETS=True, HAS_BIAS=True, BLOCK_M=block_m,
                          BLOCK_N=qt._BLOCK_N_F32 if dtype == "fp32" else qt._BLOCK_N,
                          BLOCK_K=qt.BLOCK_K, COMPUTE_F32=dtype == "fp32")
            types = {"x_ptr": "*" + dtype, "q_ptr": "*i8", "s_ptr": "*fp32", "z_ptr": "*fp32",
                     "b_ptr": "*" + dtype, "y_ptr": "*" + dtype}
            sig = {p: "constexpr" if p in consts else types.get(p, "i32") for p in inspect.signature(fn.fn).parameters}
            print("int8_matmul", dtype, block_m, compile_sm90(fn, sig, consts, qt._NUM_WARPS), flush=True)
    """


@pytest.mark.slow
def test_int8_kernel_compiles_for_sm90_without_spills() -> None:
    compiled = run_sm90(_COMPILE, timeout=300)
    assert len(compiled) == 4, compiled
    assert_no_spills(compiled)
