"""Turns a scheduled step into tensors, runs the model, returns logits to sample from.

What it is: owner of the KV cache tensors (one ``(k, v)`` pair per layer, each
``[num_blocks, block_size, num_kv_heads, head_dim]``, or int8 rows of ``head_dim + 4``
with ``--kv-cache-dtype int8``) and the input builder
(``input_ids``, ``positions``, ``slot_mapping``, ``block_tables``, ``cu_seqlens_q``,
``context_lens``). With tensor parallelism, rank 0's runner hands each step's
``StepPlan`` to ``plan_sink`` (the executor broadcasts it) and every rank runs the
same plan on its shard of the model and of the KV heads. What it is not:
scheduling or sampling.
"""

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from plimsoll.runtime.attention import kv_int8
from plimsoll.runtime.attention.backends import AttentionMetadata, get_backend
from plimsoll.runtime.engine.cuda_graphs import DecodeGraphs
from plimsoll.runtime.engine.request import Request
from plimsoll.runtime.engine.scheduler import SchedulerOutput
from plimsoll.runtime.models.llama import LlamaForCausalLM
from plimsoll.runtime.models.lora import LoRASlots, LoRAWeights
from plimsoll.runtime.models.tensor_parallel import kv_heads_per_rank


def kv_cache_shape(
    hf_config: Any, num_blocks: int, block_size: int, kv_cache_dtype: str = "auto", tensor_parallel_size: int = 1
) -> tuple[int, ...]:
    """``[num_blocks, block_size, num_kv_heads, head_dim]`` on one rank (with tensor parallelism
    each rank caches its KV heads only, ``kv_heads_per_rank``); int8 rows carry their scale (``kv_int8``)."""
    num_kv_heads = kv_heads_per_rank(hf_config, tensor_parallel_size)
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    if kv_cache_dtype == "int8":
        head_dim = kv_int8.packed_dim(head_dim)
    elif kv_cache_dtype != "auto":
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(kv_int8.KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return (num_blocks, block_size, num_kv_heads, head_dim)


def kv_bytes_per_token(
    hf_config: Any, dtype: torch.dtype, kv_cache_dtype: str = "auto", tensor_parallel_size: int = 1
) -> int:
    """2 (K and V) × layers × kv_heads × head_dim × bytes per element (GQA-aware), on one rank; for
    an int8 cache, × (head_dim + 4) bytes: each row's float32 scale is stored with it."""
    _, _, num_kv_heads, row = kv_cache_shape(hf_config, 1, 1, kv_cache_dtype, tensor_parallel_size)
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
        lora_slots: tuple[int, int] | None = None,  # (max_loras, max_lora_rank) with --enable-lora
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.model = model
        self.lora = LoRASlots(model, *lora_slots) if lora_slots is not None else None
        self.block_size = block_size
        self.device = device
        self.store_kv, self.paged_attention = get_backend(attention_backend)
        cfg = model.config
        attn = model.model.layers[0].self_attn  # this rank's heads (all of them without TP)
        row = kv_int8.packed_dim(attn.head_dim) if kv_cache_dtype == "int8" else attn.head_dim
        if kv_cache_dtype not in kv_int8.KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(kv_int8.KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
        self._block_shape = (block_size, attn.num_kv_heads, row)
        self._cache_dtype = torch.int8 if kv_cache_dtype == "int8" else dtype
        self._num_layers = cfg.num_hidden_layers
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.allocate_kv_cache(num_blocks)
        # Rank 0 of a tensor-parallel replica: called with each step's plan before it runs.
        self.plan_sink: Callable[[StepPlan], None] | None = None
        self.decode_graphs: DecodeGraphs | None = None  # enable_cuda_graphs()
        self.graph_replays = 0  # decode steps that replayed a graph

    def enable_cuda_graphs(self, max_num_seqs: int, max_model_len: int, capture: bool = True) -> None:
        """Capture the decode forward as CUDA graphs (``cuda_graphs.py``); decode-only steps replay
        them from now on. ``capture=False`` (tests on a CPU) runs the same padded static buffers
        eagerly. Needs the Triton backend; no LoRA, no tensor parallelism."""
        if self.lora is not None or self.plan_sink is not None:
            raise ValueError("CUDA graphs are not used with LoRA or tensor parallelism")
        from plimsoll.runtime.attention import triton_backend

        graphs = DecodeGraphs(
            self.model,
            self.kv_caches,
            self.store_kv,
            triton_backend.decode_attention,
            max_num_seqs,
            max_model_len,
            self.block_size,
            self.device,
            capture=capture,
        )
        graphs.capture_all()
        self.decode_graphs = graphs

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """(Re)allocate the KV cache with ``num_blocks`` blocks; the old tensors are dropped first, so
        sizing from the device can swap its provisional cache for the real one (0: drop only)."""
        self.kv_caches = []
        shape = (num_blocks, *self._block_shape)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self._cache_dtype, device=self.device),
                torch.zeros(shape, dtype=self._cache_dtype, device=self.device),
            )
            for _ in range(self._num_layers)
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
        ctx_t = torch.tensor(context_lens, dtype=torch.int64)  # [B]
        if min(q_lens) == max(q_lens) == 1:
            # Decode only (one token per sequence, at position context_len - 1): the positions and
            # slots straight from the lists, without the ~12 tensor ops of the general case below.
            pos_list = [c - 1 for c in context_lens]
            pos = torch.tensor(pos_list, dtype=torch.int64)
            slot_mapping = torch.tensor(
                [table[p // bs] * bs + p % bs for table, p in zip(tables, pos_list, strict=True)], dtype=torch.int64
            )
            cu_seqlens_q = torch.arange(len(q_lens) + 1, dtype=torch.int64)
        else:
            q_lens_t = torch.tensor(q_lens, dtype=torch.int64)  # [B]
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

    def _lora_row_mask(self, sched: SchedulerOutput) -> torch.Tensor | None:
        """``[N, max_loras]``: one-hot of each token's adapter slot; zero rows run the base model."""
        assert self.lora is not None
        slots = [req.lora_slot for req, _ in sched.scheduled]
        if max(slots) < 0:
            return None  # no adapter in this step: the projections skip LoRA entirely
        q_lens = torch.tensor([n for _, n in sched.scheduled], dtype=torch.int64)
        slot_of_token = torch.repeat_interleave(torch.tensor(slots, dtype=torch.int64), q_lens)  # [N]
        mask = torch.nn.functional.one_hot(slot_of_token.clamp(min=0), self.lora.max_loras)
        mask[slot_of_token < 0] = 0
        return mask.to(device=self.device, dtype=self.kv_caches[0][0].dtype)

    def load_lora(self, slot: int, weights: LoRAWeights) -> None:
        assert self.lora is not None
        self.lora.load(slot, weights)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> tuple[list[Request], torch.Tensor]:
        """Run one step; return the requests that sample now and their fp32 logits ``[S, V]``.

        A request carrying k proposals (``spec_token_ids``) gets k + 1 rows, in order:
        the logits after its last known token and after each proposal.
        """
        graphs = self.decode_graphs
        if graphs is not None and self.plan_sink is None and graphs.eligible(sched.scheduled):
            return self._replay(graphs, sched)
        ids, pos, meta, last_rows = self.prepare(sched)
        rows: list[int] = []
        reqs = []
        for (req, _), r in zip(sched.scheduled, last_rows, strict=True):
            if r >= 0:
                rows.extend(range(r - len(req.spec_token_ids), r + 1))
                reqs.append(req)
        plan = StepPlan(ids, pos, meta, rows)
        if self.plan_sink is not None:
            self.plan_sink(plan)
        if self.lora is not None:  # LoRA is refused with tensor parallelism: rank 0 only
            self.lora.row_mask = self._lora_row_mask(sched)
        try:
            logits = self.run(plan)
        finally:
            if self.lora is not None:
                self.lora.row_mask = None
        if logits is None:
            return [], torch.empty(0)
        return reqs, logits.float()

    def _replay(self, graphs: DecodeGraphs, sched: SchedulerOutput) -> tuple[list[Request], torch.Tensor]:
        hidden, last_rows = graphs.run(sched.scheduled)
        self.graph_replays += 1
        reqs = [req for (req, _), r in zip(sched.scheduled, last_rows, strict=True) if r >= 0]
        rows = [r for r in last_rows if r >= 0]
        if not rows:
            return [], torch.empty(0)
        logits: torch.Tensor = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        return reqs, logits.float()

    @torch.inference_mode()
    def run(self, plan: "StepPlan") -> torch.Tensor | None:
        """The forward of one plan; logits of its ``logit_rows`` (None when there are none)."""
        hidden = self.model(
            plan.input_ids, plan.positions, self.kv_caches, plan.meta, self.store_kv, self.paged_attention
        )
        if not plan.logit_rows:
            return None
        logits: torch.Tensor = self.model.compute_logits(
            hidden[torch.tensor(plan.logit_rows, device=self.device)]
        )
        return logits


@dataclass
class StepPlan:
    """One step's model input, the same on every tensor-parallel rank (rank 0 decides it)."""

    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    meta: AttentionMetadata
    logit_rows: list[int]  # rows of the hidden states that produce logits

    def to(self, device: torch.device | str) -> "StepPlan":
        m = self.meta
        return StepPlan(
            self.input_ids.to(device),
            self.positions.to(device),
            replace(
                m,
                slot_mapping=m.slot_mapping.to(device),
                block_tables=m.block_tables.to(device),
                cu_seqlens_q=m.cu_seqlens_q.to(device),
                context_lens=m.context_lens.to(device),
            ),
            self.logit_rows,
        )
