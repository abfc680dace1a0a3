"""Tiny random-initialised models of four architectures, saved as HF dirs.

The shapes and the byte-level tokenizer are the ones of ``plimsoll.runtime.testing``.

Imported by the runtime tests (``from tiny_models import ...``) and their conftest.
"""

from pathlib import Path
from typing import Any

from plimsoll.runtime.testing import TINY_SHAPE, byte_level_tokenizer, save_random_model

ARCHS = ("llama", "qwen2", "qwen3", "mistral")


def byte_tokenizer() -> Any:
    return byte_level_tokenizer(chat_template=False)


def tiny_config(arch: str) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common: dict[str, Any] = {**TINY_SHAPE, "max_position_embeddings": 1024}
    if arch == "llama":
        # llama3 RoPE scaling exercises the non-default RoPE path.
        return LlamaConfig(
            **common,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if arch == "qwen2":
        return Qwen2Config(**{**common, "tie_word_embeddings": True})
    if arch == "qwen3":
        return Qwen3Config(**common, head_dim=16)
    if arch == "mistral":
        return MistralConfig(**common, sliding_window=None)
    raise AssertionError(arch)


def build_tiny_model(arch: str, directory: Path) -> Path:
    save_random_model(directory, tiny_config(arch), chat_template=False, attn_implementation="eager")
    return directory
