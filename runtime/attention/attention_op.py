"""One layer's paged attention as one call: directly (eager) or as an opaque op (torch.compile).

What it is: ``PagedAttend``, the call ``(query, key, value, layer, scale) -> out`` a decoder
layer makes after RoPE: store this step's K/V into the layer's cache, then attend over the
paged context, through the backend's ``store_kv`` and ``paged_attention`` and the step's
``AttentionMetadata`` (``max_q_len`` comes from the host, so the Triton backend never reads it
back from the device). And ``torch.ops.plimsoll.attention``, the same call registered as a
custom op with a fake implementation: ``torch.compile`` sees one node whose output has the
query's shape and fuses everything around it (RMSNorm and the residual add, RoPE, SiLU × up),
while the KV cache, the metadata and the kernels stay the backend's. The op reads them from the
``step_context`` the model runner opens around each compiled forward, as vLLM's
``unified_attention`` reads its forward context; so neither the multi-GiB caches nor the
metadata are graph inputs, and no functionalisation copies a cache. Under CUDA graph capture
the op's kernels are recorded with the buffers of the context that was open.

What it is not: a kernel, or where metadata is built (``engine/model_runner.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from plimsoll.runtime.attention.backends import AttentionMetadata, PagedAttention, StoreKV


@dataclass(eq=False, repr=False)
class PagedAttend:
    """The eager call: one step's caches, metadata and backend."""

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    meta: AttentionMetadata
    store_kv: StoreKV
    paged_attention: PagedAttention

    def __call__(
        self,
        query: torch.Tensor,  # [N, H, D]
        key: torch.Tensor,  # [N, Hkv, D]
        value: torch.Tensor,  # [N, Hkv, D]
        layer: int,
        scale: float,
    ) -> torch.Tensor:  # [N, H, D]
        k_cache, v_cache = self.kv_caches[layer]
        m = self.meta
        # Every layer stores all of the step's KV before attending, so sequences that hit a
        # block another sequence fills in this same step read it correctly.
        self.store_kv(key, value, k_cache, v_cache, m.slot_mapping)
        out: torch.Tensor = self.paged_attention(
            query,
            k_cache,
            v_cache,
            m.block_tables,
            m.cu_seqlens_q,
            m.context_lens,
            scale,
            max_q_len=m.max_q_len,
        )
        return out


_current: PagedAttend | None = None


@contextmanager
def step_context(attend: PagedAttend) -> Iterator[None]:
    """Make ``attend`` what ``torch.ops.plimsoll.attention`` calls until the block ends (nests:
    a draft model's forward inside a step restores the outer one)."""
    global _current
    outer, _current = _current, attend
    try:
        yield
    finally:
        _current = outer


@torch.library.custom_op("plimsoll::attention", mutates_args=())
def attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scale: float
) -> torch.Tensor:
    """``PagedAttend`` of the open ``step_context``: stores K/V (the cache is the context's, not an
    argument) and returns the attention output, a new contiguous ``[N, H, D]`` tensor (what the
    fake implementation promises the compiler, whatever the strides of ``query``)."""
    if _current is None:
        raise RuntimeError(
            "torch.ops.plimsoll.attention ran outside a step_context: the model runner opens one around "
            "every compiled forward"
        )
    return _current(query, key, value, layer, scale).contiguous()


@attention.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
    return query.new_empty(query.shape)


def opaque_attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scale: float
) -> torch.Tensor:
    """What the compiled forward calls in place of a ``PagedAttend``."""
    out: torch.Tensor = torch.ops.plimsoll.attention(query, key, value, layer, scale)
    return out
