"""The replica planner's loop at fleet size: N LLMServices × R replicas planned by one operator process.

What runs, and how it stands in for a cluster:

- **Replicas**: one simulated process (this script with ``--serve-replicas``)
  listens on 127.0.0.1, one port per replica pod, and answers ``/metrics`` with
  the runtime's own exposition (``ServerMetrics``: every family a replica
  exports, histograms filled), ``/ready`` and ``POST``/``DELETE /drain``. Each
  service's load follows a slow sine around 85 % of its replicas' target
  (±20 %, its own phase), shared over the pods that take new work; a drained
  pod holds nothing and answers ``/ready`` 503.
- **Operator**: this process runs, per LLMService, the operator's own loop —
  ``ReplicaLoop.tick`` (list pods, scrape each over HTTP with httpx, parse,
  plan, act, write status once) every ``autoscaling.intervalSeconds`` (5 s,
  the default), each service with its own httpx client, as the kopf daemon does.
- **API server**: a counting in-process stand-in (:class:`FleetKube`), not the
  real one: it keeps the LLMServices and their pods in memory, JSON-encodes
  and decodes every object it hands out (as a client would decode them), waits
  ``--api-latency-ms`` per call, and plays the ReplicaSet (pods follow
  ``spec.replicas``; marked pods go first; new pods are Ready after 5 s). Every
  call is counted. kopf's watch stream and its Event poster are not run: the
  loop reads each object from the store as a watch would have delivered it, and
  Events are counted as writes.

It prints, for each fleet size: CPU per tick and cores used, tick latency
p50/p99/max, event-loop lag p99, resident memory, and API reads and writes per
minute; with ``--sweep`` it runs each size in a fresh process and names the
first size at which the tick latency p99 exceeds the tick interval (the loop no
longer keeps its cadence).

    python benchmarks/planner_scale.py --services 500 --replicas 10
    python benchmarks/planner_scale.py --sweep 25,50,100,200,300,500
"""

import argparse
import asyncio
import contextlib
import copy
import json
import logging
import math
import os
import random
import resource
import ssl
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import psutil
from kubernetes_asyncio.client.exceptions import ApiException

from plimsoll.operator.api.base import API_VERSION, KIND
from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.handlers.replica_planning import ReplicaLoop
from plimsoll.operator.resources.deployment import build_deployment
from plimsoll.operator.resources.settings import BuildSettings

NAMESPACE = "fleet"
TARGET = 4  # capacity.concurrencyPerReplica
LOAD_PERIOD_S = 240.0
BASE_PORT = 20000


# -- the simulated replicas (a child process) -----------------------------------------------------


def replica_exposition() -> str:
    """The runtime's /metrics text with every family present; {running} and {waiting} to fill in."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from plimsoll import metric_names as mn
    from plimsoll.runtime.serving.metrics import ServerMetrics

    metrics = ServerMetrics("model", CollectorRegistry())
    rng = random.Random(0)
    for family in vars(metrics).values():
        labelled = isinstance(family, Histogram | Counter | Gauge) and family._labelnames == ("model_name",)
        if isinstance(family, Histogram) and labelled:
            for _ in range(200):
                family.labels("model").observe(rng.expovariate(8))
        elif isinstance(family, Counter) and labelled:
            family.labels("model").inc(rng.randint(100, 10_000))
        elif isinstance(family, Gauge) and labelled:
            family.labels("model").set(0.5)
    lines = []
    for line in metrics.exposition()[0].decode().splitlines():
        if line.startswith(mn.NUM_REQUESTS_RUNNING + "{"):
            line = line.rsplit(" ", 1)[0] + " {running}"
        elif line.startswith(mn.NUM_REQUESTS_WAITING + "{"):
            line = line.rsplit(" ", 1)[0] + " {waiting}"
        lines.append(line.replace("{", "{{").replace("}", "}}").replace("{{running}}", "{running}")
                     .replace("{{waiting}}", "{waiting}"))  # fmt: skip
    return "\n".join(lines) + "\n"


def service_load(service: int, replicas: int, now: float) -> float:
    """Requests in flight on one service: a sine around 85 % of its replicas' target, its own phase."""
    phase = random.Random(service).random() * 2 * math.pi
    return TARGET * replicas * (0.85 + 0.2 * math.sin(2 * math.pi * now / LOAD_PERIOD_S + phase))


async def serve_replicas(count: int, per_service: int) -> None:
    """Listen on BASE_PORT..BASE_PORT+count-1; the replica behind port p belongs to service (p - base) // R."""
    template = replica_exposition()
    live: set[int] = set()  # ports with a pod on them (the operator side says so)
    drained: set[int] = set()

    def body(port: int) -> tuple[int, bytes]:
        service = (port - BASE_PORT) // per_service
        first = BASE_PORT + service * per_service
        serving = [p for p in range(first, first + per_service) if p in live and p not in drained]
        share = service_load(service, per_service, time.time()) / len(serving) if port in serving else 0.0
        running = min(share, float(TARGET))
        return 200, template.format(running=f"{running:.1f}", waiting=f"{share - running:.1f}").encode()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, port: int) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                method, path = head.split(b" ", 2)[:2]
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                if length:
                    await reader.readexactly(length)
                status, payload = 200, b"{}"
                if path == b"/metrics":
                    status, payload = body(port)
                elif path == b"/ready":
                    status = 503 if port in drained else 200
                elif path == b"/drain":
                    (drained.add if method == b"POST" else drained.discard)(port)
                elif path.startswith(b"/sim/live/"):  # the stand-in API server: a pod was created or deleted
                    pod_port = int(path.rsplit(b"/", 1)[1])
                    if method == b"PUT":
                        live.add(pod_port)
                        drained.discard(pod_port)
                    else:
                        live.discard(pod_port)
                reason = b"OK" if status == 200 else b"Service Unavailable"
                writer.write(b"HTTP/1.1 %d %s\r\nContent-Length: %d\r\nContent-Type: text/plain\r\n\r\n"
                             % (status, reason, len(payload)) + payload)  # fmt: skip
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()

    for i in range(count):
        port = BASE_PORT + i
        await asyncio.start_server(lambda r, w, p=port: handle(r, w, p), "127.0.0.1", port, backlog=64)
    print("ready", flush=True)
    await asyncio.Event().wait()


# -- the stand-in API server and ReplicaSet ------------------------------------------------------------


def _merge(target: dict[str, Any], patch: dict[str, Any]) -> None:
    """JSON merge patch (RFC 7386) in place."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


def _roundtrip(obj: Any) -> Any:
    """What a client gets: the object decoded from JSON, a fresh copy."""
    return json.loads(json.dumps(obj))


def conflict() -> ApiException:
    return ApiException(status=409, reason="Conflict")


@dataclass
class FleetKube:
    """LLMServices and their pods in memory, every call counted (see the module docstring)."""

    sim: httpx.AsyncClient
    per_service: int
    latency_s: float
    services: dict[str, dict[str, Any]] = field(default_factory=dict)
    pods: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)  # service -> pod name -> pod
    ports: dict[str, int] = field(default_factory=dict)  # pod -> port
    calls: Counter[str] = field(default_factory=Counter)
    _made: int = 0

    async def _call(self, what: str) -> None:
        self.calls[what] += 1
        await asyncio.sleep(self.latency_s)

    def add_service(self, index: int, settings: BuildSettings) -> None:
        name = f"svc-{index:04d}"
        body = {
            "apiVersion": API_VERSION, "kind": KIND,
            "metadata": {"name": name, "namespace": NAMESPACE, "uid": f"uid-{index}", "generation": 1,
                         "resourceVersion": "1", "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {
                "model": {"uri": "hf://example/model-8b"}, "replicas": self.per_service,
                "resources": {"gpu": {"count": 1}},
                "scaling": {"min": 1, "max": self.per_service, "drainSeconds": 30},
                "capacity": {"mode": "Manual", "concurrencyPerReplica": TARGET},
                "autoscaling": {"mode": "builtin", "scaleUpStabilizationSeconds": 15,
                                "scaleDownStabilizationSeconds": 60},
            },
            "status": {},
        }  # fmt: skip
        self.services[name] = body
        self.pods[name] = {}
        svc = LLMService.from_body(body)
        template = build_deployment(svc, settings)["spec"]["template"]
        body["_template"] = template  # kept beside the object, never handed out
        body["_index"] = index

    async def start_pods(self) -> None:
        for name in self.services:
            await self._reconcile(name, ready_now=True)

    def body(self, name: str) -> dict[str, Any]:
        """The object as the daemon's watch would have delivered it (not counted: a watch event, not a call)."""
        return _roundtrip({k: v for k, v in self.services[name].items() if not k.startswith("_")})

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        await self._call(f"GET {kind}")
        return self.body(name)

    async def list_objects(
        self, api_version: str, kind: str, namespace: str, label_selector: str | None = None
    ) -> list[dict[str, Any]]:
        await self._call(f"LIST {kind}")
        wanted = dict(term.split("=", 1) for term in (label_selector or "").split(",") if term)
        service = wanted.get("app.kubernetes.io/instance", "")
        found = [p for p in self.pods.get(service, {}).values()
                 if all(p["metadata"]["labels"].get(k) == v for k, v in wanted.items())]  # fmt: skip
        return list(_roundtrip(found))

    async def merge_patch(
        self, api_version: str, kind: str, namespace: str, name: str, patch: dict[str, Any]
    ) -> dict[str, Any]:
        await self._call(f"PATCH {kind}")
        if kind == "Pod":
            service = name.rsplit("-", 1)[0]
            _merge(self.pods[service][name], patch)
            return {}
        body = self.services[name]
        expected = (patch.get("metadata") or {}).get("resourceVersion")
        if expected and expected != body["metadata"]["resourceVersion"]:
            raise conflict()
        _merge(body, {k: v for k, v in patch.items() if k != "metadata"})
        body["metadata"]["resourceVersion"] = str(int(body["metadata"]["resourceVersion"]) + 1)
        await self._reconcile(name)
        return {}

    async def patch_status(
        self, api_version: str, kind: str, namespace: str, name: str, status: dict[str, Any],
        resource_version: str | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        await self._call("PATCH status")
        body = self.services[name]
        if resource_version and resource_version != body["metadata"]["resourceVersion"]:
            raise conflict()
        body.setdefault("status", {})
        _merge(body["status"], json.loads(json.dumps(status)))
        body["metadata"]["resourceVersion"] = str(int(body["metadata"]["resourceVersion"]) + 1)
        return {}

    async def _reconcile(self, name: str, ready_now: bool = False) -> None:
        """The ReplicaSet: pods follow spec.replicas; marked ones (lowest deletion cost) go first."""
        body, pods = self.services[name], self.pods[name]
        wanted = int(body["spec"].get("replicas") or 0)
        live = [p for p in pods.values() if not p["metadata"].get("deletionTimestamp")]
        first = BASE_PORT + body["_index"] * self.per_service
        if len(live) < wanted:
            used = {self.ports[n] for n in pods}
            for port in [p for p in range(first, first + self.per_service) if p not in used][
                : wanted - len(live)
            ]:
                self._made += 1
                pod_name = f"{name}-{self._made:06d}"
                pod = copy.deepcopy(body["_template"])
                pod["metadata"]["name"] = pod_name
                pod["spec"]["containers"][0]["ports"] = [{"name": "http", "containerPort": port}]
                pod["status"] = {"phase": "Running", "podIP": "127.0.0.1", "conditions": [
                    {"type": "Ready", "status": "True" if ready_now else "False"}]}  # fmt: skip
                pods[pod_name], self.ports[pod_name] = pod, port
                await self.sim.put(f"http://127.0.0.1:{BASE_PORT}/sim/live/{port}")
                if not ready_now:
                    asyncio.get_running_loop().call_later(5.0, _set_ready, pod)
        elif len(live) > wanted:

            def cost(p: dict[str, Any]) -> tuple[int, str]:
                marked = (p["metadata"].get("annotations") or {}).get(
                    "controller.kubernetes.io/pod-deletion-cost"
                )
                return (0 if marked else 1, p["metadata"]["name"])

            for pod in sorted(live, key=cost)[: len(live) - wanted]:
                pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
                asyncio.get_running_loop().call_later(2.0, lambda n=pod["metadata"]["name"]: asyncio.ensure_future(
                    self._remove(name, n)))  # fmt: skip

    async def _remove(self, service: str, pod: str) -> None:
        port = self.ports.pop(pod)
        del self.pods[service][pod]
        with contextlib.suppress(httpx.HTTPError):
            await self.sim.delete(f"http://127.0.0.1:{BASE_PORT}/sim/live/{port}")
        await self._reconcile(service)  # a port is free again: a pod still owed can start on it


def _set_ready(pod: dict[str, Any]) -> None:
    pod["status"]["conditions"] = [{"type": "Ready", "status": "True"}]


# -- the operator side ---------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))] if ordered else math.nan


async def run_fleet(services: int, per_service: int, interval: float, warmup: float, seconds: float,
                    latency_ms: float) -> dict[str, Any]:  # fmt: skip
    logging.getLogger("fleet").setLevel(logging.WARNING)
    process = psutil.Process()
    rss_start = process.memory_info().rss
    events: Counter[str] = Counter()
    latencies: list[float] = []
    lags: list[float] = []
    ticks = failures = 0
    scrape_errors: Counter[str] = Counter()
    measuring = False
    stop = asyncio.Event()
    async with httpx.AsyncClient() as sim:  # the stand-in's own line to the replicas' process
        kube = FleetKube(sim, per_service, latency_ms / 1000)
        settings = BuildSettings.model_validate({})
        for i in range(services):
            kube.add_service(i, settings)
        await kube.start_pods()

        # One client per daemon, as the operator has. Each would load the CA bundle again (tens of ms
        # of CPU, at start-up only, and the replicas speak plain HTTP): they share one TLS context.
        started = time.process_time()
        tls = ssl.create_default_context()
        clients = {name: httpx.AsyncClient(verify=tls) for name in kube.services}
        client_cpu = time.process_time() - started

        async def daemon(name: str) -> None:
            nonlocal ticks, failures
            logger = logging.getLogger("fleet")
            await asyncio.sleep(random.random() * interval)  # daemons start at different moments
            async with clients[name] as http:
                loop = ReplicaLoop(kube, http, lambda t, r, m: events.update([r]), logger)  # type: ignore[arg-type]
                while not stop.is_set():
                    start = time.perf_counter()
                    plan = None
                    try:
                        plan = await loop.tick(kube.body(name))
                    except Exception as error:  # counted, as the daemon logs and goes on
                        failures += 1
                        logger.warning("tick failed: %s", error)
                    if measuring:
                        latencies.append(time.perf_counter() - start)
                        ticks += 1
                        if plan is not None and plan.decision is not None:
                            # A scrape that timed out (a loop too busy to read its answer) is not parsed,
                            # so CPU per tick reads low once these appear.
                            scrape_errors.update(e.split(": ", 2)[1] for e in plan.decision.errors)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), interval)

        async def lag_probe() -> None:
            while not stop.is_set():
                start = time.perf_counter()
                await asyncio.sleep(0.1)
                if measuring:
                    lags.append(time.perf_counter() - start - 0.1)

        tasks = [asyncio.create_task(daemon(name)) for name in kube.services]
        tasks.append(asyncio.create_task(lag_probe()))
        await asyncio.sleep(warmup)
        measuring = True
        calls0, events0, cpu0, wall0 = (
            Counter(kube.calls),
            Counter(events),
            process.cpu_times(),
            time.perf_counter(),
        )
        await asyncio.sleep(seconds)
        cpu1, wall1 = process.cpu_times(), time.perf_counter()
        measuring = False
        stop.set()
        await asyncio.gather(*tasks)
    cpu = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
    wall = wall1 - wall0
    calls = kube.calls - calls0
    posted = events - events0
    per_min = 60.0 / wall
    writes = {k: v * per_min for k, v in calls.items() if not k.startswith(("GET", "LIST"))}
    writes["POST Event"] = sum(posted.values()) * per_min
    reads = {k: v * per_min for k, v in calls.items() if k.startswith(("GET", "LIST"))}
    return {
        "services": services,
        "replicas": per_service,
        "interval_s": interval,
        "ticks": ticks,
        "failed_ticks": failures,
        "cpu_ms_per_tick": 1000 * cpu / max(ticks, 1),
        "scrape_errors_per_tick": sum(scrape_errors.values()) / max(ticks, 1),
        "scrape_errors": dict(scrape_errors),
        "cores": cpu / wall,
        "tick_p50_s": percentile(latencies, 0.5),
        "tick_p99_s": percentile(latencies, 0.99),
        "tick_max_s": max(latencies, default=math.nan),
        "loop_lag_p99_s": percentile(lags, 0.99),
        "rss_mib": process.memory_info().rss / 2**20,
        "rss_start_mib": rss_start / 2**20,
        "client_startup_cpu_s": client_cpu,
        "writes_per_min": {k: round(v, 1) for k, v in sorted(writes.items())},
        "reads_per_min": {k: round(v, 1) for k, v in sorted(reads.items())},
        "events": dict(posted),
        "seconds": wall,
    }


def one_point(args: argparse.Namespace) -> dict[str, Any]:
    """Start the replica process for this fleet, run the operator side against it."""
    count = args.services * args.replicas
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if 2 * count + 1000 > hard:
        raise SystemExit(
            f"{count} replica ports need about {2 * count + 1000} file descriptors; the limit is {hard}"
        )
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve-replicas", str(count), "--replicas", str(args.replicas)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert server.stdout is not None
        if server.stdout.readline().strip() != "ready":
            raise SystemExit("the simulated replicas did not start")
        result = asyncio.run(run_fleet(args.services, args.replicas, args.interval, args.warmup, args.seconds,
                                       args.api_latency_ms))  # fmt: skip
        result["replica_process_cpu_s"] = sum(psutil.Process(server.pid).cpu_times()[:2])
        return result
    finally:
        server.terminate()
        server.wait(timeout=30)


def show(r: dict[str, Any]) -> str:
    writes = sum(r["writes_per_min"].values())
    keeps = "keeps up" if r["tick_p99_s"] <= r["interval_s"] else "FALLS BEHIND"
    per_core = r["interval_s"] / (r["cpu_ms_per_tick"] / 1000)
    return (
        f"{r['services']:5d} × {r['replicas']:2d}  CPU/tick {r['cpu_ms_per_tick']:6.1f} ms "
        f"(one core: {per_core:4.0f} services)  scrape errors/tick {r['scrape_errors_per_tick']:4.1f}  "
        f"cores {r['cores']:4.2f}  "
        f"tick p50 {r['tick_p50_s']:6.3f} s p99 {r['tick_p99_s']:6.3f} s max {r['tick_max_s']:6.3f} s  "
        f"lag p99 {r['loop_lag_p99_s']:6.3f} s  RSS {r['rss_mib']:5.0f} MiB  writes/min {writes:7.0f}  "
        f"ticks {r['ticks']} failed {r['failed_ticks']}  {keeps}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--services", type=int, default=500)
    parser.add_argument(
        "--replicas", type=int, default=10, help="replica pods per LLMService (and scaling.max)"
    )
    parser.add_argument("--interval", type=float, default=5.0, help="autoscaling.intervalSeconds")
    parser.add_argument("--warmup", type=float, default=15.0, help="seconds before measuring")
    parser.add_argument("--seconds", type=float, default=60.0, help="seconds measured")
    parser.add_argument(
        "--api-latency-ms", type=float, default=2.0, help="the stand-in API server's latency per call"
    )
    parser.add_argument(
        "--sweep", type=str, default="", help="comma-separated fleet sizes, each in a fresh process"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON line (what --sweep reads)")
    parser.add_argument("--serve-replicas", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_replicas:
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        asyncio.run(serve_replicas(args.serve_replicas, args.replicas))
        return
    host = f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start"
    if not args.sweep:
        result = one_point(args)
        print(json.dumps(result) if args.json else show(result) + "\n" + json.dumps(result, indent=1))
        return
    print(
        f"host: {host}; interval {args.interval:g} s; API latency {args.api_latency_ms:g} ms (in-process stand-in)"
    )
    results = []
    for size in [int(s) for s in args.sweep.split(",")]:
        cmd = [sys.executable, __file__, "--json", "--services", str(size), "--replicas", str(args.replicas),
               "--interval", str(args.interval), "--warmup", str(args.warmup), "--seconds", str(args.seconds),
               "--api-latency-ms", str(args.api_latency_ms)]  # fmt: skip
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        results.append(json.loads(out))
        print(show(results[-1]), flush=True)
        print(
            "   writes/min",
            results[-1]["writes_per_min"],
            " reads/min",
            results[-1]["reads_per_min"],
            flush=True,
        )
    behind = [r["services"] for r in results if r["tick_p99_s"] > r["interval_s"]]
    kept = [r["services"] for r in results if r["tick_p99_s"] <= r["interval_s"]]
    print(f"largest fleet that kept up: {max(kept, default=0)} services; first that fell behind: "
          f"{min(behind) if behind else 'none in this sweep'}")  # fmt: skip
    mean_cpu = statistics.mean(r["cpu_ms_per_tick"] for r in results)
    print(f"CPU per tick over the sweep: {mean_cpu:.1f} ms ({args.replicas} replicas each)")


if __name__ == "__main__":
    main()
