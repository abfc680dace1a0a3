"""The int8 KV cache layout (``--kv-cache-dtype int8``): how K and V rows are stored and read.

What it is: symmetric int8 with one float32 scale per token and KV head, computed when the
token is stored (``s = max|row| / 127``, no calibration); each value is within half a step
(``s / 2``) of its float. A cache is one int8 tensor ``[num_blocks, block_size, Hkv, D + 4]``
(the shape, and so the bytes per block, that the block pool, prefix caching and the KV
arithmetic already know), but **a block's bytes hold its values first, then its scales**:

    bytes [0, bs·Hkv·D)              values [bs, Hkv, D] int8, row-major  (``values(cache)``)
    bytes [bs·Hkv·D, bs·Hkv·(D + 4))  scales [bs, Hkv] float32            (``scales(cache)``)

So every row of ``D`` values starts ``D`` bytes after the previous one (16-byte aligned for
``D % 16 == 0`` and ``block_size % 4 == 0``): a decode kernel loads a tile of K or V rows with
full-width vector loads and the scales of the tile with one more, which is what lets it read
about half of bf16's bytes at bf16's speed. A block still carries its own scales, so prefix
caching, preemption, block tables and any code that copies a block by id need nothing new.
``head_dim`` must be a multiple of 4 (the scales' float32 view).

What it is not: fp8, static (calibrated) scales, or int8 arithmetic: readers dequantise to
the query's dtype (the Triton kernels fold the K scale into the scores and the V scale into
the probabilities, in registers).

Readers: ``reference.py`` and ``sdpa.py`` (gather and dequantise), the Triton kernels, and the
CPU decode-attention kernel (``kernels/csrc/attention.h``, ``Cache<int8_t>``), which reads values
and scales where they lie.
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


def check_head_dim(head_dim: int) -> None:
    if head_dim % SCALE_BYTES:
        raise ValueError(
            f"--kv-cache-dtype int8 needs head_dim divisible by {SCALE_BYTES} (the block layout's float32 "
            f"scales), got {head_dim}; use --kv-cache-dtype auto"
        )


def _regions(cache: torch.Tensor) -> tuple[torch.Tensor, int, int, int, int]:
    if cache.dim() != 4 or not is_int8(cache) or not cache.is_contiguous():
        raise ValueError(
            f"an int8 KV cache is a contiguous int8 [num_blocks, block_size, Hkv, D + 4] tensor, got "
            f"{cache.dtype} {tuple(cache.shape)}{'' if cache.is_contiguous() else ' (not contiguous)'}"
        )
    nb, bs, h, row = cache.shape
    d = row - SCALE_BYTES
    check_head_dim(d)
    return cache.view(nb, bs * h * row), nb, bs, h, d


def values(cache: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, block_size, Hkv, D]`` int8: a strided view of each block's value region."""
    flat, nb, bs, h, d = _regions(cache)
    return flat[:, : bs * h * d].view(nb, bs, h, d)


def scales(cache: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, block_size, Hkv]`` float32: a strided view of each block's scale region."""
    flat, nb, bs, h, d = _regions(cache)
    return flat[:, bs * h * d :].view(torch.float32).view(nb, bs, h)


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., D]`` float → (int8 ``[..., D]``, float32 scales ``[...]``); the Triton store kernel
    computes the same bits (``triton_kernels``: same division, round half to even)."""
    x = rows.float()
    scale = (x.abs().amax(dim=-1, keepdim=True) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(x / scale).clamp_(-127, 127).to(torch.int8)
    return q, scale.squeeze(-1)


def store(
    cache: torch.Tensor,  # int8 [num_blocks, block_size, Hkv, D + 4], block layout
    slots: torch.Tensor,  # [N] int64, all >= 0
    rows: torch.Tensor,  # [N, Hkv, D] float
) -> None:
    """Quantise ``rows`` and write values and scales into their slots."""
    q, s = quantize_rows(rows)
    block_size = cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    values(cache)[blocks, offsets] = q
    scales(cache)[blocks, offsets] = s


def read_blocks(cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The given blocks of a cache as ``[..., block_size, Hkv, D]`` of ``dtype``: dequantised for an
    int8 cache, cast otherwise."""
    if not is_int8(cache):
        return cache[blocks].to(dtype)
    return (values(cache)[blocks].float() * scales(cache)[blocks][..., None]).to(dtype)


def quantize_cache(cache: torch.Tensor) -> torch.Tensor:
    """A float ``[num_blocks, block_size, Hkv, D]`` cache → the int8 cache in the block layout."""
    nb, bs, h, d = cache.shape
    check_head_dim(d)
    out = torch.empty((nb, bs, h, packed_dim(d)), dtype=torch.int8, device=cache.device)
    q, s = quantize_rows(cache)
    values(out).copy_(q)
    scales(out).copy_(s)
    return out


def dequantize_cache(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An int8 cache in the block layout → ``[num_blocks, block_size, Hkv, D]`` of ``dtype``."""
    return (values(cache).float() * scales(cache)[..., None]).to(dtype)


def scale_error_bound(rows: torch.Tensor) -> torch.Tensor:
    """Half a quantisation step of each row, ``max|row| / 254``: no stored value is further off."""
    return rows.float().abs().amax(dim=-1, keepdim=True) / 254.0
