"""INT8 weight-only matmul in Triton: ``--quantization int8`` on a GPU, for decode-sized steps.

What it is: ``int8_linear(x, qweight, scales, offsets, bias)`` = ``x @ (s·q + z)ᵀ + bias`` for
the layout of ``models/quant.py`` (int8 ``q`` ``[N, K]``; float32 scales ``s`` and offsets
``z`` ``[N, K // G]`` per group of ``G`` inputs; offsets may be absent) without making the
float weight: each program owns ``BLOCK_N`` output columns and walks K one group-sized tile
at a time, ``Σ_g s_g·(x_g · q_g) + z_g·Σ x_g``. The int8 values are exact in bf16/fp16, so
the tile product runs on the tensor cores in the activations' dtype with float32
accumulation, and the scale and offset are applied per group in float32. The weight
streams as int8: half of bf16's bytes, which is what a decode step reads.

What it is not: the prefill path (above :data:`MAX_ROWS` rows the caller dequantises and calls
cuBLAS, which tiles large products better), activation quantisation, or a CPU kernel (the
CPU has ``cpu_kernels.int8_linear``). On a CPU the kernel runs only in Triton's interpreter
(``TRITON_INTERPRET=1``, the tests), in float32.
"""

# Kernel source is formatted by hand, like attention/triton_kernels.py.
# fmt: off
# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch

MAX_ROWS = 64  # decode steps up to max_num_seqs 64 (and every CUDA graph size up to it)
BLOCK_K = 32  # one quantisation group per tile (GROUP_SIZE); a group must be a multiple of it
_BLOCK_N = 64  # 16-bit activations
_BLOCK_N_F32 = 32  # float32 operands take twice the registers (64 spills on sm_90)
_NUM_WARPS = 4

triton: Any = None
tl: Any = None
_sum_combine: Any = None


def is_interpreting() -> bool:
    import triton  # only where the Triton kernel runs

    return bool(triton.knobs.runtime.interpret)


@functools.cache
def _kernels(interpret: bool) -> SimpleNamespace:
    """Import triton and decorate the kernel once per interpreter mode (see triton_kernels.build)."""
    global triton, tl, _sum_combine
    import triton as _triton
    import triton.language as _tl

    triton, tl = _triton, _tl
    assert is_interpreting() == interpret

    def sum_combine(a, b):
        return a + b

    # triton's own combiner (the interpreter reduces with numpy when it sees it), as attention does
    _sum_combine = getattr(tl.standard, "_sum_combine", None) or triton.jit(sum_combine)

    @triton.jit
    def int8_matmul_kernel(
        x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr,
        M, N, K,
        stride_xm, stride_qn, stride_sn, stride_ym,
        GROUP: tl.constexpr, HAS_OFFSETS: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, COMPUTE_F32: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask = offs_m < M
        n_mask = offs_n < N
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)  # (tl.zeros is a jit helper: not in the interpreter)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :],
                        mask=m_mask[:, None], other=0.0)  # [BLOCK_M, BLOCK_K]
            q = tl.load(q_ptr + offs_n[:, None] * stride_qn + (k0 + offs_k)[None, :],
                        mask=n_mask[:, None], other=0)  # [BLOCK_N, BLOCK_K] int8
            group = k0 // GROUP
            s = tl.load(s_ptr + offs_n * stride_sn + group, mask=n_mask, other=0.0)  # [BLOCK_N] fp32
            if COMPUTE_F32:
                x32 = x.to(tl.float32)
                part = tl.dot(x32, tl.trans(q.to(tl.float32)), input_precision="ieee")
            else:
                part = tl.dot(x, tl.trans(q.to(x.dtype)))  # int8 is exact in bf16/fp16
            acc += part * s[None, :]
            if HAS_OFFSETS:
                z = tl.load(z_ptr + offs_n * stride_sn + group, mask=n_mask, other=0.0)
                x_sum = tl.reduce(x.to(tl.float32), 1, _sum_combine)  # [BLOCK_M]
                acc += x_sum[:, None] * z[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & n_mask[None, :])

    return SimpleNamespace(int8_matmul=int8_matmul_kernel)


def unsupported_reason(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None
) -> str | None:
    """Why ``int8_linear`` cannot take this call (None: it can)."""
    if x.device.type != "cuda" and not is_interpreting():
        return f"activations on {x.device.type}, not CUDA"
    if x.dim() != 2 or not 0 < x.shape[0] <= MAX_ROWS:
        return f"{tuple(x.shape)} is not 1..{MAX_ROWS} rows of a 2-D input"
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"activations in {x.dtype}"
    if qweight.dtype != torch.int8 or qweight.dim() != 2 or qweight.device != x.device:
        return f"weights {qweight.dtype} {tuple(qweight.shape)} on {qweight.device}, activations on {x.device}"
    k = qweight.shape[1]
    group = k // scales.shape[1]
    if x.shape[1] != k or group * scales.shape[1] != k or group % BLOCK_K != 0:
        return f"groups of {k / scales.shape[1]:g} inputs (the kernel needs a multiple of {BLOCK_K})"
    if offsets is not None and offsets.shape != scales.shape:
        return "offsets and scales differ in shape"
    if not _triton_installed():
        return "the triton package is not installed"
    return None


@functools.cache
def _triton_installed() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def int8_linear(
    x: torch.Tensor,  # [M, K], M <= MAX_ROWS
    qweight: torch.Tensor,  # [N, K] int8
    scales: torch.Tensor,  # [N, K // G] float32
    offsets: torch.Tensor | None,  # [N, K // G] float32, or None (symmetric)
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N] in x's dtype
    reason = unsupported_reason(x, qweight, scales, offsets)
    if reason is not None:
        raise ValueError(f"int8_linear cannot run this call: {reason}")
    return launch(x, qweight, scales, offsets, bias)


def launch(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    """``int8_linear`` for a caller that has already had ``unsupported_reason`` say None."""
    interpret = is_interpreting()
    x = x if x.stride(-1) == 1 else x.contiguous()
    qweight, scales = qweight.contiguous(), scales.float().contiguous()
    offsets = None if offsets is None else offsets.float().contiguous()
    m, k = x.shape
    n = qweight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    compute_f32 = interpret or x.dtype == torch.float32
    # tl.dot needs >= 16 rows; float32 tiles of more than 16 rows spill registers on sm_90
    block_m = 16 if m <= 16 or compute_f32 else 32 if m <= 32 else 64
    block_n = _BLOCK_N_F32 if compute_f32 else _BLOCK_N
    grid = (-(-n // block_n), -(-m // block_m))
    _kernels(interpret).int8_matmul[grid](
        x, qweight, scales, scales if offsets is None else offsets, y if bias is None else bias, y,
        m, n, k,
        x.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
        GROUP=k // scales.shape[1], HAS_OFFSETS=offsets is not None, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K, COMPUTE_F32=compute_f32,
        **({} if interpret else {"num_warps": _NUM_WARPS}),
    )
    return y
