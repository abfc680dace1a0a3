"""Dense projections for the model: oneDNN's matmul for float32 on CPU, ``F.linear`` elsewhere.

What it is: ``Linear``, an ``nn.Linear`` (same parameters, same state dict) whose
forward, for a float32 CPU input, calls ``cpu_kernels.small_batch_linear`` when it has
at most a few rows and oneDNN's matmul otherwise.
Why: torch's ``F.linear`` on CPU goes to MKL, which runs the small-batch shapes of
decoding (1 to 64 rows against a weight of 576-49,152 outputs) on one thread and at
a fraction of the memory bandwidth, on the AMD host this project measures on.
oneDNN splits them over the intra-op threads: ``python benchmarks/engine_workloads.py
--workload gemm`` prints both side by side (figures in docs/bench.md).
What it is not: quantisation, weight packing, or a GPU path (CUDA keeps ``F.linear``).
"""

import torch
from torch import nn
from torch.nn import functional as F

from plimsoll.runtime import cpu_kernels

# The op inductor's CPU backend emits for linear layers; absent from builds without oneDNN.
_ONEDNN = bool(torch.backends.mkldnn.is_available()) and hasattr(  # type: ignore[no-untyped-call]
    torch.ops.mkldnn, "_linear_pointwise"
)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``; on CPU in float32 through oneDNN (see the module docstring)."""
    if cpu_kernels.supports_linear(x, weight, bias):
        small: torch.Tensor = cpu_kernels.small_batch_linear(x, weight, bias)
        return small
    if _ONEDNN and x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return out
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
