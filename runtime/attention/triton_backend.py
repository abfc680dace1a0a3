"""Paged attention in Triton: the GPU backend.

Same contract as ``plimsoll.runtime.attention.reference`` (the oracle): ``store_kv`` and
``paged_attention`` with identical signatures and semantics. Three kernels:

- ``store_kv``: one program per token writes its key and value into its cache slot
  (slot ``-1`` is skipped).
- paged DECODE (every sequence has ``q_len <= 1``): grid ``(kv_head, sequence,
  kv_split)``; each program serves all query heads of one KV head (so each K/V block
  is read once) over its share of the context with an online softmax; with more
  than one split a second small kernel merges them with log-sum-exp weights.
- PREFILL over paged KV (ragged ``q_len``): grid ``(head, sequence, query tile)``,
  causal, over the whole context including cached prefix tokens, so it covers
  prefill, chunked prefill and prefix-cache hits; mixed batches (some sequences
  decoding) also go through it.

GQA: ``kv_head = head // (num_heads // num_kv_heads)``. Block tables may hold any
block ids in any order; each key's page is looked up per token.

An int8 cache (``kv_int8``: each block's values, then its float32 scales) is read as int8
tiles converted in registers, with the K scale on the scores and the V scale on the
probabilities; ``store_kv`` quantises in the kernel.

What this is not: no FP8 KV, no sliding window, no ALiBi. CUDA graphs of the decode
forward are the engine's (``engine/cuda_graphs.py``): the decode kernel launches the
same grid for a given batch size and block-table width, so it can be captured.

``triton`` is imported lazily, when a kernel is first needed, so importing this
module works without triton and on a CPU. On a CPU the kernels run only under
Triton's interpreter (``TRITON_INTERPRET=1`` in the environment), where they
compute in fp32 whatever the input dtype. The kernel bodies are in
``attention_triton_kernels``.
"""

from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from plimsoll.runtime.attention import kv_int8
from plimsoll.runtime.attention import triton_kernels as attention_triton_kernels

# Tiles used under the interpreter: numpy vectorises a tile, so bigger tiles mean
# fewer Python-level iterations. On a GPU the tiles and warps are the largest that
# ptxas fits in registers without spilling for head_dim 128 on sm_90 (checked with
# cuobjdump --dump-resource-usage on cubins compiled without a GPU, see the tests).
_INTERPRET_BLOCK_N = 64
_GPU_DECODE_BLOCK_N = 32
_GPU_PREFILL_BLOCK_M = 32
_GPU_PREFILL_BLOCK_N = 32
_GPU_NUM_WARPS = 8
# Below this many tokens per split, splitting decode costs more than it gains. The
# split count is a runtime argument (not a constexpr), so batches of changing size
# and length never trigger a recompile; the merge always reads a 16-wide tile.
_MIN_TOKENS_PER_SPLIT = 256
_MAX_KV_SPLITS = 16


def is_interpreting() -> bool:
    """True when Triton kernels will run in the interpreter (CPU tensors)."""
    import triton  # only where the Triton kernels run

    return bool(triton.knobs.runtime.interpret)


@functools.cache
def _kernels(interpret: bool) -> SimpleNamespace:
    """The decorated kernels, built once per interpreter mode (keyed so that a
    change of TRITON_INTERPRET between calls gets matching kernels)."""
    kernels: SimpleNamespace = attention_triton_kernels.build(interpret)
    return kernels


def _launchable(*tensors: torch.Tensor) -> dict[str, Any]:
    """Check that the tensors can feed a Triton kernel here; return launch options."""
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        raise ValueError(
            "Triton attention: all tensors must be on one device, got "
            + ", ".join(sorted({str(t.device) for t in tensors}))
        )
    if device.type != "cuda" and not is_interpreting():
        raise RuntimeError(
            f"Triton attention runs on a CUDA device, got tensors on {device}. On a CPU use "
            "attention_backend='torch' (or set TRITON_INTERPRET=1 to run the kernels in Triton's interpreter)."
        )
    # TRITON_INTERPRET decides, as it does for triton.jit (the interpreter also takes
    # CUDA tensors, copying them through host memory). Launch options mean nothing
    # to the interpreter; pass them to compiled kernels only.
    interpret = is_interpreting()
    return {"interpret": interpret, "launch": {} if interpret else {"num_warps": _GPU_NUM_WARPS}}


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must be contiguous in head_dim (stride 1 on the last axis)")


def _pow2(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= n (tile sizes must be powers of two), at least ``minimum``."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


def store_kv(
    key: torch.Tensor,  # [N, Hkv, D]
    value: torch.Tensor,  # [N, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [N] int64; -1 = do not store (padding)
) -> None:
    """Write each token's key and value into its slot of the paged cache (an int8 cache: each
    row quantised in the kernel, values and scale into their block regions, ``kv_int8``)."""
    opts = _launchable(key, value, k_cache, v_cache, slot_mapping)
    _check_cache(k_cache, v_cache)
    num_tokens, num_kv_heads, head_dim = key.shape
    row = kv_int8.packed_dim(head_dim) if kv_int8.is_int8(k_cache) else head_dim
    if value.shape != key.shape or tuple(k_cache.shape[2:]) != (num_kv_heads, row):
        raise ValueError(
            f"key/value {tuple(key.shape)}/{tuple(value.shape)} do not fit the cache's "
            f"[num_kv_heads, head_dim] = {tuple(k_cache.shape[2:])}"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"slot_mapping must have one slot per token ({num_tokens}), got {tuple(slot_mapping.shape)}"
        )
    if num_tokens == 0:
        return
    key, value, slot_mapping = map(_unit_stride, (key, value, slot_mapping))
    k_values, v_values, k_scales, v_scales, s_strides = _kv_operands(k_cache, v_cache)
    _kernels(opts["interpret"]).store_kv[(num_tokens,)](
        key, value, k_values, v_values, k_scales, v_scales, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *k_values.stride()[:3], *v_values.stride()[:3], *s_strides,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=k_cache.shape[1],
        BLOCK_H=_pow2(num_kv_heads), BLOCK_D=_pow2(head_dim), KV_INT8=kv_int8.is_int8(k_cache),
    )  # fmt: skip


def paged_attention(
    query: torch.Tensor,  # [N, H, D], queries of all sequences packed
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32, padded with -1
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32, query offsets into N
    context_lens: torch.Tensor,  # [B] int32, tokens in the cache per sequence incl. this step's
    scale: float,
    max_q_len: int | None = None,
    num_kv_splits: int | None = None,
) -> torch.Tensor:  # [N, H, D]
    """Causal attention of each sequence's new queries over its whole paged context.

    Same contract as ``reference.paged_attention``. Batches where every
    sequence has at most one query go to the split-KV decode kernel; any batch
    with a longer query (prefill, chunked prefill, mixed) goes to the prefill kernel.
    ``max_q_len`` (the longest query, which the host knows when it builds the step) saves
    reading it back from ``cu_seqlens_q``: a host sync, and no capture in a CUDA graph.
    ``num_kv_splits`` overrides the decode kernel's automatic choice of splits (tests use it
    to cover the merge).
    """
    if max_q_len is None:
        max_q_len = _max_q_len(cu_seqlens_q)
    opts = _launchable(query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens)
    _check_cache(k_cache, v_cache)
    _check_attention_args(query, k_cache, block_tables, cu_seqlens_q, context_lens)
    query, block_tables, cu_seqlens_q, context_lens = map(
        _unit_stride, (query, block_tables, cu_seqlens_q, context_lens)
    )
    call = _Call(
        opts, _kernels(opts["interpret"]), query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale,
        torch.empty_like(query),
    )  # fmt: skip
    if max_q_len <= 1:
        _launch_decode(call, num_kv_splits)
    elif call.query.shape[0]:
        _launch_prefill(call, max_q_len)
    return call.out


# Every layer of a step passes the same cu_seqlens_q tensor: remember its longest
# query so the host syncs once per step, not once per layer. A weak reference makes
# sure a new tensor at a recycled address is never mistaken for the old one; the
# version counter catches in-place edits (tensors made under torch.inference_mode
# have none, and the engine never edits them in place between layers).
_q_len_memo: tuple[weakref.ref[torch.Tensor], int | None, int] | None = None


def _version(tensor: torch.Tensor) -> int | None:
    return None if tensor.is_inference() else tensor._version


def _max_q_len(cu_seqlens_q: torch.Tensor) -> int:
    global _q_len_memo
    memo = _q_len_memo
    if memo is not None and memo[0]() is cu_seqlens_q and memo[1] == _version(cu_seqlens_q):
        return memo[2]
    if cu_seqlens_q.numel() < 2:
        raise ValueError("cu_seqlens_q must hold B + 1 offsets for B >= 1 sequences")
    value = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item())
    _q_len_memo = (weakref.ref(cu_seqlens_q), _version(cu_seqlens_q), value)
    return value


def _kv_operands(
    k_cache: torch.Tensor, v_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, int, int]]:
    """What the kernels read: the K and V value tensors and the K and V scale tensors with the
    scales' (block, slot, head) strides. An int8 cache gives the views of its block regions
    (``kv_int8.values``/``scales``); a float cache gives itself twice and zero strides (the
    kernels read no scale then)."""
    if not kv_int8.is_int8(k_cache):
        return k_cache, v_cache, k_cache, v_cache, (0, 0, 0)
    k_scales = kv_int8.scales(k_cache)
    strides = (k_scales.stride(0), k_scales.stride(1), k_scales.stride(2))
    return kv_int8.values(k_cache), kv_int8.values(v_cache), k_scales, kv_int8.scales(v_cache), strides


@dataclass(frozen=True, slots=True)
class _Call:
    """One checked attention call as the kernels' launchers take it (``paged_attention`` makes
    it): the launch options and kernels, the query, block table, query offsets and context
    lengths with a unit last stride, the caches, the scale and the output to write."""

    opts: dict[str, Any]
    kernels: SimpleNamespace
    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    cu_seqlens_q: torch.Tensor
    context_lens: torch.Tensor
    scale: float
    out: torch.Tensor


def _strides(
    query: torch.Tensor,
    out: torch.Tensor,
    k_values: torch.Tensor,
    v_values: torch.Tensor,
    s_strides: tuple[int, int, int],
    block_tables: torch.Tensor,
) -> tuple[int, ...]:
    """The strides the decode and prefill kernels take, in their order: query and output (token,
    head), K and V values (block, slot, head), the scales' (``_kv_operands``), the block table's row."""
    return (
        *query.stride()[:2],
        *out.stride()[:2],
        *k_values.stride()[:3],
        *v_values.stride()[:3],
        *s_strides,
        block_tables.stride(0),
    )


def _unit_stride(tensor: torch.Tensor) -> torch.Tensor:
    """The kernels index the last axis with stride 1 (other strides are passed in)."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def _check_attention_args(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
) -> None:
    num_seqs = context_lens.shape[0]
    head_dim = kv_int8.head_dim_of(k_cache)
    if query.dim() != 3 or query.shape[-1] != head_dim:
        raise ValueError(
            f"query must be [num_tokens, num_heads, head_dim={head_dim}], got {tuple(query.shape)}"
        )
    if query.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(
            f"num_heads ({query.shape[1]}) must be a multiple of num_kv_heads ({k_cache.shape[2]}) for GQA"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or cu_seqlens_q.shape != (num_seqs + 1,):
        raise ValueError(
            f"for {num_seqs} sequences (context_lens) expected block_tables [{num_seqs}, max_blocks] and "
            f"cu_seqlens_q [{num_seqs + 1}], got {tuple(block_tables.shape)} and {tuple(cu_seqlens_q.shape)}"
        )


def _compute_f32(query: torch.Tensor, k_cache: torch.Tensor, interpret: bool) -> bool:
    """Whether the kernels' tl.dot runs on fp32 operands (IEEE, not TF32).

    Always in the interpreter, whose bf16 arithmetic is wrong; and whenever the
    inputs are fp32. Otherwise 16-bit operands with fp32 accumulation, as the
    tensor cores do it and as the torch backend computes in 16 bits.
    """
    return interpret or query.dtype == torch.float32 or k_cache.dtype == torch.float32


def _num_kv_splits(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """How many programs share one (sequence, KV head) in decode.

    Enough programs to fill the GPU twice over when the batch is small, but never
    splits shorter than _MIN_TOKENS_PER_SPLIT tokens. One split in the interpreter,
    where every program runs one after another anyway.
    """
    if device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    wanted = math.ceil(2 * sms / max(1, num_seqs * num_kv_heads))
    by_length = max(1, max_context // _MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, by_length, _MAX_KV_SPLITS))


@functools.cache
def _sm_count(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def _launch_decode(call: _Call, num_kv_splits: int | None) -> None:
    """The split-KV decode kernel (every ``q_len`` is 0 or 1), and the merge of its splits."""
    opts, kernels, query, k_cache, out = call.opts, call.kernels, call.query, call.k_cache, call.out
    block_tables, context_lens = call.block_tables, call.context_lens
    num_seqs, (num_tokens, num_heads, head_dim) = context_lens.shape[0], query.shape
    page_size = k_cache.shape[1]
    if num_kv_splits is None:
        num_kv_splits = _num_kv_splits(
            num_seqs, k_cache.shape[2], block_tables.shape[1] * page_size, query.device
        )
    if not 1 <= num_kv_splits <= _MAX_KV_SPLITS:
        raise ValueError(f"num_kv_splits must be between 1 and {_MAX_KV_SPLITS}, got {num_kv_splits}")
    block_d = _pow2(head_dim, 16)  # tl.dot needs every tile dimension >= 16
    if num_tokens == 0:
        return
    # Per split: unnormalised output, running max and running sum (fp32) for the merge.
    # With one split the decode kernel writes the output itself and these go unused
    # (one element each: a real device pointer, never an empty tensor's null).
    if num_kv_splits > 1:
        part_acc = torch.empty(
            (num_seqs, num_heads, num_kv_splits, block_d), dtype=torch.float32, device=query.device
        )
        part_max = torch.empty((num_seqs, num_heads, num_kv_splits), dtype=torch.float32, device=query.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = torch.empty(1, dtype=torch.float32, device=query.device)
    group = num_heads // k_cache.shape[2]
    k_values, v_values, k_scales, v_scales, s_strides = _kv_operands(k_cache, call.v_cache)
    kernels.decode[(k_cache.shape[2], num_seqs, num_kv_splits)](
        query,
        k_values,
        v_values,
        k_scales,
        v_scales,
        block_tables,
        call.cu_seqlens_q,
        context_lens,
        out,
        part_acc,
        part_max,
        part_sum,
        call.scale,
        num_kv_splits,
        *_strides(query, out, k_values, v_values, s_strides, block_tables),
        GROUP=group,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_G=_pow2(group, 16),
        BLOCK_D=block_d,
        BLOCK_N=_INTERPRET_BLOCK_N if opts["interpret"] else _GPU_DECODE_BLOCK_N,
        COMPUTE_F32=_compute_f32(query, k_cache, opts["interpret"]),
        KV_INT8=kv_int8.is_int8(k_cache),
        **opts["launch"],
    )
    if num_kv_splits > 1:
        kernels.merge[(num_heads, num_seqs)](
            out,
            part_acc,
            part_max,
            part_sum,
            call.cu_seqlens_q,
            num_kv_splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_S=_pow2(_MAX_KV_SPLITS),
            BLOCK_D=block_d,
        )


def _launch_prefill(call: _Call, max_q_len: int) -> None:
    """The prefill kernel, for any batch: causal queries over prefix + new tokens."""
    opts, query, k_cache, out = call.opts, call.query, call.k_cache, call.out
    num_seqs, (num_heads, head_dim) = call.context_lens.shape[0], query.shape[1:]
    block_m = 16 if opts["interpret"] else _GPU_PREFILL_BLOCK_M
    block_n = _INTERPRET_BLOCK_N if opts["interpret"] else _GPU_PREFILL_BLOCK_N
    grid = (num_heads, num_seqs, -(-max_q_len // block_m))
    k_values, v_values, k_scales, v_scales, s_strides = _kv_operands(k_cache, call.v_cache)
    call.kernels.prefill[grid](
        query,
        k_values,
        v_values,
        k_scales,
        v_scales,
        out,
        call.block_tables,
        call.cu_seqlens_q,
        call.context_lens,
        call.scale,
        *_strides(query, out, k_values, v_values, s_strides, call.block_tables),
        GROUP=num_heads // k_cache.shape[2],
        HEAD_DIM=head_dim,
        PAGE_SIZE=k_cache.shape[1],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=_pow2(head_dim, 16),
        COMPUTE_F32=_compute_f32(query, k_cache, opts["interpret"]),
        KV_INT8=kv_int8.is_int8(k_cache),
        **opts["launch"],
    )
