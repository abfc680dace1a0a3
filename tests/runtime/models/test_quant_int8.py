"""INT8 weight-only quantisation: matmul error bound, fallback, memory against `plimsoll plan`, and
greedy agreement with float32 on the embedded SmolLM2."""

import logging
from typing import Any

import pytest
import torch

from plimsoll.runtime.kernels import cpu_kernels
from plimsoll.runtime.models import quant


@pytest.mark.parametrize(("group", "asymmetric"), [(0, False), (32, False), (32, True), (64, True)])
def test_int8_matmul_is_within_the_rounding_bound_of_fp32(group: int, asymmetric: bool) -> None:
    torch.manual_seed(0)
    w = torch.randn(384, 576) * torch.rand(384, 1) * torch.rand(1, 576) * 4  # rows and columns of different ranges
    w[:, 64:96] = 0.25  # a constant group, and one far off zero (asymmetric stores it exactly)
    w[:, 96:128] += 3.0
    bias = torch.randn(384)
    q, s, z = quant.quantize_rows(w, group, asymmetric=asymmetric, grid=False)
    g = quant.group_size_for(576, group)
    assert s.shape == (384, 576 // g)
    assert (z is not None) == asymmetric
    # Each weight is off by at most half a step of its group (s / 2: symmetric s = max|w| / 127,
    # asymmetric s = (max - min) / 255); so per output, |error| <= sum over groups of
    # sum|x in group| * s_group / 2.
    step = s.repeat_interleave(g, dim=1)  # [N, K]: each weight's step
    assert float(((quant.dequantize(q, s, z, torch.float32) - w).abs() / step).max()) <= 0.5 + 1e-4
    layer = quant.Int8Linear(q, s, z, bias)
    for rows in (1, 3, 4, 7, 16, 64, 100):  # kernel sizes and the dequantising (prefill) path
        x = torch.randn(rows, 576)
        exact = x.double() @ w.double().T + bias.double()
        bound = x.abs().double() @ (step.double() / 2).T + 1e-4
        err = (layer(x).double() - exact).abs()
        assert bool((err <= bound).all()), f"rows={rows}: max error / bound {float((err / bound).max()):.3f}"
        # And the kernel equals the dequantised float32 matmul up to float32 summation.
        ref = x @ quant.dequantize(q, s, z, torch.float32).T + bias
        assert torch.allclose(layer(x), ref, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("isa", ["avx512", "avx2", "plain"])
def test_int8_kernel_paths_match_the_dequantised_matmul(isa: str) -> None:
    # The kernel has AVX-512, AVX2 and plain C++ paths, one in each installed build: each on odd
    # shapes (an odd number of W rows, rows of x past a block of 8).
    from kernel_builds import RUNNABLE

    if isa not in RUNNABLE:
        pytest.skip(f"the {isa} build is not installed or this CPU cannot run it")
    try:
        assert cpu_kernels.select(isa).library is not None
        torch.manual_seed(4)
        for n, k, group, asymmetric in ((300, 576, 32, True), (129, 1536, 0, False), (50, 96, 32, False)):
            q, s, z = quant.quantize_rows(torch.randn(n, k), group, asymmetric=asymmetric, grid=False)
            for m in (1, 3, 4, 9, 21):
                x, bias = torch.randn(m, k), torch.randn(n)
                out = cpu_kernels.int8_linear(x, q, s, bias, z)
                want = x @ quant.dequantize(q, s, z, torch.float32).T + bias
                torch.testing.assert_close(out, want, atol=2e-4, rtol=1e-5)
    finally:
        cpu_kernels.select()


def _dequantised_gguf_like(rows: int, k: int) -> torch.Tensor:
    """Weights as a dequantised GGUF holds them: Q4_1 blocks of 32 (``m + d·q``, ``q`` in 0..15,
    fp16 ``d`` and ``m``) in the first half of each row, Q8_0 blocks (``d·q``, ``q`` in -127..127)
    in the second."""
    blocks = k // 32
    half = blocks // 2
    d = (torch.rand(rows, blocks, 1) * 0.02 + 1e-3).half().float()
    m = (-torch.rand(rows, blocks, 1) * 0.2).half().float()
    q4 = torch.randint(0, 16, (rows, half, 32)).float()
    q8 = (torch.randn(rows, blocks - half, 32) * 40).round().clamp(-127, 127)
    q8[:, :, 0] = 127  # the block's largest magnitude sets d
    w = torch.cat([d[:, :half] * q4 + m[:, :half], d[:, half:] * q8], dim=1)
    return w.reshape(rows, k)


def test_int8_recovers_the_grid_of_a_dequantised_checkpoint_exactly() -> None:
    torch.manual_seed(3)
    w = _dequantised_gguf_like(256, 576)
    q, s, z = quant.quantize_rows(w, 32)
    assert z is not None
    back = quant.dequantize(q, s, z, torch.float32)
    err = float(((back - w).abs() / s.repeat_interleave(32, dim=1)).max())
    print(f"grid recovery: max error {err:.2e} of a step; min/max over 255 levels:", end=" ")
    q0, s0, z0 = quant.quantize_rows(w, 32, grid=False)
    plain = float(((quant.dequantize(q0, s0, z0, torch.float32) - w).abs() / s0.repeat_interleave(32, dim=1)).max())
    print(f"{plain:.2f} of its step")
    assert err <= 1e-4  # float32 rounding of s·q + z, not int8 rounding
    assert plain > 0.05  # the plain path does round (so the check above can fail)
    # Cast with a bf16 model (as on CUDA), the scales stay float32 and the weight comes out as the
    # bf16 model's own: the dequantising (GPU) path then computes what the bf16 model does.
    layer = quant.Int8Linear(q, s, z, None).to(torch.bfloat16)
    assert layer.scales.dtype == torch.float32 and layer.offsets is not None and layer.offsets.dtype == torch.float32
    assert torch.equal(layer.dequantized(torch.bfloat16), w.to(torch.bfloat16))
    # Values off any grid are not taken for one: they get min/max's bound.
    noisy = w + torch.randn_like(w) * 1e-3  # 5-100 % of a step
    qn, sn, zn = quant.quantize_rows(noisy, 32)
    assert torch.equal(sn, quant.quantize_rows(noisy, 32, grid=False)[1])
    step = sn.repeat_interleave(32, dim=1)
    assert float(((quant.dequantize(qn, sn, zn, torch.float32) - noisy).abs() / step).max()) <= 0.5 + 1e-4


def test_group_scales_fit_weights_with_uneven_blocks_better_than_row_scales() -> None:
    # Weights like the embedded model's (dequantised Q4_1: 32-wide blocks of very different ranges).
    torch.manual_seed(2)
    w = torch.randn(256, 576) * torch.rand(256, 576 // 32).repeat_interleave(32, dim=1) ** 3
    row = (quant.dequantize(*quant.quantize_rows(w, 0, asymmetric=False), torch.float32) - w).pow(2).mean()
    grouped = (quant.dequantize(*quant.quantize_rows(w, 32, grid=False), torch.float32) - w).pow(2).mean()
    print(f"mean squared error: per row {float(row):.3e}, asymmetric group 32 {float(grouped):.3e}")
    assert grouped < row / 2
    with pytest.raises(ValueError, match="divide"):
        cpu_kernels.int8_linear(torch.randn(1, 576), quant.quantize_rows(w, 64)[0], torch.ones(256, 7), None)


def test_int8_falls_back_to_dequantise_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(1)
    w = torch.randn(64, 32)
    layer = quant.Int8Linear(*quant.quantize_rows(w), None)
    x = torch.randn(2, 32)
    fast = layer(x)
    monkeypatch.setattr(cpu_kernels, "supports_int8_linear", lambda *_: False)
    monkeypatch.setattr(quant, "_warned", False)
    with caplog.at_level(logging.WARNING, logger=quant.__name__):
        slow = [layer(x) for _ in range(3)]
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "dequantise" in caplog.records[0].message
    for out in slow:
        assert torch.allclose(out, fast, atol=1e-5)


def test_int8_weight_memory_matches_plan(tiny_model_dir: Any) -> None:
    from plimsoll.plan import make_plan, read_model_config
    from plimsoll.runtime import LLM

    for arch in ("llama", "qwen2"):  # untied and tied embeddings
        directory = tiny_model_dir(arch)
        llm = LLM(model=str(directory), quantization="int8", kv_cache_memory="1MiB")
        net = llm.engine.runner.model
        engine_bytes = quant.weight_bytes(net)
        planned = {
            s.name: s.value
            for s in make_plan(
                read_model_config(directory), gpu_memory=2**30, dtype="int8", context_length=512
            )
        }
        print(f"{arch}: engine {engine_bytes} B, plan {planned['weight bytes']} B")
        assert engine_bytes == planned["weight bytes"]
        assert all(p.dtype != torch.float32 or p.dim() < 2 for p in net.parameters())


PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time, a robot", "List three colours: red,",
    "The best way to learn a language is", "import numpy as np\n", "Water boils at", "My favourite book is",
    "The sun rises in the", "To make a cup of tea, first", "SELECT * FROM users WHERE", "The history of Rome began",
    "Photosynthesis is the process", "In 1969, astronauts", "The quick brown fox", "Dear Sir or Madam,",
    "A healthy breakfast includes", "The main causes of climate change are", "for i in range(10):",
    "Machine learning is", "The largest planet in the solar system", "How do airplanes fly?", "Cats are animals that",
    "The theory of relativity", "Here is a recipe for bread:", "The stock market", "Shakespeare wrote",
    "<html>\n<head>", "The human heart has", "In a small village there lived", "Electric cars are", "The moon is",
]  # fmt: skip


@pytest.mark.slow
def test_int8_greedy_agrees_with_fp32_on_smollm2() -> None:
    from plimsoll.runtime import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = {}
    for q in (None, "int8"):
        llm = LLM(model="smollm2-135m", quantization=q, max_num_seqs=32, max_model_len=128)
        prompts = [llm.tokenizer(t).input_ids for t in PROMPTS]
        outs[q] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    same = sum(a == b for a, b in zip(outs[None], outs["int8"], strict=True))
    tokens = sum(
        x == y for a, b in zip(outs[None], outs["int8"], strict=True) for x, y in zip(a, b, strict=True)
    )
    print(
        f"int8 vs fp32: {same}/{len(PROMPTS)} prompts identical over 32 tokens, {tokens}/{32 * len(PROMPTS)} tokens"
    )
    assert same >= 0.9 * len(PROMPTS)
