"""Tiny random-initialised Llama-family models with a byte-level tokenizer, saved as HF dirs.

Imported by the runtime tests (``from tiny_models import ...``) and their conftest.
"""

from pathlib import Path
from typing import Any

ARCHS = ("llama", "qwen2", "qwen3", "mistral")


def byte_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for i, sym in enumerate(alphabet):
        vocab[sym] = i + 3
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def tiny_config(arch: str) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common: dict[str, Any] = dict(
        vocab_size=259,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=0.3,
        tie_word_embeddings=False,
    )
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
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = tiny_config(arch)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    model.save_pretrained(str(directory))
    byte_tokenizer().save_pretrained(str(directory))
    return directory
