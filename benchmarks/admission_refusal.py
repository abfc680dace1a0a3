"""A 10× burst on one real `plimsoll serve` with SLO-aware admission: how fast a refusal comes back.

What it measures: one `plimsoll serve` (the embedded model, or ``--model``) with
``--max-num-seqs`` ``--slots``; a few requests first so the replica has measured its
rates (until then it admits everything). Then open-loop Poisson arrivals of streamed
completions, each carrying ``x-slo-ttft-ms: --slo-ms``: ``--base`` per second for
``--before`` s, ``--factor`` × that for ``--burst`` s. Each request ends one of three ways:

* refused: 429 — timed from sending to the response head, with or without ``Retry-After``;
  at admission, or from the queue after admission (``x-plimsoll-refused-in-queue-ms``: the
  replica held it to its bound and refused it before computing any of it);
* served: timed to the first streamed byte, met or missed its TTFT SLO;
* timed out: nothing within ``--timeout`` s (a request left waiting in a queue).

It prints the share met, refused and timed out; the refusal latency p50/p95/max and how
many refusals carried ``Retry-After``; served TTFT p50/p95/max; and, for the admitted requests that missed their bound, the cause the
replica gave (``plimsoll_admitted_ttft_missed_total``: a step slower than its promise allowed,
or none). The client, the server
and everything else on the host share the CPU, so the refusal latency includes the
host's scheduling delay; run it with ``uptime`` beside it. A script that prints figures,
not a test.

    python benchmarks/admission_refusal.py [--burst 20] [--factor 10]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import time
from dataclasses import dataclass

import httpx

from plimsoll.metric_names import (
    ADMITTED_TTFT_MISSES,
    DECODE_STEP_SECONDS,
    PREFILL_TOKENS_PER_SECOND,
    TIME_TO_FIRST_TOKEN,
)
from plimsoll.runtime.testing import ServerProcess
from plimsoll.ttft_prediction import PREDICTED_TTFT_HEADER, REFUSED_IN_QUEUE_HEADER


@dataclass
class Outcome:
    kind: str  # "served", "refused", "timeout", "error"
    seconds: float  # to the 429's head (refused), the first byte (served), the give-up (timeout)
    retry_after: bool = False
    in_burst: bool = False
    predicted: float | None = None  # the replica's predicted TTFT (seconds), from its response header
    in_queue: bool = False  # refused from the queue after admission (not at admission)


async def one(
    client: httpx.AsyncClient, url: str, body: dict[str, object], slo_ms: float, timeout: float
) -> Outcome:
    t0 = time.perf_counter()
    headers = {"x-slo-ttft-ms": f"{slo_ms:.0f}"}
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as response:
                predicted = response.headers.get(PREDICTED_TTFT_HEADER)
                predicted_s = float(predicted) / 1000 if predicted is not None else None
                if response.status_code == 429:
                    return Outcome(
                        "refused",
                        time.perf_counter() - t0,
                        "retry-after" in response.headers,
                        predicted=predicted_s,
                        in_queue=REFUSED_IN_QUEUE_HEADER in response.headers,
                    )
                if response.status_code != 200:
                    await response.aread()
                    return Outcome("error", time.perf_counter() - t0)
                first = None
                async for line in response.aiter_lines():
                    if first is None and line:
                        first = time.perf_counter() - t0
                seconds = first if first is not None else time.perf_counter() - t0
                return Outcome("served", seconds, predicted=predicted_s)
    except TimeoutError:
        return Outcome("timeout", time.perf_counter() - t0)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def gauges(text: str) -> dict[str, float]:
    """The replica's measured rates and TTFT histogram totals from its ``/metrics`` text."""
    wanted = {
        PREFILL_TOKENS_PER_SECOND: "prefill_tok_s",
        DECODE_STEP_SECONDS: "decode_step_s",
        TIME_TO_FIRST_TOKEN + "_sum": "ttft_sum",
        TIME_TO_FIRST_TOKEN + "_count": "ttft_count",
    }
    out: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            out[wanted[name]] = float(line.rsplit(" ", 1)[1])
        elif name == ADMITTED_TTFT_MISSES:  # one line per cause
            cause = line.split('cause="', 1)[1].split('"', 1)[0]
            out[f"missed_{cause}"] = float(line.rsplit(" ", 1)[1])
    return out


async def sample_rates(client: httpx.AsyncClient, url: str, into: list[dict[str, float]]) -> None:
    """Read the replica's measured rates twice a second until cancelled."""
    while True:
        with contextlib.suppress(httpx.HTTPError):
            into.append(gauges((await client.get(f"{url}/metrics")).text))
        await asyncio.sleep(0.5)


async def run(args: argparse.Namespace, url: str) -> tuple[list[Outcome], list[dict[str, float]]]:
    body = {
        "prompt": "The capital of France is",
        "max_tokens": args.output,
        "stream": True,
        "ignore_eos": True,
    }
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        for _ in range(4):  # the replica measures its rates from these
            await one(client, url, body, 60_000, args.timeout)
        samples: list[dict[str, float]] = [gauges((await client.get(f"{url}/metrics")).text)]
        sampler = asyncio.create_task(sample_rates(client, url, samples))
        rng = random.Random(args.seed)
        tasks: list[asyncio.Task[Outcome]] = []
        burst_flags: list[bool] = []
        start = time.perf_counter()
        t = 0.0
        end = args.before + args.burst
        while True:
            rate = args.base * (args.factor if t >= args.before else 1.0)
            t += rng.expovariate(rate)
            if t >= end:
                break
            delay = start + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(client, url, body, args.slo_ms, args.timeout)))
            burst_flags.append(t >= args.before)
        outcomes = await asyncio.gather(*tasks)
        sampler.cancel()
        samples.append(gauges((await client.get(f"{url}/metrics")).text))
    for o, flag in zip(outcomes, burst_flags, strict=True):
        o.in_burst = flag
    return list(outcomes), samples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model directory (default: the embedded model)")
    p.add_argument("--slots", type=int, default=4, help="the server's --max-num-seqs")
    p.add_argument("--output", type=int, default=16, help="tokens per answer")
    p.add_argument("--base", type=float, default=1.0, help="requests per second before the burst")
    p.add_argument("--factor", type=float, default=10.0)
    p.add_argument("--before", type=float, default=5.0)
    p.add_argument("--burst", type=float, default=20.0)
    p.add_argument("--slo-ms", type=float, default=1000.0)
    p.add_argument("--timeout", type=float, default=60.0, help="a request with no answer by then timed out")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--switch-interval-ms",
        type=float,
        default=None,
        help="set the server process's GIL switch interval (Python's default is 5 ms): how long the "
        "engine thread may wait for the event loop's thread at each hand-over",
    )
    args = p.parse_args()
    serve_args = ["--max-num-seqs", str(args.slots), "--max-model-len", "512", "--kv-cache-memory", "256MiB"]
    if args.model:
        serve_args += ["--model", args.model]
    prelude = ""
    if args.switch_interval_ms is not None:
        prelude = f"import sys; sys.setswitchinterval({args.switch_interval_ms / 1000!r})"
    with ServerProcess(serve_args, startup_timeout=600, prelude=prelude) as server:
        outcomes, samples = asyncio.run(run(args, server.url))
        if server.proc is not None and server.proc.poll() is not None:
            # Its port was free when picked; another process that took it meanwhile answered instead.
            raise SystemExit(
                f"the server exited (code {server.proc.returncode}) before the run ended: no figures"
            )
    burst = [o for o in outcomes if o.in_burst]
    served = [o.seconds for o in burst if o.kind == "served"]
    refused = [o for o in burst if o.kind == "refused"]
    refusal = [o.seconds for o in refused if not o.in_queue]
    from_queue = [o.seconds for o in refused if o.in_queue]
    slo = args.slo_ms / 1000
    met = sum(1 for s in served if s <= slo)
    n = len(burst)
    interval = (
        f", GIL switch interval {args.switch_interval_ms:g} ms" if args.switch_interval_ms is not None else ""
    )
    print(f"host load {os.getloadavg()[0]:.1f} (1 min) at the end{interval}")
    print(f"{args.factor:g}× burst for {args.burst:g} s ({args.base:g} → {args.base * args.factor:g} req/s), "
          f"TTFT SLO {args.slo_ms:.0f} ms, {args.slots} slots, {args.output} tokens per answer")  # fmt: skip
    print(f"burst requests {n}: met SLO {met} ({met / max(n, 1):.1%}), served past SLO {len(served) - met}, "
          f"refused {len(refused)} ({sum(o.retry_after for o in refused)} with Retry-After), "
          f"timed out {sum(o.kind == 'timeout' for o in burst)}, other errors {sum(o.kind == 'error' for o in burst)}")  # fmt: skip
    if from_queue:
        print(f"refused from the queue after admission {len(from_queue)}: after p50 "
              f"{statistics.median(from_queue) * 1000:.0f} ms, max {max(from_queue) * 1000:.0f} ms")  # fmt: skip
    if refusal:
        print(f"refusal latency at admission: p50 {statistics.median(refusal) * 1000:.1f} ms, p95 {pct(refusal, 0.95) * 1000:.1f} ms, "
              f"max {max(refusal) * 1000:.1f} ms; within 50 ms {sum(r <= 0.05 for r in refusal) / len(refusal):.1%}")  # fmt: skip
    if served:
        print(
            f"served TTFT: p50 {statistics.median(served):.3f} s, p95 {pct(served, 0.95):.3f} s, max {max(served):.3f} s"
        )

    report_prediction(burst, slo)
    report_rates(samples, outcomes, slo)


def report_prediction(burst: list[Outcome], slo: float) -> None:
    """Predicted against measured TTFT for the admitted requests that reported a prediction."""
    pairs = [(o.predicted, o.seconds) for o in burst if o.kind == "served" and o.predicted is not None]
    if not pairs:
        print("predicted TTFT: none reported by the replica")
        return
    ratios = sorted(m / max(p, 1e-3) for p, m in pairs)
    missed = [(p, m) for p, m in pairs if m > slo]
    idle = sum(1 for p, _ in pairs if p > slo)
    print(f"admitted though predicted past the SLO (an idle replica admits, to re-measure its rates): {idle}, "
          f"of them missed {sum(1 for p, m in missed if p > slo)}; missed though predicted within it: "
          f"{sum(1 for p, m in missed if p <= slo)}")  # fmt: skip
    print(f"admitted with a prediction {len(pairs)}: measured/predicted TTFT p10 {pct(ratios, 0.1):.2f}, "
          f"p50 {pct(ratios, 0.5):.2f}, p90 {pct(ratios, 0.9):.2f}, max {ratios[-1]:.2f}; "
          f"measured − predicted p50 {statistics.median(m - p for p, m in pairs) * 1000:+.0f} ms")  # fmt: skip
    if missed:
        worst = ", ".join(
            f"{p * 1000:.0f}→{m * 1000:.0f}" for p, m in sorted(missed, key=lambda x: -x[1])[:8]
        )
        print(f"missed the SLO though admitted {len(missed)}: predicted→measured ms {worst}")


def report_rates(samples: list[dict[str, float]], outcomes: list[Outcome], slo: float) -> None:
    """The replica's measured rates over the run and its own TTFT (from arrival at the server) against the client's."""
    prefill = [s["prefill_tok_s"] for s in samples if "prefill_tok_s" in s]
    decode = [s["decode_step_s"] for s in samples if "decode_step_s" in s]
    if prefill and decode:
        print(f"measured rates: prefill {prefill[0]:.0f} tok/s before, {min(prefill):.0f}–{max(prefill):.0f} during; "
              f"decode step {decode[0] * 1000:.1f} ms before, {min(decode) * 1000:.1f}–{max(decode) * 1000:.1f} ms during")  # fmt: skip
    first, last = samples[0], samples[-1]
    causes = {k[len("missed_") :]: v - first.get(k, 0) for k, v in last.items() if k.startswith("missed_")}
    if causes:
        # The counter covers the whole run (the steady part before the burst too), as this count does.
        missed = sum(1 for o in outcomes if o.kind == "served" and o.seconds > slo)
        print(f"whole run (before and during the burst): admitted and missed {missed}; held to their bound "
              "and missed, by the replica's cause: "
              + ", ".join(f"{cause} {n:.0f}" for cause, n in sorted(causes.items())))  # fmt: skip
    count = last.get("ttft_count", 0) - first.get("ttft_count", 0)
    served = [o.seconds for o in outcomes if o.kind == "served"]
    if count > 0 and served:
        server_mean = (last["ttft_sum"] - first["ttft_sum"]) / count
        print(
            f"mean TTFT of the served: client {statistics.fmean(served) * 1000:.0f} ms, "
            f"server {server_mean * 1000:.0f} ms ({count:.0f} requests)"
        )


if __name__ == "__main__":
    main()
