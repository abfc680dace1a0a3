"""FP8 weights (vLLM's ``--quantization fp8``): e4m3 weights, activations scaled per token at run time.

What it is: every decoder projection (q/k/v, o, gate/up, down) becomes an ``Fp8Linear``: the
weight as ``float8_e4m3fn`` ``[N, K]`` with one float32 scale per output channel
(``s = max|row| / 448``, so the largest weight of a row maps to e4m3's largest finite value and
every other keeps e4m3's 3 mantissa bits: within 2⁻⁴ of its value, or of the subnormal step
``s · 2⁻⁹`` near zero). At run time each activation row gets its own scale the same way
(dynamic, per token: no calibration) and ``torch._scaled_mm`` multiplies the two FP8 operands on
the tensor cores with both scales applied in its epilogue, output in the activations' dtype.
Half of bf16's weight bytes per decode step, and FP8's tensor-core rate for prefill.
Under ``torch.compile`` the activation scaling (abs, amax, divide, cast) fuses into one kernel.
The embedding and the LM head stay in the model's dtype (as vLLM keeps them).

Where it runs: CUDA devices of compute capability 8.9 or newer (Ada, Hopper, Blackwell); an
older GPU is refused at load with the reason. On CPU torch's own ``_scaled_mm`` computes the
same thing correctly but about ten times slower than a float32 matmul, so the engine allows
it for checking outputs and logs that it is not for serving. Where the device rejects a
scale per row and per column (some builds only take one scale per tensor), the activation
scale becomes one per tensor and the channel scales are applied after the matmul; the choice
is made once per device by trying.

Checkpoints already in FP8 (``quantization_config`` in ``config.json``) load as they are:
``quant_method: "fp8"`` with a per-tensor ``weight_scale`` (no ``weight_block_size``), and
``compressed-tensors`` ``float-quantized``/``naive-quantized`` groups of 8-bit float weights
with ``strategy`` ``tensor`` or ``channel``. Per-tensor scales are spread over their rows (so
fused q/k/v keep each part's scale); a checkpoint's static ``input_scale`` is dropped in
favour of per-token scales. What it is not: FP8 activations stored between layers, block-wise
(``weight_block_size``) scales, FP8 KV caches, or int4.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
MIN_CAPABILITY = (8, 9)
# Smallest activation scale: an all-zero row stays zero instead of dividing by zero.
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
# What _scaled_mm needs of K and N on CUDA (cuBLASLt's FP8 alignment).
ALIGNMENT = 16
FP8_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


# Whether _scaled_mm takes a scale per row and per column, by device type: found by check_device
# at load, read by fp8_linear (a plain dict, so torch.compile traces the choice as a constant).
ROWWISE: dict[str, bool] = {}


def check_device(device: torch.device | str) -> None:
    """Raise ``ValueError`` saying why FP8 weights cannot run here; log that CPU is for checking.
    Also finds out (once) which scales the device's ``_scaled_mm`` takes."""
    dev = torch.device(device)
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        cap = torch.cuda.get_device_capability(index)
        if cap < MIN_CAPABILITY:
            name = torch.cuda.get_device_name(index)
            raise ValueError(
                f"--quantization fp8 needs FP8 tensor cores (compute capability 8.9+: Ada, Hopper, Blackwell); "
                f"{name} is sm_{cap[0]}{cap[1]}. Use --quantization int8, or no quantization"
            )
    elif dev.type == "cpu":
        log.warning(
            "--quantization fp8 on CPU runs torch's reference FP8 matmul: correct, about 10x slower than "
            "float32; for checking outputs, not for serving"
        )
    else:
        raise ValueError(f"--quantization fp8 runs on CUDA (compute capability 8.9+) or CPU, not {dev.type}")
    ROWWISE[dev.type] = rowwise_supported(dev.type, dev.index)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` float → (e4m3 ``[N, K]``, float32 scales ``[N]``), one scale per output channel."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize_weight(qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 ``[N, K]`` and scales ``[N]`` (or one) → the float ``[N, K]`` they stand for."""
    return (qweight.float() * scale.float().reshape(-1, 1)).to(dtype)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[M, K]`` → (e4m3 ``[M, K]``, float32 scales ``[M, 1]``), one per row (token)."""
    x32 = x.float()
    scale = (x32.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


@functools.cache
def rowwise_supported(device_type: str, device_index: int | None) -> bool:
    """Whether ``_scaled_mm`` takes a scale per row of A and per column of B here (tried once)."""
    device = (
        torch.device(device_type, device_index) if device_index is not None else torch.device(device_type)
    )
    a = torch.zeros((ALIGNMENT, ALIGNMENT), device=device).to(FP8)
    b = torch.zeros((ALIGNMENT, ALIGNMENT), device=device).to(FP8)
    try:
        torch._scaled_mm(
            a,
            b.t(),
            scale_a=torch.ones((ALIGNMENT, 1), device=device),
            scale_b=torch.ones((1, ALIGNMENT), device=device),
            out_dtype=torch.bfloat16,
        )
    except (RuntimeError, NotImplementedError) as exc:
        log.info("fp8: %s takes one scale per tensor only (%s); channel scales applied after", device, exc)
        return False
    return True


def fp8_linear(
    x: torch.Tensor,  # [..., K]
    qweight: torch.Tensor,  # [N, K] e4m3
    weight_scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None,
) -> torch.Tensor:  # [..., N] in x's dtype
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    n = qweight.shape[0]
    if x2.shape[0] == 0:
        return x.new_empty(*shape[:-1], n)
    out_dtype = x.dtype
    if ROWWISE.get(x.device.type, True):
        xq, x_scale = quantize_activations(x2)
        y = torch._scaled_mm(
            xq, qweight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, n), out_dtype=out_dtype
        )
    else:  # one activation scale for the step, the channel scales after the matmul
        x32 = x2.float()
        x_scale = (x32.abs().amax() / FP8_MAX).clamp(min=MIN_SCALE)
        xq = (x32 / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        one = torch.ones((), device=x.device)
        y32 = torch._scaled_mm(xq, qweight.t(), scale_a=x_scale, scale_b=one, out_dtype=torch.float32)
        y = (y32 * weight_scale.view(1, n)).to(out_dtype)
    if bias is not None:
        y = y + bias.to(out_dtype)
    return y.view(*shape[:-1], n)


class Fp8Linear(nn.Module):
    """A projection with e4m3 weights and per-channel scales; state dict ``weight``, ``weight_scale``."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight: torch.Tensor
        self.weight_scale: torch.Tensor
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.out_features, self.in_features = weight.shape

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        return cls(*quantize_weight(linear.weight), linear.bias)

    @classmethod
    def empty(cls, out_features: int, in_features: int, bias: bool) -> Fp8Linear:
        """A shell on the meta device for a checkpoint's FP8 tensors to load into."""
        with torch.device("meta"):
            return cls(
                torch.empty((out_features, in_features), dtype=FP8),
                torch.empty(out_features, dtype=torch.float32),
                torch.empty(out_features) if bias else None,
            )

    def _apply(self, fn: Any, recurse: bool = True) -> Fp8Linear:
        # net.to(dtype=bf16) must move the FP8 weight and the float32 scales, not cast them.
        kept = {"weight": self.weight, "weight_scale": self.weight_scale}
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call,unused-ignore]  # torch 2.15 leaves Module._apply unannotated
        device = self._buffers["weight"].device  # type: ignore[union-attr]
        for name, t in kept.items():
            self._buffers[name] = t.to(device=device)
        return self

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_weight(self.weight, self.weight_scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale, self.bias)


def check_shapes(net: nn.Module) -> None:
    """Refuse, before anything runs, a projection whose sizes ``_scaled_mm`` cannot take on CUDA."""
    for name, module in net.named_modules():
        if isinstance(module, Fp8Linear) and (
            module.in_features % ALIGNMENT or module.out_features % ALIGNMENT
        ):
            raise ValueError(
                f"--quantization fp8: {name} is {module.out_features}x{module.in_features}; FP8 matmuls need "
                f"both sizes divisible by {ALIGNMENT}. Serve this model without fp8"
            )


def _projections(net: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    found = []
    for layer in net.model.layers:  # type: ignore[union-attr]
        for parent in (layer.self_attn, layer.mlp):
            for name in FP8_PROJECTIONS:
                child = getattr(parent, name, None)
                if child is not None:
                    found.append((parent, name, child))
    return found


def quantize_model(net: nn.Module) -> nn.Module:
    """Replace every decoder projection by an ``Fp8Linear``, in place (embedding and head stay)."""
    for parent, name, child in _projections(net):
        if isinstance(child, nn.Linear):
            setattr(parent, name, Fp8Linear.from_linear(child))
    return net


# --------------------------------------------------------------------------- FP8 checkpoints


@dataclass(frozen=True)
class CheckpointFormat:
    """How an FP8 checkpoint stores its projections: ``weight`` (e4m3), ``weight_scale``."""

    name: str  # "fp8" or "compressed-tensors"
    strategy: str  # "tensor" or "channel"
    ignore: tuple[str, ...] = ()  # module names left in float (compressed-tensors' ``ignore``)


def checkpoint_format(hf_config: Any) -> CheckpointFormat | None:
    """The FP8 format of a checkpoint from its ``quantization_config``; None when it has none.
    Raises ``ValueError`` for a quantised checkpoint this loader cannot read."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8":
        if qc.get("weight_block_size"):
            raise ValueError(
                f"this FP8 checkpoint scales weights in blocks (weight_block_size={qc['weight_block_size']}); "
                "only per-tensor and per-channel FP8 checkpoints are loaded"
            )
        return CheckpointFormat("fp8", "tensor", tuple(qc.get("modules_to_not_convert") or ()))
    if method == "compressed-tensors":
        fmt = str(qc.get("format", ""))
        groups = list((qc.get("config_groups") or {}).values())
        weights = [g.get("weights") or {} for g in groups]
        is_fp8 = bool(weights) and all(w.get("num_bits") == 8 and w.get("type") == "float" for w in weights)
        if fmt not in ("float-quantized", "naive-quantized") or not is_fp8:
            raise ValueError(
                f"compressed-tensors checkpoint with format {fmt!r} and weights {weights}: only 8-bit float "
                "weights (float-quantized) are loaded"
            )
        strategies = {str(w.get("strategy", "tensor")) for w in weights}
        if not strategies <= {"tensor", "channel"} or len(strategies) != 1:
            raise ValueError(f"compressed-tensors FP8 strategy {sorted(strategies)}: only tensor or channel")
        return CheckpointFormat("compressed-tensors", strategies.pop(), tuple(qc.get("ignore") or ()))
    raise ValueError(
        f"checkpoint quantization_config quant_method={method!r} is not supported; FP8 checkpoints "
        "(quant_method 'fp8' or 'compressed-tensors' float-quantized) are, or a float checkpoint"
    )


def prepare_state(state: dict[str, torch.Tensor], fmt: CheckpointFormat) -> set[str]:
    """Make an FP8 checkpoint's state dict loadable, in place: every ``weight_scale`` becomes one
    float32 per output row (a per-tensor scale repeated over its rows, so q/k/v and gate/up fuse
    with each part's own scale) and static ``input_scale`` tensors go (activations are scaled per
    token). Returns the HF module names (``model.layers.0.self_attn.q_proj``) stored in FP8."""
    fp8_modules = set()
    for name in list(state):
        if name.endswith((".input_scale", ".weight_zero_point", ".input_zero_point")):
            del state[name]
            continue
        if not name.endswith(".weight_scale"):
            continue
        module = name[: -len(".weight_scale")]
        weight = state.get(f"{module}.weight")
        if weight is None or weight.dtype != FP8:
            raise ValueError(f"{name} has no float8_e4m3fn {module}.weight beside it ({fmt.name} checkpoint)")
        rows = weight.shape[0]
        scale = state[name].float().reshape(-1)
        if scale.numel() == 1:
            scale = scale.expand(rows).contiguous()
        elif scale.numel() != rows:
            raise ValueError(
                f"{name} holds {scale.numel()} scales for {rows} rows: not per tensor or per channel"
            )
        state[name] = scale
        fp8_modules.add(module)
    return fp8_modules


def prepare_checkpoint(
    hf_config: Any, state: dict[str, torch.Tensor], quantization: str | None, device: torch.device | str
) -> str | None:
    """The loader's hook, before the state dict is fused: an FP8 checkpoint is prepared
    (``prepare_state``) and served as ``fp8`` whatever ``quantization`` said (an explicit other
    method is refused); with ``fp8`` the device is checked. Returns the quantization to apply."""
    fmt = checkpoint_format(hf_config)
    if fmt is not None:
        if quantization not in (None, "fp8"):
            raise ValueError(
                f"this checkpoint is already FP8 ({fmt.name}, {fmt.strategy} scales); drop --quantization "
                f"{quantization} (it is served as fp8)"
            )
        modules = prepare_state(state, fmt)
        log.info(
            "FP8 checkpoint (%s, %s scales): %d projections in e4m3", fmt.name, fmt.strategy, len(modules)
        )
        quantization = "fp8"
    if quantization == "fp8":
        check_device(device)
    return quantization


def install_modules(net: nn.Module, fused_state: dict[str, torch.Tensor]) -> None:
    """Put empty ``Fp8Linear`` shells where the fused state dict holds FP8 projections (the loader
    then assigns the checkpoint's tensors into them); nothing for a float checkpoint."""
    names = {k[: -len(".weight_scale")] for k in fused_state if k.endswith(".weight_scale")}
    if not names:
        return
    modules = {id(m): n for n, m in net.named_modules()}
    for parent, name, child in _projections(net):
        if modules[id(child)] in names:
            assert isinstance(child, nn.Linear)
            setattr(
                parent, name, Fp8Linear.empty(child.out_features, child.in_features, child.bias is not None)
            )
