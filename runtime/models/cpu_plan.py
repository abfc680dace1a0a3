"""The CPU execution plan: which code serves each step of one model, chosen once at load.

What it is: ``CPUPlan``, built by the engine's model runner for its model from the engine's CPU
options (``EngineConfig``'s ``cpu_*`` fields; ``--cpu-kernels``, ``--cpu-packed-weights``):
- the compiled kernels' build the process runs (``cpu_kernels.select``, made by the engine
  first: ``avx512``, ``avx2``, ``plain``, or none and why);
- the fused decode step (``fused_decode.FusedDecode``) and the most decode rows it takes;
- the glued layers (``fused_decode.GluedLayers``) and the fewest rows they take;
- on the module path, the most rows each projection sends to the compiled small-batch matmul
  (``dense.Linear.kernel_rows``);
- the output head: the packed panels, or the projection's own rule.
Every row threshold of these decisions lives in ``RowLimits``, here and nowhere else. ``run``
serves one step through the first path that takes it and records which (``last_path``; the
engine exports it per step as ``plimsoll_engine_steps_total{path}``); ``describe`` is the one
start-up line that names what serves decode, prefill, attention and the head.

What it is not: the kernels (``runtime/kernels``), the module path (``models/llama.py``
runs its layers when ``run`` returns ``None``), or anything on a GPU (there the plan only
describes which kernels serve, and every step is the module path or a CUDA graph's replay).
"""

from dataclasses import dataclass, field
from typing import Any

import torch

from plimsoll.runtime.attention import kv_int8
from plimsoll.runtime.attention.attention_op import PagedAttend
from plimsoll.runtime.kernels import cpu_kernels
from plimsoll.runtime.models import dense
from plimsoll.runtime.models.dense import Linear
from plimsoll.runtime.models.fused_decode import FusedDecode, GluedLayers
from plimsoll.runtime.models.panel_cache import PanelCache
from plimsoll.runtime.models.quant import Int8Linear

# What served a step (plimsoll_engine_steps_total{path}).
FUSED_DECODE = "fused_decode"  # every layer in one native call (fused_decode.FusedDecode)
GLUED_LAYERS = "glued_layers"  # packed or oneDNN matmuls with one native call between each two
MODULE_LAYERS = "module_layers"  # the model's modules, layer by layer (any device)
CUDA_GRAPH = "cuda_graph"  # a captured decode graph replayed (engine/cuda_graphs.py)
STEP_PATHS = (FUSED_DECODE, GLUED_LAYERS, MODULE_LAYERS, CUDA_GRAPH)


@dataclass(frozen=True)
class RowLimits:
    """The row counts at which a CPU step or matmul changes path (figures: benchmarks/results/2026-12-02-cpu-decode-step.md, 2026-12-05-cpu-column-panels.md)."""

    # Over column panels the fused step wins up to this many decode rows (its matmuls are the
    # glued layers' own there, and it saves their ~12 calls a layer): 16 / 24 / 32 / 64 / 96 / 128
    # rows 0.92 / 0.94 / 0.92 / 0.96 / 0.98 / 0.91 of the glued step (AMD EPYC Zen 4).
    fused_panels: int = 128
    # Over plain rows (int8 projections, --no-cpu-packed-weights) oneDNN's matmuls (the glued
    # layers) win above this many (benchmarks/step_ab.py --compare fused --fused-max-rows 64:
    # 5-24 rows 0.76-0.96 of the module path's step, 32 rows 1.11).
    fused_plain: int = 16
    # float32 steps of this many rows and more that the fused step leaves are glued; fewer keep
    # the module path (its matmuls the compiled kernel's, and few ops at such sizes).
    glued_min: int = 5
    # Up to this many rows the compiled float32 matmul beats oneDNN's (register blocks of 4 W rows
    # x 4 x rows, W prefetched ahead; SmolLM2's projections and head on an AVX-512 host: 0.3-0.7x
    # oneDNN's time at 2-4 rows, 0.5-0.8x at 8-16).
    small_matmul: int = 16
    # Up to this many rows a bfloat16 matmul streams W faster through bf16_linear than through
    # torch's (AVX-512 host, 200 MB of SmolLM2-shaped weights: 1 row 13-19 GB/s against torch's
    # 11-15, 2 rows 12-14 against 7-11; at 4 rows neither wins every shape).
    bf16_matmul: int = 2


@dataclass(frozen=True)
class CPUOptions:
    """The engine's CPU switches (EngineConfig's cpu_* fields); every one on by default."""

    fused_decode: bool = True
    glued_layers: bool = True
    packed_weights: bool = True
    rows: RowLimits = field(default_factory=RowLimits)
    # Where packed float32 panels are kept between starts (models/panel_cache.py); None: packed each start.
    panel_cache_dir: str | None = None


class CPUPlan:
    """One model's plan. On CPU it attaches itself (``model.cpu_plan``) and sets each projection's
    small-batch rows; the kernels' build is the process's selection at the time it is built."""

    def __init__(
        self,
        model: Any,
        options: CPUOptions | None = None,
        device: torch.device | str = "cpu",
        attention_backend: str = "torch",
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.model = model
        self.options = options = options or CPUOptions()
        self.device = torch.device(device)
        self.attention_backend = attention_backend
        self.kv_cache_dtype = kv_cache_dtype
        self.dtype: torch.dtype = model.model.norm.weight.dtype
        self.last_path = MODULE_LAYERS
        self.fused: FusedDecode | None = None
        self.glued: GluedLayers | None = None
        self.kernels = None if self.device.type != "cpu" else cpu_kernels.library()
        self.kernels_reason = None if self.device.type != "cpu" else cpu_kernels.unavailable_reason()
        self.matmul_rows = 0
        if self.device.type != "cpu":
            return
        rows = options.rows
        fused_rows = (rows.fused_panels, rows.fused_plain) if options.fused_decode else (0, 0)
        cache = PanelCache(options.panel_cache_dir) if options.panel_cache_dir else None
        self.fused = FusedDecode(model, packed=options.packed_weights, max_rows=fused_rows, panel_cache=cache)
        if options.glued_layers:
            self.glued = GluedLayers(self.fused, min_rows=rows.glued_min)
        if self.kernels is not None:
            self.matmul_rows = {torch.float32: rows.small_matmul, torch.bfloat16: rows.bf16_matmul}.get(
                self.dtype, 0
            )
        for module in model.modules():
            if isinstance(module, Linear):
                module.kernel_rows = self.matmul_rows
        model.cpu_plan = self

    def run(
        self,
        x: torch.Tensor,  # [N, hidden] embeddings
        cos: torch.Tensor,
        sin: torch.Tensor,
        step: PagedAttend,  # the step's caches, metadata and attention backend
    ) -> torch.Tensor | None:
        """The final norm's output of a step served by the fused step or the glued layers, or
        ``None`` (the caller runs the layers); ``last_path`` says which served it."""
        if cpu_kernels.library() is not self.kernels:
            # The process runs another build now (another engine selected one): this plan's
            # packed weights are laid out for its own, so the module path serves.
            self.last_path = MODULE_LAYERS
            return None
        if self.fused is not None and self.fused.run(x, cos, sin, step):
            self.last_path = FUSED_DECODE
            hidden: torch.Tensor = self.model.model.norm(x)
            return hidden
        if self.glued is not None:
            glued: torch.Tensor | None = self.glued.run(x, cos, sin, step)
            if glued is not None:
                self.last_path = GLUED_LAYERS
                return glued
        self.last_path = MODULE_LAYERS
        return None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The head's logits where the plan serves them (the packed head; a tied head through the
        small-batch rule), else ``None`` (the model's own head: a ``Linear`` follows its rows)."""
        if cpu_kernels.library() is not self.kernels:
            return None
        if self.fused is not None:
            packed: torch.Tensor | None = self.fused.logits(hidden)
            if packed is not None:
                return packed
        if self.model.tie_word_embeddings and self.matmul_rows:
            tied: torch.Tensor = dense.linear(
                hidden, self.model.model.embed_tokens.weight, None, self.matmul_rows
            )
            return tied
        return None

    def describe(self) -> str:
        """One line: the kernels' build, then what serves decode, prefill, attention and the head."""
        dtype = str(self.dtype).removeprefix("torch.")
        if self.device.type != "cpu":
            return f"kernels: {self.attention_backend} attention on {self.device}, {dtype}; the CPU C++ kernels are not used"
        if self.kernels is None:
            return (
                f"kernels: torch only on CPU ({dtype}), every step layer by layer; the C++ kernels are "
                f"{self.kernels_reason}"
            )
        threads = "torch's OpenMP team" if self.kernels.openmp else "their own threads"
        parts = [f"kernels: the {self.kernels.variant} C++ build on {threads}, {dtype}", *self._steps()]
        parts += [self._attention(), self._head()]
        return "; ".join(parts)

    def _steps(self) -> list[str]:
        fused, glued = self.fused, self.glued
        layers = f"layer by layer ({self._module_matmuls()})"
        if self.kv_cache_dtype == "int8":  # both store and read float caches (fused_decode._plain_cpu_step)
            return [f"every step: {layers}; no fused decode step or glued layers (an int8 KV cache)"]
        out = []
        assert fused is not None  # a CPU plan always builds it: it holds the packed weights
        if fused.max_rows:
            over = "int8 rows" if fused.int8 else "column panels" if fused.panels else "plain rows"
            out.append(f"decode of up to {fused.max_rows} rows: the fused decode step over {over}")
        else:
            out.append("no fused decode step (" + (fused.reason or "off: cpu_fused_decode=False") + ")")
        if glued is not None and glued.reason is None:
            matmuls = (
                "column panels"
                if glued.panels
                else "oneDNN bf16"
                if self.dtype == torch.bfloat16
                else "oneDNN"
            )
            which = "other steps" if fused.max_rows else "every step"
            if glued.min_rows > 1:
                which += f" of {glued.min_rows} rows or more"
            out.append(f"{which}: glued layers ({matmuls} matmuls, C++ glue between)")
            if glued.min_rows > 1:
                out.append(f"smaller steps: {layers}")
        else:
            why = glued.reason if glued is not None else "off: cpu_glued_layers=False"
            out.append(
                f"{'other steps' if fused.max_rows else 'every step'}: {layers}; no glued layers ({why})"
            )
        return out

    def _module_matmuls(self) -> str:
        big = "oneDNN" if dense._ONEDNN and self.dtype == torch.float32 else "torch"
        if self.matmul_rows:
            return f"small-batch matmul kernel up to {self.matmul_rows} rows, {big} above"
        return f"{big} matmuls"

    def decode_attention_kernel(self) -> bool:
        """Whether decode attention runs on the C++ kernel: asks ``cpu_kernels.supports_attention``,
        which ``sdpa.decode_attention`` asks each step, about this model's query and cache."""
        if self.device.type != "cpu" or self.kernels is None:
            return False
        attn = self.model.model.layers[0].self_attn
        query = torch.empty((1, attn.num_heads, attn.head_dim), dtype=self.dtype)
        if self.kv_cache_dtype == "int8":
            cache = torch.empty(
                (1, 1, attn.num_kv_heads, kv_int8.packed_dim(attn.head_dim)), dtype=torch.int8
            )
        else:
            cache = torch.empty((1, 1, attn.num_kv_heads, attn.head_dim), dtype=self.dtype)
        return bool(cpu_kernels.supports_attention(query, cache, cache))

    def _attention(self) -> str:
        attn = self.model.model.layers[0].self_attn
        decode = "C++ paged decode-attention kernel" if self.decode_attention_kernel() else "torch SDPA"
        if self.kv_cache_dtype == "int8":
            return f"attention: {decode} over the int8 cache's blocks, torch SDPA for prefill"
        if attn.head_dim in (64, 128):
            return f"attention: {decode}, C++ ragged kernel for prefill"
        return f"attention: {decode}, torch SDPA for prefill (head_dim {attn.head_dim})"

    def _head(self) -> str:
        if self.fused is not None and self.fused.head is not None:
            return "head: column panels"
        if isinstance(getattr(self.model, "lm_head", None), Int8Linear):
            return "head: int8 matmul kernel"
        return f"head: {self._module_matmuls()}"
