"""FP8 weights (models/quant_fp8.py): the arithmetic, the matmul, FP8 checkpoints, the refusals.

e4m3 keeps 3 mantissa bits: a normal value is off by at most 2⁻⁴ of itself after rounding, a
subnormal one (below 2⁻⁶ of the scale) by at most half the subnormal step, ``s · 2⁻¹⁰``. The
per-channel scale maps each row's largest magnitude to 448 exactly. The matmul is checked
against the same arithmetic done in float64 on the dequantised operands. On CPU torch's own
``_scaled_mm`` runs it (the slow correct path the engine allows there).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from plimsoll.runtime.models import quant_fp8


def bound(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Largest rounding error of each element: 2⁻⁴ of its value, or half a subnormal step."""
    return torch.maximum(w.abs() * 2**-4, scale[:, None] * 2**-10) * (1 + 1e-6)


def test_per_channel_scales_and_the_rounding_bound() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn((48, 64), generator=gen) * torch.rand((48, 1), generator=gen) * 3
    w[5] = 0.0  # an all-zero row keeps a tiny positive scale
    w[7, 3] = 1e-6  # far below the row's subnormal range
    q, s = quant_fp8.quantize_weight(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (48,) and s.dtype == torch.float32
    nonzero = w.abs().amax(dim=1) > 0
    assert torch.equal(s[nonzero], w.abs().amax(dim=1)[nonzero] / 448) and float(s[5]) > 0
    assert torch.equal(q.float().abs().amax(dim=1)[nonzero], torch.full((int(nonzero.sum()),), 448.0))
    back = quant_fp8.dequantize_weight(q, s, torch.float32)
    assert bool(((back - w).abs() <= bound(w, s)).all())
    assert bool((back[5] == 0).all())
    # The bound is tight: some element uses most of it.
    assert float(((back - w).abs() / bound(w, s)).max()) > 0.5


def test_activations_get_one_scale_per_token() -> None:
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [300.0, 1.0, -896.0]])
    xq, scale = quant_fp8.quantize_activations(x)
    assert scale.shape == (3, 1)
    assert torch.allclose(scale[:, 0], torch.tensor([2 / 448, quant_fp8.MIN_SCALE, 896 / 448]))
    assert float(xq.float()[2].abs().max()) == 448.0 and bool((xq.float()[1] == 0).all())


@pytest.mark.parametrize("rowwise", [True, False])
def test_fp8_matmul_is_the_dequantised_product(rowwise: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn((32, 48), generator=gen) * 0.05
    x = torch.randn((5, 48), generator=gen)
    bias = torch.randn(32, generator=gen)
    q, s = quant_fp8.quantize_weight(w)
    if not rowwise:  # a device whose _scaled_mm takes one scale per tensor
        monkeypatch.setitem(quant_fp8.ROWWISE, "cpu", False)
    got = quant_fp8.fp8_linear(x, q, s, bias)
    if rowwise:
        xq, xs = quant_fp8.quantize_activations(x)
    else:
        xs = (x.abs().amax() / 448).reshape(1, 1)
        xq = (x / xs).to(torch.float8_e4m3fn)
    exact = (xq.double() * xs.double()) @ (q.double() * s.double()[:, None]).T + bias.double()
    assert got.dtype == torch.float32 and got.shape == (5, 32)
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)
    # ... and within FP8's error of the float matmul (about 2⁻⁴ of each operand, relative).
    rel = float((got - (x @ w.T + bias)).norm() / (x @ w.T).norm())
    assert rel < 0.08, rel


def fp8_checkpoint(src: Path, dst: Path, kind: str) -> Path:
    """The float checkpoint ``src`` written as an FP8 one: ``fp8`` (one scale per tensor) or
    ``compressed-tensors`` (one per channel), with a static input_scale the loader must drop."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    state = load_file(str(src / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        proj = name.endswith("_proj.weight") and ".layers." in name
        if not proj:
            out[name] = t
            continue
        module = name[: -len(".weight")]
        if kind == "fp8":
            scale = t.abs().amax() / 448
            out[name] = (t / scale).to(torch.float8_e4m3fn)
            out[f"{module}.weight_scale"] = scale.reshape(())
        else:
            q, s = quant_fp8.quantize_weight(t)
            out[name], out[f"{module}.weight_scale"] = q, s[:, None]
        out[f"{module}.input_scale"] = torch.tensor(0.01)
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    if kind == "fp8":
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
    else:
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
                    "input_activations": {
                        "num_bits": 8,
                        "type": "float",
                        "strategy": "token",
                        "dynamic": True,
                    },
                }
            },
            "ignore": ["lm_head"],
        }
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_fp8_checkpoints_load_as_stored(tiny_model_dir: Any, tmp_path: Path) -> None:
    from plimsoll.runtime import LLM, SamplingParams

    src = tiny_model_dir("llama")
    common: dict[str, Any] = dict(kv_cache_memory="1MiB", max_model_len=64)
    prompts = [[5, 9, 13, 2, 7, 7, 1], [30, 31, 32]]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    quantised_at_load = LLM(model=str(src), quantization="fp8", **common)
    channel = LLM(model=str(fp8_checkpoint(src, tmp_path / "ct", "compressed-tensors")), **common)
    assert channel.config.quantization is None  # detected from config.json, not asked for
    a = quantised_at_load.engine.runner.model.model.layers[1].self_attn.qkv_proj
    b = channel.engine.runner.model.model.layers[1].self_attn.qkv_proj
    assert isinstance(b, quant_fp8.Fp8Linear) and b.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(a.weight.view(torch.uint8), b.weight.view(torch.uint8)) and torch.equal(
        a.weight_scale, b.weight_scale
    )
    # The same bytes serve the same tokens.
    assert [o.outputs[0].token_ids for o in channel.generate(prompts, params)] == [
        o.outputs[0].token_ids for o in quantised_at_load.generate(prompts, params)
    ]
    # Per-tensor scales: q, k and v keep theirs, one per row of the fused projection.
    tensor = LLM(model=str(fp8_checkpoint(src, tmp_path / "pt", "fp8")), **common)
    qkv = tensor.engine.runner.model.model.layers[0].self_attn.qkv_proj
    attn = tensor.engine.runner.model.model.layers[0].self_attn
    parts = qkv.weight_scale.split([attn.q_size, attn.kv_size, attn.kv_size])
    assert all(bool((p == p[0]).all()) for p in parts) and len({float(p[0]) for p in parts}) == 3
    assert tensor.engine.runner.model.lm_head.weight.dtype == torch.float32  # the head stays float
    with pytest.raises(ValueError, match="already FP8"):
        LLM(model=str(tmp_path / "pt"), quantization="int8", **common)


def test_unsupported_fp8_checkpoints_and_devices_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    blocks = SimpleNamespace(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(ValueError, match="blocks"):
        quant_fp8.checkpoint_format(blocks)
    with pytest.raises(ValueError, match="gptq"):
        quant_fp8.checkpoint_format(SimpleNamespace(quantization_config={"quant_method": "gptq", "bits": 4}))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _i: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _i: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"8\.9\+.*A100.*sm_80"):
        quant_fp8.check_device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _i: (9, 0))
    monkeypatch.setattr(quant_fp8, "rowwise_supported", lambda *_: True)
    monkeypatch.setattr(quant_fp8, "ROWWISE", {})
    quant_fp8.check_device("cuda:0")  # Hopper: accepted, and its scales found out once
    assert quant_fp8.ROWWISE == {"cuda": True}


def test_projections_fp8_cannot_multiply_are_refused() -> None:
    from torch import nn

    net = nn.Module()
    net.bad = quant_fp8.Fp8Linear.from_linear(nn.Linear(24, 32))
    with pytest.raises(ValueError, match="divisible by 16"):
        quant_fp8.check_shapes(net)


@pytest.mark.gpu
def test_fp8_matmul_on_an_fp8_gpu() -> None:
    index = torch.cuda.current_device()
    if torch.cuda.get_device_capability(index) < quant_fp8.MIN_CAPABILITY:
        pytest.skip(f"{torch.cuda.get_device_name(index)} has no FP8 tensor cores")
    quant_fp8.check_device("cuda")
    gen = torch.Generator().manual_seed(2)
    w = (torch.randn((2048, 1024), generator=gen) * 0.02).cuda()
    q, s = quant_fp8.quantize_weight(w)
    for rows in (1, 7, 64, 300):
        x = torch.randn((rows, 1024), generator=gen).cuda().to(torch.bfloat16)
        got = quant_fp8.fp8_linear(x, q, s, None)
        xq, xs = quant_fp8.quantize_activations(x)
        exact = (xq.double() * xs.double()) @ (q.double() * s.double()[:, None]).T
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), exact, rtol=2e-2, atol=1e-3)  # bf16 output rounding
