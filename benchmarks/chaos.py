"""Chaos on the local control plane: replicas and routers SIGKILLed under streaming load, the operator restarted.

Starts a fresh local control plane with the pod runner, installs the Helm chart, runs the
operator as a local process with the chart's ServiceAccount token, and applies an
LLMService of ``--replicas`` replicas (`plimsoll serve` on a tiny random model, local
processes bound to their pod IPs) behind the router (``router.replicas`` 2, in-flight
migration on). Its capacity is profiled by the operator's own benchmark Job; the load is
the profile's recommended concurrency per replica times the replicas (``--concurrency``
overrides it and skips the profile).

Then two runs of ``--minutes`` each with the same closed-loop streaming load (greedy
``/v1/completions``, ``ignore_eos``, a fixed set of prompts): a calm one, and one during
which a chaos loop SIGKILLs a random replica's engine process every ``--replica-every``
seconds and a random router's process every ``--router-every`` seconds (the pod runner
restarts them, as a kubelet would), and the operator is SIGKILLed and started again
halfway. Clients reach the routers as a Service would send them: each request goes to a
ready router pod, and a request that fails there is retried once on the other router (a
retry after a router died mid-stream repeats the request whole). It prints, per run,
requests sent / completed / failed, streams cut (the last try ended without ``[DONE]``),
requests retried, outputs differing from the calm run's for the same prompt, the routers'
migrations by outcome, and TTFT / E2E percentiles, then the chaos run's p95 E2E against
the calm run's. Targets: 0 failed, 0 cut streams, p95 E2E within 1.5x of calm. Every
process shares this machine's CPU, so the figures are for this machine.

    python benchmarks/chaos.py
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from plimsoll.devcluster.cluster import Cluster
from plimsoll.devcluster.kubeapi import KubeAPI
from plimsoll.devcluster.podload import ready_url
from plimsoll.devcluster.podrunner import pod_processes
from plimsoll.operator.local import OperatorProcess, chart_operator
from plimsoll.operator.resources.profile_job import PROFILE_ARGS_ANNOTATION
from plimsoll.prometheus import parse

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "plimsoll"
NAME = "chaos"
NS = "chaos"
PROMPTS = [f"Request {i}: tell me about ship number {i} and its load line." for i in range(24)]
OUTCOMES = ("migrated", "completed", "limit_reached", "no_replica", "refused", "unsupported")


@dataclass
class Outcome:
    sent_at: float
    prompt: int
    tries: int = 0
    ok: bool = False
    cut: bool = False  # the last try began streaming and ended without [DONE]
    ttft_s: float | None = None
    e2e_s: float | None = None
    text: str = ""
    error: str = ""


@dataclass
class Restart:
    """One killed replica's way back, in Unix seconds: what its restart-to-Ready was spent on."""

    pod: str
    killed_at: float
    started_at: float | None = None  # the new engine process's start (its process_start_time_seconds)
    phases: dict[str, float] = field(default_factory=dict)  # plimsoll_startup_phase_seconds of the new process
    ready_at: float | None = None  # first seen Ready again in the API (to within the 0.5 s refresh)


@dataclass
class Run:
    label: str
    started: float = 0.0
    ended: float = 0.0
    outcomes: list[Outcome] = field(default_factory=list)
    migrations: Counter[str] = field(default_factory=Counter)
    events: list[str] = field(default_factory=list)
    restarts: list[Restart] = field(default_factory=list)


def manifest(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    capacity: dict[str, Any] = {
        "mode": "Profile",
        "verifySeconds": 10,
        "profile": {"workload": {"inputTokens": 24, "outputTokens": args.max_tokens,
                                 "concurrency": [1, 2, 4, 6, 8, 12, 16], "requestsPerLevel": 16}},
    }  # fmt: skip
    if args.concurrency:
        capacity = {"mode": "Manual", "concurrencyPerReplica": max(1, args.concurrency // args.replicas)}
    return {
        "apiVersion": "plimsoll.dev/v1alpha1",
        "kind": "LLMService",
        "metadata": {
            "name": NAME,
            # A shared CPU: the profile's sweep tolerates client lag it would refuse on a quiet host.
            "annotations": {PROFILE_ARGS_ANNOTATION: "--max-client-lag-ms 1000 --min-concurrency-ratio 0.8"},
        },
        "spec": {
            "model": {"uri": f"file://{model}"},
            "engine": {"maxNumSeqs": 16, "kvCacheMemory": "32Mi"},
            "resources": {"gpu": {"count": 0}},
            "replicas": args.replicas,
            "autoscaling": {"mode": "off"},
            "capacity": capacity,
            "router": {"enabled": True, "replicas": 2, "migrationLimit": 3},
        },
    }


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


class Fleet:
    """The LLMService's pods as the API server lists them, refreshed in the background."""

    def __init__(self, kubeconfig: Path) -> None:
        self.kubeconfig = kubeconfig
        self.routers: dict[str, str] = {}  # ready router pods: name -> URL
        self.router_ips: dict[str, str] = {}  # every router pod with an IP: name -> URL (for /metrics)
        self.replicas: dict[str, str] = {}  # ready replica pods

    async def refresh(self, api: KubeAPI) -> None:
        for component, ready_into in (("router", self.routers), ("replica", self.replicas)):
            selector = f"app.kubernetes.io/instance={NAME},app.kubernetes.io/component={component}"
            pods = await api.get(f"/api/v1/namespaces/{NS}/pods", params={"labelSelector": selector})
            ready = {p["metadata"]["name"]: url for p in pods["items"] if (url := ready_url(p))}
            ready_into.clear()
            ready_into.update(ready)
            if component == "router":
                self.router_ips = {p["metadata"]["name"]: f"http://{p['status']['podIP']}:8000"
                                   for p in pods["items"] if (p.get("status") or {}).get("podIP")}  # fmt: skip


class Load:
    """Closed-loop streaming clients through the routers, each request retried once on another router."""

    def __init__(self, fleet: Fleet, clients: int, max_tokens: int, seed: int) -> None:
        self.fleet = fleet
        self.clients = clients
        self.max_tokens = max_tokens
        self.rng = random.Random(seed)

    async def run(self, run: Run, seconds: float, http: httpx.AsyncClient) -> None:
        stop_at = time.monotonic() + seconds
        counter = iter(range(10**9))

        async def client() -> None:
            while time.monotonic() < stop_at:
                run.outcomes.append(await self.request(next(counter) % len(PROMPTS), http))

        await asyncio.gather(*(client() for _ in range(self.clients)))

    async def request(self, prompt: int, http: httpx.AsyncClient) -> Outcome:
        outcome = Outcome(sent_at=time.monotonic(), prompt=prompt)
        body = {"model": NAME, "prompt": PROMPTS[prompt], "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        tried: set[str] = set()
        for outcome.tries in (1, 2):
            routers = {n: u for n, u in self.fleet.routers.items() if n not in tried} or self.fleet.routers
            if not routers:
                await asyncio.sleep(0.5)
                continue
            name = self.rng.choice(sorted(routers))
            tried.add(name)
            if await self._attempt(http, routers[name], body, outcome):
                break
        outcome.e2e_s = time.monotonic() - outcome.sent_at
        return outcome

    async def _attempt(
        self, http: httpx.AsyncClient, url: str, body: dict[str, Any], outcome: Outcome
    ) -> bool:
        text: list[str] = []
        outcome.cut = False
        try:
            async with http.stream("POST", url + "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    outcome.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                    return False
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line.removeprefix("data: ")
                    if data == "[DONE]":
                        outcome.ok, outcome.text, outcome.error = True, "".join(text), ""
                        return True
                    event = json.loads(data)
                    if "error" in event:
                        outcome.cut, outcome.error = True, f"error event: {event['error'].get('message')}"
                        return False
                    for choice in event.get("choices") or []:
                        if outcome.ttft_s is None:
                            outcome.ttft_s = time.monotonic() - outcome.sent_at
                        text.append(choice.get("text") or "")
                outcome.cut, outcome.error = bool(text), "the stream ended without [DONE]"
        except httpx.HTTPError as exc:
            outcome.cut = bool(text)
            outcome.error = f"{type(exc).__name__}: {exc}"
        return False


class MigrationCounter:
    """plimsoll_router_migrations_total summed over router pods, across their restarts (a counter that
    goes down started again from zero)."""

    def __init__(self) -> None:
        self.last: dict[tuple[str, str], float] = {}
        self.total: Counter[str] = Counter()

    async def scrape(self, fleet: Fleet, http: httpx.AsyncClient) -> None:
        for name, url in list(fleet.router_ips.items()):
            try:
                text = (await http.get(url + "/metrics", timeout=2)).text
            except httpx.HTTPError:
                continue
            samples = parse(text).samples.get("plimsoll_router_migrations_total", [])
            for labels, value in samples:
                key = (name, labels.get("outcome", ""))
                previous = self.last.get(key, 0.0)
                self.total[key[1]] += value - previous if value >= previous else value
                self.last[key] = value


def kill_process(cluster: Cluster, pod: str, container: str) -> int | None:
    records = pod_processes(Path(cluster.state_dir) / "pods", NS, pod)
    record = records.get(container)
    if record is None:
        return None
    with contextlib.suppress(ProcessLookupError):
        os.kill(record.pid, signal.SIGKILL)
    return record.pid


def kill_one(cluster: Cluster, run: Run, rng: random.Random, now: float, pods: Iterable[str], container: str,
             what: str) -> str | None:  # fmt: skip
    """SIGKILL ``container`` in a random one of ``pods``, logged as ``what`` at ``now``: that pod, or None if none."""
    names = sorted(pods)
    if not names:
        return None
    pod = rng.choice(names)
    pid = kill_process(cluster, pod, container)
    run.events.append(f"{now:5.0f} s  SIGKILL {what} {pod} (PID {pid})")
    return pod


async def follow_restart(fleet: Fleet, http: httpx.AsyncClient, restart: Restart) -> None:
    """Wait for the killed replica to be Ready again, then read its new process's start-up phases."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(30):  # the pod runner marks a dead container not ready at once
            while restart.pod in fleet.replicas:
                await asyncio.sleep(0.1)
        async with asyncio.timeout(600):
            while restart.pod not in fleet.replicas:
                await asyncio.sleep(0.1)
        restart.ready_at = time.time()
        with contextlib.suppress(httpx.HTTPError, ValueError):
            scrape = parse((await http.get(fleet.replicas[restart.pod] + "/metrics", timeout=5)).text)
            restart.started_at = max(scrape.values("process_start_time_seconds"), default=None)
            restart.phases = {labels["phase"]: value for labels, value
                              in scrape.samples.get("plimsoll_startup_phase_seconds", [])}  # fmt: skip


async def chaos(cluster: Cluster, operator: OperatorProcess, fleet: Fleet, run: Run,
                args: argparse.Namespace, rng: random.Random, http: httpx.AsyncClient) -> None:  # fmt: skip
    """SIGKILL a replica every --replica-every s, a router every --router-every s; restart the operator halfway."""
    seconds = args.minutes * 60
    start = time.monotonic()
    next_replica, next_router, restart_at = args.replica_every, args.router_every, seconds / 2
    restarted = False
    followers: list[asyncio.Task[None]] = []
    while (now := time.monotonic() - start) < seconds:
        if now >= next_replica:
            pod = kill_one(cluster, run, rng, now, fleet.replicas, "engine", "replica")
            if pod is not None:
                run.restarts.append(Restart(pod, time.time()))
                followers.append(asyncio.create_task(follow_restart(fleet, http, run.restarts[-1])))
            next_replica += args.replica_every
        if now >= next_router:
            kill_one(cluster, run, rng, now, fleet.routers, "router", "router")
            next_router += args.router_every
        if not restarted and now >= restart_at:
            await asyncio.to_thread(operator.stop, True)
            run.events.append(f"{now:5.0f} s  SIGKILL the operator")
            await asyncio.to_thread(operator.start)
            run.events.append(f"{time.monotonic() - start:5.0f} s  the operator is live again")
            restarted = True
        await asyncio.sleep(0.5)
    for follower in followers:  # a replica killed near the end still comes back (the next run needs it)
        await follower


async def measure(cluster: Cluster, operator: OperatorProcess, fleet: Fleet, args: argparse.Namespace,
                  clients: int, label: str, with_chaos: bool) -> Run:  # fmt: skip
    run = Run(label)
    api = KubeAPI(Path(cluster.kubeconfig))
    migrations = MigrationCounter()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)  # a new connection per request
    async with httpx.AsyncClient(timeout=120, limits=limits, trust_env=False) as http:
        stop = asyncio.Event()

        async def watch() -> None:
            while not stop.is_set():
                with contextlib.suppress(Exception):
                    await fleet.refresh(api)
                    await migrations.scrape(fleet, http)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.5)

        await fleet.refresh(api)
        await migrations.scrape(fleet, http)
        baseline = Counter(migrations.total)
        watcher = asyncio.create_task(watch())
        load = Load(fleet, clients, args.max_tokens, seed=args.seed)
        run.started = time.monotonic()
        tasks = [load.run(run, args.minutes * 60, http)]
        if with_chaos:
            tasks.append(chaos(cluster, operator, fleet, run, args, random.Random(args.seed), http))
        await asyncio.gather(*tasks)
        run.ended = time.monotonic()
        await asyncio.sleep(3)  # a last scrape after the load stopped
        stop.set()
        await watcher
        await migrations.scrape(fleet, http)
        run.migrations = migrations.total - baseline
    await api.aclose()
    return run


def wait_ready(cluster: Cluster, fleet: Fleet, replicas: int, profile: bool, timeout: float) -> int | None:
    """Wait for every replica and both routers to be ready (and the profile, in Profile mode)."""
    deadline = time.monotonic() + timeout
    api_loop = asyncio.new_event_loop()
    api = KubeAPI(Path(cluster.kubeconfig))
    try:
        while time.monotonic() < deadline:
            try:  # a busy API server on a shared CPU can time out: ask again
                api_loop.run_until_complete(fleet.refresh(api))
                svc = json.loads(cluster.kubectl("get", "llms", NAME, "-n", NS, "-o", "json").stdout)
            except (httpx.HTTPError, subprocess.CalledProcessError, subprocess.TimeoutExpired):
                time.sleep(2)
                continue
            status = svc.get("status") or {}
            per_replica = (status.get("capacity") or {}).get("concurrencyPerReplica")
            profiled = next((c for c in status.get("conditions") or [] if c["type"] == "Profiled"), {})
            if profile and profiled.get("reason") == "NoRecommendation":
                raise SystemExit(f"the capacity profile gave no concurrency ({profiled.get('message')}); "
                                 "give --concurrency")  # fmt: skip
            if len(fleet.replicas) == replicas and len(fleet.routers) == 2 and (per_replica or not profile):
                return int(per_replica) if per_replica else None
            time.sleep(2)
    finally:
        api_loop.run_until_complete(api.aclose())
        api_loop.close()
    raise TimeoutError(f"not ready after {timeout:.0f} s: replicas {fleet.replicas}, routers {fleet.routers}")


def report(run: Run, calm_texts: dict[int, str]) -> dict[str, Any]:
    done = [o for o in run.outcomes if o.ok]
    ttft = [o.ttft_s for o in done if o.ttft_s is not None]
    e2e = [o.e2e_s for o in done if o.e2e_s is not None]
    return {
        "sent": len(run.outcomes),
        "completed": len(done),
        "failed": sum(not o.ok for o in run.outcomes),
        "cut": sum(o.cut and not o.ok for o in run.outcomes),
        "retried": sum(o.tries > 1 for o in run.outcomes),
        "mismatched": sum(o.prompt in calm_texts and o.text != calm_texts[o.prompt] for o in done),
        "ttft_p50": percentile(ttft, 0.5),
        "ttft_p95": percentile(ttft, 0.95),
        "e2e_p50": percentile(e2e, 0.5),
        "e2e_p95": percentile(e2e, 0.95),
        "seconds": run.ended - run.started,
    }


def print_restarts(restarts: list[Restart]) -> None:
    """Each killed replica's restart-to-Ready, split into where it went, and the medians."""
    print("replica restarts (s): kill->process start (restart back-off), process start->imports done, "
          "->engine /ready (weights, KV, warm-up), engine /ready->pod Ready in the API, total")  # fmt: skip
    rows = []
    for r in restarts:
        if r.ready_at is None or r.started_at is None or "ready" not in r.phases:
            print(f"  {r.pod}: not back (or not read) before the run ended")
            continue
        imports = r.phases.get("imports", 0.0)
        row = (r.started_at - r.killed_at, imports, r.phases["ready"] - imports,
               r.ready_at - r.started_at - r.phases["ready"], r.ready_at - r.killed_at)  # fmt: skip
        rows.append(row)
        print(f"  {r.pod}: " + "  ".join(f"{v:6.1f}" for v in row))
    if rows:
        medians = [percentile([row[i] for row in rows], 0.5) for i in range(5)]
        print("  median: " + "  ".join(f"{v:6.1f}" for v in medians))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--minutes", type=float, default=5.0, help="length of each run (calm, then chaos)")
    parser.add_argument("--replica-every", type=float, default=30.0, help="seconds between replica kills")
    parser.add_argument("--router-every", type=float, default=90.0, help="seconds between router kills")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=0,
                        help="total clients; 0: the profile's recommended concurrency per replica x replicas")  # fmt: skip
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    # SIGTERM (a background run ignores SIGINT) unwinds like Ctrl-C: the control plane and its pods stop.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from plimsoll.runtime.testing import pod_model

    model = pod_model()
    started = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="plimsoll-chaos-") as tmp,
        Cluster(Path(tmp) / "cluster", pod_runner=True) as cluster,
        chart_operator(cluster, CHART, Path(tmp)) as operator,
    ):
        cluster.kubectl("create", "namespace", NS)
        cluster.kubectl("apply", "-n", NS, "-f", "-", input=yaml.safe_dump(manifest(args, model)))
        fleet = Fleet(Path(cluster.kubeconfig))
        per_replica = wait_ready(cluster, fleet, args.replicas, profile=not args.concurrency, timeout=1200)
        clients = args.concurrency or (per_replica or 1) * args.replicas
        print(f"ready after {time.monotonic() - started:.0f} s: {args.replicas} replicas, 2 routers; "
              f"{clients} clients ({'--concurrency' if args.concurrency else f'profile: {per_replica} per replica'})",
              flush=True)  # fmt: skip
        calm = asyncio.run(measure(cluster, operator, fleet, args, clients, "calm", with_chaos=False))
        print(f"calm run done: {len(calm.outcomes)} requests", flush=True)
        stormy = asyncio.run(measure(cluster, operator, fleet, args, clients, "chaos", with_chaos=True))

    texts: dict[int, str] = {}
    for o in calm.outcomes:
        if o.ok:
            texts.setdefault(o.prompt, o.text)
    unsteady = sum(o.ok and o.text != texts[o.prompt] for o in calm.outcomes)
    rows = {run.label: report(run, texts) for run in (calm, stormy)}
    print(f"\n{args.minutes:g} min of closed-loop streaming per run, {clients} clients, greedy, max_tokens "
          f"{args.max_tokens} (ignore_eos), {args.replicas} replicas, 2 routers (--migration-limit 3); chaos: a "
          f"replica SIGKILLed every {args.replica_every:g} s, a router every {args.router_every:g} s, the "
          f"operator SIGKILLed and restarted halfway; total {time.monotonic() - started:.0f} s")  # fmt: skip
    head = ("sent", "completed", "failed", "cut", "retried", "mismatched")
    print(f"{'run':6} " + " ".join(f"{h:>10}" for h in head)
          + f" {'TTFT p50':>9} {'TTFT p95':>9} {'E2E p50':>9} {'E2E p95':>9}")  # fmt: skip
    for label, r in rows.items():
        print(f"{label:6} " + " ".join(f"{r[h]:>10}" for h in head)
              + "".join(f" {r[k]:>8.2f}s" for k in ("ttft_p50", "ttft_p95", "e2e_p50", "e2e_p95")))  # fmt: skip
    for run in (calm, stormy):
        counts = ", ".join(f"{k} {run.migrations.get(k, 0):g}" for k in OUTCOMES)
        print(f"{run.label}: router migrations: {counts}")
    print("chaos events:")
    for event in stormy.events:
        print(f"  {event}")
    print_restarts(stormy.restarts)
    failures = Counter(o.error.split(":")[0] for o in stormy.outcomes if not o.ok)
    if failures:
        print(f"chaos failures by kind: {dict(failures)}")
        for o in [o for o in stormy.outcomes if not o.ok][:5]:
            print(f"  {o.sent_at - stormy.started:5.0f} s  after {o.tries} tries: {o.error}")
    ratio = rows["chaos"]["e2e_p95"] / rows["calm"]["e2e_p95"]
    print(f"p95 E2E chaos / calm = {ratio:.2f} (target <= 1.5); p95 TTFT chaos / calm = "
          f"{rows['chaos']['ttft_p95'] / rows['calm']['ttft_p95']:.2f}; calm outputs differing between "
          f"repeats of a prompt: {unsteady}")  # fmt: skip


if __name__ == "__main__":
    main()
