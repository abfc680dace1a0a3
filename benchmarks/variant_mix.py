"""Hardware variants end to end on simulated replicas: profiles, the mix, the router's split, a step load, a spot reclaim.

Three variants of one service, each a simulated replica (``bench/simulator.py``)
with its own service curve: ``h100`` (batch cap 16, fast steps, 4/h), ``l4``
(cap 8, slower, 1/h) and ``spot`` (a MIG slice: cap 4, slower still, 0.5/h, spot).
What runs, and what stands in for what:

1. **Profiles.** ``plimsoll bench``'s sweep (``BenchSession``, real HTTP) on one
   replica of each variant, read by the operator's ``read_profile``: each
   variant's knees, per-replica concurrency and requests/s at it, as the
   per-variant profile Job records them in ``status.variants.<name>.capacity``.
2. **The mix for a sweep of demands**: ``choose_mix`` on the measured capacities
   against a brute force over every count within the bounds (same order).
3. **The router's split**: two replicas of each variant (six simulator
   processes) behind a real router (its app on uvicorn in this process, static
   replicas, least in-flight), closed-loop clients holding 70 % of the replicas'
   summed concurrency targets in flight; with the replicas weighed as the operator
   publishes them (``status.variants.<name>.rate``, the requests/s at the target,
   and ``.weight``, the concurrency), all at 1.0, and weighed with the spot
   replicas killed half-way. Printed: each variant's share of the requests against its share of
   capacity (requests/s), requests failed, and requests in flight on the killed
   replicas when they died (what the replica loss itself costs).
4. **Step load and 5. spot reclaim**, in simulated time (``variant_mix_cluster.py`` runs
   them on a local control plane): the operator's replica
   planner (``ReplicaPlanner.plan``, the same code the handler runs every 5 s)
   over a modelled fleet. Pods become Ready 60 s after their count goes up;
   each Ready pod takes demand in proportion to its measured requests/s (the
   split part 3 measures) and holds ``rate × its measured latency`` in flight;
   a pod taking more than the most requests/s its sweep finished within the
   SLO (at any level up to the latency knee) misses it with the excess (the
   modelled attainment). At minute 14
   the spot nodes are deleted: its pods stop answering, replacements are
   unschedulable. Printed per minute: demand, the running mix, its cost, the
   brute-force optimum's cost for that minute's demand, and attainment; then
   what ``status.mix`` and the Events said. Requests lost to the reclaim are
   the in-flight on the spot pods when their nodes went.

Figures, not a test (the optimiser's and the split's properties are tested in
``tests/operator/scaling/test_variant_mix.py`` and ``tests/router/test_router_weights.py``).

    python benchmarks/variant_mix.py
"""

import argparse
import asyncio
import collections
import itertools
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from plimsoll.bench.config import SLO, BenchConfig, LengthSpec
from plimsoll.bench.session import BenchSession
from plimsoll.bench.simulator import ServiceCurve, running_simulator, spawn_simulator
from plimsoll.operator.api.spec import LLMServiceSpec
from plimsoll.operator.scaling.metrics import PodSample
from plimsoll.operator.scaling.observations import Observations, PodObservation
from plimsoll.operator.scaling.planner import ReplicaPlanner
from plimsoll.operator.scaling.profile import CapacityProfile, ProfileFailure, read_profile
from plimsoll.operator.scaling.replica_plan import pool_variant
from plimsoll.operator.scaling.variant_mix import Offer, choose_mix, make_mix, mix_key
from plimsoll.router.app import build_app
from plimsoll.router.config import Policy, RouterConfig

OUTPUT_TOKENS = 4
SLO_BOUNDS = SLO(ttft_p95_ms=600.0, tpot_p50_ms=150.0)
MAX_SPOT_FRACTION = 0.25
TICK_S = 5.0
COLD_START_S = 60.0


@dataclass(frozen=True)
class Variant:
    name: str
    curve: ServiceCurve
    cost_per_hour: float
    max_replicas: int
    spot: bool = False


# Steps slow enough that one client process on a shared host drives every replica to its knee.
VARIANTS = (
    Variant("h100", ServiceCurve(batch_cap=16, step_t0_s=0.040, step_k_s=0.002), 4.0, 4),
    Variant("l4", ServiceCurve(batch_cap=8, step_t0_s=0.080, step_k_s=0.008), 1.0, 6),
    Variant("spot", ServiceCurve(batch_cap=4, step_t0_s=0.100, step_k_s=0.012), 0.5, 6, spot=True),
)


@dataclass(frozen=True)
class Measured:
    """One variant's profile, as the operator reads it."""

    concurrency: int
    rps: float  # requests/s one replica finishes at its concurrency target
    knee_rps: float  # the most requests/s it finished within the SLO: above it the excess misses
    knees: str


# --- 1. profiles ---------------------------------------------------------------------------


async def _sweep(url: str, args: argparse.Namespace) -> dict[str, Any]:
    cfg = BenchConfig(
        url=url, model="sim-model", levels=(1, 2, 4, 6, 8, 12, 16, 20),
        input_tokens=LengthSpec(value=16), output_tokens=LengthSpec(value=OUTPUT_TOKENS),
        requests_per_level=args.requests_per_level, slo=SLO_BOUNDS, max_client_lag_ms=1000.0,
        min_concurrency_ratio=0.8, scrape_interval_s=0.2,
    )  # fmt: skip
    session = await BenchSession.open(cfg)
    try:
        return session.report("sweep", await session.sweep())
    finally:
        await session.aclose()


def profile(variant: Variant, args: argparse.Namespace) -> Measured:
    with running_simulator(variant.curve) as url:
        report = asyncio.run(_sweep(url, args))
    prof = read_profile(report)
    if isinstance(prof, ProfileFailure):
        raise SystemExit(f"variant {variant.name}: no profile: {prof.reason}: {prof.message}")
    assert isinstance(prof, CapacityProfile)
    rps = prof.requests_per_second()
    # No latency knee: every level swept met the SLO, so the largest one is a floor under it.
    knee = prof.latency_knee or max(lv.concurrency for lv in prof.levels)
    if rps is None:
        raise SystemExit(f"variant {variant.name}: the sweep measured no latencies")
    # The most one replica finished while meeting the SLO: the best rate at any load up to the knee.
    loads = [float(lv.concurrency) for lv in prof.levels if lv.concurrency <= knee] + [float(knee)]
    best = max(c / (prof.mean_latency_s(c) or float("inf")) for c in loads)
    return Measured(
        prof.concurrency_per_replica, rps, max(rps, best),
        f"throughput knee {prof.throughput_knee}, latency knee {prof.latency_knee}",
    )  # fmt: skip


# --- 2. the mix against a brute force --------------------------------------------------------


def offers(measured: dict[str, Measured]) -> list[Offer]:
    return [Offer(v.name, measured[v.name].rps, v.cost_per_hour, 0, v.max_replicas, v.spot) for v in VARIANTS]


def brute_force(all_offers: list[Offer], demand: float) -> Any:
    ranges = [range(o.min_replicas, o.max_replicas + 1) for o in all_offers]
    return min(
        (make_mix(all_offers, c) for c in itertools.product(*ranges)),
        key=lambda m: mix_key(m, demand, MAX_SPOT_FRACTION),
    )


def mix_sweep(measured: dict[str, Measured]) -> None:
    all_offers = offers(measured)
    top = sum(o.capacity * o.max_replicas for o in all_offers)
    agree = 0
    demands = [round(top * i / 16, 2) for i in range(1, 16)]
    for demand in demands:
        choice = choose_mix(all_offers, demand, MAX_SPOT_FRACTION)
        brute = brute_force(all_offers, demand)
        same = choice.chosen.counts == brute.counts
        agree += same
        runner = choice.runner_up.describe() if choice.runner_up else "-"
        print(f"  demand {demand:7.2f} req/s: {choice.chosen.describe():28s} {choice.chosen.cost_per_hour:5.2f}/h "
              f"cap {choice.chosen.capacity:7.2f}  brute force {brute.describe():28s} {brute.cost_per_hour:5.2f}/h "
              f"{'=' if same else 'DIFFERENT'}  runner-up {runner}")  # fmt: skip
    print(f"  {agree}/{len(demands)} demands: the chosen mix equals the brute-force optimum")


# --- 3. the router's split ------------------------------------------------------------------


async def split(
    urls: dict[str, str],
    weights: dict[str, float],
    rates: dict[str, float],
    clients: int,
    seconds: float,
    kill: list[Any] | None = None,
) -> tuple[dict[str, int], int, float]:
    """``clients`` closed-loop clients through a real router (its app on uvicorn here, static replicas).

    Requests per variant (by the router's ``x-plimsoll-replica`` header), requests that failed, and,
    with ``kill``, the requests in flight on those simulators when they were killed half-way.
    """
    app = build_app(RouterConfig(port=0, backends=tuple(urls), policy=Policy.LEAST_INFLIGHT))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    router = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    replicas = app.state.router.replica_set
    replicas.set_weights(weights, rates)
    sent: collections.Counter[str] = collections.Counter()
    failed = 0
    cut = 0.0
    body = {"model": "sim-model", "prompt": "a b c d e f g h", "max_tokens": OUTPUT_TOKENS}

    async def one(client: httpx.AsyncClient) -> None:
        nonlocal failed
        try:
            response = await client.post(f"{router}/v1/completions", json=body)
            response.raise_for_status()
            sent[urls[response.headers["x-plimsoll-replica"]]] += 1
        except httpx.HTTPError:
            failed += 1

    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=1000)) as client:
        while not all(r.is_ready for r in replicas.replicas.values()):
            await asyncio.sleep(0.05)
        end = time.monotonic() + seconds

        async def worker() -> None:
            while time.monotonic() < end:
                await one(client)

        async def killer() -> None:
            nonlocal cut
            await asyncio.sleep(seconds / 2)
            killed = {p.url for p in kill or ()}
            cut = sum(r.inflight for u, r in replicas.replicas.items() if u in killed)
            for p in kill or ():
                p.kill()

        await asyncio.gather(*(worker() for _ in range(clients)), *([killer()] if kill else []))
    server.should_exit = True
    await serving
    return dict(sent), failed, cut


def router_split(measured: dict[str, Measured], args: argparse.Namespace) -> None:
    procs = {}
    try:
        for v in VARIANTS:
            for i in range(2):
                procs[f"{v.name}-{i}"] = (v.name, spawn_simulator(v.curve))
        for _, p in procs.values():
            p.wait_ready()
        urls = {p.url: variant for variant, p in procs.values()}
        capacity = {v.name: 2 * measured[v.name].rps for v in VARIANTS}
        # In flight at 70 % of the replicas' summed targets: a closed loop keeps it there however
        # busy the host is (an open loop's rate is what a busy client process fails to keep).
        clients = round(0.7 * sum(2 * measured[v.name].concurrency for v in VARIANTS))
        runs = (("weighed by measured requests/s and concurrency", True, False), ("all weights 1.0", False, False),
                ("weighed, the spot replicas killed half-way", True, True))  # fmt: skip
        for label, weigh, kill in runs:
            weights = {u: float(measured[v].concurrency) if weigh else 1.0 for u, v in urls.items()}
            rates = {u: measured[v].rps for u, v in urls.items()} if weigh else {}
            victims = [p for v, p in procs.values() if v == "spot"] if kill else None
            sent, failed, cut = asyncio.run(split(urls, weights, rates, clients, args.split_seconds, victims))
            total = sum(sent.values())
            parts = []
            for v in VARIANTS:
                share, want = sent.get(v.name, 0) / total, capacity[v.name] / sum(capacity.values())
                parts.append(f"{v.name} {share:.1%} of requests vs {want:.1%} of capacity "
                             f"({(share - want) / want:+.0%})")  # fmt: skip
            print(f"  {label}, {clients} clients for {args.split_seconds:.0f} s ({total} answered, {failed} failed"
                  + (f"; {cut:.0f} were in flight on the killed replicas" if kill else "") + "): "
                  + "; ".join(parts))  # fmt: skip
    finally:
        for _, p in procs.values():
            p.stop()


# --- 4 and 5. a step load and a spot reclaim through the replica planner ---------------------------


@dataclass
class Pod:
    name: str
    variant: str
    ready_at: float
    draining: bool = False
    in_flight: float = 0.0
    dead: bool = False  # its node was deleted: it answers nothing
    unschedulable: bool = False


@dataclass
class Fleet:
    spec: LLMServiceSpec
    status: dict[str, Any]
    measured: dict[str, Measured]
    counts: dict[str, int]
    pods: list[Pod] = field(default_factory=list)
    reclaimed: set[str] = field(default_factory=set)
    planner: ReplicaPlanner = field(default_factory=ReplicaPlanner)
    serial: int = 0
    events: list[tuple[float, str, str]] = field(default_factory=list)

    def reconcile(self, now: float) -> None:
        """What the Deployments and the scheduler do with the counts."""
        for v in VARIANTS:
            mine = [p for p in self.pods if p.variant == v.name]
            while (
                len(mine) > self.counts[v.name]
            ):  # marked pods go first, then those not Ready, then the newest
                victim = max(
                    mine, key=lambda p: (p.draining, p.unschedulable or p.ready_at > now, p.ready_at)
                )
                self.pods.remove(victim)
                mine.remove(victim)
            while len(mine) < self.counts[v.name]:
                self.serial += 1
                pod = Pod(f"{v.name}-{self.serial}", v.name, now + COLD_START_S,
                          unschedulable=v.name in self.reclaimed)  # fmt: skip
                self.pods.append(pod)
                mine.append(pod)

    def serve(self, now: float, demand: float) -> tuple[float, float]:
        """Spread the demand over the pods that take new work; the good share and requests in flight lost."""
        taking = [
            p
            for p in self.pods
            if not p.dead and not p.draining and not p.unschedulable and p.ready_at <= now
        ]
        weight = sum(self.measured[p.variant].rps for p in taking)
        good = 0.0
        for p in self.pods:
            if p.draining:
                p.in_flight = 0.0  # takes nothing new; what it held finishes within the tick (< 1 s each)
            elif p in taking:
                rate = demand * self.measured[p.variant].rps / weight
                m = self.measured[p.variant]
                p.in_flight = rate * m.concurrency / m.rps
                good += min(rate, m.knee_rps)
            else:
                p.in_flight = 0.0
        return (good / demand if demand else 1.0), 0.0

    def observe(self, now: float) -> list[PodObservation]:
        out = []
        for p in self.pods:
            if p.unschedulable:
                out.append(PodObservation(p.name, False, None, variant=p.variant,
                                          unschedulable="0/6 nodes are available: 2 node(s) didn't match "
                                          "Pod's node affinity/selector"))  # fmt: skip
                continue
            ready = p.ready_at <= now and not p.draining
            sample = None
            if (ready or p.draining) and not p.dead:
                sample = PodSample(engine="plimsoll", running=p.in_flight, waiting=0.0, kv_usage=None, ttft=None,
                                   tpot=None, slo_good=None)  # fmt: skip
            out.append(PodObservation(p.name, ready, sample, variant=p.variant, draining=p.draining))
        return out

    def tick(self, now: float) -> None:
        seen = Observations(pods=tuple(self.observe(now)), variant_replicas=dict(self.counts))
        plan = self.planner.plan(now, seen, self.spec, self.status)
        for change in plan.changes():
            variant = pool_variant(change.pool)
            assert variant is not None
            self.counts[variant] = change.desired
        marked = set(plan.drained())
        for p in self.pods:
            p.draining = p.draining or p.name in marked
        for event in plan.events:
            self.events.append((now, event.reason, event.message))
        if plan.status is not None:
            for key, value in plan.status.fields.items():
                old = self.status.get(key)
                if key == "variants" and isinstance(old, dict):
                    value = {n: {**(old.get(n) or {}), **v} for n, v in value.items()}
                self.status[key] = value
        self.reconcile(now)

    def cost_per_hour(self) -> float:
        price = {v.name: v.cost_per_hour for v in VARIANTS}
        return sum(price[p.variant] for p in self.pods if not p.unschedulable and not p.dead)

    def running(self) -> str:
        counts = collections.Counter(p.variant for p in self.pods if not p.unschedulable and not p.dead)
        return " + ".join(f"{v.name} × {counts[v.name]}" for v in VARIANTS if counts[v.name]) or "-"


def step_load(measured: dict[str, Measured], minutes: int, reclaim_at: int) -> None:
    all_offers = offers(measured)
    top = sum(o.capacity * o.max_replicas for o in all_offers)
    steps = [(0, 0.10), (4, 0.45), (9, 0.75), (reclaim_at, 0.75), (18, 0.30)]
    spec = LLMServiceSpec.model_validate({
        "model": {"uri": "embedded://smollm2-135m"},
        "variants": [{"name": v.name, "costPerHour": v.cost_per_hour, "maxReplicas": v.max_replicas,
                      "spot": v.spot} for v in VARIANTS],
        "capacity": {"mode": "Profile"},
        "autoscaling": {"mode": "builtin", "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 60},
        "mix": {"maxSpotFraction": MAX_SPOT_FRACTION, "unschedulableSeconds": 30, "unavailableSeconds": 600,
                "drainSeconds": 30},
    })  # fmt: skip
    status = {"variants": {v.name: {"capacity": {"concurrencyPerReplica": measured[v.name].concurrency,
                                                 "requestsPerSecondPerReplica": measured[v.name].rps}}
                           for v in VARIANTS}}  # fmt: skip
    # Before the first minute the fleet runs the cheapest mix for its demand (a warm start).
    first = choose_mix(all_offers, top * steps[0][1], MAX_SPOT_FRACTION).chosen.as_dict()
    fleet = Fleet(spec, status, measured, first)
    fleet.reconcile(-COLD_START_S)
    total_good = total_demand = 0.0
    lost = 0.0
    within = 0
    print(f"  minute  demand req/s  running mix{'':22s} cost/h  optimum/h  ratio  attainment")
    for minute in range(minutes):
        frac = [f for m, f in steps if m <= minute][-1]
        demand = top * frac
        if minute == reclaim_at:
            fleet.reclaimed.add("spot")
            for p in fleet.pods:
                if p.variant == "spot":
                    lost += p.in_flight
                    p.dead = True
        good = cost = 0.0
        ticks = int(60 / TICK_S)
        for i in range(ticks):
            now = minute * 60 + i * TICK_S
            share, _ = fleet.serve(now, demand)
            good += share * demand
            cost += fleet.cost_per_hour() / ticks
            fleet.tick(now)
        # The optimum over the hardware there is: none of a variant whose nodes are gone.
        left = [Offer(o.name, o.capacity, o.cost_per_hour, 0, 0, o.spot) if o.name in fleet.reclaimed else o
                for o in all_offers]  # fmt: skip
        optimum = brute_force(left, demand).cost_per_hour
        ratio = cost / optimum
        within += ratio <= 1.10
        total_good += good / ticks
        total_demand += demand
        mark = "  <- spot nodes deleted" if minute == reclaim_at else ""
        print(f"  {minute:6d}  {demand:12.2f}  {fleet.running():33s} {cost:6.2f}  {optimum:9.2f}  {ratio:5.2f}  "
              f"{good / ticks / demand:10.1%}{mark}")  # fmt: skip
    print(f"  attainment overall {total_good / total_demand:.1%}; cost at most 10% above the optimum in "
          f"{within}/{minutes} minutes; requests in flight on the spot pods when their nodes went: {lost:.1f}")  # fmt: skip
    print("  Events:")
    for now, reason, message in fleet.events:
        print(f"    t={now:5.0f}s {reason}: {message[:240]}")
    mix = fleet.status.get("mix") or {}
    print(f"  status.mix at the end: reason {mix.get('reason')}: {mix.get('message')}")
    print(f"  status.cost at the end: {fleet.status.get('cost')}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests-per-level", type=int, default=24)
    parser.add_argument("--split-seconds", type=float, default=20.0)
    parser.add_argument("--minutes", type=int, default=24)
    parser.add_argument("--reclaim-at", type=int, default=14)
    parser.add_argument("--save-profiles", help="write the measured profiles to this JSON file")
    parser.add_argument("--profiles", help="take the profiles from a file --save-profiles wrote (no sweeps)")
    args = parser.parse_args()
    print("1. Each variant profiled (plimsoll bench sweep on one simulated replica, read by read_profile):")
    measured = {}
    saved = json.loads(Path(args.profiles).read_text()) if args.profiles else {}
    for v in VARIANTS:
        t = time.monotonic()
        m = measured[v.name] = Measured(**saved[v.name]) if v.name in saved else profile(v, args)
        print(f"  {v.name:5s} {v.cost_per_hour:4.2f}/h spot={v.spot!s:5s}: {m.knees}; concurrency per replica "
              f"{m.concurrency}, {m.rps:.2f} req/s at it, {m.knee_rps:.2f} req/s at most within the SLO "
              f"({time.monotonic() - t:.0f} s)")  # fmt: skip
    if args.save_profiles:
        Path(args.save_profiles).write_text(json.dumps({n: asdict(m) for n, m in measured.items()}))
    print(f"2. The chosen mix against a brute force (max spot fraction {MAX_SPOT_FRACTION}):")
    mix_sweep(measured)
    print("3. The router's split (least in-flight, real HTTP to two simulated replicas per variant):")
    router_split(measured, args)
    print(
        f"4-5. Step load through the replica planner (simulated time), spot reclaimed at minute {args.reclaim_at}:"
    )
    step_load(measured, args.minutes, args.reclaim_at)


if __name__ == "__main__":
    main()
