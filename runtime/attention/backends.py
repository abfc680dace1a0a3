"""Attention backend selection plus the metadata every backend reads.

What it is: ``AttentionMetadata`` (the kernel-vocabulary tensors of one step) and
``get_backend(name)`` returning ``(store_kv, paged_attention)`` with the contract
of ``attention/reference.py`` (the oracle). ``"torch"`` runs on torch's SDPA kernels
(``attention/sdpa.py``: decode batched, prefill on the causal flash path), which
run faster than the oracle's einsum loop. What it is not: a kernel.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from plimsoll.runtime.attention import sdpa

StoreKV = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
PagedAttention = Callable[..., torch.Tensor]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [N] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32, -1 padded
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    context_lens: torch.Tensor  # [B] int32
    max_q_len: int


# The torch backend's batched decode path, under the name scripts/gpu_check.py times.
batched_decode_attention = sdpa.decode_attention


def get_backend(name: str) -> tuple[StoreKV, PagedAttention]:
    if name == "torch":
        return sdpa.store_kv, sdpa.paged_attention
    if name == "triton":
        try:
            from plimsoll.runtime.attention import triton_backend
        except ImportError as exc:
            raise ValueError(
                "attention_backend='triton' needs the Triton kernels (plimsoll.runtime.attention.triton_backend) "
                f"and the triton package: {exc}. Use attention_backend='torch' on CPU."
            ) from exc
        return triton_backend.store_kv, triton_backend.paged_attention
    raise ValueError(f"attention_backend must be 'torch' or 'triton', got {name!r}")
