"""Attention backend selection plus the metadata every backend reads.

What it is: ``AttentionMetadata`` (the kernel-vocabulary tensors of one step) and
``get_backend(name)`` returning ``(store_kv, paged_attention)`` with the contract
of ``attention_torch.py``. The torch backend gets a batched path for decode
sequences (``q_len == 1``), which the per-sequence loop of the oracle is too slow
for; other sequences still go through the oracle. What it is not: a kernel.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from plimsoll.runtime import attention_torch

StoreKV = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
PagedAttention = Callable[..., torch.Tensor]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [N] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32, -1 padded
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    context_lens: torch.Tensor  # [B] int32
    max_q_len: int


def batched_decode_attention(
    query: torch.Tensor,  # [B, H, D], one query per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    context_lens: torch.Tensor,  # [B]
    scale: float,
) -> torch.Tensor:  # [B, H, D]
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    max_blocks = int((int(context_lens.max()) + block_size - 1) // block_size)
    tables = block_tables[:, :max_blocks].long().clamp(min=0)  # padding reads block 0, masked below
    k = k_cache[tables].reshape(num_seqs, max_blocks * block_size, num_kv_heads, head_dim)
    v = v_cache[tables].reshape(num_seqs, max_blocks * block_size, num_kv_heads, head_dim)
    q = query.reshape(num_seqs, num_kv_heads, group, head_dim)  # GQA without copying K/V
    scores = torch.einsum("bkgd,btkd->bkgt", q, k.to(q.dtype)).float() * scale  # [B, Hkv, G, T]
    pos = torch.arange(max_blocks * block_size, device=query.device)
    scores.masked_fill_(pos[None, None, None, :] >= context_lens[:, None, None, None].long(), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.einsum("bkgt,btkd->bkgd", probs, v)
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


def torch_paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Same contract as ``attention_torch.paged_attention``; decode sequences batched."""
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    is_decode = q_lens == 1
    if not bool(is_decode.any()):
        out: torch.Tensor = attention_torch.paged_attention(
            query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale
        )
        return out
    if bool(is_decode.all()):
        return batched_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale)
    out = torch.empty_like(query)
    dec = is_decode.nonzero().squeeze(1)
    dec_rows = cu_seqlens_q[:-1][dec].long()
    out[dec_rows] = batched_decode_attention(
        query[dec_rows], k_cache, v_cache, block_tables[dec], context_lens[dec], scale
    )
    pre = (~is_decode).nonzero().squeeze(1)
    rows = torch.cat([torch.arange(int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])) for b in pre.tolist()])
    cu_pre = torch.zeros(len(pre) + 1, dtype=cu_seqlens_q.dtype)
    cu_pre[1:] = torch.cumsum(q_lens[pre], 0)
    out[rows] = attention_torch.paged_attention(
        query[rows], k_cache, v_cache, block_tables[pre], cu_pre, context_lens[pre], scale
    )
    return out


def get_backend(name: str) -> tuple[StoreKV, PagedAttention]:
    if name == "torch":
        return attention_torch.store_kv, torch_paged_attention
    if name == "triton":
        try:
            from plimsoll.runtime import attention_triton
        except ImportError as exc:
            raise ValueError(
                "attention_backend='triton' needs the Triton kernels (plimsoll.runtime.attention_triton) "
                f"and the triton package: {exc}. Use attention_backend='torch' on CPU."
            ) from exc
        return attention_triton.store_kv, attention_triton.paged_attention
    raise ValueError(f"attention_backend must be 'torch' or 'triton', got {name!r}")
