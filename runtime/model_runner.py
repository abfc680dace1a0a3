"""Turns a scheduled step into tensors, runs the model, returns logits to sample from.

What it is: owner of the KV cache tensors (one ``(k, v)`` pair per layer, each
``[num_blocks, block_size, num_kv_heads, head_dim]``) and the input builder
(``input_ids``, ``positions``, ``slot_mapping``, ``block_tables``, ``cu_seqlens_q``,
``context_lens``). What it is not: scheduling or sampling.
"""

from typing import Any

import torch

from plimsoll.runtime.attention import AttentionMetadata, get_backend
from plimsoll.runtime.models.llama import LlamaForCausalLM
from plimsoll.runtime.request import Request
from plimsoll.runtime.scheduler import SchedulerOutput


def kv_bytes_per_token(hf_config: Any, dtype: torch.dtype) -> int:
    """2 (K and V) × layers × kv_heads × head_dim × bytes per element (GQA-aware)."""
    num_kv_heads = hf_config.num_key_value_heads or hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    element = torch.empty((), dtype=dtype).element_size()
    return int(2 * hf_config.num_hidden_layers * num_kv_heads * head_dim * element)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        attention_backend: str = "torch",
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.store_kv, self.paged_attention = get_backend(attention_backend)
        cfg = model.config
        num_kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_hidden_layers)
        ]

    def prepare(
        self, sched: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Pack the step's tokens. Returns inputs, positions, metadata and the row of each
        sequence's last token (``-1`` when that sequence is mid-prefill and samples nothing)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        cu_seqlens_q = [0]
        context_lens: list[int] = []
        last_rows: list[int] = []
        max_blocks = max(len(req.block_ids) for req, _ in sched.scheduled)
        block_tables = torch.full((len(sched.scheduled), max_blocks), -1, dtype=torch.int32)
        for b, (req, num_new) in enumerate(sched.scheduled):
            end = req.num_computed_tokens  # the scheduler has already booked this step
            start = end - num_new
            input_ids.extend(req.all_token_ids[start:end])
            positions.extend(range(start, end))
            slot_mapping.extend(req.block_ids[p // bs] * bs + p % bs for p in range(start, end))
            cu_seqlens_q.append(cu_seqlens_q[-1] + num_new)
            context_lens.append(end)
            block_tables[b, : len(req.block_ids)] = torch.tensor(req.block_ids, dtype=torch.int32)
            last_rows.append(cu_seqlens_q[-1] - 1 if end == req.num_tokens else -1)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=dev),
            block_tables=block_tables.to(dev),
            cu_seqlens_q=torch.tensor(cu_seqlens_q, dtype=torch.int32, device=dev),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            max_q_len=max(n for _, n in sched.scheduled),
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        return ids, pos, meta, last_rows

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> tuple[list[Request], torch.Tensor]:
        """Run one step; return the requests that sample now and their fp32 logits ``[S, V]``."""
        ids, pos, meta, last_rows = self.prepare(sched)
        hidden = self.model(ids, pos, self.kv_caches, meta, self.store_kv, self.paged_attention)
        rows = [r for r in last_rows if r >= 0]
        reqs = [req for (req, _), r in zip(sched.scheduled, last_rows, strict=True) if r >= 0]
        if not rows:
            return [], torch.empty(0)
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        return reqs, logits.float()
