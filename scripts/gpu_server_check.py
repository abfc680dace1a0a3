"""The server check: `plimsoll serve` on a GPU, driven over HTTP by the official ``openai`` client.

What it checks, each section independent (a missing piece is skipped with a line saying
why; a failed section or a check that does not hold is printed, listed at the end, and
makes the exit status 1):

1. sampler     the batched sampler on the device: token frequencies per setting
               (temperature, top-k, top-p, min-p, penalties, logit_bias, allowed ids)
               against the exact distribution (chi-square), a seeded row identical
               across batches, and one device-to-host read per step.
2. server      one server (random weights of SmolLM2-135M's shape, SmolLM2's tokenizer,
               float32, the KV cache sized by the default --gpu-memory-utilization, the
               priority policy), 64 concurrent clients: greedy completions equal to the
               CPU reference, default-temperature chat, seeded sampling reproduced in
               different batches, top-p/top-k/min-p/penalties/logit_bias/allowed ids,
               logprobs, n=4, stop strings, streaming with usage, prefix caching, chunked
               prefill of a long prompt (equal to the reference), abort on disconnect (no
               block left in use), priority, out-of-range ids refused.
3. preemption  a server with a KV cache for a few sequences under 64 clients: all finish,
               preemptions happen, greedy output equals the reference; then SIGTERM with
               streams in flight: they finish, new requests are refused, exit status 0.
4. lora, ngram, draft, int8
               LoRA (--enable-lora), n-gram and draft-model speculation, int8 weights and
               int8 KV: greedy output equal to the CPU reference of the same configuration
               (speculation: to plain greedy), and proposals accepted.
5. throughput  a 1B-class Llama (random weights, bf16) at 64 concurrent clients: sampled
               (the default temperature 1.0) and greedy output tokens/s, and their ratio.
6. rope        bf16 engine against transformers in bf16 at a ~4k-token prompt: the first
               tokens and the last position's logits (RoPE frequencies in float32).
7. memory      --gpu-memory-utilization 0.9 (the default) with and without a draft model:
               the KV start line, torch.cuda.max_memory_reserved under load, and the KV
               tokens `plimsoll plan` predicts (CUDA only).

Usage: ``bash scripts/gpu_check.sh --part server`` on a machine with one CUDA GPU (a few
minutes), or ``python scripts/gpu_server_check.py --device cpu`` for small models on a CPU
(checks the script; CPU against CPU proves no GPU behaviour). SmolLM2's tokenizer comes
from ``--tokenizer DIR``, ``build/gpu-check/smollm2-tokenizer`` (``gpu_check.sh --prepare``
puts it there) or the embedded model's cache. Figures go to stdout and, with ``$OUT``
set, to ``$OUT/gpu_server_check.json``.

What it is not: a benchmark of real models (random weights: decode speed depends on
shapes, not weights) or a test suite run in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import LLAMA_1B_SHAPE, RESULTS, SMOLLM2_SHAPE, Skip, finish, need, say, section

REPO = Path(__file__).resolve().parents[1]
PREPARED_TOKENIZER = REPO / "build" / "gpu-check" / "smollm2-tokenizer"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
CLIENTS = 64


@dataclass
class Mode:
    """Sizes for the GPU or for a quick run on a CPU."""

    device: str
    main_shape: dict[str, Any]
    big_shape: dict[str, Any]
    draft_shape: dict[str, Any]
    new_tokens: int  # per greedy-equality request
    long_prompt: int  # tokens of the chunked-prefill prompt
    rope_prompt: int
    throughput_tokens: int
    throughput_rounds: int
    kv_args: list[str]  # how servers size their KV cache
    startup_timeout: float


def mode_for(device: str, vocab: int) -> Mode:
    if device.startswith("cuda"):
        return Mode(
            device="cuda",
            main_shape={**SMOLLM2_SHAPE, "vocab_size": vocab},
            big_shape={**LLAMA_1B_SHAPE, "vocab_size": vocab},
            draft_shape={**SMOLLM2_SHAPE, "vocab_size": vocab, "num_hidden_layers": 4},
            new_tokens=24,
            long_prompt=3000,
            rope_prompt=4000,
            throughput_tokens=128,
            throughput_rounds=3,
            kv_args=[],  # the default: sized from the device, --gpu-memory-utilization 0.9
            startup_timeout=600,
        )
    small = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
    )  # fmt: skip
    return Mode(
        device="cpu",
        main_shape=small,
        big_shape={**small, "hidden_size": 128, "num_hidden_layers": 4, "tie_word_embeddings": False},
        draft_shape={**small, "num_hidden_layers": 1},
        new_tokens=8,
        long_prompt=600,
        rope_prompt=600,
        throughput_tokens=8,
        throughput_rounds=1,
        kv_args=["--kv-cache-memory", "256MiB"],
        startup_timeout=300,
    )


# --------------------------------------------------------------------------- models
def find_tokenizer(explicit: str | None) -> Path:
    candidates = [Path(explicit)] if explicit else []
    candidates.append(PREPARED_TOKENIZER)
    if os.environ.get("PLIMSOLL_SMOLLM2_DIR"):
        candidates.append(Path(os.environ["PLIMSOLL_SMOLLM2_DIR"]))
    try:
        from plimsoll.runtime.models.embedded import EMBEDDED_MODELS, cache_dir

        candidates.append(cache_dir() / EMBEDDED_MODELS["smollm2-135m"]["dirname"])
    except Exception:
        pass
    for c in candidates:
        if (c / "tokenizer.json").exists():
            return c
    raise SystemExit(
        "SmolLM2's tokenizer was not found (looked in "
        + ", ".join(map(str, candidates))
        + "); run `bash scripts/gpu_check.sh --prepare` where the embedded model is cached, or pass --tokenizer"
    )


def write_model(
    directory: Path, shape: dict[str, Any], tokenizer: Path, device: str, init: float = 0.1
) -> Path:
    """Random weights of ``shape`` (float32 on disk) with SmolLM2's tokenizer beside them. ``init`` keeps
    the logits peaked, so greedy tokens do not flip on rounding between devices."""
    torch = need("torch")
    transformers = need("transformers")
    if (directory / "config.json").exists():
        return directory
    cfg = transformers.LlamaConfig(
        bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=init, **shape
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    for name in TOKENIZER_FILES:
        if (tokenizer / name).exists():
            shutil.copy(tokenizer / name, directory / name)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return directory


@dataclass
class Models:
    main: Path
    big: Path
    draft: Path
    lora: Path
    vocab: int


def make_models(work: Path, mode: Mode, tokenizer: Path) -> Models:
    from transformers import AutoTokenizer

    from plimsoll.runtime.testing import write_random_lora

    vocab = len(AutoTokenizer.from_pretrained(str(tokenizer)))
    main = write_model(work / "main", mode.main_shape, tokenizer, mode.device)
    draft = write_model(work / "draft", mode.draft_shape, tokenizer, mode.device)
    big = write_model(work / "big", mode.big_shape, tokenizer, mode.device, init=0.02)
    lora = write_random_lora(main, work / "lora", r=8, scale=0.5)
    return Models(main, big, draft, lora, vocab)


# --------------------------------------------------------------------------- helpers
def check(name: str, ok: bool, detail: str = "") -> bool:
    say(f"  {'ok      ' if ok else 'MISMATCH'} {name}{': ' + detail if detail else ''}")
    if not ok:
        RESULTS["mismatches"].append(f"{name}: {detail}")
    return ok


def parallel(fn: Callable[[Any], Any], items: list[Any], workers: int = CLIENTS) -> list[Any]:
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(fn, items))


def scrape(url: str) -> dict[str, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in family.samples:
            key = s.name + "".join(f"|{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[key] = s.value
    return out


def metric(samples: dict[str, float], name: str) -> float:
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "|"))


def prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(100, vocab) for _ in range(rng.randint(length // 2, length))] for _ in range(count)
    ]


class Server:
    """`plimsoll serve` in a subprocess (``plimsoll.runtime.testing.ServerProcess``) with an openai client."""

    def __init__(self, mode: Mode, model: Path, *extra: str, dtype: str = "float32") -> None:
        from plimsoll.runtime.testing import ServerProcess

        args = ["--model", str(model), "--device", mode.device, "--dtype", dtype, "--served-model-name", "m"]
        args += ["--max-num-seqs", str(CLIENTS), *mode.kv_args, *extra]
        self.process = ServerProcess(args, startup_timeout=mode.startup_timeout)

    def __enter__(self) -> Server:
        import openai

        t = time.monotonic()
        self.process.start()
        self.start_s = time.monotonic() - t
        self.url = self.process.url
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=600)
        kv = [line for line in self.process.log().splitlines() if "KV cache:" in line]
        self.kv_line = kv[-1].split("KV cache:", 1)[1].strip() if kv else "(no KV line in the log)"
        say(f"  server up in {self.start_s:.1f} s; KV cache: {self.kv_line}")
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()
        self.process.__exit__(None, None, None)

    def greedy(self, ids: list[int], max_tokens: int, model: str = "m", **extra: Any) -> tuple[str, int]:
        out = self.client.completions.create(
            model=model,
            prompt=ids,
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"ignore_eos": True},
            **extra,
        )
        return out.choices[0].text, out.usage.completion_tokens if out.usage else -1


def reference(
    model: Path, ids: list[list[int]], max_tokens: int, lora: Path | None = None, **engine: Any
) -> list[str]:
    """Greedy texts from the offline engine on the CPU, float32: what every device must give."""
    from plimsoll.runtime import LLM, SamplingParams

    extra: dict[str, Any] = {}
    if lora is not None:
        extra = {"enable_lora": True, "lora_modules": [{"name": "ad", "path": str(lora)}], "max_lora_rank": 8}
    llm = LLM(
        model=str(model),
        device="cpu",
        dtype="float32",
        kv_cache_memory="1GiB",
        max_model_len=4096,
        **extra,
        **engine,
    )
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    if lora is not None:
        outs = llm.engine.generate(ids, params, lora_names=["ad"] * len(ids))  # type: ignore[arg-type]
    else:
        outs = llm.generate(ids, params)
    return [o.outputs[0].text for o in outs]


def equal_to_reference(name: str, got: list[tuple[str, int]], want: list[str], max_tokens: int) -> None:
    same = sum(text == ref for (text, _), ref in zip(got, want, strict=True))
    counts = sum(n == max_tokens for _, n in got)
    check(f"{name}: status 200 and {max_tokens} tokens each", counts == len(got), f"{counts}/{len(got)}")
    check(f"{name}: greedy equal to the CPU reference", same == len(got), f"{same}/{len(got)}")


# --------------------------------------------------------------------------- 1. sampler
def sampler_section(mode: Mode) -> dict[str, Any]:
    torch = need("torch")
    from plimsoll.runtime.engine.request import Request
    from plimsoll.runtime.engine.sampler import Sampler
    from plimsoll.runtime.engine.sampler_reference import chi_square_p, reference_probs
    from plimsoll.runtime.engine.sampling_params import SamplingParams

    dev = torch.device(mode.device if mode.device == "cpu" else "cuda:0")
    settings: list[dict[str, Any]] = [
        {"temperature": 1.0},
        {"temperature": 0.6},
        {"temperature": 1.0, "top_k": 3},
        {"temperature": 1.0, "top_p": 0.6},
        {"temperature": 0.9, "top_k": 5, "top_p": 0.8, "min_p": 0.1},
        {"temperature": 1.0, "min_p": 0.2},
        {"temperature": 1.0, "repetition_penalty": 1.8, "presence_penalty": 0.5, "frequency_penalty": 0.5},
        {"temperature": 1.0, "logit_bias": {0: 2.0, 4: -100.0}},
        {"temperature": 1.0, "allowed_token_ids": [1, 2, 6, 7]},
    ]
    logits = torch.tensor([2.0, 1.5, 1.2, 0.3, 0.0, -0.5, -1.0, 1.0])
    trials = 20_000 if mode.device != "cpu" else 4_000
    figures: dict[str, Any] = {}
    for i, setting in enumerate(settings):
        reqs = [
            Request(f"r{j}", f"r{j}", 0, [0, 3], SamplingParams(**setting), frozenset({3}))
            for j in range(trials)
        ]
        for r in reqs:
            for t in (1, 1, 2):
                r.append_token(t)
        tokens = [t for t, _ in Sampler(seed=i)(reqs, logits.expand(trials, 8).to(dev))]
        counts = torch.bincount(torch.tensor(tokens), minlength=8).float()
        p = chi_square_p(counts, reference_probs(reqs[0], logits.clone()))
        figures[json.dumps(setting)] = round(p, 4)
        check(f"chi-square {setting} on {dev}", p > 1e-4, f"p = {p:.4f}")
    # A seeded row: the same tokens alone and in a batch of 63 unseeded rows, step after step.
    gen = torch.Generator().manual_seed(0)

    def run(batch_mates: int) -> list[int]:
        target = Request("t", "t", 0, [5], SamplingParams(temperature=1.0, top_p=0.9, seed=7), frozenset())
        mates = [
            Request(f"m{j}", f"m{j}", 0, [5], SamplingParams(temperature=1.0), frozenset())
            for j in range(batch_mates)
        ]
        sampler, out = Sampler(seed=batch_mates), []
        for step in range(16):
            row = torch.randn(1, 1000, generator=torch.Generator().manual_seed(step))
            batch = torch.cat([torch.randn(batch_mates, 1000, generator=gen), row]).to(dev)
            token = sampler([*mates, target], batch)[-1][0]
            target.append_token(token)
            out.append(token)
        return out

    alone, crowded = run(0), run(63)
    check(
        f"seeded row identical alone and among 63 rows on {dev}",
        alone == crowded,
        f"{alone[:6]} vs {crowded[:6]}",
    )
    reads: list[str] = []
    real = torch.Tensor.tolist

    def counted(t: Any) -> Any:
        reads.append("tolist")
        return real(t)

    reqs = [
        Request(f"x{j}", "x", 0, [5], SamplingParams(temperature=1.0, logprobs=2, seed=j), frozenset())
        for j in range(64)
    ]
    torch.Tensor.tolist = counted  # type: ignore[method-assign]
    try:
        Sampler(seed=0)(reqs, torch.randn(64, 1000).to(dev))
    finally:
        torch.Tensor.tolist = real  # type: ignore[method-assign]
    check("one device-to-host read for a step of 64 rows", reads == ["tolist"], f"{len(reads)} reads")
    figures["reads_per_step"] = len(reads)
    return figures


# --------------------------------------------------------------------------- 2. the main server
def main_server_section(mode: Mode, models: Models) -> dict[str, Any]:
    need("openai")
    import httpx

    from plimsoll import metric_names as mn

    n = mode.new_tokens
    ids = prompts(models.vocab, CLIENTS, 120, seed=1)
    long_ids = prompts(models.vocab, 1, mode.long_prompt, seed=2)
    long_ids[0] = long_ids[0] + [7] * (mode.long_prompt - len(long_ids[0]))
    want = reference(models.main, ids + long_ids, n)
    figures: dict[str, Any] = {}
    # --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens (off by default, as vLLM).
    with Server(
        mode,
        models.main,
        "--scheduling-policy",
        "priority",
        "--max-num-batched-tokens",
        "1024",
        "--enable-prompt-tokens-details",
    ) as s:
        figures["start_s"], figures["kv"] = round(s.start_s, 1), s.kv_line
        got = parallel(lambda p: s.greedy(p, n), ids)
        equal_to_reference("greedy completions, 64 concurrent", got, want[:-1], n)
        equal_to_reference("chunked prefill of a long prompt", [s.greedy(long_ids[0], n)], want[-1:], n)

        def chat(i: int) -> Any:  # no temperature: OpenAI's default 1.0 samples
            return s.client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"Say something {i}"}], max_tokens=n,
                extra_body={"ignore_eos": True},
            )  # fmt: skip

        chats = parallel(chat, list(range(CLIENTS)))
        ok = sum(c.usage.completion_tokens == n and c.choices[0].finish_reason == "length" for c in chats)
        check("default-temperature chat, 64 concurrent", ok == CLIENTS, f"{ok}/{CLIENTS}")

        def seeded(i: int) -> str:
            out = s.client.completions.create(
                model="m",
                prompt=ids[i],
                max_tokens=n,
                seed=1000 + i,
                top_p=0.9,
                extra_body={"ignore_eos": True},
            )
            return out.choices[0].text

        first = parallel(seeded, list(range(16)))
        mixed = parallel(lambda i: seeded(i) if i < 16 else chat(i), list(range(48)))[
            :16
        ]  # among other traffic
        again = [seeded(i) for i in range(16)]  # one at a time
        check(
            "seeded sampling reproduced in different batches",
            first == mixed == again,
            f"{sum(a == b for a, b in zip(first, again, strict=False))}/16",
        )
        variants = [
            {"top_p": 0.8}, {"extra_body": {"top_k": 20, "ignore_eos": True}}, {"extra_body": {"min_p": 0.05, "ignore_eos": True}},
            {"presence_penalty": 0.5, "frequency_penalty": 0.5}, {"extra_body": {"repetition_penalty": 1.2, "ignore_eos": True}},
            {"logit_bias": {"500": 5.0}}, {"extra_body": {"allowed_token_ids": [300, 301, 302], "ignore_eos": True}},
        ]  # fmt: skip

        def variant(v: dict[str, Any]) -> Any:
            body = {"extra_body": {"ignore_eos": True}, **v}
            return s.client.completions.create(
                model="m", prompt=ids[0], max_tokens=n, temperature=0.8, logprobs=1, **body
            )

        outs = parallel(variant, variants)
        ok = sum(o.usage.completion_tokens == n for o in outs)
        check(
            "top-p, top-k, min-p, penalties, logit_bias, allowed ids",
            ok == len(variants),
            f"{ok}/{len(variants)}",
        )
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(models.main))
        allowed = {tok.decode([t]) for t in (300, 301, 302)}
        emitted = set(outs[-1].choices[0].logprobs.tokens or []) if outs[-1].choices[0].logprobs else set()
        check(
            "allowed_token_ids: only those tokens",
            bool(emitted) and emitted <= allowed,
            f"{emitted} within {allowed}",
        )
        lp = s.client.completions.create(
            model="m", prompt=ids[0], max_tokens=n, temperature=0, logprobs=5, extra_body={"ignore_eos": True}
        )
        tops = lp.choices[0].logprobs.top_logprobs or []
        check(
            "completions logprobs=5",
            len(tops) == n and all(5 <= len(t) <= 6 for t in tops),
            f"{len(tops)} positions",
        )
        check("greedy logprobs: the chosen token is the top one", all(
            abs(max(t.values()) - c) < 1e-4 for t, c in zip(tops, lp.choices[0].logprobs.token_logprobs or [], strict=False)
        ))  # fmt: skip
        lpc = s.client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=n, logprobs=True, top_logprobs=5,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        content = lpc.choices[0].logprobs.content or []
        check("chat top_logprobs=5", len(content) == n and all(len(c.top_logprobs) == 5 for c in content))
        four = s.client.completions.create(
            model="m", prompt=ids[1], max_tokens=n, n=4, temperature=1.0, extra_body={"ignore_eos": True}
        )
        check("n=4", len(four.choices) == 4 and four.usage.completion_tokens == 4 * n)
        stop = want[2][len(want[2]) // 2 :][:3] or want[2][-1:]
        stopped = s.client.completions.create(
            model="m",
            prompt=ids[2],
            max_tokens=n,
            temperature=0,
            stop=[stop],
            extra_body={"ignore_eos": True},
        )
        expect = want[2][: want[2].find(stop)]
        check(
            "stop string",
            stopped.choices[0].text == expect and stopped.choices[0].finish_reason == "stop",
            repr(stop),
        )
        chunks = list(s.client.completions.create(
            model="m", prompt=ids[3], max_tokens=n, temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        ))  # fmt: skip
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        usage = [c.usage for c in chunks if c.usage]
        check("streaming with usage", text == want[3] and bool(usage) and usage[-1].completion_tokens == n)
        shared = prompts(models.vocab, 1, 400, seed=9)[0][:256]
        before = metric(scrape(s.url), mn.PREFIX_CACHE_HITS)
        s.greedy([*shared, 11, 12], 2)
        second = s.client.completions.create(model="m", prompt=[*shared, 13, 14], max_tokens=2, temperature=0)
        cached = (
            (second.usage.prompt_tokens_details.cached_tokens or 0)
            if second.usage and second.usage.prompt_tokens_details
            else 0
        )
        hits = metric(scrape(s.url), mn.PREFIX_CACHE_HITS) - before
        check("prefix caching", cached >= 240 and hits >= 240, f"cached_tokens {cached}, hits +{hits:.0f}")

        # Abort on disconnect: streams closed after their first chunk leave no block in use.
        def abandon(i: int) -> None:
            body = {"model": "m", "prompt": ids[i], "max_tokens": 4000, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=60) as r:
                for _ in r.iter_lines():
                    break

        parallel(abandon, list(range(16)))
        deadline, idle = time.monotonic() + 30, False
        while time.monotonic() < deadline and not idle:
            m = scrape(s.url)
            idle = metric(m, mn.NUM_REQUESTS_RUNNING) == 0 and metric(m, mn.KV_CACHE_USAGE_RATIO) == 0
            time.sleep(0.2)
        check("abort on disconnect: nothing running, no block in use", idle)
        pri = parallel(
            lambda i: s.client.completions.create(
                model="m",
                prompt=ids[i],
                max_tokens=n,
                temperature=0,
                extra_body={"priority": i % 3 - 1, "ignore_eos": True},
            ),
            list(range(16)),
        )
        check("priority", all(p.usage.completion_tokens == n for p in pri))
        r = httpx.post(
            f"{s.url}/v1/completions",
            json={"prompt": "x", "max_tokens": 2, "logit_bias": {str(models.vocab + 5): 1}},
            timeout=30,
        )
        check("an out-of-range id is refused with a 400", r.status_code == 400, r.text[:100])
    return figures


# --------------------------------------------------------------------------- 3. preemption and drain
def preemption_section(mode: Mode, models: Models) -> dict[str, Any]:
    need("openai")
    import httpx

    from plimsoll import metric_names as mn

    cfg = json.loads((models.main / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4
    n = mode.new_tokens * 4
    ids = prompts(models.vocab, CLIENTS, 200, seed=3)
    want = reference(models.main, ids, n)
    kv_bytes = per_token * 16 * (6 * (200 + n) // 16 + 4)  # about six sequences
    mode_small = Mode(**{**mode.__dict__, "kv_args": ["--kv-cache-memory-bytes", str(kv_bytes)]})
    figures: dict[str, Any] = {}
    with Server(mode_small, models.main, "--max-model-len", "1024") as s:
        got = parallel(lambda p: s.greedy(p, n), ids)
        equal_to_reference("64 clients on a cache for six", got, want, n)
        preempted = metric(scrape(s.url), mn.NUM_PREEMPTIONS)
        figures["preemptions"] = preempted
        check("preemptions happened", preempted > 0, f"{preempted:.0f}")
        results: dict[int, Any] = {}
        started = threading.Barrier(9, timeout=120)

        def stream(i: int) -> None:
            body = {"model": "m", "prompt": ids[i], "max_tokens": n, "stream": True, "ignore_eos": True}
            lines: list[str] = []
            with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        if len(lines) == 1:
                            started.wait()  # every stream has its first token before SIGTERM
            results[i] = lines

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        started.wait()
        s.process.terminate()  # SIGTERM while the streams run
        time.sleep(0.2)
        try:
            late = httpx.post(
                f"{s.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10
            ).status_code
        except httpx.HTTPError:
            late = 0  # the port is closed: refused too
        for t in threads:
            t.join(timeout=120)
        done = sum(
            bool(v) and v[-1] == "data: [DONE]" and '"error"' not in "".join(v) for v in results.values()
        )
        code = s.process.wait(timeout=120)
        check("drain: streams in flight finish", done == 8, f"{done}/8")
        check("drain: a new request is refused", late in (0, 503), str(late))
        check("drain: exit status 0", code == 0, str(code))
    return figures


# --------------------------------------------------------------------------- 4. lora, speculation, int8
def variants_section(mode: Mode, models: Models, which: str) -> dict[str, Any]:
    need("openai")
    from plimsoll import metric_names as mn

    n = mode.new_tokens
    if which == "ngram":  # prompts that repeat, so lookups find continuations
        base = prompts(models.vocab, 16, 40, seed=4)
        ids = [p + p[:20] + p + p[:20] for p in base]
    else:
        ids = prompts(models.vocab, 16, 120, seed=5)
    figures: dict[str, Any] = {}
    if which == "lora":
        want = reference(models.main, ids, n, lora=models.lora)
        args: list[str] = ["--enable-lora", "--lora-modules", f"ad={models.lora}", "--max-lora-rank", "8"]
        model_name = "ad"
    elif which == "int8":
        want = reference(models.main, ids, n, quantization="int8", kv_cache_dtype="int8")
        args, model_name = ["--quantization", "int8", "--kv-cache-dtype", "int8"], "m"
    else:
        want = reference(models.main, ids, n)
        spec = (
            {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
            if which == "ngram"
            else {"model": str(models.draft), "num_speculative_tokens": 3}
        )
        args, model_name = ["--speculative-config", json.dumps(spec)], "m"
    with Server(mode, models.main, *args) as s:
        figures["kv"] = s.kv_line
        got = parallel(lambda p: s.greedy(p, n, model=model_name), ids)
        equal_to_reference(which, got, want, n)
        sampled = parallel(
            lambda p: s.client.completions.create(
                model=model_name, prompt=p, max_tokens=n, seed=3, extra_body={"ignore_eos": True}
            ),
            ids,
        )
        check(f"{which}: sampled requests", all(o.usage.completion_tokens == n for o in sampled))
        if which in ("ngram", "draft"):
            m = scrape(s.url)
            drafted, accepted = (
                metric(m, mn.SPEC_DECODE_NUM_DRAFT_TOKENS),
                metric(m, mn.SPEC_DECODE_NUM_ACCEPTED_TOKENS),
            )
            figures.update(draft_tokens=drafted, accepted_tokens=accepted)
            check(
                f"{which}: proposals made and accepted",
                drafted > 0 and accepted > 0,
                f"{accepted:.0f}/{drafted:.0f}",
            )
    return figures


# --------------------------------------------------------------------------- 5. throughput
def throughput_section(mode: Mode, models: Models) -> dict[str, Any]:
    need("openai")
    dtype = "bfloat16" if mode.device != "cpu" else "float32"
    ids = prompts(models.vocab, CLIENTS, 160, seed=6)
    figures: dict[str, Any] = {}
    with Server(mode, models.big, dtype=dtype) as s:
        figures["kv"] = s.kv_line

        def load(temperature: float | None) -> float:
            def one(p: list[int]) -> int:
                extra = {} if temperature is None else {"temperature": temperature}
                out = s.client.completions.create(
                    model="m",
                    prompt=p,
                    max_tokens=mode.throughput_tokens,
                    extra_body={"ignore_eos": True},
                    **extra,
                )
                return out.usage.completion_tokens

            parallel(one, ids[:8])  # warm
            t, tokens = time.monotonic(), 0
            for _ in range(mode.throughput_rounds):
                tokens += sum(parallel(one, ids))
            return tokens / (time.monotonic() - t)

        greedy, sampled = load(0.0), load(None)  # None: the API default, temperature 1.0
        again = load(0.0)
        ratio = sampled / ((greedy + again) / 2)
        figures.update(
            greedy_tok_s=round(greedy, 1),
            sampled_tok_s=round(sampled, 1),
            greedy_again_tok_s=round(again, 1),
            ratio=round(ratio, 3),
        )
        say(
            f"  c={CLIENTS}: greedy {greedy:.1f} tok/s, sampled {sampled:.1f} tok/s, greedy again {again:.1f}; sampled / greedy = {ratio:.3f}"
        )
        if mode.device != "cpu":
            check("sampled / greedy tok/s at c=64 >= 0.9", ratio >= 0.9, f"{ratio:.3f}")
    return figures


# --------------------------------------------------------------------------- 6. rope at 4k, bf16
def rope_section(mode: Mode, models: Models) -> dict[str, Any]:
    torch = need("torch")
    from transformers import AutoModelForCausalLM

    from plimsoll.runtime import LLM, SamplingParams

    dev = mode.device
    dtype = torch.bfloat16
    ids = prompts(models.vocab, 1, mode.rope_prompt, seed=8)[0]
    ids = (ids * 2)[: mode.rope_prompt]
    new = 8
    hf = AutoModelForCausalLM.from_pretrained(str(models.main), dtype=dtype, attn_implementation="sdpa").to(
        dev
    )
    with torch.inference_mode():
        ref_logits = hf(torch.tensor([ids], device=dev)).logits[0, -1].float()
        ref_tokens = hf.generate(
            torch.tensor([ids], device=dev), max_new_tokens=new, do_sample=False, pad_token_id=0
        )[0, len(ids) :].tolist()
    del hf
    llm = LLM(
        model=str(models.main),
        device=dev,
        dtype="bfloat16",
        max_model_len=len(ids) + 64,
        **({"kv_cache_memory": "256MiB"} if dev == "cpu" else {}),
    )
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, logprobs=0))[
        0
    ].outputs[0]
    runner = llm.engine.runner
    from plimsoll.runtime.engine.request import Request
    from plimsoll.runtime.engine.scheduler import SchedulerOutput

    def last_logits() -> Any:
        req = Request("rope", "rope", 0, ids, SamplingParams(max_tokens=1), frozenset())
        req.block_ids = list(range(-(-len(ids) // llm.config.block_size)))
        req.num_computed_tokens = len(ids)
        _, logits = runner.execute(SchedulerOutput(scheduled=[(req, len(ids))]))
        return logits[0].float()

    ours = last_logits()
    cos = float(torch.nn.functional.cosine_similarity(ours, ref_logits, dim=0))
    rotary = runner.model.model.rotary_emb
    exact = rotary.inv_freq.clone()
    rotary.inv_freq = exact.to(torch.bfloat16).float()  # what a bf16 cast would leave
    cast = float(torch.nn.functional.cosine_similarity(last_logits(), ref_logits, dim=0))
    rotary.inv_freq = exact
    same = sum(a == b for a, b in zip(out.token_ids, ref_tokens, strict=False))
    figures = dict(
        prompt_tokens=len(ids),
        cosine=round(cos, 5),
        cosine_with_bf16_inv_freq=round(cast, 5),
        equal_tokens=f"{same}/{new}",
    )
    say(
        f"  {len(ids)}-token prompt, bf16: logits cosine {cos:.5f} (with bf16 RoPE frequencies {cast:.5f}); first {new} tokens equal {same}/{new}"
    )
    check("bf16 at a long prompt: the first token equals transformers'", out.token_ids[:1] == ref_tokens[:1])
    check("bf16 at a long prompt: last-position logits cosine >= 0.99", cos >= 0.99, f"{cos:.5f}")
    return figures


# --------------------------------------------------------------------------- 7. memory by utilization
def memory_section(mode: Mode, models: Models) -> dict[str, Any]:
    torch = need("torch")
    if mode.device == "cpu" or not torch.cuda.is_available():
        raise Skip("sizing by --gpu-memory-utilization needs CUDA (the CPU CI test uses a fake card)")
    from plimsoll import plan as planning
    from plimsoll.runtime import LLM, SamplingParams

    figures: dict[str, Any] = {}
    import gc

    for label, spec in (
        ("no draft", None),
        ("draft", {"model": str(models.draft), "num_speculative_tokens": 3}),
    ):
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        llm = LLM(
            model=str(models.big),
            device="cuda",
            dtype="bfloat16",
            max_num_seqs=CLIENTS,
            speculative_config=spec,
        )
        engine = llm.engine
        budget = engine.kv_budget
        assert budget is not None
        ids = prompts(models.vocab, CLIENTS, 400, seed=10)
        llm.generate(
            ids, SamplingParams(max_tokens=64, ignore_eos=True, temperature=1.0, top_p=0.9, logprobs=5)
        )
        peak = torch.cuda.max_memory_reserved()
        _, total = torch.cuda.mem_get_info()
        steps = {
            s.name: s.value
            for s in planning.make_plan(
                planning.read_model_config(models.big), gpu_memory=total, dtype="bf16", memory_fraction=0.9,
                context_length=engine.max_model_len,
            )
        }  # fmt: skip
        row = dict(
            kv_line=engine.kv_cache_line(),
            kv_tokens=engine.num_blocks * engine.config.block_size,
            plan_kv_tokens=steps["KV tokens that fit"] if spec is None else "n/a (plan has no draft model)",
            weights_GiB=round(budget.weights / 2**30, 3),
            activations_GiB=round(budget.activations / 2**30, 3),
            plan_activations_GiB=round(steps["activations"] / 2**30, 3),
            non_torch_GiB=round(budget.non_torch / 2**30, 3),
            max_memory_reserved_GiB=round(peak / 2**30, 2),
            total_GiB=round(total / 2**30, 2),
        )
        figures[label] = row
        say(f"  {label}: {row}")
        check(
            f"{label}: max_memory_reserved within 0.9 of the card", peak <= 0.9 * total, f"{peak / total:.3f}"
        )
        del llm, engine
    return figures


# --------------------------------------------------------------------------- main
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--device", default="cuda", help="cuda (the check) or cpu (small models: checks the script)"
    )
    parser.add_argument(
        "--budget-s", type=float, default=500.0, help="stop starting sections after this many seconds"
    )
    parser.add_argument("--tokenizer", default=None, help="a directory with SmolLM2's tokenizer.json")
    parser.add_argument(
        "--sections",
        default="sampler,server,throughput,memory,preemption,rope,ngram,draft,lora,int8",
    )
    args = parser.parse_args()
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            say("no CUDA device: run with --device cpu to check the script on this machine")
            return 2
    tokenizer = find_tokenizer(args.tokenizer)
    say(f"=== server check on {args.device} (tokenizer {tokenizer}) ===")
    wanted = set(args.sections.split(","))
    with tempfile.TemporaryDirectory(prefix="plimsoll-server-check-") as tmp:
        from transformers import AutoTokenizer

        mode = mode_for(args.device, len(AutoTokenizer.from_pretrained(str(tokenizer))))
        models = make_models(Path(tmp), mode, tokenizer)
        # What a GPU run must show first (the sampler's chi-square, the server, sampled ÷ greedy, the
        # KV line on the card), then the other configurations, while the budget lasts.
        plan: list[tuple[str, float, Callable[[], dict[str, Any]]]] = [
            ("sampler", 10, lambda: sampler_section(mode)),
            ("server", 60, lambda: main_server_section(mode, models)),
            ("throughput", 60, lambda: throughput_section(mode, models)),
            ("memory", 40, lambda: memory_section(mode, models)),
            ("preemption", 40, lambda: preemption_section(mode, models)),
            ("rope", 20, lambda: rope_section(mode, models)),
            ("ngram", 30, lambda: variants_section(mode, models, "ngram")),
            ("draft", 30, lambda: variants_section(mode, models, "draft")),
            ("lora", 30, lambda: variants_section(mode, models, "lora")),
            ("int8", 30, lambda: variants_section(mode, models, "int8")),
        ]
        for name, min_s, fn in plan:
            if name in wanted:
                section(name, args.budget_s, min_s, fn)
    say("\n=== summary ===")
    for name, fig in RESULTS["sections"].items():
        say(f"[{name}] {fig.get('status')} ({fig.get('seconds')} s)")
    return finish("gpu_server_check.json")


if __name__ == "__main__":
    sys.exit(main())
