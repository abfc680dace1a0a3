"""A Llama model's ``config.json`` read as transformers' ``LlamaConfig`` would read it, without transformers.

What it is: :func:`read_llama_config`, which returns a :class:`LlamaSettings` (attribute access,
``to_json_string``) for a ``config.json`` of ``model_type`` llama whose RoPE is the default kind
and that names every size, applying ``LlamaConfig``'s defaults to the rest (heads for KV heads,
``hidden_size // num_attention_heads`` for ``head_dim``, no biases, untied embeddings, silu,
``rope_theta`` 10000); and ``None`` for anything else — other families, RoPE scaling, quantized
checkpoints, GGUF — which the loader reads through transformers' ``AutoConfig``. Why: importing
transformers is the largest part of a replica's start. A test compares every attribute the runtime
reads with ``AutoConfig``'s for the embedded and a tiny model.

What it is not: a general config parser; it reads one family's plain case.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

# Sizes config.json must state for the fast path (transformers' defaults are a 7B model's).
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
LLAMA_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": None,
    "pretraining_tp": 1,
}


class LlamaSettings(SimpleNamespace):
    """The config's values as attributes (what the runtime reads of transformers' config object)."""

    def to_json_string(self) -> str:
        return json.dumps(vars(self), indent=2, sort_keys=True) + "\n"


def read_llama_config(directory: Path) -> LlamaSettings | None:
    path = directory / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or raw.get("model_type") != "llama":
        return None
    if raw.get("architectures") not in (None, ["LlamaForCausalLM"]) or raw.get("quantization_config"):
        return None
    if any(not isinstance(raw.get(k), int) for k in REQUIRED) or raw.get("rope_scaling"):
        return None
    rope = raw.get("rope_parameters")
    if rope is None:
        rope = {"rope_type": "default", "rope_theta": float(raw.get("rope_theta", 10000.0))}
    elif (
        not isinstance(rope, dict)
        or rope.get("rope_type", "default") != "default"
        or set(rope) - {"rope_type", "rope_theta"}
    ):
        return None
    values = {
        **LLAMA_DEFAULTS,
        **raw,
        "rope_parameters": {"rope_theta": 10000.0, **rope, "rope_type": "default"},
    }
    values.pop("rope_theta", None)
    if values.get("num_key_value_heads") is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    if values.get("head_dim") is None:
        values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
    return LlamaSettings(**values)
