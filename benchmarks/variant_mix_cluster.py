"""Hardware variants on a local control plane: a step load and a spot reclaim, with simulated replicas.

What runs: a fresh local control plane (``plimsoll.devcluster``: etcd, kube-apiserver,
controllers, scheduler, kwok) with simulated GPU nodes of three kinds (``nvidia.com/gpu.product``
H100, L4 and T4), the Helm chart, and the operator as a local process with the chart's
ServiceAccount token. One LLMService has three variants, each selecting its kind of node
(``accelerator.type``): ``h100``, ``l4`` and ``spot`` (``spot: true``). Its pods are kwok's
(scheduled, Ready, a loopback pod IP); on each Ready pod's IP this script runs a simulated
replica (``bench/simulator.py``, real HTTP and ``/metrics``) with its variant's service curve,
the same curves as ``benchmarks/variant_mix.py``. The operator's replica planner scrapes them
and sets each variant's count; a real router (``plimsoll route --llmservice``'s app, in this
process) discovers the pods and weighs them from ``status.variants``.

Each variant's per-replica target is the concurrency ``plimsoll bench``'s sweep measured on
its curve and the requests/s one replica finishes there (``--profiles FILE`` from
``variant_mix.py --save-profiles``, or a sweep here), given as Manual ``concurrencyPerReplica``
and ``requestsPerSecondPerReplica``: the mix is compared in requests/s, as with profiled
variants (the profile Jobs themselves are not run here).

The load: open-loop Poisson arrivals of streamed completions through the router, ``--low``
requests/s, then ``--high`` from ``--step-at``, back to ``--low`` from ``--fall-at``. At
``--reclaim-at`` the spot nodes are deleted (``kubectl delete node``) and the simulated replicas
on them killed, as a spot reclaim takes the machines. Printed per minute: the planner's demand
(``status.mix.demand``, mean of the samples), the running mix at the minute's end, its cost per
hour (``status.cost.perHour``, mean), the brute-force optimum's cost for the demand at each
sample over the variants there are (no spot after the reclaim), averaged the same way, their
ratio; then the optimum for the minute's **offered load** (the requests/s sent that minute,
against each variant's measured requests/s per replica at its target: what serves that
minute's traffic at its SLO) and that ratio, the cost figure the "within 10% of the optimum
for the demand at each minute" criterion means (the instantaneous comparison prices every
2 s swing of Poisson arrivals, which no autoscaler with a scale-down window follows, nor
should); the host's 1-minute load average (``uptime``), the share of the requests sent that minute that met the SLO (TTFT and mean TPOT each
within its bound; a failed request misses), and that minute's TTFT p95 and TPOT p50 (the
percentiles the profiles' SLO bounds). The clock starts once the planner holds its first mix
with every replica Ready and answering. Then: requests lost at the reclaim against those in flight on the spot replicas when
they died, and the operator's Events and ``status.mix`` saying why the mix moved.

    python benchmarks/variant_mix_cluster.py --profiles /tmp/variants_profiles.json
"""

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn
import yaml
from variant_mix import VARIANTS, Measured, profile

from plimsoll.bench.script_args import add_options
from plimsoll.bench.simulator import ServiceCurve
from plimsoll.bench.simulator import build_app as build_simulator
from plimsoll.devcluster.cluster import Cluster
from plimsoll.devcluster.nodes import SimulatedNode
from plimsoll.operator.local import chart_operator
from plimsoll.operator.resources.settings import ENGINE_PORT
from plimsoll.operator.scaling.variant_mix import Offer, make_mix, mix_key
from plimsoll.operator.scaling.variant_state import RATE_UNIT
from plimsoll.router.app import running_router
from plimsoll.router.config import Policy, RouterConfig

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "plimsoll"
NAME = "mixed"
NS = "variants"
OUTPUT_TOKENS = 4
# Each variant's kind of node: the GPU product its pods select, and (nodes, GPUs per node).
PRODUCTS = {"h100": "NVIDIA-H100-80GB-HBM3", "l4": "NVIDIA-L4", "spot": "NVIDIA-T4"}
SHAPES = {"h100": (2, 2), "l4": (2, 3), "spot": (2, 3)}


@dataclass
class Sent:
    at: float
    ok: bool = False
    ttft_s: float | None = None
    tpot_s: float | None = None
    replica: str | None = None
    error: str | None = None
    done_at: float | None = None


@dataclass
class Sample:
    at: float
    demand: float | None
    cost: float | None
    replicas: dict[str, int]
    ready: dict[str, int]
    reason: str | None
    unit: str | None
    load: float  # the host's 1-minute load average


@dataclass
class Run:
    sent: list[Sent] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    reclaimed_at: float | None = None
    in_flight_on_spot: int = 0
    spot_urls: set[str] = field(default_factory=set)


class Replicas:
    """A simulated replica on every Ready pod's IP (its variant's curve); the reclaimed ones stay dead.

    Each variant's replicas run in one helper process (this script with ``--serve-replicas``),
    each a uvicorn server on its pod's IP started within milliseconds of the pod turning Ready
    (a process per replica would leave it Ready and silent for seconds on a busy host; one
    process for all of them would be one core for the whole fleet).
    """

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.running: dict[str, tuple[str, str]] = {}  # pod name -> (variant, URL)
        self.dead: set[str] = set()
        self.curves = {v.name: asdict(v.curve) for v in VARIANTS}
        self.hosts = {
            v.name: subprocess.Popen(
                [sys.executable, __file__, "--serve-replicas"], stdin=subprocess.PIPE, text=True
            )
            for v in VARIANTS
        }
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> "Replicas":
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for host in self.hosts.values():
            assert host.stdin is not None
            host.stdin.close()
        for host in self.hosts.values():
            try:
                host.wait(timeout=20)
            except subprocess.TimeoutExpired:
                host.kill()

    def _send(self, variant: str, **command: Any) -> None:
        stdin = self.hosts[variant].stdin
        assert stdin is not None
        stdin.write(json.dumps(command) + "\n")
        stdin.flush()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except Exception as exc:  # a failed listing: try again next time
                print(f"  (pod listing failed: {exc})", flush=True)
            self._stop.wait(0.5)

    def sync(self) -> None:
        listing = self.cluster.get_json("pods", "-n", NS, "-l", f"plimsoll.dev/llmservice={NAME}")
        ready = {}
        for pod in listing.get("items", []):
            meta, status = pod["metadata"], pod.get("status") or {}
            up = any(
                c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
            )
            if up and status.get("podIP") and not meta.get("deletionTimestamp"):
                ready[meta["name"]] = (
                    (meta.get("labels") or {}).get("plimsoll.dev/variant", ""),
                    status["podIP"],
                )
        for name in set(self.running) - set(ready):
            variant, _ = self.running.pop(name)
            self._send(variant, op="stop", pod=name)
        for name, (variant, ip) in ready.items():
            if name not in self.running and name not in self.dead and variant in self.curves:
                self.running[name] = (variant, f"http://{ip}:{ENGINE_PORT}")
                self._send(variant, op="start", pod=name, ip=ip, curve=self.curves[variant])

    def reclaim(self, variant: str) -> set[str]:
        """Kill the variant's replicas (connections reset: their machines are gone); their URLs."""
        urls = set()
        for name, (v, url) in list(self.running.items()):
            if v == variant:
                self.dead.add(name)
                urls.add(url)
                del self.running[name]
                self._send(v, op="kill", pod=name)
        return urls


async def serve_replicas() -> None:
    """The helper process: start, stop or kill simulated replicas as told on stdin (JSON lines)."""
    servers: dict[str, tuple[uvicorn.Server, asyncio.Task[None]]] = {}
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        command = json.loads(line)
        pod = command["pod"]
        if command["op"] == "start":
            config = uvicorn.Config(
                build_simulator(ServiceCurve(**command["curve"])), host=command["ip"], port=ENGINE_PORT,
                log_level="error", access_log=False, lifespan="off",
            )  # fmt: skip
            server = uvicorn.Server(config)
            servers[pod] = (server, asyncio.create_task(server.serve()))
        elif pod in servers:
            server, _ = servers.pop(pod)
            if command["op"] == "kill":
                for connection in list(server.server_state.connections):
                    transport = getattr(connection, "transport", None)
                    if transport is not None:
                        transport.abort()
                server.force_exit = True
            server.should_exit = True
    for server, _ in servers.values():
        server.should_exit = True
    await asyncio.gather(*(task for _, task in servers.values()), return_exceptions=True)


def most(name: str, max_replicas: int, args: argparse.Namespace) -> int:
    """A variant's maxReplicas here: its own, its nodes' GPUs and --max-replicas, whichever is least."""
    return min(max_replicas, SHAPES[name][0] * SHAPES[name][1], args.max_replicas)


def manifest(measured: dict[str, Measured], args: argparse.Namespace) -> dict[str, Any]:
    variants = [
        {
            "name": v.name, "costPerHour": args.spot_cost if v.spot else v.cost_per_hour,
            "maxReplicas": most(v.name, v.max_replicas, args), "spot": v.spot,
            "accelerator": {"type": PRODUCTS[v.name], "count": 1},
            "concurrencyPerReplica": measured[v.name].concurrency,
            "requestsPerSecondPerReplica": round(measured[v.name].rps, 3),
        }
        for v in VARIANTS
    ]  # fmt: skip
    return {
        "apiVersion": "plimsoll.dev/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": NAME},
        "spec": {
            "model": {"uri": "embedded://smollm2-135m"},
            # kwok's pods: this script serves each one's HTTP on its IP.
            "podAnnotations": {"plimsoll.dev/run-locally": "false"},
            "capacity": {"mode": "Manual", "concurrencyPerReplica": 4},
            "variants": variants,
            "mix": {
                "maxSpotFraction": args.max_spot_fraction, "unschedulableSeconds": 20,
                "unavailableSeconds": 600, "drainSeconds": 15,
            },
            "autoscaling": {
                "mode": "builtin", "intervalSeconds": 2, "scaleUpStabilizationSeconds": 0,
                "scaleDownStabilizationSeconds": 60,
            },
        },
    }  # fmt: skip


def offers(
    measured: dict[str, Measured], args: argparse.Namespace, without: set[str], unit: str | None = RATE_UNIT
) -> list[Offer]:
    """Each variant's capacity per replica in ``unit`` (requests/s, or in-flight without rates)."""
    return [
        Offer(v.name, measured[v.name].rps if unit == RATE_UNIT else float(measured[v.name].concurrency),
              args.spot_cost if v.spot else v.cost_per_hour, 0,
              0 if v.name in without else most(v.name, v.max_replicas, args), v.spot)
        for v in VARIANTS
    ]  # fmt: skip


def optimum(all_offers: list[Offer], demand: float, fraction: float) -> Any:
    ranges = [range(o.min_replicas, o.max_replicas + 1) for o in all_offers]
    return min(
        (make_mix(all_offers, c) for c in itertools.product(*ranges)),
        key=lambda m: mix_key(m, demand, fraction),
    )


async def one(client: httpx.AsyncClient, router: str, record: Sent) -> None:
    body = {"model": "sim-model", "prompt": "a b c d e f g h", "max_tokens": OUTPUT_TOKENS, "stream": True}
    tokens: list[float] = []
    try:
        async with client.stream("POST", f"{router}/v1/completions", json=body) as response:
            record.replica = response.headers.get("x-plimsoll-replica")
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}"
                await response.aread()
                return
            async for line in response.aiter_lines():
                if line.startswith("data:") and line.strip() != "data: [DONE]":
                    if '"error"' in line:
                        record.error = line[:200]
                        return
                    tokens.append(time.monotonic())
    except httpx.HTTPError as exc:
        record.error = type(exc).__name__
        return
    finally:
        record.done_at = time.monotonic()
    if tokens:
        record.ok = True
        record.ttft_s = tokens[0] - record.at
        record.tpot_s = (tokens[-1] - tokens[0]) / (len(tokens) - 1) if len(tokens) > 1 else 0.0


def status(cluster: Cluster) -> dict[str, Any]:
    return (cluster.get_json("llms", NAME, "-n", NS) or {}).get("status") or {}


async def sampler(cluster: Cluster, run: Run, start: float, end: float) -> None:
    while time.monotonic() < end:
        s = await asyncio.to_thread(status, cluster)
        mix, cost, variants = s.get("mix") or {}, s.get("cost") or {}, s.get("variants") or {}
        run.samples.append(Sample(
            time.monotonic() - start, mix.get("demand"), cost.get("perHour"),
            {n: int(v.get("replicas") or 0) for n, v in variants.items()},
            {n: int(v.get("readyReplicas") or 0) for n, v in variants.items()}, mix.get("reason"),
            mix.get("unit"), os.getloadavg()[0],
        ))  # fmt: skip
        await asyncio.sleep(2.0)


async def drive(cluster: Cluster, replicas: Replicas, args: argparse.Namespace, run: Run) -> None:
    config = RouterConfig(
        port=0,
        llmservice=NAME,
        namespace=NS,
        kubeconfig=str(cluster.kubeconfig),
        policy=Policy.LEAST_INFLIGHT,
    )
    async with running_router(config) as (router, state):
        deadline = time.monotonic() + 180
        while not state.replica_set.ready():
            if time.monotonic() > deadline:
                raise SystemExit("no replica became ready through the router in 180 s")
            await asyncio.sleep(0.5)
        # Until the planner holds the mix with every replica Ready and answering (a kwok pod is Ready
        # a moment before its simulated replica listens, and the planner counts it silent meanwhile).
        settled = 0
        while settled < 3 and time.monotonic() < deadline + 120:
            s = await asyncio.to_thread(status, cluster)
            counts = {n: v.get("replicas") for n, v in (s.get("variants") or {}).items()}
            ready = {n: v.get("readyReplicas") for n, v in (s.get("variants") or {}).items()}
            available = all(v.get("available", True) for v in (s.get("variants") or {}).values())
            steady = (s.get("mix") or {}).get("reason") == "WithinTolerance" and counts == ready and available
            settled = settled + 1 if steady else 0
            await asyncio.sleep(2.0)
        out = {
            n: v.get("reason") for n, v in (s.get("variants") or {}).items() if v.get("available") is False
        }
        if out:
            # A replica that did not answer its scrapes at start (a starved host) takes its variant out
            # of the mix for mix.unavailableSeconds: the cost comparisons then hold that variant to no one.
            print(f"  variants unavailable at the start: {out}", flush=True)
        rng = random.Random(1)
        start = time.monotonic()
        end = start + args.minutes * 60
        tasks: set[asyncio.Task[None]] = set()
        sampling = asyncio.create_task(sampler(cluster, run, start, end))
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=2000)) as client:
            now = next_at = start
            while now < end:
                t = now - start
                if run.reclaimed_at is None and t >= args.reclaim_at * 60:
                    # The spot machines go: what was in flight on them is what the replica loss costs.
                    urls = replicas.reclaim("spot")
                    run.spot_urls = urls
                    run.in_flight_on_spot = sum(
                        r.inflight for u, r in state.replica_set.replicas.items() if u in urls
                    )
                    nodes = [f"spot-{i}" for i in range(SHAPES["spot"][0])]
                    await asyncio.to_thread(cluster.kubectl, "delete", "node", *nodes, "--wait=false")
                    run.reclaimed_at = t
                    print(f"  t={t:.0f}s: spot nodes deleted, {len(urls)} spot replicas killed with "
                          f"{run.in_flight_on_spot} requests in flight on them", flush=True)  # fmt: skip
                rate = args.high if args.step_at * 60 <= t < args.fall_at * 60 else args.low
                record = Sent(at=time.monotonic())
                run.sent.append(record)
                task = asyncio.create_task(one(client, router, record))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                # Arrivals on a fixed schedule: a late wake-up sends the next one sooner, keeping the rate.
                next_at += rng.expovariate(rate)
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
                now = time.monotonic()
            await asyncio.gather(*tasks)
        await sampling
        for r in run.sent:
            r.at -= start
            if r.done_at is not None:
                r.done_at -= start


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(cluster: Cluster, measured: dict[str, Measured], args: argparse.Namespace, run: Run) -> None:
    ttft_s, tpot_s = args.ttft_ms / 1000, args.tpot_ms / 1000

    def good(r: Sent) -> bool:
        return r.ok and r.ttft_s is not None and r.ttft_s <= ttft_s and (r.tpot_s or 0.0) <= tpot_s

    print("\n  minute  offered/s  demand  running mix at its end        cost/h  instant: optimum/h ratio  "
          "minute: optimum/h ratio  load1  attainment  TTFT p95  TPOT p50  requests")  # fmt: skip
    within = within_instant = 0
    for m in range(args.minutes):
        samples = [s for s in run.samples if m * 60 <= s.at < (m + 1) * 60]
        sent = [r for r in run.sent if m * 60 <= r.at < (m + 1) * 60]
        demands = [s.demand for s in samples if s.demand is not None]
        costs = [s.cost for s in samples if s.cost is not None]
        if not samples or not demands or not costs:
            print(f"  {m:6d}  no status samples")
            continue
        demand, cost = statistics.fmean(demands), statistics.fmean(costs)
        rate = len(sent) / 60
        # The optimum for the planner's demand at each sample, and for the minute's offered load over the
        # variants there were at each sample (no spot once reclaimed), each averaged like the cost.
        instant_costs, minute_costs = [], []
        for s in samples:
            gone = {"spot"} if run.reclaimed_at is not None and s.at >= run.reclaimed_at else set()
            if s.demand is not None:
                pick = optimum(
                    offers(measured, args, gone, s.unit), max(s.demand, 0.01), args.max_spot_fraction
                )
                instant_costs.append(pick.cost_per_hour)
            minute_costs.append(
                optimum(offers(measured, args, gone), max(rate, 0.01), args.max_spot_fraction).cost_per_hour
            )
        best_instant, best = statistics.fmean(instant_costs), statistics.fmean(minute_costs)
        ratio_instant = cost / best_instant if best_instant else float("nan")
        ratio = cost / best if best else float("nan")
        within += ratio <= 1.1
        within_instant += ratio_instant <= 1.1
        oks = [r for r in sent if r.ok and r.ttft_s is not None]
        p95 = quantile([r.ttft_s or 0.0 for r in oks], 0.95) * 1000
        p50 = quantile([r.tpot_s or 0.0 for r in oks], 0.5) * 1000
        last = samples[-1]
        mix = " + ".join(f"{n} × {c}" for n, c in last.replicas.items() if c) or "-"
        attained = sum(good(r) for r in sent) / len(sent) if sent else float("nan")
        load = statistics.fmean(s.load for s in samples)
        reclaimed = run.reclaimed_at is not None and m * 60 <= run.reclaimed_at < (m + 1) * 60
        mark = "  <- spot nodes deleted" if reclaimed else ""
        print(f"  {m:6d}  {rate:9.1f}  {demand:6.2f}  {mix:28s}  {cost:6.2f}  {best_instant:17.2f} {ratio_instant:5.2f}  "
              f"{best:16.2f} {ratio:5.2f}  {load:5.1f}  {attained:10.1%}  {p95:8.0f}  {p50:8.0f}  {len(sent):8d}"
              f"{mark}")  # fmt: skip
    unit = next((s.unit for s in run.samples if s.unit), "?")
    print(f"  demand: status.mix.demand in {unit}; cost within 10% of the optimum for the minute's offered load "
          f"in {within}/{args.minutes} minutes (the criterion's figure), for the planner's instantaneous demand "
          f"in {within_instant}/{args.minutes}")  # fmt: skip
    total = len(run.sent)
    print(
        f"  attainment overall {sum(good(r) for r in run.sent) / total:.1%} of {total} requests "
        f"(TTFT <= {args.ttft_ms:.0f} ms and mean TPOT <= {args.tpot_ms:.0f} ms each)"
    )
    failed = [r for r in run.sent if not r.ok]
    if run.reclaimed_at is not None:
        at = run.reclaimed_at
        around = [r for r in failed if r.at <= at <= (r.done_at or at)]
        later = [r for r in failed if r.at > at]
        print(f"  reclaim at t={at:.0f}s: {run.in_flight_on_spot} requests were in flight on the spot replicas; "
              f"{len(around)} requests in flight then failed, {len(later)} sent after it failed; "
              f"{len(failed)} failed in the whole run")  # fmt: skip
        for r in failed[:5]:
            print(f"    failed: sent t={r.at:.1f}s on {r.replica}: {r.error}")
    events = cluster.get_json("events", "-n", NS, "--field-selector", f"involvedObject.name={NAME}")
    print("  Events (VariantMix, VariantUnavailable, drains):")
    for e in sorted(
        events.get("items", []), key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or ""
    ):
        if e.get("reason") in {
            "VariantMix",
            "VariantUnavailable",
            "VariantAvailable",
            "DrainStarted",
            "ScaledDown",
        }:
            print(f"    {e.get('lastTimestamp') or e.get('eventTime')} {e['reason']} (x{e.get('count', 1)}): "
                  f"{e.get('message', '')[:300]}")  # fmt: skip
    final = status(cluster)
    mix, variants = final.get("mix") or {}, final.get("variants") or {}
    print(f"  status.mix at the end: {mix.get('reason')}: {mix.get('message')}")
    print(f"  status.variants.spot at the end: available {variants.get('spot', {}).get('available')}, "
          f"reason {variants.get('spot', {}).get('reason')}")  # fmt: skip
    print(
        f"  status.readyReplicas {final.get('readyReplicas')} (per variant "
        f"{ {n: v.get('readyReplicas') for n, v in variants.items()} }), status.cost {final.get('cost')}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--serve-replicas", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--profiles", help="the profiles variant_mix.py --save-profiles wrote (else sweep here)"
    )
    add_options(
        parser,
        requests_per_level=(24, "for the sweeps without --profiles"),
        minutes=8,
        low=(5.0, "requests/s before the step and after the fall"),
        high=(16.0, "requests/s after the step"),
        step_at=(2.0, "minute of the step up"),
        reclaim_at=(4.0, "minute the spot nodes are deleted"),
        fall_at=(6.0, "minute the load falls back"),
        max_replicas=(4, "cap on each variant's maxReplicas (each replica is a process on this host)"),
        spot_cost=(0.4, "the spot variant's costPerHour"),
        max_spot_fraction=0.5,
        ttft_ms=600.0,
        tpot_ms=150.0,
    )
    args = parser.parse_args()
    if args.serve_replicas:
        asyncio.run(serve_replicas())
        return
    saved = json.loads(Path(args.profiles).read_text()) if args.profiles else {}
    measured = {v.name: Measured(**saved[v.name]) if v.name in saved else profile(v, args) for v in VARIANTS}
    for v in VARIANTS:
        m = measured[v.name]
        print(f"  {v.name:5s} {args.spot_cost if v.spot else v.cost_per_hour:4.2f}/h spot={v.spot!s:5s} "
              f"{PRODUCTS[v.name]:22s} concurrency per replica {m.concurrency}, {m.rps:.2f} req/s ({m.knees})")  # fmt: skip
    nodes = [
        SimulatedNode(f"{name}-{i}", gpus, gpu_product=PRODUCTS[name])
        for name, (count, gpus) in SHAPES.items()
        for i in range(count)
    ]
    started = time.monotonic()
    run = Run()
    with (
        tempfile.TemporaryDirectory(prefix="plimsoll-variants-") as tmp,
        Cluster(Path(tmp) / "cluster", nodes=nodes) as cluster,
        chart_operator(cluster, CHART, Path(tmp)),
        Replicas(cluster) as replicas,
    ):
        cluster.kubectl("create", "namespace", NS)
        cluster.kubectl("apply", "-n", NS, "-f", "-", input=yaml.safe_dump(manifest(measured, args)))
        print(f"  control plane up, LLMService applied ({time.monotonic() - started:.0f} s); load: {args.low} req/s, "
              f"{args.high} from minute {args.step_at}, {args.low} from minute {args.fall_at}; spot reclaimed at "
              f"minute {args.reclaim_at}", flush=True)  # fmt: skip
        asyncio.run(drive(cluster, replicas, args, run))
        report(cluster, measured, args, run)
    print(f"  total run {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
