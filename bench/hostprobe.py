"""What this host's memory and arithmetic do per second: the floor under a decode step and
the ceiling over a saturated server.

What it is: :func:`bandwidth_gbs`, the read + write rate of a large tensor copy on
the intra-op threads (the best of a few), and :func:`floor_ms`, the time to read a
model's weights once at that rate — a decode step at batch 1 cannot be faster. For
high concurrency, where a CPU server is bound by arithmetic, not memory:
:func:`request_flops`, the floating-point work one request of a Llama-shaped model
costs (every projection, the attention dot products, the output head), and
:func:`matmul_gflops`, the best rate this host's matmul libraries (MKL through
``F.linear`` and oneDNN) reach on that model's projection shapes at prefill-sized
rows. Output tokens a second cannot exceed ``output tokens x rate / request_flops``
for any engine that does the same arithmetic in the same precision; the benchmarks
print each engine's share of it. What it is not: a STREAM benchmark (one kernel, no
triad), a roofline of every op, or a figure for a GPU.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn import functional as F


def bandwidth_gbs(size_bytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Read+write GB/s of copying ``size_bytes`` with torch's intra-op threads (best of ``repeats``)."""
    src = torch.ones(size_bytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * size_bytes / best / 1e9


def fma_peak_gflops(iters: int = 20_000_000, repeats: int = 3) -> float | None:
    """GFLOP/s of float32 multiply-adds on torch's intra-op threads with nothing read from memory
    (best of ``repeats``; the compiled kernels' probe): no float32 matmul here can run faster.
    ``None`` where the kernels cannot be built."""
    from plimsoll.runtime.kernels import cpu_kernels

    lib = cpu_kernels.library()
    if lib is None:
        return None
    return max(float(lib.plimsoll_fma_peak(iters, torch.get_num_threads())) for _ in range(repeats))


def weight_file_bytes(model_dir: Path) -> int:
    """Bytes of a Hugging Face directory's weight files (``*.safetensors``, else ``*.bin``)."""
    files = sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("*.bin"))
    return sum(f.stat().st_size for f in files)


def floor_ms(weight_bytes: int, gbs: float) -> float:
    """Milliseconds to read ``weight_bytes`` once at ``gbs``."""
    return weight_bytes / (gbs * 1e9) * 1e3


@dataclass(frozen=True)
class LlamaShape:
    """The sizes of a Llama-family decoder that set its arithmetic, from ``config.json``."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_dir(cls, model_dir: Path) -> LlamaShape:
        cfg = json.loads((model_dir / "config.json").read_text())
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return cls(
            hidden=hidden,
            intermediate=int(cfg["intermediate_size"]),
            layers=int(cfg["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            vocab=int(cfg["vocab_size"]),
        )

    def projections(self) -> list[tuple[int, int]]:
        """(out, in) of one layer's matmuls: q, k, v, o, gate, up, down."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h, i = self.hidden, self.intermediate
        return [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)]


def request_flops(shape: LlamaShape, input_tokens: int, output_tokens: int) -> float:
    """Floating-point operations (a multiply-add is 2) for one request: ``input_tokens`` of prompt
    then ``output_tokens`` generated. Every position but the last generated one goes through the
    layers (each projection, QK^T and PV over the positions before it, causal); each generated
    token costs one output-head matmul. Norms, activations and sampling are left out (a few
    percent), so the ceiling it gives is an upper bound."""
    positions = input_tokens + output_tokens - 1
    per_token = 2 * sum(n * k for n, k in shape.projections()) * shape.layers
    # Position p attends to p + 1 positions: 2 FLOPs x head_dim for the score and again for V.
    attended = positions * (positions + 1) // 2
    attention = 4 * shape.heads * shape.head_dim * attended * shape.layers
    head = 2 * shape.hidden * shape.vocab * output_tokens
    return float(per_token * positions + attention + head)


def matmul_gflops(shape: LlamaShape, rows: int = 256, repeats: int = 3) -> dict[str, float]:
    """GFLOP/s of every layer's projections at ``rows`` rows, float32, distinct weights per layer
    (as a model streams them), best of ``repeats``: ``{"mkl": ..., "onednn": ...}`` (oneDNN only
    where torch has it). The larger is this host's matmul rate for the ceiling."""
    from plimsoll.runtime.models import dense

    weights = [[torch.randn(n, k) for n, k in shape.projections()] for _ in range(shape.layers)]
    inputs = {k: torch.randn(rows, k) for _, k in shape.projections()}
    flops = 2 * rows * sum(n * k for n, k in shape.projections()) * shape.layers
    paths: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"mkl": lambda x, w: F.linear(x, w)}
    if dense.uses_onednn(inputs[shape.hidden], weights[0][0]):
        paths["onednn"] = lambda x, w: dense._onednn_linear(x, w, None)
    rates = {}
    for name, fn in paths.items():
        for w in weights[0]:
            fn(inputs[w.shape[1]], w)  # first call builds oneDNN's primitive
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            for layer in weights:
                for w in layer:
                    fn(inputs[w.shape[1]], w)
            best = min(best, time.perf_counter() - start)
        rates[name] = flops / best / 1e9
    return rates


def ceiling_tokens_per_s(flops_per_request: float, output_tokens: int, gflops: float) -> float:
    """The most output tokens a second an engine doing ``flops_per_request`` of work a request can
    produce at ``gflops``, however it batches."""
    return output_tokens * gflops * 1e9 / flops_per_request
