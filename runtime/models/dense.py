"""Dense projections for the model: oneDNN's matmul for float32 on CPU, ``F.linear`` elsewhere.

What it is: ``Linear``, an ``nn.Linear`` (same parameters, same state dict) whose
forward, for a float32 CPU input, calls ``cpu_kernels.small_batch_linear`` when it has
at most ``kernel_rows`` rows (``bf16_linear`` for a bfloat16 one; the engine's CPU plan sets
the limit on each projection at load, ``models/cpu_plan.py``; 0, the default, never) and
oneDNN's matmul for every other row count, decode and prefill.
Why: torch's ``F.linear`` on CPU goes to MKL, which runs the small-batch shapes of
decoding (1 to 64 rows against a weight of 576-49,152 outputs) on one thread and at
a fraction of the memory bandwidth on the AMD hosts this project measures on, and on
an AVX-512 AMD host (Zen 4/5) runs prefill-sized matmuls at about half oneDNN's rate
too (MKL takes its AVX2 path there). ``python benchmarks/matmul_rates.py`` prints oneDNN
beside the kernels' own matmuls, and ``bench.hostprobe`` probes MKL against oneDNN
(figures in docs/bench.md and the benchmarks/results/ records).

oneDNN builds and caches one primitive per distinct matmul shape, ~0.9 MiB each for
SmolLM2's shapes (unbucketed, 256 row counts × 4 shapes grew RSS by 666 MiB). So rows
are padded up to a multiple of ``ONEDNN_ROW_BUCKET`` and a matmul of more than
``ONEDNN_CHUNK_ROWS`` rows runs in chunks of that many: at most
``ONEDNN_CHUNK_ROWS / ONEDNN_ROW_BUCKET`` primitives per weight shape, which
``prime_onednn`` builds at warm-up so memory stops growing before the first request.
What it is not: quantisation, the float32 weights packed in column panels (the fused step,
the glued layers and the head take those first: ``cpu_kernels.pack_f32``), or a GPU path
(CUDA keeps ``F.linear``).
"""

from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn
from torch.nn import functional as F

from plimsoll.runtime.kernels import cpu_kernels

# Rows padded to a multiple of this, so the row counts of decode and prefill share primitives.
ONEDNN_ROW_BUCKET = 16
# Larger matmuls run in chunks of this many rows (oneDNN's rate is flat from ~128 rows on).
ONEDNN_CHUNK_ROWS = 256
# The op inductor's CPU backend emits for linear layers; absent from builds without oneDNN.
_ONEDNN = bool(torch.backends.mkldnn.is_available()) and hasattr(  # type: ignore[no-untyped-call]
    torch.ops.mkldnn, "_linear_pointwise"
)

_mkldnn_linear = torch.ops.mkldnn._linear_pointwise if _ONEDNN else None


def bucket_rows(rows: int) -> int:
    """``rows`` rounded up to a multiple of ``ONEDNN_ROW_BUCKET``."""
    return -(-rows // ONEDNN_ROW_BUCKET) * ONEDNN_ROW_BUCKET


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.shape[0]
    x = x.contiguous()
    if rows > ONEDNN_CHUNK_ROWS:
        out = x.new_empty(rows, weight.shape[0])
        for start in range(0, rows, ONEDNN_CHUNK_ROWS):
            stop = min(rows, start + ONEDNN_CHUNK_ROWS)
            out[start:stop] = _onednn_linear(x[start:stop], weight, bias)
        return out
    padded = bucket_rows(rows)
    if padded != rows:
        x = torch.cat((x, x.new_zeros(padded - rows, x.shape[1])))
    assert _mkldnn_linear is not None  # uses_onednn said so
    result: torch.Tensor = _mkldnn_linear(x, weight, bias, "none", [], "")
    return result[:rows]


def uses_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        _ONEDNN
        and x.dim() == 2
        and x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and x.shape[0] > 0
    )


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, kernel_rows: int = 0
) -> torch.Tensor:
    """``x @ weight.T + bias``; on CPU in float32 through oneDNN (see the module docstring), up to
    ``kernel_rows`` rows in float32 or bfloat16 through the compiled kernels."""
    if torch.compiler.is_compiling():  # torch.compile (engine/compilation.py) lowers F.linear itself
        return F.linear(x, weight, bias)
    if 0 < x.shape[0] <= kernel_rows:
        if cpu_kernels.supports_linear(x, weight, bias):
            small: torch.Tensor = cpu_kernels.small_batch_linear(x, weight, bias)
            return small
        if cpu_kernels.supports_bf16_linear(x, weight, bias):  # --dtype bfloat16 decode at low concurrency
            return cpu_kernels.bf16_linear(x, weight, bias)
    if uses_onednn(x, weight):
        return _onednn_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def prime_onednn(
    weights: Iterable[tuple[torch.Tensor, torch.Tensor | None]], max_rows: int, min_rows: int = ONEDNN_ROW_BUCKET
) -> int:
    """Build oneDNN's primitive for each distinct (weight shape, bias) and padded row count from
    ``min_rows`` to ``max_rows`` (capped at ``ONEDNN_CHUNK_ROWS``) now, so serving allocates none
    later. Returns how many matmuls it ran; 0 where oneDNN is not used (no oneDNN, not float32
    on CPU)."""
    return sum(1 for _ in prime_onednn_steps(weights, max_rows, min_rows))


def prime_onednn_steps(
    weights: Iterable[tuple[torch.Tensor, torch.Tensor | None]], max_rows: int, min_rows: int = ONEDNN_ROW_BUCKET
) -> Iterator[None]:
    """``prime_onednn`` one matmul at a time: yields after each, so a caller can stop between two
    (the engine's deferred warm-up gives way to a request that arrives) and go on later."""
    seen: set[tuple[tuple[int, ...], bool]] = set()
    first = bucket_rows(min_rows)
    top = min(max_rows, ONEDNN_CHUNK_ROWS)
    for weight, bias in weights:
        key = (tuple(weight.shape), bias is not None)
        if key in seen or weight.dim() != 2:
            continue
        seen.add(key)
        for rows in range(first, top + ONEDNN_ROW_BUCKET, ONEDNN_ROW_BUCKET):
            x = weight.new_zeros(rows, weight.shape[1])
            if not uses_onednn(x, weight):
                return
            _onednn_linear(x, weight, bias)
            yield


class Linear(nn.Linear):
    # Set by models/lora.LoRASlots on the projections adapters can target: adds each row's delta.
    lora: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    # Set by the engine's CPU plan (models/cpu_plan.py): the most rows the compiled small-batch
    # matmul takes; 0: none (oneDNN, or torch's F.linear, at every row count).
    kernel_rows: int = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self.weight, self.bias, self.kernel_rows)
        return out if self.lora is None else self.lora(x, out)
