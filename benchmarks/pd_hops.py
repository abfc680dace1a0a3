"""Where a split request's decode hop spends its time, one request at a time, on this host.

What it measures: two replicas of ``pd_split.py``'s bench model (``kv_both``, each pinned to a core);
40 sequential requests of a 33-token prompt sent whole to the decode replica (it prefills them all),
then 40 that were first prefilled on the other replica (``max_tokens`` 1, ``do_remote_decode``) and
then sent to the decode replica with the parameters it answered (the decode replica pulls the whole
blocks and prefills the last token). Prints the client's TTFT p50 and, from the decode replica's
histograms over each set, its mean TTFT, queue time, prefill time (first scheduled to first token:
a pulled request's wait for its blocks is in it) and end-to-end latency. A script, not a test.

    python benchmarks/pd_hops.py
"""

import asyncio
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from pd_split import serve, small_model

from plimsoll import metric_names as mn
from plimsoll.prometheus import parse

PROMPT = "The quick brown fox jumps over t"


async def ttft(client, url, body):
    t0 = time.monotonic()
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and '"text"' in line:
                first = time.monotonic() - t0
        return first


async def means(client, url):
    s = parse((await client.get(url + "/metrics")).text)
    out = {}
    for k in (
        mn.TIME_TO_FIRST_TOKEN,
        mn.REQUEST_QUEUE_TIME,
        mn.REQUEST_PREFILL_TIME,
        mn.KV_PREFETCH_WAIT,
        mn.KV_TRANSFER_TIME,
        "plimsoll_e2e_request_latency_seconds",
    ):
        out[k] = (s.sum(k + "_sum") or 0.0, s.sum(k + "_count") or 0.0)
    out["fail"] = s.sum(mn.KV_TRANSFER_FAILURES) or 0.0
    out["pulls"] = s.sum("plimsoll_kv_transfer_pulls_total") or 0.0
    out["bytes"] = sum(
        v for labels, v in s.samples.get(mn.KV_TRANSFER_BYTES, []) if labels.get("direction") == "received"
    )
    return out


async def main():
    model = small_model()
    reps = [serve(model, c, 2048, "256MiB") for c in (0, 1)]
    for r in reps:
        r.start()
    urls = [r.url for r in reps]
    try:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {
                "model": model,
                "prompt": PROMPT,
                "max_tokens": 4,
                "temperature": 0,
                "stream": True,
                "ignore_eos": True,
            }
            pb = {**body, "stream": False, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
            for _ in range(5):
                await ttft(client, urls[1], body)
            for label, use_split in (
                ("direct (decode replica prefills all)", False),
                ("hop 2 (pulled)", True),
            ):
                b0 = await means(client, urls[1])
                cl = []
                for i in range(40):
                    # Its own first block: no prompt shares a cached block with another (no prefix hit).
                    b = {**body, "prompt": f"{int(use_split)}{i:02d}" + PROMPT[3:]}
                    if use_split:
                        js = (
                            await client.post(urls[0] + "/v1/completions", json={**pb, "prompt": b["prompt"]})
                        ).json()
                        b["kv_transfer_params"] = js["kv_transfer_params"]
                    cl.append(await ttft(client, urls[1], b))
                b1 = await means(client, urls[1])
                print(f"{label}: client TTFT p50 {statistics.median(cl) * 1e3:.1f} ms")
                print(f"    failed pulls {b1['fail'] - b0['fail']:.0f}")
                for k in (k for k in b1 if k not in ("fail", "pulls", "bytes")):
                    ds, dc = b1[k][0] - b0[k][0], b1[k][1] - b0[k][1]
                    if dc:
                        print(f"    {k} mean {ds / dc * 1e3:.1f} ms (n={dc:.0f})")
                print(f"    pulls {b1['pulls'] - b0['pulls']:.0f}, bytes {b1['bytes'] - b0['bytes']:.0f}")
    finally:
        for r in reps:
            r.stop(timeout=30)


if __name__ == "__main__":
    asyncio.run(main())
