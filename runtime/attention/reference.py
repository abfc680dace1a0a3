"""Paged attention in plain torch: the CPU backend and the oracle for the Triton kernels.

Not fast: a loop over sequences. It defines the contract every backend meets.

KV cache layout, per layer: ``k_cache``/``v_cache`` are ``[num_blocks, block_size,
num_kv_heads, head_dim]`` (int8: ``head_dim + 4``, values then scales per block, see ``kv_int8``).
A token's slot is ``block_id * block_size + offset``.
Batches are ragged: the queries of all sequences are packed into ``[num_tokens, ...]``
and ``cu_seqlens_q`` marks where each sequence's queries start.
"""

import torch

from plimsoll.runtime.attention import kv_int8


def store_kv(
    key: torch.Tensor,  # [N, Hkv, D]
    value: torch.Tensor,  # [N, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [N] int64; -1 = do not store (padding)
) -> None:
    """Write each token's key and value into its slot of the paged cache (int8: quantised)."""
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    if kv_int8.is_int8(k_cache):
        kv_int8.store(k_cache, slots, key[keep])
        kv_int8.store(v_cache, slots, value[keep])
        return
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = value[keep].to(v_cache.dtype)


def paged_attention(
    query: torch.Tensor,  # [N, H, D], queries of all sequences packed
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32, padded with -1
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32, query offsets into N
    context_lens: torch.Tensor,  # [B] int32, tokens in the cache per sequence incl. this step's
    scale: float,
    max_q_len: int | None = None,  # accepted for the common signature; this oracle reads the offsets
) -> torch.Tensor:  # [N, H, D]
    """Causal attention of each sequence's new queries over its whole paged context.

    Sequence b has ``q_len = cu_seqlens_q[b+1] - cu_seqlens_q[b]`` new tokens at
    positions ``context_lens[b] - q_len ... context_lens[b] - 1``; query i attends
    to every cached position up to its own. This one contract covers prefill,
    chunked prefill after a prefix-cache hit, and decode (q_len = 1).
    """
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads  # GQA: query heads per KV head
    block_size = k_cache.shape[1]
    out = torch.empty_like(query)
    cu = cu_seqlens_q.tolist()
    lens = context_lens.tolist()
    for b, ctx_len in enumerate(lens):
        q = query[cu[b] : cu[b + 1]]  # [q_len, H, D]
        q_len = q.shape[0]
        if q_len == 0:
            continue
        num_blocks = (ctx_len + block_size - 1) // block_size
        blocks = block_tables[b, :num_blocks].long()
        head_dim = q.shape[-1]
        k = kv_int8.read_blocks(k_cache, blocks, q.dtype).reshape(-1, num_kv_heads, head_dim)[:ctx_len]
        v = kv_int8.read_blocks(v_cache, blocks, q.dtype).reshape(-1, num_kv_heads, head_dim)[:ctx_len]
        k = k.repeat_interleave(group, dim=1).to(q.dtype)  # [ctx, H, D]
        v = v.repeat_interleave(group, dim=1).to(q.dtype)
        scores = torch.einsum("qhd,khd->hqk", q, k).float() * scale  # [H, q_len, ctx]
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
        k_pos = torch.arange(ctx_len, device=q.device)
        scores.masked_fill_(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        out[cu[b] : cu[b + 1]] = torch.einsum("hqk,khd->qhd", probs, v)
    return out
