"""Turns a scheduled step into tensors, runs the model, returns logits to sample from.

What it is: owner of the KV cache tensors (one ``(k, v)`` pair per layer, each
``[num_blocks, block_size, num_kv_heads, head_dim]``, or int8 rows of ``head_dim + 4``
with ``--kv-cache-dtype int8``) and the input builder
(``input_ids``, ``positions``, ``slot_mapping``, ``block_tables``, ``cu_seqlens_q``,
``context_lens``). What it is not: scheduling or sampling.
"""

from typing import Any

import torch

from plimsoll.runtime.attention import kv_int8
from plimsoll.runtime.attention.backends import AttentionMetadata, get_backend
from plimsoll.runtime.engine.request import Request
from plimsoll.runtime.engine.scheduler import SchedulerOutput
from plimsoll.runtime.models.llama import LlamaForCausalLM


def kv_cache_shape(hf_config: Any, num_blocks: int, block_size: int, kv_cache_dtype: str = "auto") -> tuple[int, ...]:
    """``[num_blocks, block_size, num_kv_heads, head_dim]``; int8 rows carry their scale (``kv_int8``)."""
    num_kv_heads = hf_config.num_key_value_heads or hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    if kv_cache_dtype == "int8":
        head_dim = kv_int8.packed_dim(head_dim)
    elif kv_cache_dtype != "auto":
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(kv_int8.KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return (num_blocks, block_size, num_kv_heads, head_dim)


def kv_bytes_per_token(hf_config: Any, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """2 (K and V) × layers × kv_heads × head_dim × bytes per element (GQA-aware); for an int8
    cache, × (head_dim + 4) bytes: each row's float32 scale is stored with it."""
    _, _, num_kv_heads, row = kv_cache_shape(hf_config, 1, 1, kv_cache_dtype)
    element = 1 if kv_cache_dtype == "int8" else torch.empty((), dtype=dtype).element_size()
    return int(2 * hf_config.num_hidden_layers * num_kv_heads * row * element)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        attention_backend: str = "torch",
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.store_kv, self.paged_attention = get_backend(attention_backend)
        cfg = model.config
        shape = kv_cache_shape(cfg, num_blocks, block_size, kv_cache_dtype)
        cache_dtype = torch.int8 if kv_cache_dtype == "int8" else dtype
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=cache_dtype, device=device),
                torch.zeros(shape, dtype=cache_dtype, device=device),
            )
            for _ in range(cfg.num_hidden_layers)
        ]

    def kv_cache_bytes(self) -> int:
        """Bytes the KV cache tensors hold, all layers, K and V."""
        return sum(k.nbytes + v.nbytes for k, v in self.kv_caches)

    def prepare(
        self, sched: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Pack the step's tokens. Returns inputs, positions, metadata and the row of each
        sequence's last token (``-1`` when that sequence is mid-prefill and samples nothing).

        Python touches each sequence once (its new token ids and block table); per-token
        positions and slots are computed with tensor ops, since a prefill step packs
        thousands of tokens.
        """
        bs = self.block_size
        input_ids: list[int] = []
        q_lens: list[int] = []
        context_lens: list[int] = []
        last_rows: list[int] = []
        max_blocks = max(len(req.block_ids) for req, _ in sched.scheduled)
        tables: list[list[int]] = []
        num_tokens = 0
        for req, num_new in sched.scheduled:
            end = req.num_computed_tokens  # the scheduler has already booked this step
            tokens = req.all_token_ids + req.spec_token_ids if req.spec_token_ids else req.all_token_ids
            input_ids.extend(tokens[end - num_new : end])
            q_lens.append(num_new)
            context_lens.append(end)
            tables.append(req.block_ids + [-1] * (max_blocks - len(req.block_ids)))
            num_tokens += num_new
            last_rows.append(num_tokens - 1 if end == req.num_tokens + len(req.spec_token_ids) else -1)
        block_tables = torch.tensor(tables, dtype=torch.int32)  # [B, max_blocks]
        q_lens_t = torch.tensor(q_lens, dtype=torch.int64)  # [B]
        ctx_t = torch.tensor(context_lens, dtype=torch.int64)  # [B]
        cu_seqlens_q = torch.zeros(len(q_lens) + 1, dtype=torch.int64)
        torch.cumsum(q_lens_t, 0, out=cu_seqlens_q[1:])
        seq_of_token = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens_t)  # [N]
        # Token i of sequence b sits at position context_len[b] - q_len[b] + (i - cu[b]).
        pos = torch.arange(num_tokens) + (ctx_t - q_lens_t - cu_seqlens_q[:-1])[seq_of_token]  # [N]
        slot_mapping = block_tables[seq_of_token, pos // bs].long() * bs + pos % bs  # [N]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(dev),
            block_tables=block_tables.to(dev),
            cu_seqlens_q=cu_seqlens_q.to(dtype=torch.int32, device=dev),
            context_lens=ctx_t.to(dtype=torch.int32, device=dev),
            max_q_len=max(q_lens),
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        return ids, pos.to(dev), meta, last_rows

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> tuple[list[Request], torch.Tensor]:
        """Run one step; return the requests that sample now and their fp32 logits ``[S, V]``.

        A request carrying k proposals (``spec_token_ids``) gets k + 1 rows, in order:
        the logits after its last known token and after each proposal.
        """
        ids, pos, meta, last_rows = self.prepare(sched)
        hidden = self.model(ids, pos, self.kv_caches, meta, self.store_kv, self.paged_attention)
        rows: list[int] = []
        reqs = []
        for (req, _), r in zip(sched.scheduled, last_rows, strict=True):
            if r >= 0:
                rows.extend(range(r - len(req.spec_token_ids), r + 1))
                reqs.append(req)
        if not rows:
            return [], torch.empty(0)
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        return reqs, logits.float()
