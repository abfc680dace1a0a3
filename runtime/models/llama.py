"""Llama-family decoder over the paged KV cache: Llama (incl. SmolLM2), Mistral, Qwen2, Qwen3.

What it is: one readable model file whose parameter names match Hugging Face's,
except that q/k/v and gate/up are each one fused matmul (``fuse_hf_state_dict``
stacks a transformers state dict's tensors into them at load). Differences between the family members are
switches read from the HF config: Qwen2's q/k/v bias, Qwen3's per-head q/k
RMSNorm, tied or untied embeddings, RoPE variants (default, linear, llama3, yarn).
Each layer calls one ``attend(q, k, v, layer, scale)`` after RoPE: eagerly a ``PagedAttend``
over the step's caches and backend (``forward``, which also takes the CPU native paths), or
the opaque ``torch.ops.plimsoll.attention`` in ``forward_opaque``, the forward
``torch.compile`` traces (``engine/compilation.py``).
What it is not: a general model zoo; sliding-window attention is not implemented,
so a window shorter than ``max_model_len`` is refused by the loader.
"""

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from plimsoll.runtime.attention.attention_op import PagedAttend, opaque_attend
from plimsoll.runtime.models.cpu_plan import CPUPlan
from plimsoll.runtime.models.dense import Linear, linear, prime_onednn_steps

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

# The activations Llama-family checkpoints name, as the torch modules transformers' ACT2FN maps
# them to; built here so that serving does not import transformers (seconds of a cold start).
ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "silu": nn.SiLU,
    "swish": nn.SiLU,
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"),
}


def activation(name: str) -> nn.Module:
    """The module for ``hidden_act``; a name not listed above comes from transformers' table."""
    if name in ACTIVATIONS:
        return ACTIVATIONS[name]()
    from transformers.activations import ACT2FN

    module: nn.Module = ACT2FN[name]
    return module

# What a layer calls after RoPE: (query, key, value, layer index, scale) -> attention output.
# A ``PagedAttend`` eagerly, ``opaque_attend`` (one custom op) under torch.compile.
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # torch's fused op: one call instead of seven, bitwise equal to the lines below in fp32.
            return torch.nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in fp32 and cast back before the weight, as transformers does.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        rope = getattr(config, "rope_parameters", None) or {"rope_type": "default"}
        rope_type = rope.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"RoPE type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # Computed on the CPU even inside the loader's meta device: on meta these ops run through
        # torch's Python refs, which import torch._dynamo (and Triton with it) on a CPU server.
        with torch.device("cpu"):
            if rope_type == "default":
                base = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
                inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
                self.attention_scaling = 1.0
            else:
                from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

                inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :].float()  # [N, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [N, D]
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [N, H, D], cos/sin [N, D]; x * cos + rotate_half(x) * sin, in two fewer ops.
    return torch.addcmul(x * cos[:, None, :], rotate_half(x), sin[:, None, :])


class Attention(nn.Module):
    def __init__(self, config: Any, arch: str, layer_index: int = 0) -> None:
        super().__init__()
        self.layer_index = layer_index  # which KV cache of the step is this layer's
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scale = self.head_dim**-0.5
        qkv_bias = arch == "Qwen2ForCausalLM" or bool(getattr(config, "attention_bias", False))
        o_bias = arch != "Qwen2ForCausalLM" and bool(getattr(config, "attention_bias", False))
        hidden = config.hidden_size
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k and v in one matmul (rows stacked in that order; see fuse_hf_state_dict).
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, hidden, bias=o_bias)
        self.qk_norm = arch == "Qwen3ForCausalLM"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [N, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: Attend,
    ) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size :].view(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = qkv[:, : self.q_size], qkv[:, self.q_size : self.q_size + self.kv_size]
            qk = torch.cat(
                (
                    self.q_norm(q.reshape(n, self.num_heads, self.head_dim)),
                    self.k_norm(k.reshape(n, self.num_kv_heads, self.head_dim)),
                ),
                dim=1,
            )
        else:
            qk = qkv[:, : self.q_size + self.kv_size].view(
                n, self.num_heads + self.num_kv_heads, self.head_dim
            )
        # RoPE on q and k heads together: one set of ops per layer instead of two.
        q, k = torch.split(apply_rope(qk, cos, sin), [self.num_heads, self.num_kv_heads], dim=1)
        out = attend(q, k, v, self.layer_index, self.scale)  # [N, H, D]; stores this step's K/V first
        result: torch.Tensor = self.o_proj(out.reshape(n, self.num_heads * self.head_dim))
        return result


class MLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.intermediate_size = config.intermediate_size
        # gate and up in one matmul (gate rows first; see fuse_hf_state_dict).
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        result: torch.Tensor = self.down_proj(self.act(gate) * up)
        return result


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, arch: str, layer_index: int = 0) -> None:
        super().__init__()
        self.self_attn = Attention(config, arch, layer_index)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attend)
        result: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return result


class DecoderModel(nn.Module):
    def __init__(self, config: Any, arch: str) -> None:
        super().__init__()
        # Initialised here, not by nn.Embedding: its normal_() on the loader's meta device runs
        # through torch's Python refs, which import torch._dynamo (and Triton with it) on a CPU.
        weight = torch.empty(config.vocab_size, config.hidden_size)
        if weight.device.type != "meta":
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(config, arch, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class LlamaForCausalLM(nn.Module):
    """Parameters named like transformers' ``*ForCausalLM`` (``model.layers.0.self_attn.o_proj.weight``),
    except the fused ``qkv_proj`` and ``gate_up_proj``: ``fuse_hf_state_dict`` maps a HF state dict."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        arch = check_architecture(config)
        self.config = config
        self.model = DecoderModel(config, arch)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        # Set by the engine's model runner at load, after LoRA, TP and int8 (models/cpu_plan.py).
        self.cpu_plan: CPUPlan | None = None
        # Set by the loader (loader.checkpoint_fingerprint): keys what is cached from the weights.
        self.checkpoint_fingerprint: str | None = None
        # Set by the loader: the weights are pages of the weight cache's file (models/weight_cache.py).
        self.weights_mapped = False

    def forward(
        self,
        input_ids: torch.Tensor,  # [N]
        positions: torch.Tensor,  # [N]
        step: PagedAttend,  # the step's KV caches, attention metadata and attention backend
    ) -> torch.Tensor:  # [N, hidden]
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(positions, x.dtype)  # once per step, for every layer
        # On CPU (models/cpu_plan.py): the fused decode step or the glued layers where they take
        # the step; every other step runs the layers below.
        if self.cpu_plan is not None:
            planned = self.cpu_plan.run(x, cos, sin, step)
            if planned is not None:
                return planned
        return self.run_layers(x, cos, sin, step)

    def forward_opaque(
        self,
        input_ids: torch.Tensor,  # [N]
        positions: torch.Tensor,  # [N]
    ) -> torch.Tensor:  # [N, hidden]
        """The forward ``torch.compile`` traces (``engine/compilation.py``): every layer's attention
        is the opaque ``torch.ops.plimsoll.attention``, which reads the step's caches and metadata
        from the runner's ``step_context``; none of the CPU native paths."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(positions, x.dtype)
        return self.run_layers(x, cos, sin, opaque_attend)

    def run_layers(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        for layer in self.model.layers:
            x = layer(x, cos, sin, attend)
        hidden: torch.Tensor = self.model.norm(x)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        planned = None if self.cpu_plan is None else self.cpu_plan.logits(hidden)  # CPU: the packed head
        if planned is not None:
            return planned
        if self.tie_word_embeddings:
            return linear(hidden, self.model.embed_tokens.weight)
        logits: torch.Tensor = self.lm_head(hidden)  # a Linear, or an Int8Linear (models/quant.py)
        return logits

    def prime_matmuls(self, max_tokens: int, max_logit_rows: int) -> int:
        """Build the CPU matmul primitives every step shape will need (``dense.prime_onednn``): the
        layers' for up to ``max_tokens`` rows, the output head's for up to ``max_logit_rows``. An int8
        layer dequantises above its kernel's rows, so its float shape is primed from there on.
        Returns the matmuls run (0 off CPU float32)."""
        return sum(1 for _ in self.prime_matmul_steps(max_tokens, max_logit_rows))

    def prime_matmul_steps(self, max_tokens: int, max_logit_rows: int) -> Iterator[None]:
        """``prime_matmuls`` one matmul at a time (yields after each; see ``dense.prime_onednn_steps``)."""
        from plimsoll.runtime.models.quant import KERNEL_MAX_ROWS, Int8Linear

        float_dtype = self.model.norm.weight.dtype

        def prime(module: nn.Module, max_rows: int) -> Iterator[None]:
            if isinstance(module, Linear):
                yield from prime_onednn_steps([(module.weight, module.bias)], max_rows)
            elif isinstance(module, Int8Linear):
                shape = (module.qweight.shape[0], module.qweight.shape[1])
                stand_in = torch.empty(shape, dtype=float_dtype)  # primitives are per shape, not per tensor
                yield from prime_onednn_steps([(stand_in, module.bias)], max_rows, min_rows=KERNEL_MAX_ROWS + 1)

        seen: set[tuple[type, tuple[int, ...], bool]] = set()  # a stand-in per int8 shape, not per layer
        for module in self.model.layers.modules():
            if isinstance(module, Linear | Int8Linear):
                weight = module.weight if isinstance(module, Linear) else module.qweight
                key = (type(module), tuple(weight.shape), module.bias is not None)
                if key not in seen:
                    seen.add(key)
                    yield from prime(module, max_tokens)
        if self.tie_word_embeddings:
            yield from prime_onednn_steps([(self.model.embed_tokens.weight, None)], max_logit_rows)
        else:
            yield from prime(self.lm_head, max_logit_rows)


FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def fuse_hf_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map a transformers state dict onto this model's fused projections.

    Each layer's q/k/v weights (and biases) are stacked into ``qkv_proj`` and its
    gate/up weights into ``gate_up_proj``; every other name passes through. A layer
    missing one of the parts is left alone, so the loader's mismatch error names the
    Hugging Face tensors that are missing.
    """
    fused = dict(state)
    for name in list(state):
        for target, parts in FUSED_PROJECTIONS.items():
            head, sep, tail = name.partition(f".{parts[0]}.")
            if not sep:
                continue
            keys = [f"{head}.{part}.{tail}" for part in parts]
            if all(key in fused for key in keys):
                fused[f"{head}.{target}.{tail}"] = torch.cat([fused.pop(key) for key in keys], dim=0)
    return fused


def check_architecture(config: Any) -> str:
    archs = list(getattr(config, "architectures", None) or [])
    if not archs:
        # Configs built in code have no ``architectures``; infer from model_type.
        by_type = {
            "llama": "LlamaForCausalLM",
            "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM",
        }
        archs = [by_type.get(getattr(config, "model_type", ""), f"model_type={config.model_type!r}")]
    arch = str(archs[0])
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"model architecture {arch} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)} "
            "(Llama-family decoders)"
        )
    return arch
