"""Dense projections for the model: oneDNN's matmul for float32 on CPU, ``F.linear`` elsewhere.

What it is: ``Linear``, an ``nn.Linear`` (same parameters, same state dict) whose
forward, for a float32 CPU input, calls ``cpu_kernels.small_batch_linear`` when it has
at most a few rows, oneDNN's matmul up to 64 rows (decode), ``F.linear`` above.
Why: torch's ``F.linear`` on CPU goes to MKL, which runs the small-batch shapes of
decoding (1 to 64 rows against a weight of 576-49,152 outputs) on one thread and at
a fraction of the memory bandwidth, on the AMD host this project measures on.
oneDNN splits them over the intra-op threads: ``python benchmarks/engine_workloads.py
--workload gemm`` prints both side by side (figures in docs/bench.md).
What it is not: quantisation, weight packing, or a GPU path (CUDA keeps ``F.linear``).
"""

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from plimsoll.runtime.kernels import cpu_kernels

# Decode-sized matmuls go to oneDNN; prefill-sized ones (where MKL is as fast) stay with
# F.linear, which keeps the number of cached oneDNN primitives, and their memory, bounded.
ONEDNN_MAX_ROWS = 64
ONEDNN_ROW_BUCKET = 16
# The op inductor's CPU backend emits for linear layers; absent from builds without oneDNN.
_ONEDNN = bool(torch.backends.mkldnn.is_available()) and hasattr(  # type: ignore[no-untyped-call]
    torch.ops.mkldnn, "_linear_pointwise"
)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``; on CPU in float32 through oneDNN (see the module docstring)."""
    if cpu_kernels.supports_linear(x, weight, bias):
        small: torch.Tensor = cpu_kernels.small_batch_linear(x, weight, bias)
        return small
    rows = x.shape[0]
    if (
        _ONEDNN
        and x.dim() == 2
        and rows <= ONEDNN_MAX_ROWS
        and x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
    ):
        # oneDNN caches one primitive (~0.2-0.8 MiB here) per distinct row count: rows are
        # padded to a multiple of ONEDNN_ROW_BUCKET so decode batches share a few of them.
        padded = -(-rows // ONEDNN_ROW_BUCKET) * ONEDNN_ROW_BUCKET
        if padded != rows:
            x = torch.cat((x, x.new_zeros(padded - rows, x.shape[1])))
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return out[:rows]
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    # Set by models/lora.LoRASlots on the projections adapters can target: adds each row's delta.
    lora: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self.weight, self.bias)
        return out if self.lora is None else self.lora(x, out)
