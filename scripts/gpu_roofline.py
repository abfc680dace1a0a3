"""The GPU roofline bench: how close decode and prefill come to the card's memory and tensor-core peaks.

What it measures (one prepared run, a few minutes on one GPU; each part checks the time budget
and says when it is skipped), on random-weight models of SmolLM2-135M's, a 1B and an 8B Llama's
shapes (weights made on the GPU, never written to disk, except SmolLM2's shape for the server):

- decode at concurrency 1, 8, 64 and 256 (Workload A: 160-token prompts, 64 output tokens):
  median step ms, tokens/s, HBM bytes per step (weights read + KV in use) ÷ step time, and the
  share of the card's HBM peak; prefill (8 prompts of 1,024 tokens): tokens/s and the share of
  the tensor-core peak (2 × parameters × tokens plus attention FLOPs); bf16 and FP8 weights;
- compile, CUDA-graph capture and engine start-up seconds for each model (the in-process ones
  after the first load the cache the first wrote), and `plimsoll serve`'s own start-up with a
  cold and then a warm ``--compilation-cache-dir`` (SmolLM2's shape, two processes);
- the same decode through `plimsoll serve` over HTTP at c=64 against the offline engine;
- FP8 against bf16: greedy agreement on 32 prompts' first 32 tokens (random weights: see the
  printed caveat) and the speed-up;
- n-gram speculation and ``--enable-lora`` (base-only traffic) against plain decode at c=1;
- the int8 KV cache against bf16 at long context (the decode attention kernel alone) and the
  Triton int8 weight-only matmul against bf16 ``F.linear``;
- host syncs inside ``ModelRunner.execute`` of a decode and a mixed step
  (``torch.cuda.set_sync_debug_mode``): the step should have none.

Peaks come from a small table of data-sheet figures by device name; an unknown card prints
"unknown" instead of a share. Output: a text table on stdout and ``roofline.json`` plus
``roofline.txt`` in ``--out-dir`` (printed; default ``$OUT/roofline`` when ``$OUT`` is set).

``--device cpu`` runs every part on tiny shapes (the attention in Triton's interpreter where a
part needs Triton), to check the script itself: its figures say nothing about a GPU.

Usage: ``bash scripts/gpu_check.sh --sections roofline`` (on the GPU machine), or
``python scripts/gpu_roofline.py --device cpu`` here.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check  # the shapes, peaks and kernel helpers live there

from plimsoll.runtime import testing

# Dense (no sparsity) tensor-core peaks, FLOP/s: (bf16, fp8), data sheets.
PEAK_TENSOR_FLOPS = {
    "H200": (989e12, 1979e12),
    "H100 SXM": (989e12, 1979e12),
    "H100 NVL": (835e12, 1671e12),
    "H100 PCIe": (756e12, 1513e12),
    "H100": (989e12, 1979e12),
    "A100": (312e12, None),
    "L40S": (362e12, 733e12),
    "L4": (121e12, 242e12),
}
LLAMA_8B_SHAPE = testing.llama_shape(128256, 4096, 14336, 32, 32, 8, 8192, rope_theta=5e5)  # Llama-3.1-8B
# --device cpu: the test suite's tiny shape (checks the script, nothing else); the token ids are
# the config writers' own.
TINY_SHAPE = {
    **{k: v for k, v in testing.TINY_SHAPE.items() if not k.endswith("_token_id")},
    "max_position_embeddings": 1024,
}
MODELS = {"smollm2": gpu_check.SMOLLM2_SHAPE, "1b": gpu_check.LLAMA_1B_SHAPE, "8b": LLAMA_8B_SHAPE}

RESULTS: dict[str, Any] = {}
LINES: list[str] = []
T0 = time.monotonic()


def say(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


class Budget:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


def part(name: str, budget: Budget, need_s: float, fn: Callable[[], dict[str, Any]]) -> None:
    """Run one part; record its figures, or why it was skipped or failed (the next part still runs)."""
    say(f"\n--- {name} ---")
    RESULTS[name] = gpu_check.run_timed(name, budget.left(), need_s, fn, say)


# --------------------------------------------------------------------------- the card


def card(device: str) -> dict[str, Any]:
    import torch

    if device == "cpu":
        return {"name": "cpu (script check only)", "hbm_Bps": None, "bf16_flops": None, "fp8_flops": None}
    props = torch.cuda.get_device_properties(0)
    name = props.name
    hbm = next((v for k, v in gpu_check.PEAK_BANDWIDTH.items() if k in name), None)
    flops = next((v for k, v in PEAK_TENSOR_FLOPS.items() if k in name), (None, None))
    info = {
        "name": name,
        "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
        "memory_gib": round(props.total_memory / 2**30, 1),
        "hbm_Bps": hbm,
        "bf16_flops": flops[0],
        "fp8_flops": flops[1],
    }
    if hbm is None or flops[0] is None:
        say(
            f"  {name}: not in the peak tables (scripts/gpu_check.py PEAK_BANDWIDTH, PEAK_TENSOR_FLOPS): shares unknown"
        )
    return info


def share(value: float, peak: float | None) -> str:
    return f"{100 * value / peak:.1f}%" if peak else "unknown"


# --------------------------------------------------------------------------- models


def model_dir(work: Path, name: str, shape: dict[str, Any]) -> Path:
    """A config and byte tokenizer only: ``random_weights`` makes the weights in memory."""
    from transformers import LlamaConfig

    from plimsoll.runtime.testing import byte_level_tokenizer

    directory = work / f"{name}-random"
    if not (directory / "config.json").exists():
        directory.mkdir(parents=True, exist_ok=True)
        LlamaConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0, **shape).save_pretrained(directory)
        byte_level_tokenizer().save_pretrained(directory)
        (directory / "random-weights").write_text("weights are made at load, normal(0, 0.02), seeded\n")
    return directory


@contextmanager
def random_weights(seed: int = 0) -> Iterator[None]:
    """Engines built inside load a directory marked ``random-weights`` as seeded random weights made
    on the device (the same numbers for every dtype and quantisation, so FP8 and bf16 engines
    share their float weights); any other model loads as usual."""
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from plimsoll.runtime.engine import llm_engine
    from plimsoll.runtime.models.llama import LlamaForCausalLM, RotaryEmbedding
    from plimsoll.runtime.models.loader import LoadedModel
    from plimsoll.runtime.models.quant import quantize_model

    real = llm_engine.load_model

    def load(
        model: str, dtype: Any, device: Any = "cpu", quantization: Any = None, tensor_parallel: Any = None
    ) -> Any:
        directory = Path(model)
        if tensor_parallel is not None or not (directory / "random-weights").exists():
            return real(model, dtype, device, quantization, tensor_parallel)
        cfg = AutoConfig.from_pretrained(str(directory))
        with torch.device("meta"):
            net = LlamaForCausalLM(cfg)
        net = net.to(dtype=dtype).to_empty(device=device)  # cast on meta: no float32 copy on the device
        gen = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for _, p in sorted(net.named_parameters()):
                if p.dim() == 1:
                    p.fill_(1.0)  # RMSNorm weights
                else:
                    p.normal_(0.0, 0.02, generator=gen)
        net.model.rotary_emb = RotaryEmbedding(cfg).to(device)
        if quantization is not None:
            if quantization == "fp8":
                from plimsoll.runtime.models.quant_fp8 import check_device

                check_device(device)
            quantize_model(net, quantization, dtype)
            net = net.to(device=device, dtype=dtype)
        net.model.rotary_emb.inv_freq = net.model.rotary_emb.inv_freq.float()
        tok = AutoTokenizer.from_pretrained(str(directory))
        return LoadedModel(net.eval(), cfg, tok, frozenset({2}), directory, int(cfg.max_position_embeddings))

    llm_engine.load_model = load  # type: ignore[assignment]
    try:
        yield
    finally:
        llm_engine.load_model = real  # type: ignore[assignment]


def weight_bytes_per_step(model: Any) -> int:
    """Bytes a decode step reads: every weight but the input embedding's (a few rows are gathered),
    which is read whole when it is also the LM head (tied)."""
    seen: dict[int, int] = {}
    for module in model.modules():
        for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if t is not None and t.numel():
                seen[t.data_ptr()] = t.numel() * t.element_size()
    total = sum(seen.values())
    rotary = sum(b.numel() * b.element_size() for b in model.model.rotary_emb.buffers())
    embed = model.model.embed_tokens
    tied = bool(getattr(model, "tie_word_embeddings", False)) or any(
        getattr(model, "lm_head", None) is not None and p is q
        for p in embed.parameters()
        for q in model.lm_head.parameters()
    )
    embed_bytes = (
        0 if tied else sum(t.numel() * t.element_size() for t in [*embed.parameters(), *embed.buffers()])
    )
    return total - rotary - embed_bytes


def matmul_params(hf: Any) -> int:
    """Parameters a token multiplies by (the projections and the LM head)."""
    h, i, layers = hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers
    heads, kv = hf.num_attention_heads, hf.num_key_value_heads
    d = h // heads
    per_layer = h * (heads * d + 2 * kv * d) + heads * d * h + 3 * h * i
    return int(layers * per_layer + h * hf.vocab_size)


class Engine:
    """One engine with its step log, built under ``random_weights``."""

    def __init__(self, args: argparse.Namespace, directory: Path, **overrides: Any) -> None:
        from plimsoll.runtime import LLM

        self.log = gpu_check.StepLog()
        smoke = args.device == "cpu"
        settings: dict[str, Any] = dict(
            model=str(directory),
            device=args.device,
            dtype="float32" if smoke else "bfloat16",
            attention_backend="torch" if smoke else "triton",
            kv_cache_memory=overrides.pop("kv_cache_memory", "64MiB" if smoke else "24GiB"),
            max_num_seqs=256 if not smoke else 8,
            max_num_batched_tokens=8192 if not smoke else 256,
            enable_prefix_caching=False,
            observer=self.log,
            compilation_config={
                "mode": args.compile_mode,
                "cache_dir": str(args.cache_dir),
                "cudagraph_capture_sizes": [1, 8, 64, 256] if not smoke else [1, 2, 4, 8],
            },
        )
        settings.update(overrides)
        t = time.monotonic()
        with random_weights():
            self.llm = LLM(**settings)
        self.build_s = time.monotonic() - t
        self.engine = self.llm.engine
        self.report = self.engine.compile_report()
        self.report["engine_build_seconds"] = round(self.build_s, 2)
        self.model = self.engine.runner.model
        self.hf = self.engine.hf_config
        from plimsoll.runtime.engine.model_runner import kv_bytes_per_token

        self.kv_per_token = kv_bytes_per_token(
            self.hf, self.llm.config.torch_dtype, self.llm.config.kv_cache_dtype
        )
        self.weight_bytes = weight_bytes_per_step(self.model)

    def prompts(self, count: int, length: int, seed: int) -> list[list[int]]:
        rng = random.Random(seed)
        vocab = min(int(self.hf.vocab_size), 259)  # ids the byte tokenizer also decodes
        return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]

    def generate(self, prompts: list[list[int]], out_len: int) -> list[list[int]]:
        from plimsoll.runtime import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
        return [o.outputs[0].token_ids for o in self.llm.generate(prompts, params)]

    def close(self) -> None:
        import torch

        self.engine.close()
        del self.llm, self.engine, self.model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def decode_rows(
    eng: Engine, peaks: dict[str, Any], levels: list[int], prompt_len: int, out_len: int
) -> list[dict[str, Any]]:
    rows = []
    eng.generate(eng.prompts(2, prompt_len, 99), 4)  # warm-up outside the measurement
    for c in levels:
        eng.log.steps.clear()
        t = time.monotonic()
        outs = eng.generate(eng.prompts(c, prompt_len, c), out_len)
        wall = time.monotonic() - t
        dec = [s for s in eng.log.steps if s.num_prefill_tokens == 0 and s.num_decode_tokens > 0]
        full = [s for s in dec if s.batch_size == c] or dec
        step_s = statistics.median(s.step_time_s for s in full)
        kv_bytes = c * (prompt_len + out_len // 2) * eng.kv_per_token  # the median step's context
        bw = (eng.weight_bytes + kv_bytes) / step_s
        row = dict(
            concurrency=c,
            step_ms=round(step_s * 1000, 3),
            decode_tokens_per_s=round(c / step_s, 1),
            end_to_end_tokens_per_s=round(sum(map(len, outs)) / wall, 1),
            bytes_per_step=int(eng.weight_bytes + kv_bytes),
            hbm_GBps=round(bw / 1e9, 1),
            hbm_share=share(bw, peaks["hbm_Bps"]),
            floor_ms=round((eng.weight_bytes + kv_bytes) / peaks["hbm_Bps"] * 1000, 3)
            if peaks["hbm_Bps"]
            else None,
            decode_steps=len(full),
            graph_replays=eng.engine.runner.graph_replays,
        )
        rows.append(row)
        say(
            f"  c={c:3d}: step {row['step_ms']:8.3f} ms  {row['decode_tokens_per_s']:10.1f} tok/s  "
            f"HBM {row['hbm_GBps']:7.1f} GB/s = {row['hbm_share']} of peak (floor {row['floor_ms']} ms)"
        )
    return rows


def prefill_row(eng: Engine, peaks: dict[str, Any], fp8: bool, count: int, length: int) -> dict[str, Any]:
    eng.log.steps.clear()
    eng.generate(eng.prompts(count, length, 7), 1)
    pre = [s for s in eng.log.steps if s.num_decode_tokens == 0 and s.num_prefill_tokens > 0]
    tokens = sum(s.num_prefill_tokens for s in pre)
    seconds = sum(s.step_time_s for s in pre)
    hf = eng.hf
    head_dim = hf.hidden_size // hf.num_attention_heads
    # 2 FLOPs a multiply-add: the matmuls, then causal attention (QK^T and PV, half the square).
    attn = 2 * 2 * hf.num_hidden_layers * hf.num_attention_heads * head_dim * count * length * length / 2
    flops = 2 * matmul_params(hf) * tokens + attn
    peak = peaks["fp8_flops" if fp8 else "bf16_flops"]
    row = dict(
        prompts=count,
        prompt_tokens=length,
        prefill_tokens_per_s=round(tokens / seconds, 1),
        tflops=round(flops / seconds / 1e12, 2),
        tensor_core_share=share(flops / seconds, peak),
        steps=len(pre),
    )
    say(
        f"  prefill {count}x{length}: {row['prefill_tokens_per_s']:.0f} tok/s, {row['tflops']} TFLOP/s = "
        f"{row['tensor_core_share']} of the {'FP8' if fp8 else 'bf16'} tensor-core peak"
    )
    return row


def host_syncs(eng: Engine) -> dict[str, Any]:
    """Syncs inside ModelRunner.execute of a decode and a mixed step (CUDA's sync debug mode)."""
    import torch

    if not torch.cuda.is_available():
        return {"status": "CUDA only"}
    runner = eng.engine.runner
    counts: dict[str, int] = {}
    execute = runner.execute

    def counted(sched: Any) -> Any:
        kind = "decode" if all(n == 1 for _, n in sched.scheduled) else "mixed"
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = execute(sched)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts[kind] = max(counts.get(kind, 0), sum("synchroniz" in str(w.message) for w in caught))
        return out

    runner.execute = counted
    try:
        from plimsoll.runtime import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        engine = eng.engine
        for i, prompt in enumerate(eng.prompts(4, 40, 3)):
            engine.add_request(f"sync-{i}", prompt, params)
        engine.step()
        engine.step()  # the four decode now
        engine.add_request("sync-long", eng.prompts(1, 300, 4)[0], params)  # a prefill joins them: mixed
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        runner.execute = execute
    say(f"  host syncs inside a step: {counts} (the sampler's read of the tokens is after the step)")
    return counts


# --------------------------------------------------------------------------- parts


def model_part(
    args: argparse.Namespace, work: Path, peaks: dict[str, Any], name: str, quant: str | None
) -> dict[str, Any]:
    smoke = args.device == "cpu"
    shape = TINY_SHAPE if smoke else MODELS[name]
    directory = model_dir(work, "tiny" if smoke else name, shape)
    eng = Engine(args, directory, quantization=quant)
    try:
        say(f"  {name} {'fp8' if quant == 'fp8' else 'bf16' if not smoke else 'fp32'}: built in {eng.build_s:.1f} s; "
            f"{eng.report}; weights read per step {eng.weight_bytes / 1e9:.3f} GB")  # fmt: skip
        levels = [1, 8, 64, 256] if not smoke else [1, 4]
        prompt_len, out_len = (160, 64) if not smoke else (20, 8)
        figures: dict[str, Any] = {"startup": eng.report, "weight_bytes_per_step": eng.weight_bytes}
        figures["decode"] = decode_rows(eng, peaks, levels, prompt_len, out_len)
        figures["prefill"] = prefill_row(eng, peaks, quant == "fp8", *((8, 1024) if not smoke else (2, 64)))
        if name == "1b" and quant is None:
            figures["host_syncs"] = host_syncs(eng)
        agree_prompts = eng.prompts(32 if not smoke else 4, 24, 11)
        figures["greedy_32x32"] = eng.generate(agree_prompts, 32 if not smoke else 8)
        return figures
    finally:
        eng.close()


def agreement(model: str, base: dict[str, Any], fp8: dict[str, Any]) -> dict[str, Any]:
    a, b = base.get("greedy_32x32"), fp8.get("greedy_32x32")
    if not a or not b:
        return {"status": "skipped: the bf16 or fp8 run is missing"}
    same = sum(x == y for x, y in zip(a, b, strict=True))
    prefix = [
        next((i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q), len(x))
        for x, y in zip(a, b, strict=True)
    ]
    c1 = lambda fig: next((r for r in fig.get("decode", []) if r["concurrency"] == 1), None)  # noqa: E731
    speedup = None
    if c1(base) and c1(fp8):
        speedup = round(c1(base)["step_ms"] / c1(fp8)["step_ms"], 3)
    out = {
        "prompts_identical": f"{same}/{len(a)}",
        "mean_matching_prefix": round(statistics.mean(prefix), 1),
        "c1_speedup_fp8_over_bf16": speedup,
        "caveat": "random weights: logits have small margins, so a flip is likelier than on a trained model",
    }
    say(f"  {model} FP8 vs bf16: {out}")
    return out


def speculation_and_lora(args: argparse.Namespace, work: Path, peaks: dict[str, Any]) -> dict[str, Any]:
    smoke = args.device == "cpu"
    directory = model_dir(work, "tiny" if smoke else "1b", TINY_SHAPE if smoke else MODELS["1b"])
    prompt_len, out_len = (160, 64) if not smoke else (20, 8)
    # Repetitive prompts: a phrase said over and over, the workload n-gram lookup is for.
    rng = random.Random(5)
    phrase = [rng.randrange(3, 259) for _ in range(16)]
    repetitive = [(phrase * (prompt_len // 16 + 1))[:prompt_len]]
    figures: dict[str, Any] = {}
    for label, overrides in (
        ("plain", {}),
        (
            "ngram k=4",
            {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}},
        ),
        ("enable_lora (base-only requests)", {"enable_lora": True, "max_loras": 1, "max_lora_rank": 16}),
    ):
        eng = Engine(args, directory, max_num_seqs=8, **overrides)
        try:
            eng.generate(repetitive, 4)
            eng.log.steps.clear()
            t = time.monotonic()
            out = eng.generate(repetitive, out_len)
            wall = time.monotonic() - t
            steps = [s for s in eng.log.steps if s.num_prefill_tokens == 0]
            drafts = sum(s.spec_num_draft_tokens for s in steps)
            accepted = sum(s.spec_num_accepted_tokens for s in steps)
            row = dict(
                tokens_per_s=round(len(out[0]) / wall, 1),
                median_step_ms=round(1000 * statistics.median(s.step_time_s for s in steps), 3),
                steps=len(steps),
                acceptance=round(accepted / drafts, 3) if drafts else None,
                graph_replays=eng.engine.runner.graph_replays,
                startup=eng.report,
            )
            figures[label] = row
            say(f"  c=1 {label:34s}: {row['tokens_per_s']:8.1f} tok/s, step {row['median_step_ms']} ms, "
                f"acceptance {row['acceptance']}, {row['graph_replays']} graph replays")  # fmt: skip
        finally:
            eng.close()
    base = figures["plain"]["tokens_per_s"]
    for label in list(figures):
        if label != "plain":
            figures[label]["vs_plain"] = round(figures[label]["tokens_per_s"] / base, 3)
    return figures


def kv_and_int8_kernels(args: argparse.Namespace) -> dict[str, Any]:
    """Decode attention over an int8 cache against bf16 at long context, and the int8 matmul."""
    import functools

    import torch

    from plimsoll.runtime.attention import kv_int8, triton_backend

    smoke = args.device == "cpu"
    heads, kv_heads, head_dim, block = (32, 8, 128, 16) if not smoke else (4, 2, 32, 16)
    context = 8192 if not smoke else 64
    rows = []
    for batch in [8, 32] if not smoke else [2]:
        query, k_cache, v_cache, tables, cu, lens, scale = gpu_check.make_batch(
            [context] * batch, [1] * batch, heads, kv_heads, head_dim, block, torch.bfloat16, args.device, 3
        )
        kq = kv_int8.quantize_cache(k_cache.float())
        vq = kv_int8.quantize_cache(v_cache.float())
        q = query if not smoke else query.float()
        iters = 50 if not smoke else 2
        bf16 = gpu_check.cuda_time_ms(
            functools.partial(triton_backend.paged_attention, q, k_cache if not smoke else k_cache.float(),
                              v_cache if not smoke else v_cache.float(), tables, cu, lens, scale, max_q_len=1), iters)  # fmt: skip
        int8 = gpu_check.cuda_time_ms(
            functools.partial(
                triton_backend.paged_attention, q, kq, vq, tables, cu, lens, scale, max_q_len=1
            ),
            iters,
        )
        bf16_bytes = 2 * batch * context * kv_heads * head_dim * 2
        int8_bytes = 2 * batch * context * kv_heads * (head_dim + 4)
        row = dict(
            batch=batch,
            context=context,
            bf16_ms=round(bf16, 4),
            int8_ms=round(int8, 4),
            int8_speedup=round(bf16 / int8, 3),
            bf16_kv_GBps=round(bf16_bytes / bf16 / 1e6, 1),
            int8_kv_GBps=round(int8_bytes / int8 / 1e6, 1),
        )
        rows.append(row)
        say(f"  decode attention ctx {context} batch {batch}: bf16 {bf16:.3f} ms ({row['bf16_kv_GBps']} GB/s), "
            f"int8 {int8:.3f} ms ({row['int8_kv_GBps']} GB/s): int8 {row['int8_speedup']}x")  # fmt: skip
    matmul = gpu_check.int8_matmul_check(torch, args.device, smoke)
    return {"int8_kv_decode": rows, "int8_weight_matmul": matmul}


def serve_part(args: argparse.Namespace, work: Path, offline: dict[str, Any] | None) -> dict[str, Any]:
    """`plimsoll serve` started twice on one fresh compile cache (cold, then warm), then Workload A
    at c=64 over HTTP against the offline engine's end-to-end tokens/s."""
    import httpx

    from plimsoll.runtime.testing import ServerProcess

    smoke = args.device == "cpu"
    directory = gpu_check.write_random_model(
        work / ("tiny-serve" if smoke else "smollm2-serve"),
        TINY_SHAPE if smoke else gpu_check.SMOLLM2_SHAPE,
        "float32" if smoke else "bfloat16",
        args.device,
    )
    cache = work / "serve-compile-cache"
    flags = [
        "--model", str(directory), "--device", args.device, "--max-num-seqs", "64" if not smoke else "8",
        "--max-num-batched-tokens", "8192" if not smoke else "256", "--kv-cache-memory", "8GiB" if not smoke else "64MiB",
        "--no-enable-prefix-caching", "--compilation-cache-dir", str(cache),
        "--compilation-config", json.dumps({"mode": args.compile_mode, "cudagraph_capture_sizes": [1, 8, 64] if not smoke else [1, 8]}),
    ]  # fmt: skip
    figures: dict[str, Any] = {}
    concurrency, prompt_len, out_len, rounds = (64, 160, 64, 3) if not smoke else (4, 20, 8, 1)
    for start in ("cold", "warm"):
        t = time.monotonic()
        with ServerProcess(flags, startup_timeout=600) as server:
            ready_s = time.monotonic() - t
            body = httpx.get(f"{server.url}/ready", timeout=10).json()
            figures[f"{start}_start"] = {
                "seconds_to_ready": round(ready_s, 1),
                "phases": body.get("startup", body),
            }
            say(
                f"  plimsoll serve, {start} compile cache: ready in {ready_s:.1f} s ({figures[f'{start}_start']['phases']})"
            )
            if start == "warm":
                figures["http"] = asyncio.run(http_load(server.url, concurrency, prompt_len, out_len, rounds))
    cold, warm = figures["cold_start"]["seconds_to_ready"], figures["warm_start"]["seconds_to_ready"]
    figures["warm_over_cold"] = round(warm / cold, 3)
    http = figures["http"]["output_tokens_per_s"]
    if offline is not None:
        figures["offline_end_to_end_tokens_per_s"] = offline
        figures["http_over_offline"] = round(http / offline, 3)
    say(
        f"  HTTP c={concurrency}: {http} output tok/s"
        + (f" = {figures.get('http_over_offline')} of offline" if offline else "")
    )
    return figures


async def http_load(url: str, concurrency: int, prompt_len: int, out_len: int, rounds: int) -> dict[str, Any]:
    import httpx

    rng = random.Random(1)
    letters = "abcdefghijklmnopqrstuvwxyz "
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def one() -> int:
            prompt = "".join(rng.choice(letters) for _ in range(prompt_len))  # one token a byte
            r = await client.post(
                "/v1/completions",
                json={
                    "model": model,
                    "prompt": prompt,
                    "max_tokens": out_len,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )
            r.raise_for_status()
            return int(r.json()["usage"]["completion_tokens"])

        await asyncio.gather(*(one() for _ in range(concurrency)))  # warm-up round
        t = time.monotonic()
        tokens = 0
        for _ in range(rounds):
            tokens += sum(await asyncio.gather(*(one() for _ in range(concurrency))))
        wall = time.monotonic() - t
    return {"concurrency": concurrency, "rounds": rounds, "output_tokens_per_s": round(tokens / wall, 1)}


def offline_c64(args: argparse.Namespace, work: Path) -> float:
    """The offline engine's end-to-end output tokens/s on the HTTP part's workload (SmolLM2 shape)."""
    smoke = args.device == "cpu"
    directory = model_dir(work, "tiny" if smoke else "smollm2", TINY_SHAPE if smoke else MODELS["smollm2"])
    eng = Engine(args, directory, max_num_seqs=64 if not smoke else 8)
    try:
        c, prompt_len, out_len, rounds = (64, 160, 64, 3) if not smoke else (4, 20, 8, 1)
        eng.generate(eng.prompts(c, prompt_len, 1), out_len)
        t = time.monotonic()
        tokens = sum(
            len(o) for _ in range(rounds) for o in eng.generate(eng.prompts(c, prompt_len, 2), out_len)
        )
        return round(tokens / (time.monotonic() - t), 1)
    finally:
        eng.close()


# --------------------------------------------------------------------------- main


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernel parts run in Triton's interpreter
        torch.set_num_threads(1)  # tiny shapes: threads only add spin-waits on a shared host
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu to check the script on a CPU")
    budget = Budget(args.budget_s)
    out_dir = (
        Path(args.out_dir) if args.out_dir else Path(os.environ.get("OUT", tempfile.mkdtemp())) / "roofline"
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    say(f"roofline: figures go to {out_dir}")
    peaks = card(args.device)
    RESULTS["card"] = peaks
    say(f"  card: {peaks}")
    with tempfile.TemporaryDirectory(prefix="plimsoll-roofline-") as tmp:
        work = Path(tmp)
        args.cache_dir = Path(args.cache_dir) if args.cache_dir else work / "compile-cache"
        # Parts in order of what the figures are for; each starts only with enough budget left.
        for item in args.plan.split(","):
            if item == "kernels":
                part("int8 KV and int8 matmul kernels", budget, 20, lambda: kv_and_int8_kernels(args))
            elif item == "spec-lora":
                part("1b c=1: n-gram speculation and --enable-lora vs plain", budget, 150,
                     lambda: speculation_and_lora(args, work, peaks))  # fmt: skip
            elif item == "serve":

                def serve() -> dict[str, Any]:
                    return serve_part(args, work, offline_c64(args, work))

                part("plimsoll serve: cold/warm start-up and HTTP c=64", budget, 150, serve)
            else:
                model, _, dtype = item.partition("-")
                if model not in MODELS or dtype not in ("bf16", "fp8"):
                    raise SystemExit(
                        f"unknown part {item!r} in --plan: MODEL-bf16, MODEL-fp8, kernels, serve, spec-lora"
                    )
                quant = "fp8" if dtype == "fp8" else None
                part(item, budget, 90, functools.partial(model_part, args, work, peaks, model, quant))
                other = f"{model}-{'bf16' if quant else 'fp8'}"
                if other in RESULTS:
                    bf16, fp8 = (RESULTS[other], RESULTS[item]) if quant else (RESULTS[item], RESULTS[other])
                    RESULTS[f"{model}: fp8 vs bf16"] = agreement(model, bf16, fp8)
    for result in RESULTS.values():
        if isinstance(result, dict):
            result.pop("greedy_32x32", None)  # tokens were for the agreement figure
    RESULTS["total_seconds"] = round(time.monotonic() - T0, 1)
    (out_dir / "roofline.json").write_text(json.dumps(RESULTS, indent=2, default=str))
    (out_dir / "roofline.txt").write_text("\n".join(LINES) + "\n")
    say(f"\nroofline: wrote {out_dir / 'roofline.json'} and {out_dir / 'roofline.txt'}")
    return RESULTS


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--device", default="cuda", help="cuda (the bench) or cpu (tiny shapes: checks the script)"
    )
    p.add_argument("--budget-s", type=float, default=480.0, help="start no part after this many seconds")
    p.add_argument(
        "--plan",
        default="kernels,1b-bf16,8b-bf16,8b-fp8,smollm2-bf16,serve,1b-fp8,spec-lora,smollm2-fp8",
        help="parts in order: MODEL-DTYPE (MODEL smollm2, 1b, 8b; DTYPE bf16, fp8), kernels, serve, spec-lora",
    )
    p.add_argument(
        "--compile-mode",
        type=int,
        default=None,
        help="--compilation-config mode (default: 3 on CUDA, 0 on CPU)",
    )
    p.add_argument(
        "--cache-dir", default=None, help="compile cache shared by the in-process engines (default: fresh)"
    )
    p.add_argument(
        "--out-dir", default=None, help="where roofline.json and roofline.txt go (default $OUT/roofline)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.compile_mode is None:
        args.compile_mode = 3 if args.device != "cpu" else 0
    results = run(args)
    failed = [
        k for k, v in results.items() if isinstance(v, dict) and str(v.get("status", "")).startswith("failed")
    ]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
