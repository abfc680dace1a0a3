"""One prepared GPU check for plimsoll's runtime: a few minutes on one GPU (sized for an H200).

What it measures, each section independent (a missing piece is skipped with a line
saying why, a failure is printed and the next section still runs):

1. kernels   Triton attention vs the torch backend on the GPU, fp32, bf16 and an int8 KV
             cache (--kv-cache-dtype int8, against the same int8 cache and the fp32 one), max abs
             error on realistic shapes (32 sequences, 32 heads / 8 KV heads, head_dim 128,
             block 16, contexts up to 2k, shuffled block tables, prefix hits, decode and
             mixed batches), and the time and KV bandwidth of paged decode; the
             ``--quantization int8`` Triton matmul against float64 and timed against bf16
             ``F.linear`` on a 1B Llama's shapes.
2. parity    greedy tokens of the engine (fp32, on the GPU) equal transformers ``generate()``
             for random-initialised tiny Llama and Qwen3: Triton with decode steps replaying
             CUDA graphs (the default), Triton eager (``enforce_eager``), torch backend.
3. decode    Workload A (prompts of 160 tokens, 64 output tokens, ignore_eos) through the
             offline API at concurrency 1 and 64, bf16, Triton backend: decode tokens/s
             and the HBM bandwidth decode achieves ((weights + KV in use) bytes per
             step ÷ step time) against the GPU's peak; for SmolLM2-135M (the embedded
             model if its converted weights are cached here, else a random-initialised
             model of the same shape: decode speed depends on shapes, not on weights)
             and a random-initialised 1B-class Llama; also TTFT p50/p95 and TPOT p50.
             Each with CUDA graphs and again eagerly; then the SmolLM2 run on the torch
             attention backend, and the 1B model with ``--quantization int8``.

4. roofline  scripts/gpu_roofline.py (read its docstring): decode and prefill against the card's
             HBM and tensor-core peaks on SmolLM2-, 1B- and 8B-shaped models in bf16 and FP8,
             compile and start-up seconds with a cold and a warm compile cache, HTTP at c=64,
             speculation and LoRA at c=1, int8 KV and int8 weights against bf16. Not in the
             default list; run it with ``--sections roofline``.

What it is not: a test suite (it prints figures; it exits 1 when a section fails or a
check that must hold does not: greedy parity with transformers, store_kv bit-exact) and
not a serving benchmark (the offline API, no HTTP; closed loop = all requests submitted
at once; the server check is ``scripts/gpu_server_check.py``).

Usage: ``python scripts/gpu_check.py [--budget-s 420] [--smoke]``, or
``bash scripts/gpu_check.sh`` which also prints versions and makes ``plimsoll``
importable without installing it. Figures go to stdout as a table and, when ``$OUT``
is set, to ``$OUT/gpu_check.json``. ``--smoke`` runs tiny shapes on the CPU (Triton
interpreter) to check the script itself.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from plimsoll.runtime.testing import llama_shape

# Peak HBM bandwidth by device name (vendor data sheets), bytes/s.
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100 SXM": 3.35e12, "H100": 3.35e12, "A100": 2.0e12, "L40S": 0.864e12}

# Real models' shapes: vocab, hidden, intermediate, layers, heads, KV heads, context (config.json);
# the first is SmolLM2-135M-Instruct's.
SMOLLM2_SHAPE = llama_shape(49152, 576, 1536, 30, 9, 3, 8192, rope_theta=1e5, tied=True)
LLAMA_1B_SHAPE = llama_shape(32000, 2048, 8192, 16, 32, 8, 4096, rope_theta=5e5)

RESULTS: dict[str, Any] = {"sections": {}, "mismatches": []}
T0 = time.monotonic()


def mismatch(what: str) -> None:
    """A check that must hold did not: printed now, listed at the end, and the exit status is 1."""
    RESULTS["mismatches"].append(what)
    say(f"MISMATCH {what}")


def say(line: str = "") -> None:
    print(line, flush=True)


def section(name: str, budget_s: float, min_s: float, fn: Callable[[], dict[str, Any]]) -> None:
    """Run one section; record its figures, or why it was skipped or failed."""
    say(f"\n=== {name} ===")
    RESULTS["sections"][name] = run_timed(name, budget_s - (time.monotonic() - T0), min_s, fn)


Measure = Callable[[], dict[str, Any]]  # a section or part: its figures


def run_timed(
    name: str, left_s: float, need_s: float, fn: Measure, tell: Callable[[str], None] = say
) -> dict[str, Any]:
    """``fn``'s figures with their status and seconds, or why it was skipped (fewer than ``need_s``
    of the ``left_s`` seconds of budget left, or ``Skip``) or failed; the next part still runs."""
    if left_s < need_s:
        why = f"{left_s:.0f} s of the budget left, needs ~{need_s:.0f} s"
        tell(f"SKIPPED {name}: {why}")
        return {"status": f"skipped: {why}"}
    t = time.monotonic()
    try:
        figures = fn()
        figures.setdefault("status", "ok")
    except Skip as exc:
        figures = {"status": f"skipped: {exc}"}
        tell(f"SKIPPED {name}: {exc}")
    except Exception as exc:  # one broken part must not hide the others' figures
        figures = {"status": f"failed: {type(exc).__name__}: {exc}"}
        tell(f"FAILED {name}: {type(exc).__name__}: {exc}")
        traceback.print_exc()
    figures["seconds"] = round(time.monotonic() - t, 1)
    return figures


class Skip(Exception):
    """A section cannot run here (missing package, no GPU...); the message says what."""


def need(module: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except Exception as exc:
        raise Skip(f"cannot import {module}: {type(exc).__name__}: {exc}") from exc


# --------------------------------------------------------------------------- environment
def environment(smoke: bool) -> dict[str, Any]:
    env: dict[str, Any] = {"python": platform.python_version()}
    for mod in ("torch", "triton", "transformers", "safetensors", "pydantic", "numpy"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception as exc:
            env[mod] = f"missing ({type(exc).__name__})"
    try:
        import torch

        env["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            env["device"] = props.name
            env["sms"] = props.multi_processor_count
            env["memory_gib"] = round(props.total_memory / 2**30, 1)
            env["peak_bandwidth_Bps"] = next((v for k, v in PEAK_BANDWIDTH.items() if k in props.name), None)
    except Exception as exc:
        env["cuda_available"] = f"unknown ({exc})"
    for mod in ("plimsoll.runtime.attention.triton_backend", "plimsoll.runtime.llm"):
        try:
            __import__(mod)
            env[mod] = "importable"
        except Exception as exc:
            env[mod] = f"not importable: {type(exc).__name__}: {exc}"
    env["mode"] = "smoke (CPU, Triton interpreter, tiny shapes)" if smoke else "gpu"
    for k, v in env.items():
        say(f"  {k}: {v}")
    return env


def device(smoke: bool) -> str:
    import torch

    if smoke:
        return "cpu"
    if not torch.cuda.is_available():
        raise Skip("no CUDA device (run with --smoke to exercise the script on a CPU)")
    return "cuda"


# --------------------------------------------------------------------------- 1. kernels
def make_batch(
    context_lens: list[int],
    q_lens: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block: int,
    dtype: Any,
    dev: str,
    seed: int,
) -> tuple[Any, ...]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-c // block) for c in context_lens]
    num_blocks = sum(per_seq) + 16
    k_cache = torch.randn((num_blocks, block, kv_heads, head_dim), generator=gen).to(dev, dtype)
    v_cache = torch.randn((num_blocks, block, kv_heads, head_dim), generator=gen).to(dev, dtype)
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(context_lens), max(per_seq)), -1, dtype=torch.int32)
    for b, n in enumerate(per_seq):
        tables[b, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    query = torch.randn((int(cu[-1]), heads, head_dim), generator=gen).to(dev, dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    return query, k_cache, v_cache, tables.to(dev), cu.to(dev), lens.to(dev), head_dim**-0.5


def cuda_time_ms(fn: Callable[[], Any], iters: int) -> float:
    import torch

    if not torch.cuda.is_available():
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t) * 1000 / iters
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return float(start.elapsed_time(end)) / iters


def kernels(smoke: bool) -> dict[str, Any]:
    torch = need("torch")
    need("triton")
    at = need("plimsoll.runtime.attention.triton_backend")
    ref = need("plimsoll.runtime.attention.reference")
    dev = device(smoke)
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 oracle must really be fp32
    rng = random.Random(0)
    if smoke:
        seqs, heads, kv_heads, head_dim, block, max_ctx, max_q = 3, 4, 2, 32, 4, 40, 12
    else:
        seqs, heads, kv_heads, head_dim, block, max_ctx, max_q = 32, 32, 8, 128, 16, 2048, 512
    ctx = [rng.randint(1, max_ctx) for _ in range(seqs)]
    ctx[0] = max_ctx
    q_mixed = [rng.choice([1, rng.randint(1, min(c, max_q))]) for c in ctx]  # prefix hits and decodes
    q_mixed[1] = min(ctx[1], max_q)
    ctx[1] = q_mixed[1]  # one full prefill (no prefix)
    figures: dict[str, Any] = {
        "shape": f"{seqs} seqs, {heads}/{kv_heads} heads, head_dim {head_dim}, block {block}, ctx <= {max_ctx}"
    }
    rows = []
    for dtype_name in ("float32", "bfloat16"):
        dtype = getattr(torch, dtype_name)
        for kind, q_lens in (("decode", [1] * seqs), ("mixed prefill", q_mixed)):
            args = make_batch(ctx, q_lens, heads, kv_heads, head_dim, block, dtype, dev, seed=len(rows))
            got = at.paged_attention(*args)
            same_dtype = ref.paged_attention(*args)
            f32 = ref.paged_attention(
                *[a.float() if hasattr(a, "is_floating_point") and a.is_floating_point() else a for a in args]
            )
            err_same = (got.float() - same_dtype.float()).abs().max().item()
            err_f32 = (got.float() - f32).abs().max().item()
            finite = bool(torch.isfinite(got).all())
            rows.append((dtype_name, kind, err_same, err_f32, finite))
            say(
                f"  {dtype_name:9s} {kind:14s} max|triton - torch({dtype_name})| = {err_same:.3e}   "
                f"max|triton - torch(fp32)| = {err_f32:.3e}   finite={finite}"
            )
        # store_kv: a copy, must be bit-exact
        n = 4 * seqs
        key = torch.randn((n, kv_heads, head_dim), device=dev).to(dtype)
        val = torch.randn((n, kv_heads, head_dim), device=dev).to(dtype)
        caches = [
            torch.zeros((n // block + 4, block, kv_heads, head_dim), device=dev, dtype=dtype)
            for _ in range(4)
        ]
        slots = torch.randperm(caches[0].shape[0] * block, device=dev)[:n]
        slots[::7] = -1
        ref.store_kv(key, val, caches[0], caches[1], slots)
        at.store_kv(key, val, caches[2], caches[3], slots)
        exact = bool(torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3]))
        say(f"  {dtype_name:9s} store_kv       bit-exact = {exact}")
        if not exact:
            mismatch(f"kernels: Triton store_kv is not bit-exact in {dtype_name}")
        figures[f"store_kv_exact_{dtype_name}"] = exact
    # --kv-cache-dtype int8: the same batches with K/V quantised (attention/kv_int8.py); the
    # Triton kernels against the oracle reading the same int8 cache, and against the fp32 cache.
    kv_int8 = need("plimsoll.runtime.attention.kv_int8")
    for dtype_name in ("float32", "bfloat16"):
        dtype = getattr(torch, dtype_name)
        for kind, q_lens in (("decode", [1] * seqs), ("mixed prefill", q_mixed)):
            args = make_batch(
                ctx, q_lens, heads, kv_heads, head_dim, block, torch.float32, dev, seed=len(rows)
            )
            query, k_cache, v_cache, tables, cu, lens, scale = args
            kq, vq = kv_int8.quantize_cache(k_cache), kv_int8.quantize_cache(v_cache)
            got = at.paged_attention(query.to(dtype), kq, vq, tables, cu, lens, scale)
            same = ref.paged_attention(query.to(dtype), kq, vq, tables, cu, lens, scale)
            f32 = ref.paged_attention(*args)
            err_same = (got.float() - same.float()).abs().max().item()
            err_f32 = (got.float() - f32).abs().max().item()
            finite = bool(torch.isfinite(got).all())
            rows.append((f"{dtype_name}+int8KV", kind, err_same, err_f32, finite))
            say(
                f"  {dtype_name:9s} int8 KV {kind:14s} max|triton - torch(int8 KV)| = {err_same:.3e}   "
                f"max|triton - torch(fp32 KV)| = {err_f32:.3e}   finite={finite}"
            )
    figures["errors"] = [
        dict(dtype=d, batch=k, max_abs_err_vs_torch_same_dtype=e1, max_abs_err_vs_torch_fp32=e2, finite=f)
        for d, k, e1, e2, f in rows
    ]

    # Decode timing, bf16, every sequence at the full context.
    from plimsoll.runtime.attention.backends import batched_decode_attention

    timing = []
    for batch in [1, 8, 64] if not smoke else [2]:
        args = make_batch(
            [max_ctx] * batch, [1] * batch, heads, kv_heads, head_dim, block, torch.bfloat16, dev, 7
        )
        query, k_cache, v_cache, tables, _cu, lens, scale = args
        iters = 3 if smoke else 50
        t_triton = cuda_time_ms(functools.partial(at.paged_attention, *args), iters)
        torch_decode = functools.partial(
            batched_decode_attention, query, k_cache, v_cache, tables, lens, scale
        )
        t_torch = cuda_time_ms(torch_decode, max(1, iters // 5))
        kv_bytes = batch * max_ctx * kv_heads * head_dim * 2 * 2  # K and V, 2 bytes each
        row = dict(
            batch=batch,
            context=max_ctx,
            triton_ms=round(t_triton, 4),
            torch_ms=round(t_torch, 4),
            triton_kv_GBps=round(kv_bytes / t_triton / 1e6, 1),
            torch_kv_GBps=round(kv_bytes / t_torch / 1e6, 1),
            kv_splits=at._num_kv_splits(batch, kv_heads, tables.shape[1] * block, query.device),
        )
        timing.append(row)
        say(
            f"  decode bf16 batch {batch:3d} ctx {max_ctx}: triton {t_triton:.3f} ms ({row['triton_kv_GBps']} GB/s of KV, "
            f"{row['kv_splits']} splits), torch {t_torch:.3f} ms ({row['torch_kv_GBps']} GB/s)"
        )
    for batch in [8, 64] if not smoke else [2]:  # decode over an int8 cache: half the KV bytes of bf16
        args = make_batch(
            [max_ctx] * batch, [1] * batch, heads, kv_heads, head_dim, block, torch.float32, dev, 7
        )
        query, k_cache, v_cache, tables, cu, lens, scale = args
        kq, vq = kv_int8.quantize_cache(k_cache), kv_int8.quantize_cache(v_cache)
        t_int8 = cuda_time_ms(
            functools.partial(at.paged_attention, query.to(torch.bfloat16), kq, vq, tables, cu, lens, scale),
            3 if smoke else 50,
        )
        kv_bytes = batch * max_ctx * kv_heads * (head_dim + 4) * 2
        timing.append(dict(batch=batch, context=max_ctx, kv="int8", triton_ms=round(t_int8, 4),
                           triton_kv_GBps=round(kv_bytes / t_int8 / 1e6, 1)))  # fmt: skip
        say(f"  decode bf16 int8-KV batch {batch:3d} ctx {max_ctx}: triton {t_int8:.3f} ms "
            f"({timing[-1]['triton_kv_GBps']} GB/s of KV)")  # fmt: skip
    figures["decode_timing"] = timing
    figures["int8_matmul"] = int8_matmul_check(torch, dev, smoke)
    return figures


def int8_matmul_check(torch: Any, dev: str, smoke: bool) -> list[dict[str, Any]]:
    """--quantization int8's Triton matmul (models/quant_triton.py) against float64 and, timed,
    against bf16 ``F.linear`` on the same shapes (a 1B Llama's gate_up and down projections)."""
    from plimsoll.runtime.models import quant_triton
    from plimsoll.runtime.models.quant import dequantize, quantize_rows

    rows = []
    shapes = [(16384, 2048), (2048, 8192)] if not smoke else [(96, 64)]
    for n, k in shapes:
        gen = torch.Generator().manual_seed(n + k)
        w = torch.randn((n, k), generator=gen) * 0.02
        q, s, z = quantize_rows(w)
        q, s, z = q.to(dev), s.to(dev), z.to(dev)
        w_bf16 = dequantize(q, s, z, torch.bfloat16)
        for m in (1, 16, 64) if not smoke else (3,):
            x = torch.randn((m, k), generator=gen).to(dev, torch.bfloat16)
            got = quant_triton.int8_linear(x, q, s, z)
            ref = x.double() @ dequantize(q, s, z, torch.float64).T
            err = float((got.double() - ref).norm() / ref.norm())
            iters = 3 if smoke else 200
            t_int8 = cuda_time_ms(functools.partial(quant_triton.int8_linear, x, q, s, z), iters)
            t_bf16 = cuda_time_ms(functools.partial(torch.nn.functional.linear, x, w_bf16), iters)
            weight_bytes = q.numel() + 4 * (s.numel() + z.numel())  # int8 values, float32 scales and offsets
            row = dict(
                shape=f"{m}x{k} @ {n}x{k}", rel_err_vs_fp64=round(err, 6), int8_ms=round(t_int8, 4),
                bf16_ms=round(t_bf16, 4), int8_GBps=round(weight_bytes / t_int8 / 1e6, 1),
                bf16_GBps=round(2 * n * k / t_bf16 / 1e6, 1),
            )  # fmt: skip
            rows.append(row)
            say(
                f"  int8 matmul {row['shape']:22s} rel err {err:.1e}: int8 {t_int8:.4f} ms "
                f"({row['int8_GBps']} GB/s of weight), bf16 F.linear {t_bf16:.4f} ms ({row['bf16_GBps']} GB/s)"
            )
    return rows


# --------------------------------------------------------------------------- model helpers
def write_random_model(
    directory: Path, shape: dict[str, Any], dtype_name: str, dev: str, seed: int = 0
) -> Path:
    """A random-initialised Llama directory (safetensors + config + byte tokenizer)."""
    torch = need("torch")
    transformers = need("transformers")
    testing = need("plimsoll.runtime.testing")
    if (directory / "config.json").exists():
        return directory
    cfg = transformers.LlamaConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0, **shape)
    torch.manual_seed(seed)
    with torch.device(dev):  # initialise on the GPU: a 1B model initialises in seconds there
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype_name))
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    testing.byte_level_tokenizer().save_pretrained(directory)
    del model
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the engine loads its own copy next
    return directory


def smollm2_dir(work: Path, dev: str) -> tuple[Path, str]:
    """The cached embedded SmolLM2 if present (never downloads: the GPU machine is offline)."""
    explicit = os.environ.get("PLIMSOLL_SMOLLM2_DIR")
    if explicit and (Path(explicit) / "config.json").exists():
        return Path(explicit), f"SmolLM2-135M-Instruct ({explicit})"
    try:
        from plimsoll.runtime.models.embedded import EMBEDDED_MODELS, cache_dir

        cached = cache_dir() / EMBEDDED_MODELS["smollm2-135m"]["dirname"]
        if (cached / "model.safetensors").exists():
            return cached, "SmolLM2-135M-Instruct (embedded, cached)"
    except Exception:
        pass
    return (
        write_random_model(work / "smollm2-shape", SMOLLM2_SHAPE, "bfloat16", dev),
        "SmolLM2-135M shape, random weights (embedded weights not cached here)",
    )


# --------------------------------------------------------------------------- 2. parity
def parity(smoke: bool, work: Path) -> dict[str, Any]:
    torch = need("torch")
    need("transformers")
    runtime = need("plimsoll.runtime")
    testing = need("plimsoll.runtime.testing")
    dev = device(smoke)
    torch.backends.cuda.matmul.allow_tf32 = False
    new_tokens = 8 if smoke else 32
    count = 4 if smoke else 16
    figures: dict[str, Any] = {}
    from transformers import AutoModelForCausalLM

    for arch in ("llama",) if smoke else ("llama", "qwen3"):
        directory = testing.write_tiny_model(work / f"tiny-{arch}", arch)
        rng = random.Random(1)
        shared = [rng.randrange(3, 259) for _ in range(40)]
        prompts = []
        for i in range(count):
            body = [rng.randrange(3, 259) for _ in range(rng.choice([1, 5, 17, 33, 64, 100, 150]))]
            prompts.append(shared + body if i % 2 else body)
        hf = AutoModelForCausalLM.from_pretrained(
            str(directory), attn_implementation="eager", dtype=torch.float32
        ).to(dev)
        hf.generation_config.eos_token_id = None
        refs = []
        with torch.inference_mode():
            for p in prompts:
                out = hf.generate(
                    torch.tensor([p], device=dev), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
                )
                refs.append(out[0, len(p) :].tolist())
        del hf
        # Triton with its decode steps replaying CUDA graphs (the default on CUDA), Triton eagerly
        # (--enforce-eager), and the torch backend.
        for backend, eager in (("triton", False), ("triton", True), ("torch", False)):
            llm = runtime.LLM(
                model=str(directory),
                device=dev,
                dtype="float32",
                attention_backend=backend,
                kv_cache_memory="64MiB",
                max_num_batched_tokens=256,
                enforce_eager=eager,
            )
            replays_before = llm.engine.runner.graph_replays
            outs = llm.generate(
                prompts, runtime.SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
            )
            got = [o.outputs[0].token_ids for o in outs]
            equal = sum(g == r for g, r in zip(got, refs, strict=True))
            first_diff = [
                next((j for j, (a, b) in enumerate(zip(g, r, strict=False)) if a != b), None)
                for g, r in zip(got, refs, strict=True)
            ]
            replays = llm.engine.runner.graph_replays - replays_before
            name = f"{backend}-eager" if eager else backend
            figures[f"{arch}/{name}"] = dict(
                prompts=count,
                equal=equal,
                first_divergence=[d for d in first_diff if d is not None],
                cuda_graph_replays=replays,
            )
            say(
                f"  {arch:6s} {name:12s} on {dev}: {equal}/{count} prompts token-for-token equal "
                f"to transformers ({new_tokens} new tokens, fp32; {replays} decode steps replayed CUDA graphs)"
            )
            if equal != count:
                mismatch(f"parity {arch}/{name}: {count - equal} of {count} prompts differ from transformers")
            del llm
    return figures


# --------------------------------------------------------------------------- 3. decode throughput
class StepLog:
    """EngineObserver that keeps every step's statistics."""

    def __init__(self) -> None:
        self.steps: list[Any] = []

    def on_step(self, stats: Any) -> None:
        self.steps.append(stats)

    def on_request_finished(self, output: Any) -> None:
        pass


def decode(
    smoke: bool,
    work: Path,
    which: str,
    backend: str = "triton",
    enforce_eager: bool = False,
    quantization: str | None = None,
) -> dict[str, Any]:
    torch = need("torch")
    runtime = need("plimsoll.runtime")
    from plimsoll.runtime.engine.model_runner import kv_bytes_per_token

    dev = device(smoke)
    dtype_name = "float32" if smoke else "bfloat16"
    if smoke:
        directory, label = (
            need("plimsoll.runtime.testing").write_tiny_model(work / "tiny-llama", "llama"),
            "tiny llama (smoke)",
        )
    elif which == "smollm2":
        directory, label = smollm2_dir(work, dev)
    else:
        directory, label = (
            write_random_model(work / "llama-1b", LLAMA_1B_SHAPE, dtype_name, dev),
            "Llama 1B-class, random weights",
        )
    say(f"  model: {label}")
    log = StepLog()
    backend = "torch" if smoke else backend
    t = time.monotonic()
    llm = runtime.LLM(
        model=str(directory),
        device=dev,
        dtype=dtype_name,
        attention_backend=backend,
        observer=log,
        kv_cache_memory="256MiB" if smoke else "16GiB",
        max_num_seqs=64,
        max_num_batched_tokens=8192,
        enable_prefix_caching=False,
        enforce_eager=enforce_eager,
        quantization=quantization,
    )
    load_s = time.monotonic() - t
    graphs = llm.engine.runner.decode_graphs
    model = llm.engine.runner.model

    def nbytes(module: Any) -> int:  # parameters and buffers (int8 weights and scales are buffers)
        seen = {t.data_ptr(): t for t in [*module.parameters(), *module.buffers()] if t.numel()}
        return sum(t.numel() * t.element_size() for t in seen.values())

    total_bytes = nbytes(model) - sum(b.numel() * b.element_size() for b in model.model.rotary_emb.buffers())
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    tied = bool(getattr(llm.engine.hf_config, "tie_word_embeddings", False))
    # The input embedding is gathered (a few rows), not streamed, unless it doubles as the LM head.
    embed_bytes = 0 if (embed is None or tied) else nbytes(embed)
    weight_bytes = total_bytes - embed_bytes
    per_token_kv = kv_bytes_per_token(llm.engine.hf_config, llm.config.torch_dtype)
    kv_total = llm.engine.num_blocks * llm.config.block_size * per_token_kv
    vocab = min(int(llm.engine.hf_config.vocab_size), 259)  # ids the byte tokenizer can also decode
    prompt_len, out_len = (20, 8) if smoke else (160, 64)
    rng = random.Random(2)
    params_a = runtime.SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    peak = RESULTS.get("environment", {}).get("peak_bandwidth_Bps")
    figures: dict[str, Any] = dict(
        model=label,
        attention_backend=backend,
        dtype=dtype_name,
        load_s=round(load_s, 1),
        weight_bytes_read_per_step=weight_bytes,
        kv_bytes_per_token=per_token_kv,
        quantization=quantization,
        cuda_graphs=(
            dict(
                sizes=graphs.sizes,
                capture_s=round(graphs.capture_s, 2),
                pool_MiB=round(graphs.pool_bytes / 2**20),
            )
            if graphs is not None
            else "eager"
        ),
    )
    say(f"  load {load_s:.1f} s; CUDA graphs: {figures['cuda_graphs']}")
    # Warm-up: compiles the Triton kernels and fills caches outside the measurement.
    llm.generate([[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(4)], params_a)
    for concurrency, rounds in ((1, 2 if smoke else 4), (64 if not smoke else 4, 1)):
        log.steps.clear()
        replays_before = llm.engine.runner.graph_replays
        prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(concurrency)]
        t = time.monotonic()
        total_out = 0
        ttft, tpot = [], []
        for _ in range(rounds):  # closed loop: each round submits `concurrency` requests at once
            outs = llm.generate(prompts, params_a)
            total_out += sum(len(o.outputs[0].token_ids) for o in outs)
            for o in outs:
                m = o.metrics
                if m.first_token_time is not None and m.finished_time is not None:
                    ttft.append(m.first_token_time - m.arrival_time)
                    n = len(o.outputs[0].token_ids)
                    if n > 1:
                        tpot.append((m.finished_time - m.first_token_time) / (n - 1))
        wall = time.monotonic() - t
        dec = [s for s in log.steps if s.num_prefill_tokens == 0 and s.num_decode_tokens > 0]
        full = [s for s in dec if s.batch_size == concurrency] or dec
        step_s = statistics.median(s.step_time_s for s in full)
        tok_s = statistics.median(s.batch_size / s.step_time_s for s in full)
        kv_bytes = statistics.median(s.kv_cache_usage * kv_total for s in full)
        bw = (weight_bytes + kv_bytes) / step_s
        row = dict(
            concurrency=concurrency,
            decode_tokens_per_s=round(tok_s, 1),
            decode_step_ms=round(step_s * 1000, 3),
            output_tokens_per_s_end_to_end=round(total_out / wall, 1),
            ttft_p50_ms=round(1000 * statistics.median(ttft), 2) if ttft else None,
            ttft_p95_ms=round(1000 * statistics.quantiles(ttft, n=20)[-1], 2) if len(ttft) > 1 else None,
            tpot_p50_ms=round(1000 * statistics.median(tpot), 3) if tpot else None,
            decode_steps=len(full),
            bytes_read_per_step=int(weight_bytes + kv_bytes),
            hbm_GBps=round(bw / 1e9, 1),
            fraction_of_peak=round(bw / peak, 4) if peak else None,
            cuda_graph_replays=llm.engine.runner.graph_replays - replays_before,
        )
        figures[f"c{concurrency}"] = row
        say(
            f"  c={concurrency:3d}: decode {tok_s:9.1f} tok/s (median step {step_s * 1000:.2f} ms, {len(full)} steps), "
            f"end-to-end {total_out / wall:9.1f} tok/s, HBM {bw / 1e9:8.1f} GB/s"
            + (f" = {100 * bw / peak:.1f}% of {peak / 1e12:.1f} TB/s peak" if peak else "")
        )
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return figures


# --------------------------------------------------------------------------- 4. roofline
def roofline(smoke: bool, budget_s: float) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu_roofline

    left = budget_s - (time.monotonic() - T0)
    results = gpu_roofline.run(
        gpu_roofline.parser().parse_args(
            ["--device", "cpu" if smoke else "cuda", "--budget-s", str(max(60.0, left - 30))]
            + (["--compile-mode", "0"] if smoke else ["--compile-mode", "3"])
        )
    )
    return {"parts": {k: v.get("status") if isinstance(v, dict) else v for k, v in results.items()}}


# --------------------------------------------------------------------------- main
def table() -> None:
    say("\n=== figures ===")
    for name, fig in RESULTS["sections"].items():
        say(f"[{name}] status={fig.get('status')} ({fig.get('seconds')} s)")
        for key, value in fig.items():
            if key in ("status", "seconds"):
                continue
            if isinstance(value, list):
                for item in value:
                    say(f"    {key}: {item}")
            else:
                say(f"    {key}: {value}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--budget-s", type=float, default=420.0, help="stop starting sections after this many seconds"
    )
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes on the CPU (Triton interpreter): checks the script"
    )
    parser.add_argument(
        "--sections",
        default="kernels,parity,decode-smollm2,decode-smollm2-eager,decode-llama1b,decode-llama1b-eager,"
        "decode-smollm2-torch,decode-llama1b-int8",
    )
    args = parser.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    say("=== environment ===")
    RESULTS["environment"] = environment(args.smoke)
    wanted = set(args.sections.split(","))
    with tempfile.TemporaryDirectory(prefix="plimsoll-gpu-check-") as tmp:
        work = Path(tmp)
        plan: list[tuple[str, float, Callable[[], dict[str, Any]]]] = [
            ("kernels", 20, lambda: kernels(args.smoke)),
            ("parity", 30, lambda: parity(args.smoke, work)),
            ("decode-smollm2", 40, lambda: decode(args.smoke, work, "smollm2")),
            ("decode-smollm2-eager", 40, lambda: decode(args.smoke, work, "smollm2", enforce_eager=True)),
            ("decode-llama1b", 60, lambda: decode(args.smoke, work, "llama1b")),
            ("decode-llama1b-eager", 60, lambda: decode(args.smoke, work, "llama1b", enforce_eager=True)),
            # the same SmolLM2 run on the torch attention backend, for comparison
            ("decode-smollm2-torch", 40, lambda: decode(args.smoke, work, "smollm2", backend="torch")),
            # --quantization int8 on the GPU (weights dequantised per matmul: memory, not speed)
            ("decode-llama1b-int8", 60, lambda: decode(args.smoke, work, "llama1b", quantization="int8")),
            # not in the default list: --sections roofline (scripts/gpu_roofline.py)
            ("roofline", 120, lambda: roofline(args.smoke, args.budget_s)),
        ]
        gpu_only = ("decode-llama1b", "decode-llama1b-eager", "decode-smollm2-torch", "decode-llama1b-int8")
        for name, min_s, fn in plan:
            if name in wanted and not (args.smoke and name in gpu_only):
                section(name, args.budget_s, min_s, fn)
    table()
    return finish("gpu_check.json")


def finish(json_name: str) -> int:
    """Write the figures to ``$OUT/json_name`` (when ``$OUT`` is set), list the mismatches, and
    return the exit status: 1 when a section failed or a check did not hold."""
    RESULTS["total_seconds"] = round(time.monotonic() - T0, 1)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        path = Path(out) / json_name
        path.write_text(json.dumps(RESULTS, indent=2, default=str))
        say(f"\nwrote {path}")
    failed = [n for n, f in RESULTS["sections"].items() if str(f.get("status", "")).startswith("failed")]
    for what in RESULTS["mismatches"]:
        say(f"MISMATCH {what}")
    if failed or RESULTS["mismatches"]:
        say(f"\nFAILED: {len(failed)} section(s) failed, {len(RESULTS['mismatches'])} mismatch(es)")
        return 1
    say("\nall checks held")
    return 0


if __name__ == "__main__":
    sys.exit(main())
