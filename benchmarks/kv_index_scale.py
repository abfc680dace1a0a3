"""The router's KV block index at fleet size, from synthetic KV event streams in one process.

Builds the index a router would hold for REPLICAS replicas × BLOCKS blocks each (a share of
them common prefixes held by many replicas, the rest each replica's own), then, while
synthetic events arrive at RATE events/s through the real decoder and index (vLLM's msgpack
schema, ``KVEventSubscriber.handle``), scores requests the size llm-d measured (240k tokens
= 15,000 blocks of 16, against 96 replicas) and smaller ones. Prints score time p50/p99
(hashing the prompt apart from the index walk), index memory (RSS growth), and event lag
(the time from a batch being due to it being applied, on the scoring loop's one thread).

    python benchmarks/kv_index_scale.py [--replicas 100] [--blocks 100000] [--rate 2000]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from plimsoll.router.kv_events import KVEventSubscriber
from plimsoll.router.kv_index import KVBlockIndex
from plimsoll.runtime.kv.blocks import chain_hashes_fast, event_hash
from plimsoll.runtime.kv.events import BlockRemoved, BlockStored, EventBatch, encode_batch


def rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", type=int, default=100)
    ap.add_argument("--blocks", type=int, default=100_000, help="blocks each replica holds")
    ap.add_argument(
        "--shared-fraction",
        type=float,
        default=0.3,
        help="share of each replica's blocks that are common prefixes",
    )
    ap.add_argument("--rate", type=float, default=2000.0, help="synthetic events per second during scoring")
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()
    rng = random.Random(0)
    index = KVBlockIndex(max_replicas=max(128, args.replicas))
    sub = KVEventSubscriber(index, stale_after_s=60)
    names = [f"http://10.0.{i // 250}.{i % 250}:8000" for i in range(args.replicas)]
    for n in names:
        sub.watch(n, "tcp://unused:1")  # no loop running: handle() is driven directly

    # 1. Fill: common prefixes (one pool, each replica holding a random 30%) and each replica's own blocks.
    common = [rng.getrandbits(64) for _ in range(int(args.blocks * args.shared_fraction * 3))]
    rss0, t0 = rss_bytes(), time.perf_counter()
    seqs = dict.fromkeys(names, 0)
    for n in names:
        mine = rng.sample(common, int(args.blocks * args.shared_fraction))
        mine += [rng.getrandbits(64) for _ in range(args.blocks - len(mine))]
        for i in range(0, len(mine), 1000):  # batches of 1000 blocks, as a long prefill publishes
            sub.handle(
                n,
                seqs[n],
                encode_batch(
                    EventBatch(time.time(), [BlockStored(mine[i : i + 1000], None, [], 16, None, "GPU")])
                ),
            )
            seqs[n] += 1
    fill_s = time.perf_counter() - t0
    rss = rss_bytes() - rss0
    print(
        f"index: {args.replicas} replicas x {args.blocks} blocks = {args.replicas * args.blocks:,} (replica, block) pairs, "
        f"{len(index):,} distinct hashes; filled in {fill_s:.1f} s ({args.replicas * args.blocks / fill_s:,.0f} blocks/s); "
        f"RSS +{rss / 2**30:.2f} GiB ({rss / max(1, len(index)):.0f} B per distinct hash)"
    )

    # 2. Requests: a replica-held prompt of P blocks (240k tokens = 15,000 blocks) scored against 96 replicas.
    def prompt_hashes(blocks: int) -> list[int]:
        holder = rng.choice(names)
        held = [h for h, v in index.entries.items() if v >> index.slot_of[holder] & 1]
        return held[:blocks]

    results: dict[int, tuple[list[float], list[float]]] = {}
    lags: list[float] = []
    candidates = names[:96]
    event_interval = 1.0 / args.rate
    next_event = time.perf_counter()
    deadline = next_event + args.seconds
    sizes = (1_000, 15_000)
    tokens_for_hash = {b: [rng.randrange(50_000) for _ in range(b * 16)] for b in sizes}
    prompts = {b: prompt_hashes(b) for b in sizes}
    i = 0
    applied = 0
    next_event = time.perf_counter()
    deadline = next_event + args.seconds
    while time.perf_counter() < deadline:
        # Apply every event now due (one per batch: the worst case for per-batch cost), recording its lag.
        now = time.perf_counter()
        while next_event <= now:
            n = names[applied % len(names)]
            h = rng.getrandbits(64)
            ev = BlockStored([h], None, [], 16, None, "GPU") if applied % 2 == 0 else BlockRemoved([h], "GPU")
            sub.handle(n, seqs[n], encode_batch(EventBatch(time.time(), [ev])))
            seqs[n] += 1
            lags.append(time.perf_counter() - next_event)
            next_event += event_interval
            applied += 1
        blocks = sizes[i % len(sizes)]
        i += 1
        t0 = time.perf_counter()
        hashed = [event_hash(h) for h in chain_hashes_fast(tokens_for_hash[blocks], 16)]
        t1 = time.perf_counter()
        scores = index.score(candidates, prompts[blocks])
        t2 = time.perf_counter()
        assert max(s.blocks for s in scores.values()) == len(prompts[blocks]) and len(hashed) == blocks
        results.setdefault(blocks, ([], []))[0].append(t1 - t0)
        results[blocks][1].append(t2 - t1)
    print(f"events applied during scoring: {applied:,} ({applied / args.seconds:,.0f}/s)")
    print(
        f"event lag: p50 {pct(lags, 0.5) * 1e3:.2f} ms, p99 {pct(lags, 0.99) * 1e3:.2f} ms, max {max(lags) * 1e3:.1f} ms"
    )
    for blocks, (hash_s, score_s) in sorted(results.items()):
        print(
            f"prompt {blocks * 16:>7,} tokens ({blocks:>6,} blocks) x {len(candidates)} replicas, {len(score_s)} requests: "
            f"score p50 {statistics.median(score_s) * 1e3:.1f} ms, p99 {pct(score_s, 0.99) * 1e3:.1f} ms; "
            f"hashing the prompt p50 {statistics.median(hash_s) * 1e3:.1f} ms"
        )


if __name__ == "__main__":
    main()
