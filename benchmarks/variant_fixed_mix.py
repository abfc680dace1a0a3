"""A fixed mix of simulated variant replicas at a fixed Poisson rate: what the curves predict, what is measured.

What runs: no control plane and no operator. Each variant's replicas are simulated replicas
(``bench/simulator.py``, the curves of ``benchmarks/variant_mix.py``) served by one helper process
per variant (``variant_mix_cluster.py --serve-replicas``, as the step-load run serves them) on
loopback addresses; a real router with static backends, each weighed by its variant's profiled
concurrency and requests/s (as ``status.variants`` weighs them), in this process or in its own
(``--router-process``); open-loop Poisson arrivals of streamed completions (4 tokens) for
``--seconds``.

Printed, per variant and overall: the share of requests, attainment (TTFT and mean TPOT each
within its bound), the misses by bound, the client's TTFT p50/p95 and TPOT p50; the replicas'
own view from their ``/metrics`` histograms (the share of TTFT past 0.5 s and 0.75 s and of
TPOT past 0.15 s, measured inside the replica, so without the router and the client); each
process's event-loop lag (a 10 ms sleep timed over and over: p50, p99, max and the share of the
time spent in wake-ups 50 ms or more late); and the same mix and arrivals replayed in event time
(``plimsoll.bench.curve_replay``: the simulator's curve semantics and the router's own pick rule,
no host), so what the curves predict at that load stands beside what this host measured.

    python benchmarks/variant_fixed_mix.py --profiles /tmp/variants_profiles.json --mix l4=1,spot=2 --rate 14
"""

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import httpx
from variant_mix import VARIANTS, Measured
from variant_mix_cluster import LoopLag, Sent, one, quantile

from plimsoll import metric_names as mn
from plimsoll.bench.curve_replay import ReplicaKind, replay
from plimsoll.bench.script_args import add_options
from plimsoll.operator.resources.settings import ENGINE_PORT
from plimsoll.router.app import running_router
from plimsoll.router.backends import ReplicaSet
from plimsoll.router.config import Policy, RouterConfig

OUTPUT_TOKENS = 4
CURVES = {v.name: v.curve for v in VARIANTS}


def predicted(
    mix: dict[str, int], measured: dict[str, Measured], rate: float, seconds: float, seed: int
) -> tuple[list[Sent], dict[str, str]]:
    """The same mix and arrivals replayed in event time (``plimsoll.bench.curve_replay``)."""
    kinds = {name: (ReplicaKind(CURVES[name], float(measured[name].concurrency), measured[name].rps), count)
             for name, count in mix.items()}  # fmt: skip
    replayed = replay(kinds, rate, seconds, OUTPUT_TOKENS, seed)
    names = {f"{name}-{i}": name for name, count in mix.items() for i in range(count)}
    return [Sent(at=r.at, ok=True, ttft_s=r.ttft_s, tpot_s=r.tpot_s, replica=r.replica) for r in replayed], names


def histogram_share_above(text: str, name: str, bound: float) -> tuple[float, int]:
    """From a Prometheus text page: the share of one histogram's observations above ``bound`` (a bucket edge)."""
    count = below = 0.0
    for line in text.splitlines():
        if line.startswith(f"{name}_count"):
            count = float(line.split()[-1])
        elif line.startswith(f'{name}_bucket{{le="{bound}"}}'):
            below = float(line.split()[-1])
    return ((count - below) / count if count else float("nan")), int(count)


async def drive(
    args: argparse.Namespace, urls: dict[str, str], measured: dict[str, Measured], router_url: str | None
) -> tuple[list[Sent], dict[str, float], dict[str, str]]:
    """The load through the router (``router_url``, or one started in this process); outcomes, this process's
    loop lag, each replica's ``/metrics`` page."""
    lag = LoopLag()
    watching = asyncio.create_task(lag.run())
    sent: list[Sent] = []

    async def load(router: str) -> None:
        rng = random.Random(args.seed)
        tasks: set[asyncio.Task[None]] = set()
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=2000)) as client:
            start = next_at = time.monotonic()
            while next_at - start < args.seconds:
                record = Sent(at=time.monotonic())
                sent.append(record)
                task = asyncio.create_task(one(client, router, record))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                next_at += rng.expovariate(
                    args.rate
                )  # a fixed schedule: a late wake-up sends the next sooner
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            await asyncio.gather(*tasks)

    if router_url is None:
        config = RouterConfig(port=0, backends=tuple(urls), policy=Policy.LEAST_INFLIGHT)
        async with running_router(config) as (router, state):
            weigh(state.replica_set, urls, measured)
            await ready(state.replica_set)
            await load(router)
    else:
        await load(router_url)
    watching.cancel()
    async with httpx.AsyncClient(timeout=10) as client:
        pages = {u: (await client.get(f"{u}/metrics")).text for u in urls}
    return sent, lag.summary(), pages


def weigh(replicas: ReplicaSet, urls: dict[str, str], measured: dict[str, Measured]) -> None:
    replicas.set_weights(
        {u: float(measured[v].concurrency) for u, v in urls.items()},
        {u: measured[v].rps for u, v in urls.items()},
    )


async def ready(replicas: ReplicaSet) -> None:
    deadline = time.monotonic() + 60
    while len(replicas.ready()) < len(replicas.replicas):
        if time.monotonic() > deadline:
            raise SystemExit("the replicas did not all become ready through the router in 60 s")
        await asyncio.sleep(0.2)


async def serve_router(spec: str) -> None:
    """The router in its own process (``--router-process``): prints its URL, serves until stdin ends, prints
    its loop lag."""
    setup = json.loads(spec)
    measured = {n: Measured(**m) for n, m in setup["measured"].items()}
    lag = LoopLag()
    watching = asyncio.create_task(lag.run())
    config = RouterConfig(port=0, backends=tuple(setup["urls"]), policy=Policy.LEAST_INFLIGHT)
    async with running_router(config) as (router, state):
        weigh(state.replica_set, setup["urls"], measured)
        await ready(state.replica_set)
        print(json.dumps({"router": router}), flush=True)
        await asyncio.to_thread(sys.stdin.read)
    watching.cancel()
    print(json.dumps({"loop_lag": lag.summary()}), flush=True)


def summarize(label: str, outcomes: list[Sent], urls: dict[str, str], args: argparse.Namespace) -> None:
    ttft_s, tpot_s = args.ttft_ms / 1000, args.tpot_ms / 1000
    skip = [o for o in outcomes if o.at - outcomes[0].at >= args.warmup]

    def line(name: str, rows: list[Sent]) -> str:
        served = [o for o in rows if o.ttft_s is not None]
        good = sum((o.ttft_s or 0) <= ttft_s and (o.tpot_s or 0) <= tpot_s for o in served)
        late = sum((o.ttft_s or 0) > ttft_s for o in served)
        slow = sum((o.tpot_s or 0) > tpot_s for o in served)
        n = max(1, len(rows))
        return (f"    {name:8s} {len(rows) / max(1, len(skip)):6.1%} of requests  attainment {good / n:6.1%}  "
                f"TTFT misses {late / n:5.1%}  TPOT misses {slow / n:5.1%}  failed {len(rows) - len(served)}  "
                f"TTFT p50/p95 {quantile([o.ttft_s or 0 for o in served], 0.5) * 1000:5.0f}/"
                f"{quantile([o.ttft_s or 0 for o in served], 0.95) * 1000:5.0f} ms  "
                f"TPOT p50 {quantile([o.tpot_s or 0 for o in served], 0.5) * 1000:4.0f} ms")  # fmt: skip

    print(f"  {label}: {len(skip)} requests after the first {args.warmup:.0f} s")
    print(line("all", skip))
    for variant in sorted(set(urls.values())):
        print(
            line(
                variant,
                [o for o in skip if o.replica is not None and urls.get(o.replica.rstrip("/")) == variant],
            )
        )


def parse_mix(text: str) -> dict[str, int]:
    mix = {}
    for part in text.split(","):
        name, _, count = part.partition("=")
        if name not in CURVES or not count.isdigit() or int(count) < 1:
            raise SystemExit(f"--mix: {part!r} is not VARIANT=COUNT with VARIANT one of {sorted(CURVES)}")
        mix[name] = int(count)
    return mix


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--serve-router", help=argparse.SUPPRESS)
    parser.add_argument("--profiles", required=False, help="variant_mix.py --save-profiles output")
    parser.add_argument("--mix", default="l4=1,spot=2", help="replicas per variant, e.g. l4=1,spot=2")
    parser.add_argument("--router-process", action="store_true", help="the router in its own process")
    add_options(
        parser,
        rate=(14.0, "Poisson arrivals, requests/s"),
        seconds=90.0,
        warmup=(5.0, "seconds of requests left out of the figures"),
        seed=1,
        ttft_ms=600.0,
        tpot_ms=150.0,
    )
    args = parser.parse_args()
    if args.serve_router:
        asyncio.run(serve_router(args.serve_router))
        return
    if not args.profiles:
        raise SystemExit("--profiles FILE is needed (variant_mix.py --save-profiles writes it)")
    saved = json.loads(Path(args.profiles).read_text())
    measured = {name: Measured(**saved[name]) for name in CURVES}
    mix = parse_mix(args.mix)
    here = Path(__file__).with_name("variant_mix_cluster.py")
    hosts = {
        name: subprocess.Popen([sys.executable, str(here), "--serve-replicas"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
        for name in mix
    }  # fmt: skip
    urls: dict[str, str] = {}
    for k, (name, count) in enumerate(mix.items()):
        for i in range(count):
            ip = f"127.0.95.{10 * k + i + 1}"
            urls[f"http://{ip}:{ENGINE_PORT}"] = name
            command = {"op": "start", "pod": f"{name}-{i}", "ip": ip, "curve": asdict(CURVES[name])}
            stdin = hosts[name].stdin
            assert stdin is not None
            stdin.write(json.dumps(command) + "\n")
            stdin.flush()
    router_proc = None
    router_url = None
    if args.router_process:
        spec = json.dumps({"urls": urls, "measured": {n: asdict(m) for n, m in measured.items()}})
        router_proc = subprocess.Popen(
            [sys.executable, __file__, "--serve-router", spec],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert router_proc.stdout is not None
        router_url = json.loads(router_proc.stdout.readline())["router"]
    else:
        time.sleep(2.0)  # the helpers start listening
    sent, lag, pages = asyncio.run(drive(args, urls, measured, router_url))
    print(f"  mix {args.mix} at {args.rate} requests/s Poisson for {args.seconds:.0f} s; router "
          f"{'in its own process' if args.router_process else 'in the client process'}; SLO TTFT <= "
          f"{args.ttft_ms:.0f} ms and mean TPOT <= {args.tpot_ms:.0f} ms per request")  # fmt: skip
    summarize("measured on this host", sent, urls, args)
    names = mn.ENGINE_FAMILIES["plimsoll"]
    print("  inside each replica (its /metrics): share of TTFT > 0.5 s, > 0.75 s, of TPOT > 0.15 s")
    for url, page in pages.items():
        above_half, count = histogram_share_above(page, names.ttft, 0.5)
        above, _ = histogram_share_above(page, names.ttft, 0.75)
        slow, _ = histogram_share_above(page, names.tpot, 0.15)
        print(f"    {urls[url]:5s} {url}: {count:5d} requests  TTFT>0.5s {above_half:5.1%}  TTFT>0.75s {above:5.1%}  "
              f"TPOT>0.15s {slow:5.1%}")  # fmt: skip
    lags = {"client" + ("" if args.router_process else " + router"): lag}
    if router_proc is not None:
        assert router_proc.stdin is not None and router_proc.stdout is not None
        router_proc.stdin.close()
        lags["router"] = json.loads(router_proc.stdout.readline())["loop_lag"]
        router_proc.wait(timeout=20)
    for name, host in hosts.items():
        assert host.stdin is not None and host.stdout is not None
        host.stdin.close()
        lags[f"{name} replicas"] = json.loads(host.stdout.readline())["loop_lag"]
        host.wait(timeout=20)
    print("  event-loop lag per process (10 ms sleeps): p50 / p99 / max ms, share of time in stalls >= 50 ms")
    for name, figures in lags.items():
        print(f"    {name:16s} {figures.get('p50_ms', 0):6.1f} {figures.get('p99_ms', 0):7.1f} "
              f"{figures.get('max_ms', 0):7.1f}  {figures.get('stalled_share', 0):6.1%}")  # fmt: skip
    replayed, replay_urls = predicted(mix, measured, args.rate, max(args.seconds, 600.0), args.seed)
    summarize("the curves' prediction (event time, no host)", replayed, replay_urls, args)


if __name__ == "__main__":
    main()
