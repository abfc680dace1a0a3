"""Prefix affinity vs round-robin through `plimsoll route`: prefix-cache hit ratio and TTFT p95.

What it is: a benchmark script that starts three real `plimsoll serve` replicas
(a tiny random model, a deliberately small KV cache) unless replica URLs are
given, runs the same kind of workload through the router once per policy — many
requests sharing a handful of long system prompts, each run with its own fresh
prompts so no run inherits another's cache — and prints, side by side, the
replicas' prefix-cache hit ratio (Δ plimsoll_prefix_cache_hits_total /
Δ plimsoll_prefix_cache_queries_total, summed over replicas) and the TTFT p50/p95
measured by the client through the router. What it is not: a timed test; the CI
test (tests/router/test_router_real.py) imports :func:`measure` and only asserts
the direction with a margin.

Usage:
    python benchmarks/router_prefix.py [--requests 144] [--concurrency 3] [--system-prompts 18]
    python benchmarks/router_prefix.py --replica http://127.0.0.1:8001 ... --model NAME
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import string
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import openai
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from plimsoll import metric_names
from plimsoll.bench.script_args import add_options
from plimsoll.router.app import build_app
from plimsoll.router.config import RouterConfig
from plimsoll.router.proxy import REPLICA_HEADER

# The tiny test model has 256 positions and one token per byte: system prompts of
# 192 characters (12 blocks of 16) plus a short question and 4 output tokens fit.
# 512 KiB of KV cache at 512 bytes per token is 64 blocks: with one or two
# requests running, about four system prompts stay cached. A replica that sees
# all 18 prompts (round-robin) keeps few of them until they come round again;
# one that sees only its share (affinity, ~6) keeps a good part of it.
TINY_SERVE_ARGS = (
    "--kv-cache-memory", "512KiB", "--block-size", "16", "--max-num-seqs", "8", "--drain-timeout", "2",
)


@dataclass(frozen=True)
class Workload:
    system_prompts: int = 18
    system_chars: int = 192
    requests: int = 144
    concurrency: int = 3
    max_tokens: int = 4
    # Shorter than the system prompts, so the key is the shared part only.
    prefix_chars: int = 128
    # Bounded-load factor c of prefix affinity (the router's --load-factor).
    load_factor: float = 1.25


@dataclass(frozen=True)
class Result:
    policy: str
    hit_ratio: float
    ttft_p50: float
    ttft_p95: float
    per_replica: dict[str, int]
    errors: int


def make_prompts(workload: Workload, seed: int) -> list[str]:
    rng = random.Random(seed)
    letters = string.ascii_lowercase + "     "
    systems = ["".join(rng.choice(letters) for _ in range(workload.system_chars))
               for _ in range(workload.system_prompts)]
    return [f"{rng.choice(systems)}\nQ{i}: {''.join(rng.choice(letters) for _ in range(12))}\nA:"
            for i in range(workload.requests)]


def prefix_counters(urls: Sequence[str]) -> tuple[float, float]:
    """(hits, queries) in tokens, summed over replicas."""
    hits = queries = 0.0
    for url in urls:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == metric_names.PREFIX_CACHE_HITS:
                    hits += sample.value
                elif sample.name == metric_names.PREFIX_CACHE_QUERIES:
                    queries += sample.value
    return hits, queries


@contextlib.asynccontextmanager
async def running_router(**config: Any) -> AsyncIterator[str]:
    """`plimsoll route`'s app on a free 127.0.0.1 port inside this event loop; yields its URL."""
    server = uvicorn.Server(uvicorn.Config(build_app(RouterConfig(port=0, **config)), host="127.0.0.1", port=0,
                                           log_level="warning", ws="none"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("router exited before it started")
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        await task


async def measure(policy: str, replica_urls: Sequence[str], model: str, workload: Workload, seed: int) -> Result:
    """Run one workload through a router with `policy`; return hit ratio, TTFT and the split."""
    prompts = make_prompts(workload, seed)
    hits_before, queries_before = prefix_counters(replica_urls)
    ttfts: list[float] = []
    served: Counter[str] = Counter()
    errors = 0
    async with running_router(backends=tuple(replica_urls), policy=policy, prefix_chars=workload.prefix_chars,
                              load_factor=workload.load_factor,
                              scrape_interval_s=0.5) as url:
        api = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        todo = iter(prompts)

        async def worker() -> None:
            nonlocal errors
            for prompt in todo:
                start = time.monotonic()
                try:
                    raw = await api.completions.with_raw_response.create(
                        model=model, prompt=prompt, max_tokens=workload.max_tokens, temperature=0, stream=True)
                    first = None
                    async for _ in raw.parse():
                        first = first or time.monotonic()
                    if first is not None:
                        ttfts.append(first - start)
                    served[raw.headers[REPLICA_HEADER]] += 1
                except openai.APIError:
                    errors += 1

        await asyncio.gather(*(worker() for _ in range(workload.concurrency)))
        await api.close()
    hits_after, queries_after = prefix_counters(replica_urls)
    queries = queries_after - queries_before
    return Result(
        policy=policy,
        hit_ratio=(hits_after - hits_before) / queries if queries else 0.0,
        ttft_p50=float(np.percentile(ttfts, 50)) if ttfts else float("nan"),
        ttft_p95=float(np.percentile(ttfts, 95)) if ttfts else float("nan"),
        per_replica=dict(served),
        errors=errors,
    )


def start_tiny_replicas(count: int, model_name: str = "tiny") -> list[Any]:
    """Start `count` real `plimsoll serve` replicas of the tiny random model, in parallel."""
    from plimsoll.runtime.testing import ServerProcess, write_tiny_model

    model_dir = write_tiny_model(tempfile.gettempdir() + "/plimsoll-router-tiny-model")
    servers = [ServerProcess(["--model", str(model_dir), "--served-model-name", model_name, *TINY_SERVE_ARGS],
                             startup_timeout=300) for _ in range(count)]
    with ThreadPoolExecutor(count) as pool:
        list(pool.map(lambda s: s.start(), servers))
    return servers


def format_table(results: Sequence[Result]) -> str:
    lines = [f"{'policy':<16} {'hit ratio':>9} {'TTFT p50 s':>10} {'TTFT p95 s':>10} {'errors':>6}  split"]
    for r in results:
        split = " ".join(str(n) for _, n in sorted(r.per_replica.items()))
        lines.append(f"{r.policy:<16} {r.hit_ratio:>9.3f} {r.ttft_p50:>10.3f} {r.ttft_p95:>10.3f} "
                     f"{r.errors:>6}  {split}")
    base, affine = results[0], results[-1]
    if base.hit_ratio > 0:
        lines.append(f"hit ratio {affine.policy} / {base.policy} = {affine.hit_ratio / base.hit_ratio:.2f}x")
    else:
        lines.append(f"hit ratio {base.policy} = 0 (no prefix reuse at all); {affine.policy} = "
                     f"{affine.hit_ratio:.3f}")
    lines.append(f"TTFT p95 {affine.policy} / {base.policy} = {affine.ttft_p95 / base.ttft_p95:.2f}x")
    return "\n".join(lines)


async def compare(replica_urls: Sequence[str], model: str, workload: Workload, seed: int) -> list[Result]:
    return [await measure(policy, replica_urls, model, workload, seed + i)
            for i, policy in enumerate(("round-robin", "prefix-affinity"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replica", action="append", default=[], help="Existing replica URL (repeat).")
    parser.add_argument("--model", default="tiny", help="Model name the replicas serve.")
    add_options(parser, requests=144, concurrency=3, system_prompts=18, system_chars=192, prefix_chars=128,
                load_factor=1.25, seed=0)
    args = parser.parse_args()
    workload = Workload(system_prompts=args.system_prompts, system_chars=args.system_chars, requests=args.requests,
                        concurrency=args.concurrency, prefix_chars=args.prefix_chars,
                        load_factor=args.load_factor)
    servers = [] if args.replica else start_tiny_replicas(3, args.model)
    urls = args.replica or [s.url for s in servers]
    try:
        results = asyncio.run(compare(urls, args.model, workload, args.seed))
    finally:
        for server in servers:
            server.stop()
    print(f"{len(urls)} replicas, {workload.requests} requests, concurrency {workload.concurrency}, "
          f"{workload.system_prompts} system prompts of {workload.system_chars} chars, "
          f"prefix key {workload.prefix_chars} chars, load factor {workload.load_factor}")
    print(format_table(results))


if __name__ == "__main__":
    main()
