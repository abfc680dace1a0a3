"""The int8 KV cache layout (``--kv-cache-dtype int8``): how a K or V row is stored and read.

What it is: symmetric int8 with one float32 scale per token and KV head, computed when the
token is stored (``s = max|row| / 127``, no calibration). The scale lives in the same int8
tensor, after the row: a cache is ``[num_blocks, block_size, Hkv, D + 4]`` int8, where bytes
``D .. D + 3`` of each ``[D + 4]`` row are the float32 scale of its ``D`` values. One tensor
per cache keeps every backend's signature (``store_kv`` / ``paged_attention`` take the same
``(k_cache, v_cache)``); a block carries its own scales, so prefix caching, preemption and
the block tables need nothing new. Each value is within half a step (``s / 2``) of its float.

What it is not: fp8, static (calibrated) scales, or int8 arithmetic: readers dequantise to
the query's dtype (the compiled CPU kernel and the Triton kernels do it in registers).
"""

import torch

KV_CACHE_DTYPES = ("auto", "int8")
SCALE_BYTES = 4  # one float32 per (token, KV head)


def is_int8(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.int8


def packed_dim(head_dim: int) -> int:
    """The last dimension of an int8 cache for rows of ``head_dim`` values."""
    return head_dim + SCALE_BYTES


def head_dim_of(cache: torch.Tensor) -> int:
    """The head dimension a cache holds (its last dimension, less the scale for int8)."""
    return cache.shape[-1] - SCALE_BYTES if is_int8(cache) else cache.shape[-1]


def quantize(rows: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` float → ``[..., D + 4]`` int8: the rounded values, then the scale's bytes."""
    x = rows.float()
    scale = (x.abs().amax(dim=-1, keepdim=True) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(x / scale).clamp_(-127, 127).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[..., D + 4]`` int8 → ``[..., D]`` of ``dtype``."""
    d = packed.shape[-1] - SCALE_BYTES
    scale = packed[..., d:].contiguous().view(torch.float32)  # [..., 1]
    return (packed[..., :d].float() * scale).to(dtype)


def scale_error_bound(rows: torch.Tensor) -> torch.Tensor:
    """Half a quantisation step of each row, ``max|row| / 254``: no stored value is further off."""
    return rows.float().abs().amax(dim=-1, keepdim=True) / 254.0
