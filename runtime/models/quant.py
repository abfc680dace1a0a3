"""INT8 weight-only quantisation (``--quantization int8``), computed at load from float weights.

What it is: asymmetric group-wise int8 — each group of :data:`GROUP_SIZE` (32) consecutive
inputs of a weight row keeps int8 values ``q`` with a float32 scale ``s`` and offset ``z``
(``w ≈ s·q + z``) — for every projection, the output head, and the token embedding (rows
looked up and dequantised; with tied embeddings the head reads the same int8 matrix).

**Grid recovery.** When a group's values already lie on a uniform grid of at most 256
levels (``origin + step·j`` for integers ``j``, within ``GRID_TOLERANCE`` of a step) — as
every group of a checkpoint that was quantised and dequantised back does (GGUF Q4_0, Q4_1,
Q5_*, Q8_0: a block's values are ``m + d·q``) — that grid's step and origin become ``s`` and
``z``, so int8 stores the values exactly (to float32 rounding) and such a checkpoint
round-trips without loss. Other groups take ``s = (max − min) / 255`` over 256 levels,
each weight within ``s / 2``. A grid found is never worse than min/max: its error is at
most ``GRID_TOLERANCE · step`` against min/max's ``step / 2``.

Activations stay in the model's dtype. On CPU with float32 activations the matmul runs
in the compiled kernel (``cpu_kernels.int8_linear``: the weight streams as int8, about a
quarter of the float32 bytes, which is what a decode step is bound by) for up to 64
rows; on CUDA the Triton kernel (``quant_triton.int8_linear``, int8 tiles on the tensor cores)
does the same for up to 64 rows; prefill-sized matmuls dequantise the weight and call
``dense.linear`` (oneDNN on CPU, cuBLAS through ``F.linear`` on a GPU; on a GPU a few thousand
output rows at a time, so the float temporary is a slice of the matrix, never all of it), and
a device where neither kernel can run logs one warning and dequantises, trading the speed for
the memory saving. Under ``torch.compile`` the whole projection is one opaque op
(``plimsoll::int8_linear``). ``compare_with_bf16`` times the kernel against the bf16 matmul at
start on a GPU, so a server whose int8 path is slower than bfloat16 says so in its log.
Norms and biases are not quantised.

``quantize_rows(w, group_size, asymmetric, grid)`` also makes the older layouts (one
symmetric scale per row or per group, ``s = max|w| / 127``, no offsets) for comparison
(``benchmarks/int8_agreement.py``); the kernel takes both.

What it is not: activation quantisation, int4, or loading pre-quantised checkpoints
(a GGUF is dequantised by transformers first; grid recovery re-finds its grid).
"""

import logging
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from plimsoll.runtime.kernels import cpu_kernels
from plimsoll.runtime.models import quant_triton
from plimsoll.runtime.models.dense import linear

log = logging.getLogger(__name__)

QUANTIZATIONS = ("int8", "fp8")  # fp8: models/quant_fp8.py
# Above this, dequantise + the dense matmul is as fast on a layer's matrices (benchmarks/results/2026-12-02-int8-weights.md).
KERNEL_MAX_ROWS = 64
# Inputs per scale and offset; 0 = one per output row. 32 matches GGUF's blocks (benchmarks/results/2026-12-02-int8-weights.md
# compares per row, symmetric groups and asymmetric groups with and without grid recovery).
GROUP_SIZE = 32
ASYMMETRIC = True  # a float32 offset per group beside its scale
GRID_RECOVERY = True
GRID_TOLERANCE = 1e-3  # of a step: how far a value may sit from the grid and still be on it
_GRID_DIVISORS = 4  # the smallest gap between a group's values may be up to 4 steps
_GRID_CHUNK = 16384  # groups checked at a time: the temporaries stay in cache
_warned = False


def group_size_for(k: int, group_size: int | None = None) -> int:
    """The group a row of ``k`` inputs is quantised by: ``group_size`` (default :data:`GROUP_SIZE`;
    0 means per row), or the whole row when it does not divide ``k``."""
    group_size = GROUP_SIZE if group_size is None else group_size
    return group_size if 0 < group_size < k and k % group_size == 0 else k


def _grid_steps(groups: torch.Tensor, lo: torch.Tensor, span: torch.Tensor) -> torch.Tensor:
    """Each group's grid step where its values lie on ``lo + step·j`` (``j`` in 0..255), else 0."""
    steps = torch.zeros_like(lo)
    for start in range(0, groups.shape[0], _GRID_CHUNK):
        part = slice(start, start + _GRID_CHUNK)
        above = groups[part] - lo[part, None]
        # The nearest value above the minimum is a whole number of steps away (values on one
        # level are bit-equal); for the groups that fails, the smallest gap between any two.
        nearest = torch.where(above > 0, above, torch.inf).amin(dim=1)
        found = _try_steps(above, span[part], nearest, 1)
        retry = ((found == 0) & (span[part] > 0)).nonzero().squeeze(1)
        if retry.numel():
            gaps = above[retry].sort(dim=1).values.diff(dim=1)
            smallest = torch.where(gaps > 0, gaps, torch.inf).amin(dim=1)
            found[retry] = _try_steps(above[retry], span[part][retry], smallest, _GRID_DIVISORS)
        steps[part] = found
    return steps


def _try_steps(above: torch.Tensor, span: torch.Tensor, gap: torch.Tensor, divisors: int) -> torch.Tensor:
    """The step (else 0) of each group whose offsets from its minimum are whole multiples of
    ``gap / d`` for a divisor ``d`` up to ``divisors``, over at most 255 steps."""
    steps = torch.zeros_like(span)
    for divisor in range(1, divisors + 1):
        levels = torch.round(span * divisor / gap)  # inf (no gap) fails the level check below
        step = span / levels.clamp(min=1)  # from the extremes: the best estimate of the step
        r = above / step[:, None]
        on_grid = ((r - r.round()).abs_().amax(dim=1) <= GRID_TOLERANCE) & (levels <= 255) & (steps == 0)
        steps = torch.where(on_grid, step, steps)
        if divisor < divisors and bool((steps > 0).all()):
            break
    return steps


def quantize_rows(
    weight: torch.Tensor,
    group_size: int | None = None,
    asymmetric: bool | None = None,
    grid: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``[N, K]`` float → (int8 ``[N, K]``, float32 scales ``[N, K // G]``, float32 offsets
    ``[N, K // G]`` or ``None`` when symmetric), per group of ``G = group_size_for(K, group_size)``
    consecutive inputs of a row. Defaults: :data:`GROUP_SIZE`, :data:`ASYMMETRIC`,
    :data:`GRID_RECOVERY` (grid recovery needs offsets)."""
    asymmetric = ASYMMETRIC if asymmetric is None else asymmetric
    grid = (GRID_RECOVERY if grid is None else grid) and asymmetric
    w = weight.detach().float()
    n, k = w.shape
    g = group_size_for(k, group_size)
    groups = w.reshape(n * k // g, g)
    if not asymmetric:
        scales = (groups.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
        q = torch.round(groups / scales[:, None]).clamp_(-127, 127).to(torch.int8)
        return q.view(n, k).contiguous(), scales.view(n, k // g).contiguous(), None
    lo, hi = groups.aminmax(dim=1)
    span = hi - lo
    scales = torch.where(span > 0, span / 255.0, torch.ones_like(span))  # a constant group: any step
    if grid:
        steps = _grid_steps(groups, lo, span)
        scales = torch.where(steps > 0, steps, scales)
    # q = j - 128 with j = (w - lo) / s in 0..255; a grid of at most 128 levels keeps j itself,
    # so its origin is stored as it is.
    shift = torch.where(torch.round(span / scales) <= 127, 0.0, 128.0)
    offsets = lo + shift * scales
    q = torch.round((groups - lo[:, None]) / scales[:, None]) - shift[:, None]
    q = q.clamp_(-128, 127).to(torch.int8)
    return (
        q.view(n, k).contiguous(),
        scales.view(n, k // g).contiguous(),
        offsets.view(n, k // g).contiguous(),
    )


def dequantize(
    qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """int8 ``[N, K]``, scales and offsets ``[N, K // G]`` (offsets may be ``None``) → the float
    ``[N, K]`` they stand for, computed in float32 and then cast to ``dtype`` (so a recovered
    grid gives a bf16 model exactly its bf16 weights)."""
    n, k = qweight.shape
    groups = scales.shape[-1]
    out = qweight.view(n, groups, k // groups).float() * scales.float()[:, :, None]
    if offsets is not None:
        out += offsets.float()[:, :, None]
    return out.view(n, k).to(dtype)


class _Int8Weights(nn.Module):
    """What both int8 modules hold: the int8 matrix with its float32 scales and offsets, which
    stay float32 when the model is cast (``net.to(dtype=bf16)`` moves them, and casts only
    the rest); int8's own rounding is what they describe, a bf16 scale would add to it."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None) -> None:
        super().__init__()
        self.qweight: torch.Tensor
        self.scales: torch.Tensor
        self.offsets: torch.Tensor | None
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("offsets", offsets)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "_Int8Weights":
        kept = {name: getattr(self, name) for name in ("scales", "offsets")}
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        for name, t in kept.items():
            if t is not None:
                self._buffers[name] = t.to(device=self.qweight.device)
        return self


def _warn_fallback_once(reason: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning(
            "int8 weights: %s; matmuls dequantise the weight each call (slower, same results)", reason
        )


class Int8Linear(_Int8Weights):
    def __init__(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        offsets: torch.Tensor | None,
        bias: torch.Tensor | None,
    ) -> None:
        super().__init__(qweight, scales, offsets)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        return cls(*quantize_rows(linear.weight), linear.bias)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:  # [N, K]
        return dequantize(self.qweight, self.scales, self.offsets, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # one opaque node: the kernels below are not traceable
            out: torch.Tensor = torch.ops.plimsoll.int8_linear(
                x, self.qweight, self.scales, self.offsets, self.bias
            )
            return out
        return int8_matmul(x, self.qweight, self.scales, self.offsets, self.bias)


def int8_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``x @ dequantize(qweight, scales, offsets).T + bias`` by the fastest path this device has."""
    if x.dim() == 2 and x.shape[0] <= KERNEL_MAX_ROWS and x.device.type == "cpu":
        if cpu_kernels.supports_int8_linear(x, qweight, scales):
            out: torch.Tensor = cpu_kernels.int8_linear(x, qweight, scales, bias, offsets)
            return out
        _warn_fallback_once(
            "the compiled CPU kernel cannot run here (not built, activations not float32, or groups "
            "not a multiple of 16 inputs)"
        )
    elif x.device.type == "cuda" and x.dim() == 2 and x.shape[0] <= quant_triton.MAX_ROWS:
        reason = quant_triton.unsupported_reason(x, qweight, scales, offsets)
        if reason is None:
            gpu: torch.Tensor = quant_triton.launch(x, qweight, scales, offsets, bias)
            return gpu
        _warn_fallback_once(f"the Triton int8 kernel cannot run here ({reason})")
    bias = None if bias is None else bias.to(x.dtype)
    if x.device.type == "cpu":  # oneDNN's primitives are primed per whole weight shape (prime_matmuls)
        return linear(x, dequantize(qweight, scales, offsets, x.dtype), bias)
    return chunked_dequant_linear(x, qweight, scales, offsets, bias)


# ``int8_matmul`` as one node of a compiled graph (eager callers call the function itself).
int8_linear_op = torch.library.custom_op("plimsoll::int8_linear", int8_matmul, mutates_args=())


@int8_linear_op.register_fake
def _(x: torch.Tensor, qweight: torch.Tensor, *_: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], qweight.shape[0])


DEQUANT_CHUNK_BYTES = 8 * 2**20  # float32 temporary per chunk of output rows


def chunked_dequant_linear(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [N, K] int8
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:  # [M, N]
    """The prefill-sized path: dequantise a few thousand output rows at a time to ``x.dtype`` and
    matmul them, so the float temporaries are a slice of the matrix (``DEQUANT_CHUNK_BYTES`` of
    float32), not the whole of it on every call."""
    n, k = qweight.shape
    chunk = max(64, DEQUANT_CHUNK_BYTES // (4 * k) // 64 * 64)
    if chunk >= n:
        return F.linear(x, dequantize(qweight, scales, offsets, x.dtype), bias)
    out = x.new_empty(*x.shape[:-1], n)
    for n0 in range(0, n, chunk):
        n1 = min(n, n0 + chunk)
        w = dequantize(qweight[n0:n1], scales[n0:n1], None if offsets is None else offsets[n0:n1], x.dtype)
        out[..., n0:n1] = F.linear(x, w, None if bias is None else bias[n0:n1])
    return out


class Int8Embedding(_Int8Weights):
    """Token embedding stored as int8 rows: a lookup dequantises only the rows it reads."""

    def __init__(
        self, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, dtype: torch.dtype
    ) -> None:
        super().__init__(qweight, scales, offsets)
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        offsets = None if self.offsets is None else self.offsets[flat]
        rows = dequantize(self.qweight[flat], self.scales[flat], offsets, self.dtype)
        return rows.view(*ids.shape, rows.shape[-1])


def quantize_model(net: nn.Module, method: str, dtype: torch.dtype) -> nn.Module:
    """Replace the model's projections, head and embedding by int8 ones, in place; ``dtype`` is
    what the embedding's rows come out as. Call it on the float32 model, before it is cast
    (a bf16 cast moves a checkpoint's values off the grid that grid recovery finds)."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} or None, got {method!r}")
    if method == "fp8":
        from plimsoll.runtime.models import quant_fp8

        quant_fp8.quantize_model(net)  # projections an FP8 checkpoint loaded stay as they are
        quant_fp8.check_shapes(net)
        return net
    for module in list(net.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, Int8Linear.from_linear(child))
    decoder = net.get_submodule("model")
    q, s, z = quantize_rows(decoder.get_parameter("embed_tokens.weight"))
    decoder.embed_tokens = Int8Embedding(q, s, z, dtype)
    if net.tie_word_embeddings:
        net.lm_head = Int8Linear(q, s, z, None)  # the same int8 storage serves both
        net.tie_word_embeddings = False  # type: ignore[assignment]
    return net


def weight_bytes(net: nn.Module) -> int:
    """Bytes of the weights (the state dict: not RoPE's tables), each storage counted once."""
    seen: dict[int, int] = {}
    for t in net.state_dict().values():
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
