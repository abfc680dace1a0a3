"""Hardware variants on a local control plane: a step load and a spot reclaim, with simulated replicas.

What runs: a fresh local control plane (``plimsoll.devcluster``: etcd, kube-apiserver,
controllers, scheduler, kwok) with simulated GPU nodes of three kinds (``nvidia.com/gpu.product``
H100, L4 and T4), the Helm chart, and the operator as a local process with the chart's
ServiceAccount token. One LLMService has three variants, each selecting its kind of node
(``accelerator.type``): ``h100``, ``l4`` and ``spot`` (``spot: true``). Its pods are kwok's
(scheduled, Ready, a loopback pod IP); on each Ready pod's IP this script runs a simulated
replica (``bench/simulator.py``, real HTTP and ``/metrics``) with its variant's service curve,
the same curves as ``benchmarks/variant_mix.py``. The operator's replica planner scrapes them
and sets each variant's count; a real router (``plimsoll route --llmservice`` in its own process,
as the chart deploys it) discovers the pods and weighs them from ``status.variants``.

Each variant's per-replica target is the concurrency ``plimsoll bench``'s sweep measured on
its curve and the requests/s one replica finishes there (``--profiles FILE`` from
``variant_mix.py --save-profiles``, or a sweep here), given as Manual ``concurrencyPerReplica``
and ``requestsPerSecondPerReplica``: the mix is compared in requests/s, as with profiled
variants (the profile Jobs themselves are not run here).

The load: open-loop Poisson arrivals of streamed completions through the router, sent and timed
by a process of their own (``--send-load``: nothing else runs on the loop that timestamps tokens),
``--low`` requests/s, then ``--high`` from ``--step-at``, back to ``--low`` from ``--fall-at``. At
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
percentiles the profiles' SLO bounds); the share of that minute the load generator's and the
replica processes' event loops spent in stalls of 50 ms or more, and the share of requests over
0.5 s to first token as the client, the router (its time to first byte) and the replicas (their
own TTFT histograms) saw it, which places a minute's misses. The clock starts once the planner holds its first mix
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
import resource
import socket
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

from plimsoll import metric_names as mn
from plimsoll.bench.script_args import add_options
from plimsoll.bench.simulator import ServiceCurve
from plimsoll.bench.simulator import build_app as build_simulator
from plimsoll.devcluster import paths
from plimsoll.devcluster.cluster import Cluster
from plimsoll.devcluster.nodes import SimulatedNode
from plimsoll.operator.local import chart_operator
from plimsoll.operator.resources.settings import ENGINE_PORT
from plimsoll.operator.scaling.variant_mix import Offer, make_mix, mix_key
from plimsoll.operator.scaling.variant_state import RATE_UNIT

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "plimsoll"
NAME = "mixed"
NS = "variants"
OUTPUT_TOKENS = 4
TTFT_NAME = mn.ENGINE_FAMILIES["plimsoll"].ttft
ROUTER_TTFB_NAME = "plimsoll_router_time_to_first_byte_seconds"
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
    client_lag: dict[str, float] = field(default_factory=dict)
    client_stalls: list[tuple[float, float]] = field(default_factory=list)
    start: float = 0.0  # the load's start, monotonic
    # (minute, "replicas" | "router") -> [requests seen, those with TTFT (first byte) over 0.5 s]
    views: dict[tuple[int, str], list[float]] = field(default_factory=dict)
    # CPU the driving process's finished children (kubectl) used while the load ran
    harness_cpu_s: float = 0.0


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
        self.variant_of: dict[str, str] = {}  # URL -> variant, of every replica started
        self.lags: dict[str, dict[str, Any]] = {}  # variant -> its helper process's loop lag, once it ended
        self.curves = {v.name: asdict(v.curve) for v in VARIANTS}
        self.hosts = {
            v.name: subprocess.Popen(
                [sys.executable, __file__, "--serve-replicas"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for v in VARIANTS
        }
        self.pods: dict[str, dict[str, Any]] = {}  # name -> the pod as last watched
        self._lock = threading.Lock()
        self._watch: subprocess.Popen[str] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> "Replicas":
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.terminate()
        self._thread.join(timeout=10)
        for host in self.hosts.values():
            assert host.stdin is not None
            host.stdin.close()
        for name, host in self.hosts.items():
            assert host.stdout is not None
            try:
                out = host.stdout.read()  # to its end: the helper exits once its input has
                host.wait(timeout=20)
                self.lags[name] = json.loads(out.strip().splitlines()[-1])
            except (subprocess.TimeoutExpired, ValueError, IndexError) as exc:
                print(f"  ({name} replicas' helper: no loop lag read: {exc!r})", flush=True)
                host.kill()

    def _send(self, variant: str, **command: Any) -> None:
        stdin = self.hosts[variant].stdin
        assert stdin is not None
        stdin.write(json.dumps(command) + "\n")
        stdin.flush()

    def _loop(self) -> None:
        """Follow the pods with one ``kubectl get --watch`` (a listing every half second, a kubectl process
        each, cost the host 12% of a core while the load ran); watch again if it ends."""
        selector = f"plimsoll.dev/llmservice={NAME}"
        argv = [str(paths.binary("kubectl")), "get", "pods", "-n", NS, "-l", selector, "-o", "json", "--watch",
                "--output-watch-events"]  # fmt: skip
        while not self._stop.is_set():
            self._watch = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=self.cluster.env
            )
            assert self._watch.stdout is not None
            text = ""
            for line in self._watch.stdout:
                text += line  # an event per line (kubectl 1.37); indented JSON spans several
                try:
                    event = json.loads(text)
                except json.JSONDecodeError:
                    continue
                text = ""
                pod = event.get("object") or {}
                name = (pod.get("metadata") or {}).get("name")
                if name is None:
                    continue
                with self._lock:
                    if event.get("type") == "DELETED":
                        self.pods.pop(name, None)
                    else:
                        self.pods[name] = pod
                    self.sync()
            self._watch.wait()
            self._stop.wait(0.5)

    def sync(self) -> None:
        """Start a replica on each Ready pod's IP, stop those whose pods went (under ``_lock``)."""
        ready = {}
        for pod in self.pods.values():
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
                self.variant_of[f"http://{ip}:{ENGINE_PORT}"] = variant
                self._send(variant, op="start", pod=name, ip=ip, curve=self.curves[variant])

    def reclaim(self, variant: str) -> set[str]:
        """Kill the variant's replicas (connections reset: their machines are gone); their URLs."""
        urls = set()
        with self._lock:
            for name, (v, url) in list(self.running.items()):
                if v == variant:
                    self.dead.add(name)
                    urls.add(url)
                    del self.running[name]
                    self._send(v, op="kill", pod=name)
        return urls


STALL_S = (
    0.05  # an event-loop wake-up this late is a stall: a third of the TPOT bound, a tenth of the TTFT one
)


class LoopLag:
    """How late this process's event loop wakes: a short sleep timed over and over.

    A simulated replica's token times are deadlines on its process's event loop, so a late wake-up
    (the host's scheduler, another coroutine's CPU work) is added to every token then due.
    """

    def __init__(self, period_s: float = 0.01) -> None:
        self.period_s = period_s
        self.lags: list[float] = []
        self.stalls: list[tuple[float, float]] = []  # (monotonic time it ended, lag) of lags >= 50 ms

    async def run(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(self.period_s)
            lag = max(0.0, time.perf_counter() - t0 - self.period_s)
            self.lags.append(lag)
            if lag >= STALL_S:
                self.stalls.append((time.monotonic(), lag))

    def summary(self) -> dict[str, float]:
        if not self.lags:
            return {}
        ordered = sorted(self.lags)
        total = sum(ordered) + self.period_s * len(ordered)
        return {
            "p50_ms": 1000 * ordered[len(ordered) // 2],
            "p99_ms": 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
            "max_ms": 1000 * ordered[-1],
            # The share of the time spent in wake-ups 50 ms or more late: stalls a token feels.
            "stalled_share": sum(lag for lag in ordered if lag >= STALL_S) / total,
        }


def stalled_share(stalls: list[tuple[float, float]], start: float, end: float) -> float:
    """The share of ``[start, end)`` (monotonic) a process spent in stalls (each counted where it ended)."""
    return sum(lag for at, lag in stalls if start <= at < end) / (end - start)


async def serve_replicas() -> None:
    """The helper process: start, stop or kill simulated replicas as told on stdin (JSON lines);
    at the end of its input it prints its event loop's lag (one JSON line)."""
    servers: dict[str, tuple[uvicorn.Server, asyncio.Task[None]]] = {}
    loop = asyncio.get_running_loop()
    lag = LoopLag()
    watching = asyncio.create_task(lag.run())
    started: set[str] = set()
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
            started.add(pod)
        elif pod in servers:
            server, _ = servers.pop(pod)
            if command["op"] == "kill":
                for connection in list(server.server_state.connections):
                    transport = getattr(connection, "transport", None)
                    if transport is not None:
                        transport.abort()
                server.force_exit = True
            server.should_exit = True
    watching.cancel()
    print(json.dumps({"loop_lag": lag.summary(), "stalls": lag.stalls, "replicas served": sorted(started)}),
          flush=True)  # fmt: skip
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
                "scaleDownStabilizationSeconds": args.scale_down_window,
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


def over(seen_slow: list[float]) -> float:
    seen, slow = seen_slow
    return slow / seen if seen else float("nan")


def slow_share_counts(page: str, name: str, bound: str = "0.5") -> tuple[float, float]:
    """From a Prometheus page: one histogram's (observations, those above ``bound``), summed over its labels."""
    count = below = 0.0
    for line in page.splitlines():
        if line.startswith(f"{name}_count"):
            count += float(line.rsplit(" ", 1)[-1])
        elif line.startswith(f"{name}_bucket") and f'le="{bound}"' in line:
            below += float(line.rsplit(" ", 1)[-1])
    return count, count - below


async def latency_views(replicas: Replicas, router: str, run: Run, start: float, end: float) -> None:
    """Every 2 s, each live replica's own TTFT histogram and the router's time to first byte: per minute, how
    many requests each saw and how many took over 0.5 s, so a minute's misses can be placed (replica or
    router) against the client's."""
    last: dict[str, tuple[float, float]] = {}
    async with httpx.AsyncClient(timeout=5) as client:
        while time.monotonic() < end + 5:
            minute = int((time.monotonic() - start) // 60)
            targets = [(url, TTFT_NAME, "replicas") for _, url in list(replicas.running.values())]
            targets.append((router, ROUTER_TTFB_NAME, "router"))
            for url, name, view in targets:
                try:
                    page = (await client.get(f"{url}/metrics")).text
                except httpx.HTTPError:
                    continue
                count, slow = slow_share_counts(page, name)
                before = last.get(url, (0.0, 0.0))
                if count < before[0]:  # a new replica on a reused address: its counts start from zero
                    before = (0.0, 0.0)
                last[url] = (count, slow)
                if minute >= 0:
                    seen = run.views.setdefault((minute, view), [0.0, 0.0])
                    seen[0] += count - before[0]
                    seen[1] += slow - before[1]
            await asyncio.sleep(2.0)


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


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_router(cluster: Cluster, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """``plimsoll route --llmservice`` in its own process, as the chart deploys it: discovering the pods,
    weighing them from ``status.variants``; its URL once it answers ``/ready``."""
    port = free_port()
    router = subprocess.Popen(
        [sys.executable, "-c", "from plimsoll.cli import main; main()", "route", "--llmservice", NAME, "--namespace", NS,
         "--kubeconfig", str(cluster.kubeconfig), "--port", str(port), "--policy", "least-in-flight"],
        stdout=log.open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if router.poll() is not None:
            raise SystemExit(f"the router exited ({router.returncode}); its log: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return router, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    router.terminate()
    raise SystemExit("no replica became ready through the router in 180 s")


async def send_load(spec: dict[str, Any]) -> None:
    """The load generator's process (``--send-load``): open-loop Poisson arrivals through the router from
    ``spec["start"]`` (the shared monotonic clock), then every request's record and this process's loop lag
    as JSON to ``spec["out"]``.

    Alone in its process, so what it measures is the router's and the replicas' latency: the
    kubectl polling, the status sampling and the router in the driving process would otherwise
    stall the event loop that timestamps the tokens.
    """
    lag = LoopLag()
    watching = asyncio.create_task(lag.run())
    rng = random.Random(1)
    sent: list[Sent] = []
    tasks: set[asyncio.Task[None]] = set()
    start = spec["start"]
    end = start + spec["minutes"] * 60
    await asyncio.sleep(max(0.0, start - time.monotonic()))
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=2000)) as client:
        now = next_at = start
        while now < end:
            t = now - start
            rate = spec["high"] if spec["step_at"] * 60 <= t < spec["fall_at"] * 60 else spec["low"]
            record = Sent(at=time.monotonic())
            sent.append(record)
            task = asyncio.create_task(one(client, spec["router"], record))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            # Arrivals on a fixed schedule: a late wake-up sends the next one sooner, keeping the rate.
            next_at += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            now = time.monotonic()
        await asyncio.gather(*tasks)
    watching.cancel()
    Path(spec["out"]).write_text(
        json.dumps(
            {
                "sent": [asdict(r) for r in sent],
                "loop_lag": lag.summary(),
                "stalls": lag.stalls,
                "cpu_s": own_cpu_s(),
            }
        )
    )


async def drive(cluster: Cluster, replicas: Replicas, args: argparse.Namespace, run: Run, tmp: Path) -> None:
    router, router_url = await asyncio.to_thread(start_router, cluster, tmp / "router.log")
    try:
        await measure(cluster, replicas, args, run, router_url, tmp)
    finally:
        router.terminate()
        router.wait(timeout=20)


async def measure(
    cluster: Cluster, replicas: Replicas, args: argparse.Namespace, run: Run, router_url: str, tmp: Path
) -> None:
    deadline = time.monotonic() + 180
    # Until the planner holds the mix with every replica Ready and answering (a kwok pod is Ready
    # a moment before its simulated replica listens, and the planner counts it silent meanwhile).
    settled = 0
    s: dict[str, Any] = {}
    while settled < 3 and time.monotonic() < deadline:
        s = await asyncio.to_thread(status, cluster)
        counts = {n: v.get("replicas") for n, v in (s.get("variants") or {}).items()}
        ready = {n: v.get("readyReplicas") for n, v in (s.get("variants") or {}).items()}
        available = all(v.get("available", True) for v in (s.get("variants") or {}).values())
        steady = (s.get("mix") or {}).get("reason") == "WithinTolerance" and counts == ready and available
        settled = settled + 1 if steady else 0
        await asyncio.sleep(2.0)
    out = {n: v.get("reason") for n, v in (s.get("variants") or {}).items() if v.get("available") is False}
    if out:
        # A replica that did not answer its scrapes at start (a starved host) takes its variant out
        # of the mix for mix.unavailableSeconds: the cost comparisons then hold that variant to no one.
        print(f"  variants unavailable at the start: {out}", flush=True)
    start = time.monotonic() + 2.0
    spec = {"router": router_url, "start": start, "minutes": args.minutes, "low": args.low, "high": args.high,
            "step_at": args.step_at, "fall_at": args.fall_at, "out": str(tmp / "sent.json")}  # fmt: skip
    load = subprocess.Popen([sys.executable, __file__, "--send-load", json.dumps(spec)])
    end = start + args.minutes * 60
    sampling = asyncio.create_task(sampler(cluster, run, start, end))
    viewing = asyncio.create_task(latency_views(replicas, router_url, run, start, end))
    children_before = children_cpu_s()
    while load.poll() is None:
        t = time.monotonic() - start
        if run.reclaimed_at is None and t >= args.reclaim_at * 60:
            # The spot machines go: what was in flight on them is what the replica loss costs.
            run.spot_urls = replicas.reclaim("spot")
            nodes = [f"spot-{i}" for i in range(SHAPES["spot"][0])]
            await asyncio.to_thread(cluster.kubectl, "delete", "node", *nodes, "--wait=false")
            run.reclaimed_at = t
            print(f"  t={t:.0f}s: spot nodes deleted, {len(run.spot_urls)} spot replicas killed", flush=True)
        await asyncio.sleep(0.2)
    await sampling
    await viewing
    if load.returncode != 0:
        raise SystemExit(f"the load generator exited with {load.returncode}")
    result = json.loads((tmp / "sent.json").read_text())
    run.client_lag = result["loop_lag"]
    run.harness_cpu_s = children_cpu_s() - children_before - result["cpu_s"]
    run.client_stalls = [(at, lag) for at, lag in result["stalls"]]
    run.start = start
    for row in result["sent"]:
        r = Sent(**row)
        r.at -= start
        if r.done_at is not None:
            r.done_at -= start
        run.sent.append(r)
    if run.reclaimed_at is not None:
        at = run.reclaimed_at
        run.in_flight_on_spot = sum(
            1 for r in run.sent
            if r.replica is not None and r.replica in run.spot_urls and r.at <= at <= (r.done_at or at)
        )  # fmt: skip


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(
    cluster: Cluster,
    measured: dict[str, Measured],
    args: argparse.Namespace,
    run: Run,
    replicas: Replicas,
) -> None:
    variant_of, lags = replicas.variant_of, replicas.lags
    ttft_s, tpot_s = args.ttft_ms / 1000, args.tpot_ms / 1000

    def good(r: Sent) -> bool:
        return r.ok and r.ttft_s is not None and r.ttft_s <= ttft_s and (r.tpot_s or 0.0) <= tpot_s

    print("\n  minute  offered/s  demand  running mix at its end        cost/h  instant: optimum/h ratio  "
          "minute: optimum/h ratio  load1  stalls: client replicas  TTFT>0.5s: client router replicas  attainment  TTFT p95  TPOT p50  requests")  # fmt: skip
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
        lo, hi = run.start + m * 60, run.start + (m + 1) * 60
        client_stalled = stalled_share(run.client_stalls, lo, hi)
        replica_stalls = [
            stalled_share([(a, b) for a, b in lag.get("stalls", [])], lo, hi) for lag in lags.values()
        ]
        replicas_stalled = max(replica_stalls, default=float("nan"))
        client_slow = sum(1 for r in sent if r.ok and (r.ttft_s or 0.0) > 0.5) / max(1, len(sent))

        router_slow, replica_slow = (
            over(run.views.get((m, view), [0.0, 0.0])) for view in ("router", "replicas")
        )

        reclaimed = run.reclaimed_at is not None and m * 60 <= run.reclaimed_at < (m + 1) * 60
        mark = "  <- spot nodes deleted" if reclaimed else ""
        print(f"  {m:6d}  {rate:9.1f}  {demand:6.2f}  {mix:28s}  {cost:6.2f}  {best_instant:17.2f} {ratio_instant:5.2f}  "
              f"{best:16.2f} {ratio:5.2f}  {load:5.1f}  {client_stalled:14.1%} {replicas_stalled:8.1%}  {client_slow:17.1%} {router_slow:6.1%} {replica_slow:8.1%}  {attained:10.1%}  {p95:8.0f}  {p50:8.0f}  {len(sent):8d}"
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
    by_variant: dict[str, list[Sent]] = {}
    for r in run.sent:
        by_variant.setdefault(variant_of.get((r.replica or "").rstrip("/"), "no replica named"), []).append(r)
    print("  attainment per variant (the replica the router sent it to): " + "; ".join(
        f"{name} {sum(good(r) for r in rows) / len(rows):.1%} of {len(rows)} (TTFT p95 "
        f"{quantile([r.ttft_s or 0.0 for r in rows if r.ok], 0.95) * 1000:.0f} ms)"
        for name, rows in sorted(by_variant.items())
    ))  # fmt: skip
    lag = run.client_lag
    if lag:
        print(f"  the load generator's event-loop lag (10 ms sleeps): p50 {lag['p50_ms']:.1f} ms, p99 "
              f"{lag['p99_ms']:.1f} ms, max {lag['max_ms']:.0f} ms, {lag['stalled_share']:.1%} of the time in "
              f"stalls >= 50 ms")  # fmt: skip
    for name, lag in sorted(lags.items()):
        figures = lag.get("loop_lag") or {}
        if figures:
            print(f"  {name} replicas' process loop lag: p50 {figures['p50_ms']:.1f} ms, p99 {figures['p99_ms']:.1f} "
                  f"ms, max {figures['max_ms']:.0f} ms, {figures['stalled_share']:.1%} of the time in stalls")  # fmt: skip
    print(f"  the harness's finished kubectl calls (status every 2 s; not the pod watch, still running) used {run.harness_cpu_s:.0f} CPU s "
          f"while the load ran ({run.harness_cpu_s / (args.minutes * 60):.0%} of a core)")  # fmt: skip
    failed = [r for r in run.sent if not r.ok]
    kinds: dict[str, int] = {}
    for r in failed:
        kinds[(r.error or "no tokens")[:60]] = kinds.get((r.error or "no tokens")[:60], 0) + 1
    print(f"  failed requests: {len(failed)}" + (f" ({kinds})" if kinds else ""))
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
    parser.add_argument("--send-load", help=argparse.SUPPRESS)
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
        scale_down_window=(60, "autoscaling.scaleDownStabilizationSeconds: how long a fall waits to shed"),
        ttft_ms=600.0,
        tpot_ms=150.0,
    )
    args = parser.parse_args()
    if args.serve_replicas:
        asyncio.run(serve_replicas())
        return
    if args.send_load:
        asyncio.run(send_load(json.loads(args.send_load)))
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
    ):
        with Replicas(cluster) as replicas:
            cluster.kubectl("create", "namespace", NS)
            cluster.kubectl("apply", "-n", NS, "-f", "-", input=yaml.safe_dump(manifest(measured, args)))
            print(f"  control plane up, LLMService applied ({time.monotonic() - started:.0f} s); load: {args.low} "
                  f"req/s, {args.high} from minute {args.step_at}, {args.low} from minute {args.fall_at}; spot "
                  f"reclaimed at minute {args.reclaim_at}; scale-down window {args.scale_down_window} s", flush=True)  # fmt: skip
            asyncio.run(drive(cluster, replicas, args, run, Path(tmp)))
        # The replicas' helper processes have ended and said how late their event loops woke.
        report(cluster, measured, args, run, replicas)
    print(f"  total run {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
