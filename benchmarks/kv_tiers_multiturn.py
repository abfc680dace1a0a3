"""Multi-turn chat over three real replicas whose primary KV caches hold a third of the working set.

Four set-ups, the same conversations (long system prompts shared by groups of conversations,
each turn resending the whole history):

  (a) prefix-affinity routing, no tiers (today's policy)
  (b) prefix-affinity + a host tier per replica (--kv-offloading-size)
  (c) prefix-affinity + the tier shared through a real Valkey/Redis server
  (d) precise-prefix routing (the replicas' KV events) + the shared tier

Prints per set-up: TTFT p50/p95, prompt tokens computed (prompt − cached, from each response's
usage), hit rate per tier (the replicas' own counters), output tokens/s; then (d) against (a).

    python benchmarks/kv_tiers_multiturn.py [--conversations 64 --turns 6] [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from plimsoll.bench.script_args import add_options
from plimsoll.prometheus import parse
from plimsoll.runtime.testing import KeyValueServer, ServerProcess, free_port

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "kernel",
    "cache",
    "block",
    "router",
    "replica",
    "token",
    "prefix",
    "tier",
    "host",
    "shared",
    "event",
    "index",
    "vector",
    "matrix",
    "stream",
    "batch",
    "queue",
    "latency",
    "memory",
    "policy",
    "engine",
    "model",
    "layer",
    "head",
    "value",
    "key",
]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@dataclass
class Result:
    name: str
    ttft: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0
    errors: int = 0
    tiers: dict[str, float] = field(default_factory=dict)

    @property
    def computed(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    def line(self) -> str:
        t = sorted(self.ttft)
        p95 = t[min(len(t) - 1, int(0.95 * len(t)))] if t else float("nan")
        hits = " ".join(f"{k} {v:.1%}" for k, v in self.tiers.items())
        return (
            f"{self.name:<34} TTFT p50 {statistics.median(t) * 1e3:7.0f} ms  p95 {p95 * 1e3:7.0f} ms  "
            f"computed {self.computed:>7} of {self.prompt_tokens:>7} prompt tokens  "
            f"out {self.output_tokens / self.wall_s:6.1f} tok/s  errors {self.errors}  hits: {hits}"
        )


def conversations(
    n: int, turns: int, groups: int, system_words: int, seed: int
) -> list[tuple[str, list[str]]]:
    rng = random.Random(seed)
    systems = [f"System {g}: " + words(rng, system_words) for g in range(groups)]
    return [
        (systems[i % groups], [f"User {i}.{t}: " + words(rng, 24) for t in range(turns)]) for i in range(n)
    ]


async def run_conversations(url: str, model: str, convs: list[tuple[str, list[str]]], concurrency: int,
                            max_tokens: int, result: Result) -> None:  # fmt: skip
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:

        async def one(system: str, turns: list[str]) -> None:
            history = system
            for user in turns:
                history += "\n" + user + "\nAssistant:"
                async with sem:
                    body = {"model": model, "prompt": history, "max_tokens": max_tokens, "temperature": 0,
                            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}  # fmt: skip
                    t0 = time.perf_counter()
                    first, text, usage = None, "", None
                    try:
                        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                            if r.status_code != 200:
                                result.errors += 1
                                return
                            async for line in r.aiter_lines():
                                if not line.startswith("data: ") or line == "data: [DONE]":
                                    continue
                                chunk = json.loads(line[6:])
                                if chunk.get("choices"):
                                    if first is None:
                                        first = time.perf_counter() - t0
                                    text += chunk["choices"][0].get("text", "")
                                if chunk.get("usage"):
                                    usage = chunk["usage"]
                    except httpx.HTTPError:
                        result.errors += 1
                        return
                if first is not None:
                    result.ttft.append(first)
                if usage:
                    result.prompt_tokens += usage["prompt_tokens"]
                    result.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                    result.output_tokens += usage["completion_tokens"]
                history += text

        await asyncio.gather(*(one(s, t) for s, t in convs))


def tier_hits(urls: list[str]) -> dict[str, float]:
    queries = primary = 0.0
    by_medium: dict[str, float] = {}
    for url in urls:
        scrape = parse(httpx.get(f"{url}/metrics", timeout=10).text)
        queries += scrape.sum("plimsoll_prefix_cache_queries_total") or 0.0
        primary += scrape.sum("plimsoll_prefix_cache_hits_total") or 0.0
        for labels, value in scrape.samples.get("plimsoll_kv_tier_hits_total", []):
            by_medium[labels["medium"]] = by_medium.get(labels["medium"], 0.0) + value
    out = {"primary": primary / queries if queries else 0.0}
    out.update({m.lower(): v / queries for m, v in sorted(by_medium.items())} if queries else {})
    return out


async def measure(name: str, policy: str, serve_extra: list[str], args: argparse.Namespace,
                  convs: list[tuple[str, list[str]]], kv: KeyValueServer | None) -> Result:  # fmt: skip
    import uvicorn

    from plimsoll.router.app import build_app
    from plimsoll.router.config import RouterConfig

    ports = [free_port() for _ in range(3)]
    replicas = []
    for p in ports:
        extra = list(serve_extra)
        if kv is not None:
            extra += ["--kv-shared-url", kv.url]
        if policy == "precise-prefix":
            extra += [
                "--kv-events-config",
                json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{p + 1}"}),
            ]
        replicas.append(ServerProcess(["--model", args.model, "--served-model-name", "m", "--kv-cache-memory",
                                       str(args.kv_bytes), "--max-model-len", str(args.max_model_len),
                                       "--max-num-seqs", "4", "--drain-timeout", "2",
                                       "--enable-prompt-tokens-details", *extra],
                                      port=p, startup_timeout=600))  # fmt: skip
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda s: s.start(), replicas))
    urls = [r.url for r in replicas]
    cfg: dict[str, Any] = {"backends": tuple(urls), "policy": policy, "port": 0}
    if policy == "precise-prefix":
        cfg.update(
            kv_tokenizer=args.model,
            kv_events_endpoints={u: f"tcp://127.0.0.1:{p + 1}" for u, p in zip(urls, ports, strict=True)},
        )
    app = build_app(RouterConfig(**cfg))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    router_url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    result = Result(name)
    try:
        t0 = time.perf_counter()
        await run_conversations(router_url, "m", convs, args.concurrency, args.max_tokens, result)
        result.wall_s = time.perf_counter() - t0
        result.tiers = tier_hits(urls)
    finally:
        server.should_exit = True
        await task
        for r in replicas:
            r.terminate()
        for r in replicas:
            with contextlib.suppress(Exception):
                r.stop(timeout=20)
    return result


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="a model directory, smollm2-135m, or tiny")
    ap.add_argument("--groups", type=int, default=4, help="distinct system prompts")
    add_options(
        ap, conversations=64, turns=6, system_words=300, max_tokens=16, concurrency=6, host_gib=1.0, seed=0
    )
    args = ap.parse_args()
    from transformers import AutoConfig

    if args.model == "tiny":
        # The tiny random model (byte-level tokenizer): prefill is cheap, so TTFT ratios understate the
        # real ones; the prompt tokens computed and the hit rates do not depend on the model.
        from plimsoll.runtime.testing import pod_model

        args.model = str(pod_model(8192))

    from plimsoll.router.prompt_tokens import load_tokenizer

    tok = load_tokenizer(args.model)
    convs = conversations(args.conversations, args.turns, args.groups, args.system_words, args.seed)
    # Working set: every conversation's final history, the system prompts counted once per group.
    final = [
        len(tok.encode(s + "".join("\n" + u + "\nAssistant:" + " x" * args.max_tokens for u in turns)))
        for s, turns in convs
    ]
    system = len(tok.encode(convs[0][0]))
    working_set = sum(final) - system * (args.conversations - args.groups)
    from plimsoll.runtime.models.embedded import EMBEDDED_MODELS, ensure_embedded_model

    path = str(ensure_embedded_model(args.model)) if args.model in EMBEDDED_MODELS else args.model
    hf = AutoConfig.from_pretrained(path)
    heads = hf.num_key_value_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    per_token = 2 * hf.num_hidden_layers * heads * head_dim * 4  # float32 on CPU
    # Three replicas hold a third of the working set together (at least one longest history each).
    per_replica_tokens = -(-max(working_set // 9, max(final) + 64) // 16) * 16
    args.kv_bytes = per_replica_tokens * per_token
    args.max_model_len = min(per_replica_tokens, hf.max_position_embeddings)
    print(
        f"{args.conversations} conversations x {args.turns} turns, {args.groups} system prompts of {system} tokens; "
        f"longest history {max(final)} tokens; working set {working_set} tokens; each replica's KV cache "
        f"{per_replica_tokens} tokens ({args.kv_bytes / 2**20:.1f} MiB); the three hold "
        f"{3 * per_replica_tokens / working_set:.0%} of it",
        flush=True,
    )
    results = []
    host = ["--kv-offloading-size", str(args.host_gib)]
    with KeyValueServer(maxmemory="2gb") as kv:
        for name, policy, extra, shared in (
            ("(a) prefix-affinity, no tiers", "prefix-affinity", [], None),
            ("(b) prefix-affinity + host tier", "prefix-affinity", host, None),
            ("(c) prefix-affinity + shared tier", "prefix-affinity", [], kv),
            ("(d) precise-prefix + shared tier", "precise-prefix", [], kv),
        ):
            if shared is not None:
                httpx_flush(kv)
            results.append(await measure(name, policy, extra, args, convs, shared))
            print(results[-1].line(), flush=True)
    a, d = results[0], results[-1]
    print(
        f"(d) vs (a): prompt tokens computed {a.computed / max(d.computed, 1):.2f}x fewer; TTFT p50 "
        f"{statistics.median(a.ttft) / statistics.median(d.ttft):.2f}x lower; output tok/s "
        f"{(d.output_tokens / d.wall_s) / (a.output_tokens / a.wall_s):.2f}x"
    )


def httpx_flush(kv: KeyValueServer) -> None:
    """Empty the shared server between set-ups so each starts cold."""
    import redis

    redis.Redis.from_url(kv.url).flushall()


if __name__ == "__main__":
    tempfile.gettempdir()
    asyncio.run(main())
