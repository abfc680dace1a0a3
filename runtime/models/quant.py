"""INT8 weight-only quantisation (``--quantization int8``), computed at load from float weights.

What it is: per-output-channel symmetric int8 — each row of a weight matrix keeps
``round(w / s)`` in int8 with ``s = max|row| / 127`` as its float32 scale — for every
projection, the output head, and the token embedding (rows looked up and
dequantised; with tied embeddings the head reads the same int8 matrix).
Activations stay in the model's dtype. On CPU with float32 activations the matmul
runs in the compiled kernel (``cpu_kernels.int8_linear``: the weight streams as
int8, a quarter of the float32 bytes, which is what a decode step is bound by)
for up to 64 rows; prefill-sized matmuls and every other device dequantise the
weight and call ``F.linear``, trading the speed for the memory saving, and a CPU
without the kernels logs one warning. Norms and biases are not quantised.

``quantize_rows(w, group_size)`` and the kernel also take a scale per group of inputs of a
row (scales ``[N, K // G]``); the engine uses :data:`GROUP_SIZE`.

What it is not: activation quantisation, int4, or loading pre-quantised checkpoints.
"""

import logging

import torch
from torch import nn
from torch.nn import functional as F

from plimsoll.runtime.kernels import cpu_kernels

log = logging.getLogger(__name__)

QUANTIZATIONS = ("int8",)
KERNEL_MAX_ROWS = 64  # above this (prefill) the dequantise + F.linear path is as fast
# Inputs per scale; 0 = one scale per output row, the default: groups of 64 agreed with float32
# on 16/32 prompts against 11/32 per row, but the kernel ran 3-5x slower (docs/runtime.md).
GROUP_SIZE = 0
_warned = False


def group_size_for(k: int, group_size: int | None = None) -> int:
    """The group a row of ``k`` inputs is quantised by: ``group_size`` (default :data:`GROUP_SIZE`;
    0 means per row), or the whole row when it does not divide ``k``."""
    group_size = GROUP_SIZE if group_size is None else group_size
    return group_size if 0 < group_size < k and k % group_size == 0 else k


def quantize_rows(weight: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` float → (int8 ``[N, K]``, float32 scales ``[N, K // G]``), symmetric per group of
    ``G = group_size_for(K, group_size)`` consecutive inputs of a row."""
    w = weight.detach().float()
    n, k = w.shape
    g = group_size_for(k, group_size)
    groups = w.view(n, k // g, g)
    scales = (groups.abs().amax(dim=2) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(groups / scales[:, :, None]).clamp_(-127, 127).to(torch.int8).view(n, k)
    return q.contiguous(), scales.contiguous()


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 ``[N, K]`` and scales ``[N, K // G]`` → the float ``[N, K]`` they stand for."""
    n, k = qweight.shape
    groups = scales.shape[-1]
    out = qweight.view(n, groups, k // groups).to(dtype) * scales.to(dtype)[:, :, None]
    return out.view(n, k)


def _warn_fallback_once(reason: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning(
            "int8 weights: %s; matmuls dequantise the weight each call (slower, same results)", reason
        )


class Int8Linear(nn.Module):
    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.qweight: torch.Tensor
        self.scales: torch.Tensor
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        q, s = quantize_rows(linear.weight)
        return cls(q, s, linear.bias)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:  # [N, K]
        return dequantize(self.qweight, self.scales, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= KERNEL_MAX_ROWS and x.device.type == "cpu":
            if cpu_kernels.supports_int8_linear(x, self.qweight):
                out: torch.Tensor = cpu_kernels.int8_linear(x, self.qweight, self.scales, self.bias)
                return out
            _warn_fallback_once(
                "the compiled CPU kernel cannot run here (not built, or activations are not float32)"
            )
        return F.linear(x, self.dequantized(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


class Int8Embedding(nn.Module):
    """Token embedding stored as int8 rows: a lookup dequantises only the rows it reads."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.qweight: torch.Tensor
        self.scales: torch.Tensor
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = dequantize(self.qweight[flat], self.scales[flat], self.dtype)
        return rows.view(*ids.shape, rows.shape[-1])


def quantize_model(net: nn.Module, method: str, dtype: torch.dtype) -> nn.Module:
    """Replace the model's projections, head and embedding by int8 ones, in place."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} or None, got {method!r}")
    for module in list(net.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, Int8Linear.from_linear(child))
    decoder = net.model  # type: ignore[attr-defined]
    q, s = quantize_rows(decoder.embed_tokens.weight)
    decoder.embed_tokens = Int8Embedding(q, s, dtype)
    if net.tie_word_embeddings:  # type: ignore[attr-defined]
        net.lm_head = Int8Linear(q, s, None)  # the same int8 storage serves both
        net.tie_word_embeddings = False  # type: ignore[assignment]
    return net


def weight_bytes(net: nn.Module) -> int:
    """Bytes of the weights (the state dict: not RoPE's tables), each storage counted once."""
    seen: dict[int, int] = {}
    for t in net.state_dict().values():
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
