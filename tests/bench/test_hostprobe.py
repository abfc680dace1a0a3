"""The host probes' arithmetic: a request's FLOPs against torch's own counter on a real model.

``request_flops`` is checked against ``torch.utils.flop_counter.FlopCounterMode`` running a
tiny random-initialised transformers Llama (eager attention) over one prompt: the counter
sees every projection, the output head and the attention matmuls. Eager attention multiplies
the full square of positions and masks it afterwards, so that part is compared separately:
the counter's attention FLOPs for a full square, the function's for the causal triangle.
"""

import json
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM

from plimsoll.bench.hostprobe import LlamaShape, ceiling_tokens_per_s, matmul_gflops, request_flops

CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **CONFIG}))
    return tmp_path


def test_shape_reads_a_config_and_defaults_head_dim_and_kv_heads(model_dir: Path, tmp_path: Path) -> None:
    shape = LlamaShape.from_dir(model_dir)
    assert (shape.heads, shape.kv_heads, shape.head_dim, shape.layers) == (8, 2, 8, 3)
    assert shape.projections()[1] == (16, 64)  # k: 2 KV heads x head_dim 8
    mha = tmp_path / "mha"
    mha.mkdir()
    cfg = {k: v for k, v in CONFIG.items() if k != "num_key_value_heads"}
    (mha / "config.json").write_text(json.dumps(cfg))
    assert LlamaShape.from_dir(mha).kv_heads == 8


@pytest.mark.parametrize("prompt", [1, 17, 40])
def test_request_flops_match_torchs_counter_on_a_prefill(model_dir: Path, prompt: int) -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG, attn_implementation="eager")).eval()
    ids = torch.randint(0, CONFIG["vocab_size"], (1, prompt))
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(ids, logits_to_keep=1)  # the prefill of a request: one output token's logits
    counted = counter.get_total_flops()
    shape = LlamaShape.from_dir(model_dir)
    # One generated token: the prompt's positions go through the layers, one head matmul.
    ours = request_flops(shape, prompt, 1)
    full_square = 4 * shape.heads * shape.head_dim * prompt * prompt * shape.layers
    causal = 4 * shape.heads * shape.head_dim * prompt * (prompt + 1) // 2 * shape.layers
    assert ours - causal == counted - full_square


def test_decode_tokens_add_their_layers_their_context_and_the_head(model_dir: Path) -> None:
    shape = LlamaShape.from_dir(model_dir)
    one = request_flops(shape, 10, 1)
    two = request_flops(shape, 10, 2)
    per_token = 2 * sum(n * k for n, k in shape.projections()) * shape.layers
    # The second output token: position 10 through every layer, attending to 11 positions.
    attention = 4 * shape.heads * shape.head_dim * 11 * shape.layers
    assert two - one == per_token + attention + 2 * shape.hidden * shape.vocab


def test_ceiling_and_matmul_probe(model_dir: Path) -> None:
    shape = LlamaShape.from_dir(model_dir)
    rates = matmul_gflops(shape, rows=32, repeats=1)
    assert "mkl" in rates and all(r > 0 for r in rates.values())
    # 1e9 FLOPs a request, 10 output tokens, 100 GFLOP/s: 100 requests a second, 1000 tokens.
    assert ceiling_tokens_per_s(1e9, 10, 100.0) == pytest.approx(1000.0)


def test_fma_peak_probe_counts_its_multiply_adds(monkeypatch: pytest.MonkeyPatch) -> None:
    from plimsoll.bench.hostprobe import fma_peak_gflops
    from plimsoll.runtime.kernels import cpu_kernels

    if cpu_kernels.library() is None:
        pytest.skip(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
    assert fma_peak_gflops(iters=200_000, repeats=1) > 0
    assert cpu_kernels.library().plimsoll_fma_peak(0, 2) == 0.0  # no rounds, no FLOPs
    monkeypatch.setattr(cpu_kernels, "library", lambda: None)
    assert fma_peak_gflops() is None  # no kernels: no probe, and the report leaves the line out
