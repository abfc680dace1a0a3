"""LoRA adapters for the Llama-family model: PEFT files in, per-row deltas out.

What it is: :func:`read_peft_adapter` reads a PEFT directory (``adapter_config.json``
and ``adapter_model.safetensors``), checks it against the base model and returns a
host-side :class:`LoRAWeights` (``lora_alpha / r`` scaling folded into B; rsLoRA's
``alpha / sqrt(r)`` too). :class:`LoRASlots` holds ``max_loras`` device slots per
projection and computes every row's delta in one step, whatever adapter the row uses:

    h          = x @ A_all.T           # [N, S, P, R]  every slot's shrink at once
    h         *= row_mask              # [N, S] one-hot of the row's slot (all zero: base row)
    out[:, p] += h[:, :, p] @ B_p      # [N, out_p]    per part p; only the row's own slot counts

``S`` = slots, ``P`` = HF projections fused in ours (3 for q/k/v, 2 for gate/up, else 1),
``R`` = ``--max-lora-rank``; a smaller rank or an untargeted module is zero-padded.
Small matmuls per projection serve a step that mixes the base model and several
adapters (punica's BGMV, written with the mask instead of a per-row weight gather:
the cost is ``N x S x R x (P x in + out)``, against ``N x in x out`` for the base).

What it is not: merging adapters into the weights, a loop over adapters, or the
choice of which adapter sits in which slot (``engine/lora_manager.py`` decides).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from plimsoll.runtime.models.dense import Linear

if TYPE_CHECKING:
    from plimsoll.runtime.models.llama import LlamaForCausalLM

# Our projection -> the Hugging Face modules stacked in it, in row order (see llama.FUSED_PROJECTIONS).
PROJECTIONS: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "self_attn.o_proj": ("o_proj",),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.down_proj": ("down_proj",),
}
TARGET_MODULES = tuple(m for parts in PROJECTIONS.values() for m in parts)
_PART_OF = {m: (proj, i) for proj, parts in PROJECTIONS.items() for i, m in enumerate(parts)}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


class LoRAAdapterError(ValueError):
    """An adapter directory that cannot be served; the message names what is wrong."""


@dataclass
class LoRAWeights:
    """One adapter on the host: ``(layer, projection, part) -> (A [r, in], B_scaled [out_part, r])``."""

    name: str
    path: str
    rank: int
    tensors: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def target_modules(self) -> list[str]:
        return sorted({PROJECTIONS[p][i] for _, p, i in self.tensors})


def projection_shapes(hf_config: Any) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Our projection -> (in features, output rows of each HF part), from the base config."""
    heads = hf_config.num_attention_heads
    kv_heads = hf_config.num_key_value_heads or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
    return {
        "self_attn.qkv_proj": (hidden, (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)),
        "self_attn.o_proj": (heads * head_dim, (hidden,)),
        "mlp.gate_up_proj": (hidden, (inter, inter)),
        "mlp.down_proj": (inter, (hidden,)),
    }


def _read_config(directory: Path) -> dict[str, Any]:
    config_file = directory / "adapter_config.json"
    if not config_file.is_file():
        raise LoRAAdapterError(
            f"{directory} has no adapter_config.json; pass a PEFT LoRA directory (save_pretrained of a PeftModel)"
        )
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise LoRAAdapterError(f"{config_file} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{config_file} must hold a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAAdapterError(f"{config_file}: peft_type {peft_type!r} is not served; only LORA adapters are")
    refused = {
        "use_dora": "DoRA adapters",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D) layouts",
        "modules_to_save": "modules_to_save (fully trained extra modules)",
        "rank_pattern": "per-module ranks (rank_pattern)",
        "alpha_pattern": "per-module alphas (alpha_pattern)",
        "lora_bias": "LoRA biases (lora_bias)",
        "use_qalora": "QALoRA adapters",
        "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
        "layer_replication": "layer_replication",
        "trainable_token_indices": "trainable token embeddings (trainable_token_indices)",
    }
    for key, what in refused.items():
        if config.get(key):
            raise LoRAAdapterError(f"{config_file}: {what} are not supported; drop {key!r} from the adapter")
    if config.get("bias", "none") != "none":
        raise LoRAAdapterError(f"{config_file}: bias={config['bias']!r} is not supported; train with bias='none'")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), int | float) or config[key] <= 0:
            raise LoRAAdapterError(f"{config_file}: {key!r} must be a positive number, got {config.get(key)!r}")
    return config


def read_peft_adapter(
    name: str, path: str | Path, hf_config: Any, max_lora_rank: int, dtype: torch.dtype = torch.float32
) -> LoRAWeights:
    """Read and check a PEFT LoRA directory against the base model; raises :class:`LoRAAdapterError`."""
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise LoRAAdapterError(f"LoRA path {str(path)!r} is not a directory; pass a PEFT adapter directory")
    config = _read_config(directory)
    rank = int(config["r"])
    if rank > max_lora_rank:
        raise LoRAAdapterError(
            f"adapter {name!r} has rank {rank}, above --max-lora-rank {max_lora_rank}; raise --max-lora-rank"
        )
    scale = float(config["lora_alpha"]) / (math.sqrt(rank) if config.get("use_rslora") else rank)
    weights_file = directory / "adapter_model.safetensors"
    if not weights_file.is_file():
        extra = " (adapter_model.bin is not read: save with safe_serialization=True)" if (
            directory / "adapter_model.bin"
        ).exists() else ""
        raise LoRAAdapterError(f"{directory} has no adapter_model.safetensors{extra}")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        state = load_file(str(weights_file))
    except (SafetensorError, OSError, ValueError) as exc:
        raise LoRAAdapterError(f"{weights_file} cannot be read as safetensors ({exc})") from None
    shapes = projection_shapes(hf_config)
    num_layers = int(hf_config.num_hidden_layers)
    pairs: dict[tuple[int, str, int], dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in _PART_OF:
            raise LoRAAdapterError(
                f"{weights_file}: tensor {key!r} is not a LoRA weight of {', '.join(TARGET_MODULES)}; "
                "only those projections can carry an adapter"
            )
        layer = int(m.group(1))
        if layer >= num_layers:
            raise LoRAAdapterError(f"{weights_file}: {key!r} is for layer {layer}; the base model has {num_layers}")
        proj, part = _PART_OF[m.group(2)]
        pairs.setdefault((layer, proj, part), {})[m.group(3)] = tensor
    if not pairs:
        raise LoRAAdapterError(f"{weights_file} holds no LoRA weights")
    out = LoRAWeights(name=name, path=str(path), rank=rank)
    for (layer, proj, part), ab in sorted(pairs.items()):
        module = f"layers.{layer}.{PROJECTIONS[proj][part]}"
        if set(ab) != {"A", "B"}:
            raise LoRAAdapterError(f"{weights_file}: {module} has lora_{''.join(ab)} but not its pair")
        in_features, part_rows = shapes[proj][0], shapes[proj][1][part]
        a, b = ab["A"], ab["B"]
        if a.shape != (rank, in_features) or b.shape != (part_rows, rank):
            raise LoRAAdapterError(
                f"{weights_file}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; the base "
                f"model and r={rank} need {(rank, in_features)} and {(part_rows, rank)} (an adapter of "
                "another base model?)"
            )
        out.tensors[(layer, proj, part)] = (a.to(dtype), (b.float() * scale).to(dtype))
    return out


class LoRASlots:
    """``max_loras`` adapter slots on the device for every LoRA-able projection of the model.

    ``row_mask`` ([N, S], set by the model runner for one forward pass, None when no row
    uses an adapter) selects each row's slot; the projections read it in :meth:`delta`.
    """

    def __init__(self, model: LlamaForCausalLM, max_loras: int, max_rank: int) -> None:
        cfg = model.config
        self.max_loras, self.max_rank = max_loras, max_rank
        self.shapes = projection_shapes(cfg)
        self.row_mask: torch.Tensor | None = None
        # A: rows (slot, part, rank) -> [S * P * R, in]; B: one [S * R, out_part] per part, rows
        # (slot, rank), so the expand reads no zero blocks (B is block-diagonal over the parts).
        self.lora_a: dict[tuple[int, str], torch.Tensor] = {}
        self.lora_b: dict[tuple[int, str], list[torch.Tensor]] = {}
        weight = next(model.parameters())
        kw: dict[str, Any] = {"dtype": weight.dtype, "device": weight.device}
        for layer_idx, layer in enumerate(model.model.layers):
            for proj, (in_features, parts) in self.shapes.items():
                self.lora_a[(layer_idx, proj)] = torch.zeros(max_loras * len(parts) * max_rank, in_features, **kw)
                self.lora_b[(layer_idx, proj)] = [torch.zeros(max_loras * max_rank, rows, **kw) for rows in parts]
                module = layer.get_submodule(proj)
                if not isinstance(module, Linear):  # the projections that carry a ``lora`` hook
                    raise ValueError(f"{type(module).__name__} cannot carry LoRA (quantised weights?)")
                module.lora = _SlotView(self, layer_idx, proj)

    def load(self, slot: int, weights: LoRAWeights) -> None:
        """Copy one adapter into ``slot``; what it does not target stays zero.

        Every A and B row of the slot is packed into one host buffer (pinned on CUDA), copied to
        the device in one transfer that does not block the engine thread, and spread into the
        slots there with one batched device copy: not a small blocking copy per layer and
        projection."""
        r, big_r = weights.rank, self.max_rank
        targets: list[torch.Tensor] = []
        pieces: list[torch.Tensor] = []
        for (layer, proj), a_all in self.lora_a.items():
            p_count = len(self.shapes[proj][1])
            a_slot = a_all[slot * p_count * big_r : (slot + 1) * p_count * big_r]
            a_host = torch.zeros(a_slot.shape, dtype=a_slot.dtype)
            for part, b_part in enumerate(self.lora_b[(layer, proj)]):
                b_slot = b_part[slot * big_r : (slot + 1) * big_r]
                b_host = torch.zeros(b_slot.shape, dtype=b_slot.dtype)
                ab = weights.tensors.get((layer, proj, part))
                if ab is not None:
                    a_host[part * big_r : part * big_r + r] = ab[0]
                    b_host[:r] = ab[1].T
                targets.append(b_slot)
                pieces.append(b_host)
            targets.append(a_slot)
            pieces.append(a_host)
        staged = torch.cat([p.reshape(-1) for p in pieces])  # [total] on the host
        device = targets[0].device
        if device.type == "cuda":
            staged = staged.pin_memory().to(device, non_blocking=True)
        parts = torch.split(staged, [p.numel() for p in pieces])
        torch._foreach_copy_(targets, [v.view(p.shape) for v, p in zip(parts, pieces, strict=True)])

    def delta(self, layer: int, proj: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        mask = self.row_mask
        if mask is None:
            return out
        n, s, big_r = x.shape[0], self.max_loras, self.max_rank
        b_parts = self.lora_b[(layer, proj)]
        h = (x @ self.lora_a[(layer, proj)].T).view(n, s, len(b_parts), big_r)  # [N, S, P, R]
        h = h * mask[:, :, None, None]  # only the row's own slot survives
        if len(b_parts) == 1:
            return torch.addmm(out, h.view(n, s * big_r), b_parts[0])
        col = 0
        for part, b_part in enumerate(b_parts):  # the P parts of a fused projection (2 or 3), not adapters
            width = b_part.shape[1]
            out[:, col : col + width].addmm_(h[:, :, part].reshape(n, s * big_r), b_part)
            col += width
        return out


@dataclass(frozen=True)
class _SlotView:
    """What a projection holds: where its slots are."""

    slots: LoRASlots
    layer: int
    proj: str

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return self.slots.delta(self.layer, self.proj, x, out)
