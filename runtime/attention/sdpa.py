"""Paged attention on torch's SDPA kernels: the fast CPU path of the torch backend.

What it is: the contract of ``reference.paged_attention`` (ragged queries over
a paged KV cache, causal within each sequence's context) on
``scaled_dot_product_attention``. Decode sequences (one query each) go through one
SDPA call for the whole batch: every context is gathered from its blocks into
``[B, Hkv, T, D]`` and a boolean mask hides the padding. Prefill sequences (several
queries, possibly after a prefix-cache hit) get one SDPA call each, on the causal
flash path when nothing of the context was cached (``prefill_attention`` says why
not one padded batch). GQA goes through SDPA's ``enable_gqa``, so K/V heads are
never copied per query head. ``store_kv`` writes through a flat view of the cache
with one ``index_copy_``. An int8 cache (``kv_int8``) is quantised as it is stored and
dequantised as it is gathered (through ``kv_int8``'s block layout).

Decode steps with a float32 query on CPU go to ``cpu_kernels.decode_attention`` where it is
built (float32, bfloat16 or int8 cache); float32 prefill and mixed steps over a float cache to
``cpu_kernels.paged_attention`` (head_dim 64 or 128): the SDPA calls below are what they fall
back to.

What it is not: a kernel, or the oracle. ``attention/reference.py`` stays the
reference the Triton kernels and this module are tested against.
"""

import functools

import torch
import torch.nn.functional as F

from plimsoll.runtime.attention import kv_int8
from plimsoll.runtime.kernels import cpu_kernels


def store_kv(
    key: torch.Tensor,  # [N, Hkv, D]
    value: torch.Tensor,  # [N, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [N] int64; -1 = do not store (padding)
) -> None:
    """Write each token's key and value into its slot; one ``index_copy_`` per cache."""
    if slot_mapping.numel() and int(slot_mapping.min()) < 0:
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    if kv_int8.is_int8(k_cache):  # --kv-cache-dtype int8: values and scales into their block regions
        kv_int8.store(k_cache, slot_mapping, key)
        kv_int8.store(v_cache, slot_mapping, value)
        return
    # A slot is block_id * block_size + offset: exactly its row in the flat view.
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks], -1 padded
    num_blocks: int,
    dtype: torch.dtype,
) -> torch.Tensor:  # [B, Hkv, num_blocks * block_size, D]
    tables = block_tables[:, :num_blocks].long().clamp(min=0)  # padding reads block 0; masked later
    ctx = kv_int8.read_blocks(cache, tables, dtype)  # [B, num_blocks, block_size, Hkv, D], int8 dequantised
    b, _, _, hkv, d = ctx.shape
    return ctx.reshape(b, -1, hkv, d).transpose(1, 2)


def decode_attention(
    query: torch.Tensor,  # [B, H, D], one query per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    context_lens: torch.Tensor,  # [B]
    scale: float,
    *,
    use_kernel: bool = True,
) -> torch.Tensor:  # [B, H, D]
    """A float32 query on CPU goes to the compiled kernel (``cpu_kernels``) when it is built (and
    ``use_kernel``), over a float32, bfloat16 or int8 cache (the kernel reads ``kv_int8``'s block
    layout in place); anything else to one SDPA call for the whole batch."""
    if use_kernel and cpu_kernels.supports_attention(query, k_cache, v_cache):
        return cpu_kernels.decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale)
    block_size = k_cache.shape[1]
    num_blocks = (int(context_lens.max()) + block_size - 1) // block_size
    k = gather_context(k_cache, block_tables, num_blocks, query.dtype)
    v = gather_context(v_cache, block_tables, num_blocks, query.dtype)
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k.shape[1]
    k_pos = torch.arange(k.shape[2], device=query.device)
    padding = k_pos[None, :] >= context_lens[:, None]  # [B, T]
    mask = torch.zeros(padding.shape, dtype=query.dtype, device=query.device).masked_fill_(
        padding, float("-inf")
    )
    # GQA as G queries per KV head (query head h reads KV head h // G), with an additive
    # mask: measured ~25% faster on CPU than enable_gqa with a boolean mask.
    q = query.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, Hkv, G, D]
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask[:, None, None, :], scale=scale
    )  # [B, Hkv, G, D]
    return out.reshape(num_seqs, num_heads, head_dim)


# The SDPA path alone, never the compiled kernel: what the kernel is tested against.
sdpa_decode_attention = functools.partial(decode_attention, use_kernel=False)


def prefill_attention(
    query: torch.Tensor,  # [N, H, D], queries of all sequences packed
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    cu_seqlens_q: torch.Tensor,  # [B + 1]
    context_lens: torch.Tensor,  # [B]
    scale: float,
) -> torch.Tensor:  # [N, H, D]
    """One SDPA call per sequence, which measured about 2x faster on CPU than one padded batch.

    A step holds a few prefills of very different lengths (32 to 512 tokens), so a
    padded batch computes up to 2-3x the scores it needs, while the loop costs ~10
    Python ops per sequence and layer against milliseconds of attention. A prompt
    whose whole context is new takes SDPA's ``is_causal`` flash path, with no mask.
    """
    out = torch.empty_like(query)
    block_size = k_cache.shape[1]
    cu = cu_seqlens_q.tolist()
    for b, ctx_len in enumerate(context_lens.tolist()):
        q_len = cu[b + 1] - cu[b]
        if q_len == 0:
            continue
        num_blocks = (ctx_len + block_size - 1) // block_size
        tables = block_tables[b : b + 1]
        k = gather_context(k_cache, tables, num_blocks, query.dtype)[:, :, :ctx_len]  # [1, Hkv, ctx, D]
        v = gather_context(v_cache, tables, num_blocks, query.dtype)[:, :, :ctx_len]
        q = query[cu[b] : cu[b + 1]].transpose(0, 1)[None]  # [1, H, q_len, D]
        if q_len == ctx_len:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:  # the queries end the context (after a prefix-cache hit, or a later chunk)
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=query.device)
            mask = torch.arange(ctx_len, device=query.device)[None, :] <= q_pos[:, None]  # [q_len, ctx]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[cu[b] : cu[b + 1]] = o[0].transpose(0, 1)
    return out


def paged_attention(
    query: torch.Tensor,  # [N, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_q_len: int | None = None,  # accepted for the common signature; this path reads the offsets
) -> torch.Tensor:  # [N, H, D]
    """Same contract as ``reference.paged_attention``: decode rows batched, prefills apart; a
    float32 CPU cache with head_dim 64 or 128 takes the compiled kernel for the whole step."""
    if query.shape[0] == 0:
        return torch.empty_like(query)
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    is_decode = q_lens == 1
    if bool(is_decode.all()):
        return decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale)
    # Prefill and mixed steps in one call (float32 and bfloat16 caches; an int8 one goes to SDPA).
    if cpu_kernels.supports_paged_attention(query, k_cache, v_cache):
        return cpu_kernels.paged_attention(
            query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale
        )
    if not bool(is_decode.any()):
        return prefill_attention(query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale)
    out = torch.empty_like(query)
    dec = is_decode.nonzero().squeeze(1)
    dec_rows = cu_seqlens_q[:-1][dec].long()
    out[dec_rows] = decode_attention(
        query[dec_rows], k_cache, v_cache, block_tables[dec], context_lens[dec], scale
    )
    pre = (~is_decode).nonzero().squeeze(1)
    row_is_decode = torch.zeros(query.shape[0], dtype=torch.bool, device=query.device)
    row_is_decode[dec_rows] = True
    pre_rows = (~row_is_decode).nonzero().squeeze(1)  # prefill rows, in order
    cu_pre = torch.zeros(pre.numel() + 1, dtype=torch.long, device=query.device)
    cu_pre[1:] = torch.cumsum(q_lens[pre].long(), 0)
    out[pre_rows] = prefill_attention(
        query[pre_rows], k_cache, v_cache, block_tables[pre], cu_pre, context_lens[pre], scale
    )
    return out
