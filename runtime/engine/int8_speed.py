"""At start on a GPU: are the int8 paths this engine was asked for faster than bf16 here?

What it is: ``check(model, config, device)`` times, with CUDA events and on the model's own
shapes, what ``--quantization int8`` and ``--kv-cache-dtype int8`` replace: the largest int8
projection at a decode step's rows against ``F.linear`` on its dequantised bf16 weight, and
paged decode attention over an int8 cache against a bf16 one (8 sequences at 4,096 tokens).
It logs both ratios, as a warning when int8 is the slower one, so a server whose int8 path
costs time rather than saving it says so in its first lines. Tens of milliseconds, once.

What it is not: a benchmark (``scripts/gpu_roofline.py`` measures these properly), or a
switch: the engine runs what it was asked for either way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)


def _ms(fn: Callable[[], Any], iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call,unused-ignore]  # torch.cuda.Event.__init__ is unannotated (torch 2.15)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / iters


def _say(what: str, int8_ms: float, bf16_ms: float) -> dict[str, float]:
    ratio = int8_ms / bf16_ms
    if ratio > 1.0:
        log.warning(
            "%s is %.2fx slower than bfloat16 on this GPU (%.3f ms vs %.3f ms): it saves memory here, not time",
            what, ratio, int8_ms, bf16_ms,
        )  # fmt: skip
    else:
        log.info("%s: %.3f ms vs bfloat16 %.3f ms (%.2fx)", what, int8_ms, bf16_ms, ratio)
    return {"int8_ms": round(int8_ms, 4), "bf16_ms": round(bf16_ms, 4), "ratio": round(ratio, 3)}


@torch.inference_mode()
def check(
    model: Any, quantization: str | None, kv_cache_dtype: str, attention_backend: str, rows: int
) -> dict[str, Any]:
    """Time the int8 paths in use against bf16; ``rows``: a decode step's (``max_num_seqs``, at most 64)."""
    from plimsoll.runtime.models.quant import Int8Linear

    found: dict[str, Any] = {}
    device = next(model.parameters()).device
    if device.type != "cuda":
        return found
    if quantization == "int8":
        layers = [m for m in model.model.layers.modules() if isinstance(m, Int8Linear)]
        if layers:
            big = max(layers, key=lambda m: m.qweight.numel())
            x = torch.randn((min(rows, 64), big.qweight.shape[1]), device=device, dtype=torch.bfloat16)
            weight = big.dequantized(torch.bfloat16)
            found["int8_weights"] = _say(
                f"--quantization int8 ({tuple(big.qweight.shape)} at {x.shape[0]} rows)",
                _ms(lambda: big(x)),
                _ms(lambda: torch.nn.functional.linear(x, weight)),
            )
            del weight
    if kv_cache_dtype == "int8" and attention_backend == "triton":
        from plimsoll.runtime.attention import kv_int8, triton_backend

        attn = model.model.layers[0].self_attn
        seqs, ctx, block = 8, 4096, 16
        blocks = seqs * ctx // block
        shape = (blocks, block, attn.num_kv_heads, attn.head_dim)
        k = torch.randn(shape, device=device, dtype=torch.bfloat16)
        v = torch.randn(shape, device=device, dtype=torch.bfloat16)
        kq, vq = kv_int8.quantize_cache(k), kv_int8.quantize_cache(v)
        tables = torch.arange(blocks, device=device, dtype=torch.int32).view(seqs, -1)
        cu = torch.arange(seqs + 1, device=device, dtype=torch.int32)
        lens = torch.full((seqs,), ctx, device=device, dtype=torch.int32)
        q = torch.randn((seqs, attn.num_heads, attn.head_dim), device=device, dtype=torch.bfloat16)

        def attend(kc: torch.Tensor, vc: torch.Tensor) -> Callable[[], Any]:
            return lambda: triton_backend.paged_attention(
                q, kc, vc, tables, cu, lens, attn.scale, max_q_len=1
            )

        found["int8_kv"] = _say(
            f"--kv-cache-dtype int8 decode attention ({seqs} x {ctx} tokens)",
            _ms(attend(kq, vq)),
            _ms(attend(k, v)),
        )
    return found
