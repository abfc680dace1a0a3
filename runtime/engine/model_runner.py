"""Turns a scheduled step into tensors, runs the model, returns logits to sample from.

What it is: owner of the KV cache tensors (one ``(k, v)`` pair per layer, each
``[num_blocks, block_size, num_kv_heads, head_dim]``, or ``head_dim + 4`` int8 bytes a row
with ``--kv-cache-dtype int8``, ``attention/kv_int8.py``) and the input builder
(``input_ids``, ``positions``, ``slot_mapping``, ``block_tables``, ``cu_seqlens_q``,
``context_lens``). A step's inputs are built on the host as a ``StepPlan`` and uploaded
through ``StepInputs``: persistent pinned staging and device buffers, copies that do not
block the host; with the Triton backend nothing in the step waits for the GPU until the
sampler reads the logits (the longest query comes from the host, contiguous logit rows are
sliced, other rows gathered through a staged index). The forward is the model's, or its
``torch.compile`` (``engine/compilation.py``); uniform decode and fixed-k verify steps
replay CUDA graphs (``cuda_graphs.py``), on ``--enable-lora`` servers too when no row of
the step uses an adapter. With tensor parallelism, rank 0's runner hands each step's host
plan to ``plan_sink`` (the executor broadcasts it) and every rank uploads and runs the
same plan on its shard of the model and of the KV heads. What it is not: scheduling or
sampling.
"""

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from plimsoll.runtime.attention import kv_int8
from plimsoll.runtime.attention.attention_op import PagedAttend
from plimsoll.runtime.attention.backends import AttentionMetadata, get_backend
from plimsoll.runtime.engine import kv_pages
from plimsoll.runtime.engine.compilation import CompiledForward
from plimsoll.runtime.engine.cuda_graphs import DecodeGraphs
from plimsoll.runtime.engine.request import Request
from plimsoll.runtime.engine.scheduler import SchedulerOutput
from plimsoll.runtime.models.cpu_plan import CUDA_GRAPH, MODULE_LAYERS, CPUOptions, CPUPlan
from plimsoll.runtime.models.llama import Attention, LlamaForCausalLM
from plimsoll.runtime.models.lora import LoRASlots, LoRAWeights
from plimsoll.runtime.models.tensor_parallel import kv_heads_per_rank
from plimsoll.runtime.models.weight_cache import WeightCache


def kv_cache_shape(
    hf_config: Any,
    num_blocks: int,
    block_size: int,
    kv_cache_dtype: str = "auto",
    tensor_parallel_size: int = 1,
) -> tuple[int, ...]:
    """``[num_blocks, block_size, num_kv_heads, head_dim]`` on one rank (with tensor parallelism
    each rank caches its KV heads only, ``kv_heads_per_rank``); an int8 block also holds its
    scales (``kv_int8``: ``head_dim + 4`` bytes a row)."""
    num_kv_heads = kv_heads_per_rank(hf_config, tensor_parallel_size)
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    if kv_cache_dtype == "int8":
        kv_int8.check_head_dim(head_dim)
        head_dim = kv_int8.packed_dim(head_dim)
    elif kv_cache_dtype != "auto":
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(kv_int8.KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
        )
    return (num_blocks, block_size, num_kv_heads, head_dim)


def kv_bytes_per_token(
    hf_config: Any, dtype: torch.dtype, kv_cache_dtype: str = "auto", tensor_parallel_size: int = 1
) -> int:
    """2 (K and V) × layers × kv_heads × head_dim × bytes per element (GQA-aware), on one rank; for
    an int8 cache, × (head_dim + 4) bytes: each row's float32 scale is stored with it."""
    _, _, num_kv_heads, row = kv_cache_shape(hf_config, 1, 1, kv_cache_dtype, tensor_parallel_size)
    element = 1 if kv_cache_dtype == "int8" else torch.empty((), dtype=dtype).element_size()
    return int(2 * hf_config.num_hidden_layers * num_kv_heads * row * element)


def cpu_options(config: Any) -> CPUOptions:
    """The CPU plan's switches from an ``EngineConfig``."""
    return CPUOptions(
        fused_decode=config.cpu_fused_decode,
        glued_layers=config.cpu_glued_layers,
        packed_weights=config.cpu_packed_weights,
        # Packed panels kept beside the compile caches (--compilation-cache-dir): a volume there
        # makes a restart map them instead of packing them again.
        panel_cache_dir=config.compilation_config.cache_dir,
    )


def weight_cache(config: Any) -> WeightCache | None:
    """Where a CPU model's weights are kept as served (fused, aligned) and mapped from on the next
    start: beside the packed panels under ``--compilation-cache-dir`` (models/weight_cache.py)."""
    directory = config.compilation_config.cache_dir
    return WeightCache(directory) if directory and str(config.device).startswith("cpu") else None


class StepInputs:
    """Persistent buffers a step's host tensors are uploaded through, one pair per input name.

    On CUDA: the host tensor is copied into a pinned staging buffer, then to a device buffer
    with ``non_blocking=True`` (the host goes on while the copy engine works); an event after
    each upload lets the next step wait for exactly that copy before it rewrites the staging
    rows. The device tensors returned are views of the device buffers, valid until the next
    step's upload of the same name (the stream runs the copies in order after this step's
    kernels). Buffers grow (to a power of two elements) when a step needs more. On CPU an
    upload is the tensor itself; ``staged=True`` runs the staging path on CPU (unpinned) for
    tests.
    """

    def __init__(self, device: torch.device, staged: bool | None = None) -> None:
        self.device = device
        self.staged = device.type == "cuda" if staged is None else staged
        self.pinned = device.type == "cuda"
        self._host: dict[str, torch.Tensor] = {}
        self._device: dict[str, torch.Tensor] = {}
        self._copied: Any = None  # torch.cuda.Event of the last upload

    def _buffer(
        self, table: dict[str, torch.Tensor], name: str, like: torch.Tensor, device: torch.device
    ) -> torch.Tensor:
        buf = table.get(name)
        if buf is None or buf.dtype != like.dtype or buf.numel() < like.numel():
            size = 1 << max(4, (like.numel() - 1).bit_length())
            pin = self.pinned and device.type == "cpu"
            buf = torch.empty(size, dtype=like.dtype, device=device, pin_memory=pin)
            table[name] = buf
        return buf

    def begin_step(self) -> None:
        """Wait until the last step's copies have read the staging buffers (they have, almost always)."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def upload(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if not self.staged:
            return tensor.to(self.device)
        n = tensor.numel()
        host = self._buffer(self._host, name, tensor, torch.device("cpu"))[:n].view(tensor.shape)
        host.copy_(tensor)
        dev = self._buffer(self._device, name, tensor, self.device)[:n].view(tensor.shape)
        dev.copy_(host, non_blocking=self.pinned)
        if self.pinned:
            self._copied = torch.cuda.Event()  # type: ignore[no-untyped-call,unused-ignore]  # torch.cuda.Event.__init__ is unannotated (torch 2.15)
            self._copied.record()
        return dev


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
        cpu_options: CPUOptions | None = None,  # the engine's cpu_* switches (cpu_options(config))
    ) -> None:
        self.model = model
        self.lora = LoRASlots(model, *lora_slots) if lora_slots is not None else None
        self.block_size = block_size
        self.device = device
        self.store_kv, self.paged_attention = get_backend(attention_backend)
        cfg = model.config
        attn = model.model.layers[0].self_attn  # this rank's heads (all of them without TP)
        if not isinstance(attn, Attention):
            raise TypeError(f"the model's layers must use llama.Attention, found {type(attn).__name__}")
        if kv_cache_dtype not in kv_int8.KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(kv_int8.KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
            )
        if kv_cache_dtype == "int8":
            kv_int8.check_head_dim(attn.head_dim)
        row = kv_int8.packed_dim(attn.head_dim) if kv_cache_dtype == "int8" else attn.head_dim
        self._block_shape = (block_size, attn.num_kv_heads, row)
        self._cache_dtype = torch.int8 if kv_cache_dtype == "int8" else dtype
        self._num_layers = cfg.num_hidden_layers
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.allocate_kv_cache(num_blocks)
        self.inputs = StepInputs(device)
        # The forward steps run: the model itself, or its torch.compile (enable_compile()).
        self.forward: Callable[..., torch.Tensor] = model
        self.compiled: CompiledForward | None = None
        # Rank 0 of a tensor-parallel replica: called with each step's host plan before it runs.
        self.plan_sink: Callable[[StepPlan], None] | None = None
        self.decode_graphs: DecodeGraphs | None = None  # enable_cuda_graphs(): one token a sequence
        self.verify_graphs: DecodeGraphs | None = None  # and 1 + k tokens (speculative verification)
        self.graph_replays = 0  # steps that replayed a graph
        # Which code serves each step (after LoRA's slots are attached: they change what fits).
        self.cpu_plan = CPUPlan(model, cpu_options, device, attention_backend, kv_cache_dtype)
        self.last_path = self.cpu_plan.last_path  # what served the last step (models/cpu_plan.STEP_PATHS)

    def enable_compile(self, warm_up: bool = True) -> CompiledForward:
        """Run the forward through ``torch.compile`` from now on (``engine/compilation.py``); with
        ``warm_up``, compile its graphs now (CUDA-graph capture compiles them anyway)."""
        if self.plan_sink is not None:
            raise ValueError("the compiled forward is not used with tensor parallelism")
        self.compiled = CompiledForward(self.model)
        self.forward = self.compiled
        if warm_up:
            with torch.inference_mode():
                self.compiled.warm_up(self.device, self.kv_caches, self.store_kv, self.paged_attention)
        return self.compiled

    def enable_cuda_graphs(
        self,
        max_num_seqs: int,
        max_model_len: int,
        capture: bool = True,
        num_speculative_tokens: int = 0,
        sizes: list[int] | None = None,
    ) -> None:
        """Capture the forward of uniform steps as CUDA graphs (``cuda_graphs.py``): decode steps
        (one token a sequence) and, with ``num_speculative_tokens`` k, verify steps (1 + k each);
        such steps replay them from now on. ``capture=False`` (tests on a CPU) runs the same
        padded static buffers eagerly. Needs the Triton backend; no tensor parallelism."""
        if self.plan_sink is not None:
            raise ValueError("CUDA graphs are not used with tensor parallelism")
        from plimsoll.runtime.attention import triton_backend

        forward, kv_caches, store_kv = self.forward, self.kv_caches, self.store_kv

        def step_forward(
            input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
        ) -> torch.Tensor:
            return forward(
                input_ids, positions, PagedAttend(kv_caches, meta, store_kv, triton_backend.paged_attention)
            )

        def graphs(query_len: int) -> DecodeGraphs:
            g = DecodeGraphs(
                step_forward,
                max_num_seqs,
                max_model_len,
                self.block_size,
                self.device,
                capture=capture,
                query_len=query_len,
                sizes=sizes,
            )
            g.capture_all()
            return g

        self.decode_graphs = graphs(1)
        if num_speculative_tokens > 0:
            self.verify_graphs = graphs(1 + num_speculative_tokens)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """(Re)allocate the KV cache with ``num_blocks`` blocks; the old tensors are dropped first, so
        sizing from the device can swap its provisional cache for the real one (0: drop only)."""
        self.kv_caches = []
        shape = (num_blocks, *self._block_shape)

        def zeroed() -> torch.Tensor:
            # On CPU each tensor on anonymous pages of its own (engine/kv_pages.py): zeroed by the
            # kernel, no memset, and given back in place by sleep level 1.
            if self.device.type == "cpu":
                return kv_pages.allocate(shape, self._cache_dtype)
            return torch.zeros(shape, dtype=self._cache_dtype, device=self.device)

        self.kv_caches = [(zeroed(), zeroed()) for _ in range(self._num_layers)]

    def kv_cache_bytes(self) -> int:
        """Bytes the KV cache tensors hold, all layers, K and V."""
        return sum(k.nbytes + v.nbytes for k, v in self.kv_caches)

    def kv_cache_resident_bytes(self) -> int:
        """Bytes of the KV cache in memory now (on CPU its resident pages: 0 after sleep level 1
        released them, all again once awake; see engine/kv_pages.py)."""
        return kv_pages.resident_bytes(t for pair in self.kv_caches for t in pair)

    def plan(self, sched: SchedulerOutput) -> tuple["StepPlan", list[int]]:
        """Pack the step's tokens on the host. Returns the plan (its ``logit_rows``: each sampling
        sequence's last token and, with proposals, the rows before it) and the row of each
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
        logit_rows: list[int] = []
        max_blocks = max(len(req.block_ids) for req, _ in sched.scheduled)
        tables: list[list[int]] = []
        num_tokens = 0
        for req, num_new in sched.scheduled:
            end = req.num_computed_tokens  # the scheduler has already booked this step
            spec = req.spec_token_ids
            tokens = req.all_token_ids + spec if spec else req.all_token_ids
            input_ids.extend(tokens[end - num_new : end])
            q_lens.append(num_new)
            context_lens.append(end)
            tables.append(req.block_ids + [-1] * (max_blocks - len(req.block_ids)))
            num_tokens += num_new
            samples = end == req.num_tokens + len(spec)
            last_rows.append(num_tokens - 1 if samples else -1)
            if samples:
                logit_rows.extend(range(num_tokens - 1 - len(spec), num_tokens))
        block_tables = torch.tensor(tables, dtype=torch.int32)  # [B, max_blocks]
        ctx_t = torch.tensor(context_lens, dtype=torch.int32)  # [B]
        if min(q_lens) == max(q_lens) == 1:
            # Decode only (one token per sequence, at position context_len - 1): the positions and
            # slots straight from the lists, without the ~12 tensor ops of the general case below.
            pos_list = [c - 1 for c in context_lens]
            pos = torch.tensor(pos_list, dtype=torch.int64)
            slot_mapping = torch.tensor(
                [table[p // bs] * bs + p % bs for table, p in zip(tables, pos_list, strict=True)],
                dtype=torch.int64,
            )
            cu_seqlens_q = torch.arange(len(q_lens) + 1, dtype=torch.int32)
        else:
            q_lens_t = torch.tensor(q_lens, dtype=torch.int64)  # [B]
            cu = torch.zeros(len(q_lens) + 1, dtype=torch.int64)
            torch.cumsum(q_lens_t, 0, out=cu[1:])
            seq_of_token = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens_t)  # [N]
            # Token i of sequence b sits at position context_len[b] - q_len[b] + (i - cu[b]).
            pos = torch.arange(num_tokens) + (ctx_t.long() - q_lens_t - cu[:-1])[seq_of_token]  # [N]
            slot_mapping = block_tables[seq_of_token, pos // bs].long() * bs + pos % bs  # [N]
            cu_seqlens_q = cu.to(torch.int32)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            cu_seqlens_q=cu_seqlens_q,
            context_lens=ctx_t,
            max_q_len=max(q_lens),
        )
        ids = torch.tensor(input_ids, dtype=torch.int64)
        return StepPlan(ids, pos, meta, logit_rows), last_rows

    def upload(self, plan: "StepPlan") -> "StepPlan":
        """The plan on this runner's device, through ``StepInputs`` (on CPU: the plan's own tensors)."""
        up, m = self.inputs.upload, plan.meta
        return StepPlan(
            up("input_ids", plan.input_ids),
            up("positions", plan.positions),
            replace(
                m,
                slot_mapping=up("slot_mapping", m.slot_mapping),
                block_tables=up("block_tables", m.block_tables),
                cu_seqlens_q=up("cu_seqlens_q", m.cu_seqlens_q),
                context_lens=up("context_lens", m.context_lens),
            ),
            plan.logit_rows,
        )

    def prepare(
        self, sched: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """The step's inputs on the device: ids, positions, metadata, and the row of each sequence's
        last token (``-1`` when that sequence is mid-prefill and samples nothing)."""
        plan, last_rows = self.plan(sched)
        self.inputs.begin_step()
        plan = self.upload(plan)
        return plan.input_ids, plan.positions, plan.meta, last_rows

    def _lora_row_mask(self, sched: SchedulerOutput) -> torch.Tensor | None:
        """``[N, max_loras]``: one-hot of each token's adapter slot; zero rows run the base model.
        Built on the device from the uploaded slot of each token (no blocking copy)."""
        assert self.lora is not None
        slots = [req.lora_slot for req, _ in sched.scheduled]
        if max(slots) < 0:
            return None  # no adapter in this step: the projections skip LoRA entirely
        q_lens = torch.tensor([n for _, n in sched.scheduled], dtype=torch.int64)
        slot_of_token = torch.repeat_interleave(torch.tensor(slots, dtype=torch.int64), q_lens)  # [N]
        slot_of_token = self.inputs.upload("lora_slots", slot_of_token)
        mask = torch.nn.functional.one_hot(slot_of_token.clamp(min=0), self.lora.max_loras)
        mask *= (slot_of_token >= 0)[:, None]
        return mask.to(dtype=self.model.model.norm.weight.dtype)

    def load_lora(self, slot: int, weights: LoRAWeights) -> None:
        assert self.lora is not None
        self.lora.load(slot, weights)

    def _graphs_for(self, scheduled: list[tuple[Request, int]]) -> DecodeGraphs | None:
        """The captured graphs that can run this step, if any: a uniform decode or verify step that
        fits them, with no row under an adapter."""
        if self.plan_sink is not None:
            return None
        if self.lora is not None and any(req.lora_slot >= 0 for req, _ in scheduled):
            return None
        for graphs in (self.decode_graphs, self.verify_graphs):
            if graphs is not None and graphs.eligible(scheduled):
                return graphs
        return None

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> tuple[list[Request], torch.Tensor]:
        """Run one step; return the requests that sample now and their fp32 logits ``[S, V]``.

        A request carrying k proposals (``spec_token_ids``) gets k + 1 rows, in order:
        the logits after its last known token and after each proposal.
        """
        graphs = self._graphs_for(sched.scheduled)
        if graphs is not None:
            return self._replay(graphs, sched)
        plan, last_rows = self.plan(sched)
        reqs = [req for (req, _), r in zip(sched.scheduled, last_rows, strict=True) if r >= 0]
        if self.plan_sink is not None:
            self.plan_sink(plan)  # host tensors: each rank uploads its own copy
        self.inputs.begin_step()
        mask = self._lora_row_mask(sched) if self.lora is not None else None  # LoRA is refused with TP
        if self.lora is not None:
            self.lora.row_mask = mask
        try:
            logits = self.run(self.upload(plan), eager=mask is not None)
        finally:
            if self.lora is not None:
                self.lora.row_mask = None
        # A compiled forward (engine/compilation.py) runs the modules, never the CPU plan's paths.
        compiled = self.compiled is not None and mask is None
        self.last_path = MODULE_LAYERS if compiled else self.cpu_plan.last_path
        if logits is None:
            return [], torch.empty(0)
        return reqs, logits.float()

    def _replay(self, graphs: DecodeGraphs, sched: SchedulerOutput) -> tuple[list[Request], torch.Tensor]:
        hidden, last_rows = graphs.run(sched.scheduled)
        self.graph_replays += 1
        self.last_path = CUDA_GRAPH
        reqs = [req for (req, _), r in zip(sched.scheduled, last_rows, strict=True) if r >= 0]
        q = graphs.query_len
        rows = [row for r in last_rows if r >= 0 for row in range(r - q + 1, r + 1)]
        if not rows:
            return [], torch.empty(0)
        logits: torch.Tensor = self.model.compute_logits(self._select_rows(hidden, rows))
        return reqs, logits.float()

    def _select_rows(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """``hidden[rows]`` (rows increasing): a slice when they are contiguous, as in decode and
        verify steps, else a gather through a staged index (no blocking copy either way)."""
        if rows[-1] - rows[0] == len(rows) - 1:
            return hidden[rows[0] : rows[-1] + 1]
        index = self.inputs.upload("logit_rows", torch.tensor(rows, dtype=torch.int64))
        return hidden.index_select(0, index)

    @torch.inference_mode()
    def run(self, plan: "StepPlan", eager: bool = False) -> torch.Tensor | None:
        """The forward of one plan (on this runner's device); logits of its ``logit_rows`` (None when
        there are none). ``eager`` skips the compiled forward (a step with LoRA adapters)."""
        forward = self.model if eager else self.forward
        step = PagedAttend(self.kv_caches, plan.meta, self.store_kv, self.paged_attention)
        hidden = forward(plan.input_ids, plan.positions, step)
        if not plan.logit_rows:
            return None
        logits: torch.Tensor = self.model.compute_logits(self._select_rows(hidden, plan.logit_rows))
        return logits


@dataclass
class StepPlan:
    """One step's model input, the same on every tensor-parallel rank (rank 0 decides it on the
    host and broadcasts it; each rank uploads it, ``ModelRunner.upload``)."""

    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    meta: AttentionMetadata
    logit_rows: list[int]  # rows of the hidden states that produce logits
