"""The fused CPU decode step: every decoder layer of a small decode batch in one native call.

What it is: ``FusedDecode``, built once per model, which decides whether a step can run
through ``cpu_kernels.fused_decode`` and runs it. The module path calls ~130 torch ops and
five kernels per layer (~4,000 ops a step for SmolLM2); this is one ctypes call a step,
with the step's metadata (positions' cos/sin, slots, block tables, context lengths)
prepared once by the caller and the layers' weight and cache addresses gathered once.
A step fits when the model is a plain Llama/SmolLM2/Mistral decoder with float32
activations on CPU (no biases, no Qwen3 q/k norm, SiLU MLP, projections either all
float32 ``Linear`` or all ``Int8Linear`` from ``--quantization int8``, without LoRA or
tensor parallelism hooks, a float32 cache, the torch attention backend) and every row of
the step is one decode token, at most ``MAX_ROWS`` of them (above that oneDNN's matmuls
beat the kernel's register-blocked ones). Everything else (prefill rows,
mixed steps, speculative verification, an int8 KV cache, Qwen2/Qwen3, LoRA, TP, GPUs)
takes the module path, unchanged. ``PLIMSOLL_FUSED_DECODE=0`` turns it off; a model that
fits on a machine where the kernels cannot be built logs one warning and runs the module path.

What it is not: a compiler, or a second model definition (``models/llama.py`` stays the
reference the fused step is tested against: ``tests/runtime/models/test_fused_decode.py``).
"""

import logging
import os
from typing import Any

import torch
from torch import nn

from plimsoll.runtime.attention import sdpa
from plimsoll.runtime.attention.backends import AttentionMetadata
from plimsoll.runtime.kernels import cpu_kernels
from plimsoll.runtime.models.dense import Linear
from plimsoll.runtime.models.quant import Int8Linear

log = logging.getLogger(__name__)

# Read at import; tests and benchmarks/step_ab.py flip the module attribute.
ENABLED = os.environ.get("PLIMSOLL_FUSED_DECODE", "1") != "0"
# Above this many rows oneDNN's matmuls (the module path) beat the kernel's (benchmarks/step_ab.py
# --compare fused --fused-max-rows 64: 5-24 rows 0.76-0.96 of the module path's step, 32 rows 1.11).
MAX_ROWS = 16
_warned = False


def _warn_unavailable_once(reason: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning("fused CPU decode step unavailable (%s); decode runs layer by layer (slower, same results)", reason)


def why_not(model: Any) -> str | None:
    """Why this model's decode steps cannot be fused (``None`` when they can)."""
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
            if w.device.type != "cpu" or w.dtype != torch.float32 or not w.is_contiguous():
                return f"{w.dtype} weights on {w.device.type}"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if norm.weight.dtype != torch.float32 or norm.eps != layers[0].input_layernorm.eps:
                return "norm weights not float32 or mixed eps"
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


class FusedDecode:
    """Built by ``LlamaForCausalLM`` at its first forward; ``run`` returns ``False`` when the step
    does not fit (the caller then runs the layers)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.reason = why_not(model)
        if self.reason is None and cpu_kernels.library() is None:
            self.reason = f"the CPU kernels: {cpu_kernels.unavailable_reason()}"
            _warn_unavailable_once(self.reason)
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

    def _layer_addresses(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """``[L, 8]`` int64 addresses (``[L, 20]`` for int8 projections), rebuilt only when a weight
        or a cache tensor moved."""
        layers = self.model.model.layers

        def weight(proj: Any) -> torch.Tensor:
            return proj.qweight if self.int8 else proj.weight

        key = (
            weight(layers[0].self_attn.qkv_proj).data_ptr(),
            weight(layers[-1].mlp.down_proj).data_ptr(),
            kv_caches[0][0].data_ptr(),
            kv_caches[-1][1].data_ptr(),
        )
        if self._addresses is None or key != self._key:
            rows = []
            for layer, (k, v) in zip(layers, kv_caches, strict=True):
                attn, mlp = layer.self_attn, layer.mlp
                if self.int8:
                    row = [layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr()]
                    row += [k.data_ptr(), v.data_ptr()]
                    for proj in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                        row += _int8_entries(proj)
                else:
                    row = [
                        layer.input_layernorm.weight.data_ptr(),
                        attn.qkv_proj.weight.data_ptr(),
                        attn.o_proj.weight.data_ptr(),
                        layer.post_attention_layernorm.weight.data_ptr(),
                        mlp.gate_up_proj.weight.data_ptr(),
                        mlp.down_proj.weight.data_ptr(),
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
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        store_kv: Any,
        paged_attention: Any,
    ) -> bool:
        """Run every layer on ``x`` in place and return ``True``, or return ``False`` untouched."""
        n = x.shape[0]
        k0 = kv_caches[0][0]
        if (
            not ENABLED
            or self.reason is not None
            or getattr(self._first_qkv, "lora", None) is not None  # adapters attached after the first forward
            or not 0 < n <= MAX_ROWS
            or meta.max_q_len != 1
            or meta.context_lens.shape[0] != n
            or x.dtype != torch.float32
            or x.device.type != "cpu"
            or k0.dtype != torch.float32
            or not k0.is_contiguous()
            or store_kv is not sdpa.store_kv
            or paged_attention is not sdpa.paged_attention
        ):
            return False
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
        )
        return True
