"""The fused CPU decode step (every decoder layer of a small decode batch in one native call)
and the glued layers (every other step, oneDNN's matmuls with one native call between each two).

What it is: ``FusedDecode``, built once per model, which decides whether a step can run
through ``cpu_kernels.fused_decode`` and runs it. The module path calls ~130 torch ops and
five kernels per layer (~4,000 ops a step for SmolLM2); this is one ctypes call a step,
with the step's metadata (positions' cos/sin, slots, block tables, context lengths)
prepared once by the caller and the layers' weight and cache addresses gathered once.
A step fits when the model is a plain Llama/SmolLM2/Mistral decoder with float32
activations on CPU (no biases, no Qwen3 q/k norm, SiLU MLP, projections either all
float32 ``Linear`` or all ``Int8Linear`` from ``--quantization int8``, without LoRA or
tensor parallelism hooks, a float32 cache, the torch attention backend) and every row of
the step is one decode token, at most ``max_rows`` of them (the plan's limit over column panels,
or over plain rows; above that the glued layers take over). ``GluedLayers`` takes the steps of
at least ``min_rows`` rows it leaves (more decode rows, prefill, mixed steps, speculative
verification) for the same models with float32 projections: ~12 Python calls a layer
instead of ~130 torch ops; and every step of the same models in bfloat16 (``--dtype
bfloat16``) on a CPU whose oneDNN has native bf16 matmuls (AVX512_BF16, AMX). Everything
else (an int8 KV cache, Qwen2/Qwen3, LoRA, TP, GPUs; int8 projections above the plain-row
limit; bf16 where oneDNN would emulate it) takes the module path, unchanged. The engine's CPU
plan (``models/cpu_plan.py``) builds both once at load, with the row limits and switches it
was given, and runs each step through the first that takes it.

What it is not: a compiler, or a second model definition (``models/llama.py`` stays the
reference the fused step is tested against: ``tests/runtime/models/test_fused_decode.py``).
"""

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from plimsoll.runtime.attention import sdpa
from plimsoll.runtime.attention.attention_op import PagedAttend
from plimsoll.runtime.attention.backends import AttentionMetadata
from plimsoll.runtime.kernels import cpu_kernels
from plimsoll.runtime.models import dense
from plimsoll.runtime.models.dense import Linear
from plimsoll.runtime.models.quant import Int8Linear

_linear_pointwise = torch.ops.mkldnn._linear_pointwise if dense._ONEDNN else None


def why_not(model: Any, float_dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> str | None:
    """Why this model's decode steps cannot be fused (``None`` when they can): float projections
    of one of ``float_dtypes`` (the glued layers also take bfloat16) or int8 ones."""
    cfg = model.config
    if getattr(cfg, "hidden_act", None) != "silu":
        return f"activation {getattr(cfg, 'hidden_act', None)!r}, not silu"
    layers = list(model.model.layers)
    if not layers:
        return "no layers"
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qk_norm:
            return "per-head q/k norm (Qwen3)"
        kinds = {type(proj) for proj in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)}
        if kinds not in ({Linear}, {Int8Linear}):
            return f"{', '.join(sorted(k.__name__ for k in kinds))} projections"
        for proj in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            if proj.bias is not None:
                return "projection biases"
            if isinstance(proj, Int8Linear):
                reason = _int8_reason(proj)
                if reason is not None:
                    return reason
                continue
            if proj.lora is not None:
                return "LoRA adapters"
            w = proj.weight
            if w.device.type != "cpu" or w.dtype not in float_dtypes or not w.is_contiguous():
                return f"{w.dtype} weights on {w.device.type}"
            if w.dtype != model.model.norm.weight.dtype:
                return f"{w.dtype} projections in a {model.model.norm.weight.dtype} model"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if norm.weight.dtype != model.model.norm.weight.dtype or norm.eps != layers[0].input_layernorm.eps:
                return "norm weights of another dtype or mixed eps"
        for module in layer.modules():
            if isinstance(module, nn.Module) and (module._forward_hooks or module._forward_pre_hooks):
                return "forward hooks (tensor parallelism)"
        if attn.head_dim != layers[0].self_attn.head_dim or attn.head_dim % 2:
            return "uneven head_dim"
    return None


def _int8_reason(proj: Int8Linear) -> str | None:
    """Why the kernel cannot read this int8 projection (``None`` when it can)."""
    q, scales, offsets = proj.qweight, proj.scales, proj.offsets
    # The fused kernel reads the scales and offsets in place, so they must be float32 [N, groups].
    for t in (scales,) if offsets is None else (scales, offsets):
        if t.dtype != torch.float32 or t.dim() != 2 or not t.is_contiguous() or t.shape[0] != q.shape[0]:
            return "int8 scales not float32 [N, groups]"
    if not cpu_kernels.int8_weight_fits(q, scales):
        return (
            f"int8 weights on {q.device.type} in groups of {q.shape[-1] / scales.shape[1]:g} inputs "
            "(the kernels read contiguous CPU rows in groups of a multiple of 16)"
        )
    return None


def _int8_entries(proj: Int8Linear) -> list[int]:
    """qweight, scales, offsets (0: none) and the group size, as the int8 kernel reads them."""
    offsets = 0 if proj.offsets is None else proj.offsets.data_ptr()
    return [proj.qweight.data_ptr(), proj.scales.data_ptr(), offsets, proj.qweight.shape[1] // proj.scales.shape[1]]


def _plain_head(model: Any) -> torch.Tensor | None:
    """The output head's float32 weight where ``compute_logits`` is a plain matmul by it (a tied
    embedding, or an ``lm_head`` without bias, adapters or hooks), else ``None``."""
    if model.tie_word_embeddings:
        weight: torch.Tensor = model.model.embed_tokens.weight
    else:
        head = getattr(model, "lm_head", None)
        if type(head) is not Linear or head.bias is not None or head.lora is not None:
            return None
        if head._forward_hooks or head._forward_pre_hooks:
            return None
        weight = head.weight
    return weight if weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2 else None


def _plain_cpu_step(
    first_qkv: Any, x: torch.Tensor, step: PagedAttend, dtype: torch.dtype = torch.float32
) -> bool:
    """What both native paths need of a step, beyond the model's fit (``why_not``): no adapters
    (they can be attached after the first forward), activations of ``dtype`` on CPU, a contiguous
    cache of ``dtype`` and the torch attention backend."""
    k0 = step.kv_caches[0][0]
    return (
        getattr(first_qkv, "lora", None) is None
        and x.dtype == dtype
        and x.device.type == "cpu"
        and k0.dtype == dtype
        and k0.is_contiguous()
        and step.store_kv is sdpa.store_kv
        and step.paged_attention is sdpa.paged_attention
    )


class FusedDecode:
    """Built once per model by its CPU plan; ``run`` returns ``False`` when the step does not fit
    (the caller then runs the glued or the module path). ``packed``: the float32 projections and
    head packed in column panels (a second copy of them; off: the plain rows, one copy);
    ``max_rows``: the most decode rows a step may have over panels and over plain rows (0: the
    step never runs; the panels are still packed for the glued layers and the head)."""

    def __init__(
        self, model: Any, packed: bool = True, max_rows: tuple[int, int] = (0, 0), panel_cache: Any = None
    ) -> None:
        self.model = model
        self.packed_weights = packed
        self.reason = why_not(model)
        if self.reason is None and cpu_kernels.library() is None:
            self.reason = f"the CPU kernels: {cpu_kernels.unavailable_reason()}"
        first = model.model.layers[0]
        attn = first.self_attn
        self.eps = float(first.input_layernorm.eps)
        self.scale = float(attn.scale)
        self.shape = (attn.num_heads, attn.num_kv_heads, attn.head_dim)
        self.hidden = int(model.config.hidden_size)
        self.inter = int(first.mlp.intermediate_size)
        self._first_qkv = attn.qkv_proj
        self.int8 = isinstance(attn.qkv_proj, Int8Linear)
        self._addresses: torch.Tensor | None = None
        self._key: tuple[int, ...] = ()
        # Each layer's float32 projections (qkv, o, gate_up in two parts, down) and the output head
        # packed once in column panels (cpu_kernels.pack_f32), read by this step, the glued layers
        # and compute_logits in place of the plain rows, which the module path keeps.
        self.panels: list[tuple[cpu_kernels.PackedWeight, ...]] = []
        self.head: cpu_kernels.PackedWeight | None = None
        # The panels are pages of a file in the panel cache (models/panel_cache.py), not packed here.
        self.mapped = False
        if self.reason is None and not self.int8 and packed:
            self._pack_or_map(panel_cache)
        self.max_rows = 0 if self.reason is not None else max_rows[0] if self.panels else max_rows[1]

    def _sources(self) -> list[tuple[torch.Tensor, int]]:
        """The weights packed in panels, in order (each layer's qkv, o, gate_up in two parts, down;
        then the plain head, if any), with their parts."""
        out: list[tuple[torch.Tensor, int]] = []
        for layer in self.model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            out += [(attn.qkv_proj.weight, 1), (attn.o_proj.weight, 1)]
            out += [(mlp.gate_up_proj.weight, 2), (mlp.down_proj.weight, 1)]
        head = _plain_head(self.model)
        return out if head is None else [*out, (head, 1)]

    def _pack_or_map(self, cache: Any) -> None:
        sources = self._sources()
        packed: list[cpu_kernels.PackedWeight] | None = None
        fingerprint = getattr(self.model, "checkpoint_fingerprint", None)
        key = None
        if cache is not None and fingerprint:
            layouts = [cpu_kernels.packed_f32_layout(w.shape[0], w.shape[1], parts) for w, parts in sources]
            cols = layouts[0][1]
            key = cache.key(fingerprint, [(*w.shape, parts) for w, parts in sources], cols)
            mapped = cache.load(key, [floats for floats, _ in layouts])
            if mapped is not None:
                packed = [
                    cpu_kernels.PackedWeight(data, w.shape[0], w.shape[1], parts, cols)
                    for data, (w, parts) in zip(mapped, sources, strict=True)
                ]
                self.mapped = True
        if packed is None:
            with torch.no_grad():
                packed = [cpu_kernels.pack_f32(w, parts) for w, parts in sources]
            if key is not None:
                cache.store(key, [p.data for p in packed])
        layers = len(self.model.model.layers)
        self.panels = [tuple(packed[4 * i : 4 * i + 4]) for i in range(layers)]
        self.head = packed[4 * layers] if len(packed) > 4 * layers else None

    def _panel_sources(self) -> list[tuple[torch.Tensor, int, cpu_kernels.PackedWeight]]:
        """Each packed panel with the weight it was packed from and its parts."""
        panels = [p for layer in self.panels for p in layer] + ([self.head] if self.head is not None else [])
        return [(w, parts, p) for (w, parts), p in zip(self._sources(), panels, strict=True)]

    def drop_panels(self) -> int:
        """Free the packed panels' memory (sleep level 2, which drops the weights they copy); the
        bytes freed. The ``PackedWeight`` objects stay, empty, for :meth:`repack` to fill."""
        freed = 0
        for _, _, packed in self._panel_sources():
            storage = packed.data.untyped_storage()
            freed += storage.nbytes()
            storage.resize_(0)
        return freed

    def repack(self) -> None:
        """Pack the panels again from the weights, into the same ``PackedWeight`` objects (every
        reader, the glued layers too, holds those), after :meth:`drop_panels` and a reload."""
        with torch.no_grad():
            for weight, parts, packed in self._panel_sources():
                packed.data.untyped_storage().resize_(packed.data.numel() * packed.data.element_size())
                cpu_kernels.pack_f32(weight, parts, out=packed.data)
        self._addresses = None  # the panels' addresses moved

    def _layer_addresses(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """``[L, 8]`` int64 addresses (``[L, 20]`` for int8 projections), rebuilt only when a weight
        or a cache tensor moved."""
        layers = self.model.model.layers

        def weight(proj: Any) -> torch.Tensor:
            # ``proj`` is an Int8Linear (int8 projections) or an nn.Linear: read by attribute.
            tensor: torch.Tensor = proj.qweight if self.int8 else proj.weight
            return tensor

        key = (
            weight(layers[0].self_attn.qkv_proj).data_ptr(),
            weight(layers[-1].mlp.down_proj).data_ptr(),
            kv_caches[0][0].data_ptr(),
            kv_caches[-1][1].data_ptr(),
        )
        if self._addresses is None or key != self._key:
            rows = []
            for i, (layer, (k, v)) in enumerate(zip(layers, kv_caches, strict=True)):
                attn, mlp = layer.self_attn, layer.mlp
                if self.int8:
                    row = [layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr()]
                    row += [k.data_ptr(), v.data_ptr()]
                    for proj in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                        row += _int8_entries(proj)
                else:
                    qkv, o, gate_up, down = (
                        [p.data for p in self.panels[i]] if self.panels
                        else [attn.qkv_proj.weight, attn.o_proj.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight]
                    )  # fmt: skip
                    row = [
                        layer.input_layernorm.weight.data_ptr(),
                        qkv.data_ptr(),
                        o.data_ptr(),
                        layer.post_attention_layernorm.weight.data_ptr(),
                        gate_up.data_ptr(),
                        down.data_ptr(),
                        k.data_ptr(),
                        v.data_ptr(),
                    ]
                rows.append(row)
            self._addresses, self._key = torch.tensor(rows, dtype=torch.int64), key
        return self._addresses

    def run(
        self,
        x: torch.Tensor,  # [N, hidden] embeddings; overwritten with the last layer's output
        cos: torch.Tensor,  # [N, D]
        sin: torch.Tensor,
        step: PagedAttend,  # the step's caches, metadata and attention backend
    ) -> bool:
        """Run every layer on ``x`` in place and return ``True``, or return ``False`` untouched."""
        n, kv_caches, meta = x.shape[0], step.kv_caches, step.meta
        if (
            self.reason is not None
            or not 0 < n <= self.max_rows
            or meta.max_q_len != 1
            or meta.context_lens.shape[0] != n
            or not _plain_cpu_step(self._first_qkv, x, step)
        ):
            return False
        k0 = kv_caches[0][0]
        heads, kv_heads, head_dim = self.shape
        num_blocks, block_size = k0.shape[0], k0.shape[1]
        cpu_kernels.fused_decode(
            x,
            self._layer_addresses(kv_caches),
            cos.contiguous(),
            sin.contiguous(),
            meta.slot_mapping.to(torch.int64).contiguous(),
            meta.block_tables.to(torch.int32).contiguous(),
            meta.context_lens.to(torch.int32).contiguous(),
            (self.hidden, heads, kv_heads, head_dim, self.inter, block_size, num_blocks * block_size),
            self.eps,
            self.scale,
            int8=self.int8,
            packed=bool(self.panels),
        )
        return True

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``hidden @ head.T`` over the packed head, or ``None`` where the step's rows are not float32
        CPU rows or there is no packed head (the caller then runs its own matmul)."""
        if self.head is None or hidden.dtype != torch.float32 or hidden.device.type != "cpu" or hidden.dim() != 2:
            return None
        if not hidden.shape[0] or hidden.stride(1) != 1:
            return None
        return cpu_kernels.packed_linear(hidden, self.head)


# Below this many rows the glue between matmuls runs on the calling thread: a few microseconds
# a call, where handing it to the kernels' pool costs more than it saves while oneDNN's OpenMP
# threads spin (step_ab --compare glued at 32 and 64 rows: 0.96 and 1.09 of the module path
# split over the pool, 0.88 and 0.93 on one thread). Prefill-sized steps split it.
GLUE_SPLIT_ROWS = 256


# Weights packed once instead of read as plain rows (FusedDecode's ``packed``, from
# --cpu-packed-weights): a float32 model's projections and output head in column panels
# (cpu_kernels.pack_f32) for the fused step, the glued layers and the head (SmolLM2's projections
# streamed from memory, two threads, AMD EPYC Zen 4: 16 rows 125-135 -> 176 GFLOP/s, 64 rows 194
# -> 214, 256 rows 212 -> 219; benchmarks/results/2026-12-05-cpu-column-panels.md); a bfloat16 model's in oneDNN's blocked layout for
# the glued layers (as vLLM's CPU build prepacks). The cost is a second copy of the projections
# (and for float32 the head): the module path reads the plain rows. Off, one copy (the plain-row
# kernel and oneDNN then).


def _reorder_op() -> Any:
    """oneDNN's weight reorder for ``_linear_pointwise``, or ``None`` in a torch without it."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight
    except (AttributeError, RuntimeError):
        return None


_REORDER = _reorder_op()


def _pack(weight: torch.Tensor) -> torch.Tensor:
    packed: torch.Tensor = _REORDER(weight.detach(), dense.ONEDNN_CHUNK_ROWS)
    return packed


# A bf16 step whose prefills see at least this many (query, token) pairs runs torch's SDPA, which
# on an AMX host computes them in bf16 faster than the float32 ragged kernel; a step of fewer
# (decode rows beside short prefills) stays in the kernel. Per layer, SmolLM2 heads, two threads
# (ms, SDPA / kernel): 12 prefills of 160 3.3 / 5.1, 1 of 512 beside 32 decodes 2.4 / 4.0, a
# 256-token chunk of 1,024 2.0 / 5.6; 2 of 160 beside 48 decodes 1.8 / 1.4, 3 of 64 0.40 / 0.47.
BF16_SDPA_MIN_PAIRS = 1 << 17


def _prefill_pairs(meta: AttentionMetadata) -> int:
    """(query, token) pairs of the step's rows that are not decode rows (each query row sees at
    most its sequence's context)."""
    q_lens = meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]
    prefill = q_lens > 1
    return int((q_lens[prefill] * meta.context_lens[prefill]).sum())


def _bf16_matmul_reason() -> str | None:
    """Why oneDNN's bfloat16 matmul is not the fast path here (``None`` when it is: AVX512_BF16 or AMX)."""
    try:
        fast = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        fast = False
    return None if fast else "oneDNN has no native bfloat16 matmul on this CPU"


class GluedLayers:
    """The steps ``FusedDecode`` does not take (more decode rows than it does, prefill and mixed
    steps), layer by layer with ~10 calls a layer instead of ~130: oneDNN's matmul for each
    projection at the module path's padded row counts, over weights prepacked once,
    and one native call for each run of ops between two matmuls (``cpu_kernels.add_rms_norm``,
    ``rope_store``, ``silu_mul``; attention into a buffer). Same model fit as the fused step with
    float32 projections, where a step of fewer than ``min_rows`` rows keeps the module path
    (its matmuls are not oneDNN's there), or bfloat16 projections on a CPU with native bf16
    matmuls (AVX512_BF16, AMX), where every step is glued: the matmuls' operands and the cache
    bfloat16, the residual stream, the norms, RoPE and attention float32 (each layer's output
    rounded to bf16 once, where the module path rounds every op's). ``run`` returns the final
    norm's output (the model's dtype), or ``None``."""

    def __init__(self, fused: FusedDecode, min_rows: int = 1) -> None:
        self.fused = fused
        model = fused.model
        self.dtype = model.model.norm.weight.dtype
        self.reason = why_not(model, tuple(cpu_kernels.GLUE_DTYPES))
        if self.reason is None and cpu_kernels.library() is None:
            self.reason = f"the CPU kernels: {cpu_kernels.unavailable_reason()}"
        if self.reason is None and fused.int8:
            self.reason = "int8 projections (their kernel dequantises above its rows)"
        if self.reason is None and not dense.uses_onednn(torch.empty(1, 1), torch.empty(1, 1)):
            self.reason = "no oneDNN in this torch build"
        if self.reason is None and self.dtype == torch.bfloat16:
            self.reason = _bf16_matmul_reason()
        # The fewest rows a glued step takes: bf16 matmuls are oneDNN's at every row count; in
        # float32 a step of fewer than min_rows rows that the fused step does not take keeps the
        # module path (its matmuls the compiled kernel's, and few ops at such sizes).
        self.min_rows = 1 if self.dtype == torch.bfloat16 else min_rows
        self.layers = [] if self.reason is not None else [
            (
                layer.input_layernorm.weight,
                layer.self_attn.qkv_proj.weight,
                layer.self_attn.o_proj.weight,
                layer.post_attention_layernorm.weight,
                layer.mlp.gate_up_proj.weight,
                layer.mlp.down_proj.weight,
            )
            for layer in model.model.layers
        ]  # fmt: skip
        # The norms run in float32 (a bf16 model's weights widened once: a few KiB a layer).
        self.layers = [
            (ln1.float(), qkv, o, ln2.float(), gate_up, down) for ln1, qkv, o, ln2, gate_up, down in self.layers
        ]
        self.final_norm = model.model.norm.weight.float()
        # float32: the fused step's column panels (cpu_kernels.packed_linear, faster than oneDNN at
        # every row count measured). bfloat16: each projection in oneDNN's blocked layout for up to
        # ONEDNN_CHUNK_ROWS rows (an opaque tensor _linear_pointwise takes in the plain weight's
        # place), and the primitives for every row bucket built now (warm-up), as
        # dense.prime_onednn does for the plain weights.
        self.panels = bool(self.layers) and bool(fused.panels) and self.dtype == torch.float32
        if self.panels:
            self.layers = [
                (ln1, qkv, o, ln2, gate_up, down)
                for (ln1, _, _, ln2, _, _), (qkv, o, gate_up, down) in zip(self.layers, fused.panels, strict=True)
            ]
        self.packed = fused.packed_weights and _REORDER is not None and bool(self.layers) and not self.panels
        if self.packed:
            assert _linear_pointwise is not None
            with torch.no_grad():
                self.layers = [
                    (ln1, _pack(qkv), _pack(o), ln2, _pack(gate_up), _pack(down))
                    for ln1, qkv, o, ln2, gate_up, down in self.layers
                ]
                _, qkv, o, _, gate_up, down = self.layers[0]
                for weight in (qkv, o, gate_up, down):
                    for rows in range(dense.ONEDNN_ROW_BUCKET, dense.ONEDNN_CHUNK_ROWS + 1, dense.ONEDNN_ROW_BUCKET):
                        h = torch.zeros(rows, weight.shape[1], dtype=self.dtype)
                        _linear_pointwise(h, weight, None, "none", [], "")

    def run(
        self,
        x: torch.Tensor,  # [N, hidden] embeddings (updated in place: the residual stream)
        cos: torch.Tensor,
        sin: torch.Tensor,
        step: PagedAttend,  # the step's caches, metadata and attention backend
    ) -> torch.Tensor | None:
        n, kv_caches, meta = x.shape[0], step.kv_caches, step.meta
        if (
            self.reason is not None
            or n < self.min_rows
            or not _plain_cpu_step(self.fused._first_qkv, x, step, self.dtype)
        ):
            return None
        bf16 = self.dtype == torch.bfloat16
        if bf16:  # the residual stream in float32; x (the embeddings) is left as it is
            x = x.float()
        k0 = kv_caches[0][0]
        fused = self.fused
        heads, _, head_dim = fused.shape
        hidden, eps = fused.hidden, fused.eps
        assert _linear_pointwise is not None  # __init__ checked oneDNN is there
        # Rows go through each layer's matmuls in chunks of at most ONEDNN_CHUNK_ROWS (the last
        # padded to its bucket), each chunk's matmul output read by the glue in place: no copy
        # of chunk outputs into a whole-step tensor, and a chunk's activations stay in cache.
        chunks = [
            (c0, min(n, c0 + dense.ONEDNN_CHUNK_ROWS)) for c0 in range(0, n, dense.ONEDNN_CHUNK_ROWS)
        ]  # fmt: skip
        top = chunks[-1][0] + dense.bucket_rows(chunks[-1][1] - chunks[-1][0])  # rows the last chunk's matmul reads
        width = dense.bucket_rows(chunks[0][1] - chunks[0][0])
        # Matmul inputs: rows past a chunk's own hold zeros or an earlier chunk's values, finite
        # either way, and each output row depends on its input row only, so they reach nothing.
        h = torch.zeros(width, hidden, dtype=self.dtype)
        act = torch.zeros(width, fused.inter, dtype=self.dtype)
        attn = torch.zeros(top, heads * head_dim, dtype=self.dtype)
        q = x.new_empty(n, heads, head_dim)
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        # All decode rows: the decode-attention kernel writes straight into the o_proj's input.
        decode_only = (
            meta.max_q_len == 1
            and meta.context_lens.shape[0] == n
            and cpu_kernels.supports_attention(q, k0, k0)
        )
        # Prefill and mixed steps: the ragged kernel, also straight into the o_proj's input; for
        # bf16, torch's SDPA (bf16 on AMX) once the prefills' (query, token) pairs are many.
        ragged = (
            not decode_only
            and cpu_kernels.supports_paged_attention(q, k0, k0)
            and not (bf16 and _prefill_pairs(meta) >= BF16_SDPA_MIN_PAIRS)
        )
        # The attention kernels write float32: into o_proj's input itself, or for bf16 into a
        # buffer rounded into it.
        attn_rows = x.new_empty(n, heads, head_dim) if bf16 else attn[:n].view(n, heads, head_dim)
        if decode_only:
            tables = meta.block_tables.to(torch.int32).contiguous()
            lens = meta.context_lens.to(torch.int32).contiguous()
        threads = [1 if c1 - c0 < GLUE_SPLIT_ROWS else torch.get_num_threads() for c0, c1 in chunks]
        deltas: list[torch.Tensor | None] = [None] * len(chunks)  # each chunk's down_proj output
        matmul = self._panel_matmul(width, len(chunks)) if self.panels else _onednn_matmul
        for (ln1, w_qkv, w_o, ln2, w_gate_up, w_down), (k_cache, v_cache) in zip(
            self.layers, kv_caches, strict=True
        ):
            for (c0, c1), delta, t in zip(chunks, deltas, threads, strict=True):
                r = c1 - c0
                cpu_kernels.add_rms_norm(x[c0:c1], delta, ln1, h, r, eps, t)
                qkv = matmul(h, w_qkv, r, "qkv")
                cpu_kernels.rope_store(
                    qkv, q[c0:c1], k_cache, v_cache, cos[c0:c1], sin[c0:c1], slots[c0:c1], r, fused.shape, t
                )  # fmt: skip
            if decode_only:
                cpu_kernels.decode_attention(q, k_cache, v_cache, tables, lens, fused.scale, out=attn_rows)
            elif ragged:
                cpu_kernels.paged_attention(
                    q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.context_lens, fused.scale,
                    out=attn_rows,
                )  # fmt: skip
            else:
                out = sdpa.paged_attention(
                    q.to(self.dtype), k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.context_lens,
                    fused.scale,
                )  # fmt: skip
                attn_rows.copy_(out)
            if bf16:
                cpu_kernels.to_bf16(attn_rows, attn[:n])
            for k, ((c0, c1), t) in enumerate(zip(chunks, threads, strict=True)):
                r = c1 - c0
                o = matmul(attn[c0:], w_o, r, "o")
                cpu_kernels.add_rms_norm(x[c0:c1], o, ln2, h, r, eps, t)
                gate_up = matmul(h, w_gate_up, r, "gate_up")
                cpu_kernels.silu_mul(gate_up, act, r, t)
                deltas[k] = matmul(act, w_down, r, k)
        out_hidden = torch.empty(n, hidden, dtype=self.dtype)
        for (c0, c1), delta, t in zip(chunks, deltas, threads, strict=True):
            cpu_kernels.add_rms_norm(x[c0:c1], delta, self.final_norm, out_hidden[c0:c1], c1 - c0, eps, t)
        return out_hidden

    def _panel_matmul(self, width: int, chunks: int) -> "Matmul":
        """A step's matmuls over the packed panels, each into a buffer of its own made once a step
        (``slot``: the projection, or the chunk for down_proj, whose output the next layer adds)."""
        fused = self.fused
        qkv_n = self.layers[0][1].n
        buffers: dict[str | int, torch.Tensor] = {
            "qkv": torch.empty(width, qkv_n),
            "o": torch.empty(width, fused.hidden),
            "gate_up": torch.empty(width, 2 * fused.inter),
        }
        buffers.update({k: torch.empty(width, fused.hidden) for k in range(chunks)})

        def matmul(x: torch.Tensor, w: Any, rows: int, slot: str | int) -> torch.Tensor:
            return cpu_kernels.packed_linear(x[:rows], w, out=buffers[slot])

        return matmul


Matmul = Callable[[torch.Tensor, Any, int, "str | int"], torch.Tensor]


def _onednn_matmul(x: torch.Tensor, w: Any, rows: int, slot: str | int) -> torch.Tensor:
    """oneDNN's matmul of ``x``'s first ``rows`` rows (padded to their bucket) by a prepacked or plain weight."""
    assert _linear_pointwise is not None  # GluedLayers checked oneDNN is there
    out: torch.Tensor = _linear_pointwise(x[: dense.bucket_rows(rows)], w, None, "none", [], "")
    return out
