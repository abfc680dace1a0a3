"""Simulated replicas behind the router's pick rule, replayed in event time: what the service curves predict.

What it is: :func:`replay` runs Poisson arrivals through the router's own ``LeastInflight``
policy (each replica weighed and rated as ``status.variants`` weighs it) onto replicas that
follow ``bench/simulator.py``'s curve semantics exactly — at most ``batch_cap`` running, FIFO
beyond; the first token one step after a request starts, each next one a step after the last,
the step taken at the running count when it is scheduled — on a virtual clock. Its per-request
TTFT and mean TPOT are what the curves give at that load with no host at all, to set beside
what a run of the same mix measured (``benchmarks/variant_fixed_mix.py``): the difference is
the host's (late event loops, delivery jitter), not the curves' or the router's.

What it is not: a model of prefill (the variants' curves have none), of KV limits or of
faults; nor a replacement for a measured profile.
"""

import heapq
import random
from collections.abc import Mapping
from dataclasses import dataclass, field

from plimsoll.bench.simulator import ServiceCurve
from plimsoll.router.backends import ReplicaSet
from plimsoll.router.config import Policy, RouterConfig
from plimsoll.router.policy import RequestFeatures, Router


@dataclass(frozen=True, slots=True)
class ReplicaKind:
    """A variant as the replay sees it: its curve, and the weight and rate the router weighs it by."""

    curve: ServiceCurve
    weight: float
    rate: float


@dataclass(frozen=True, slots=True)
class Replayed:
    """One request: when it arrived, the replica it went to, its TTFT and mean TPOT (seconds)."""

    at: float
    replica: str
    ttft_s: float
    tpot_s: float


@dataclass(slots=True)
class _Request:
    at: float
    replica: str
    tokens: list[float] = field(default_factory=list)
    due: float = 0.0


def replay(
    mix: Mapping[str, tuple[ReplicaKind, int]], rate: float, seconds: float, output_tokens: int, seed: int = 1
) -> list[Replayed]:
    """``mix`` (variant -> (its kind, replicas)) under ``rate`` Poisson arrivals for ``seconds``; the
    requests in arrival order. Replica names are ``variant-i``."""
    if rate <= 0 or seconds <= 0 or output_tokens < 1:
        raise ValueError(
            f"rate, seconds and output_tokens must be positive, got {rate}, {seconds}, {output_tokens}"
        )
    # The router takes URLs; the replicas are named ``variant-i`` after them.
    kinds = {f"http://{name}-{i}": kind for name, (kind, count) in mix.items() for i in range(count)}
    if not kinds:
        raise ValueError("the mix has no replicas")
    replicas = ReplicaSet.static(kinds)
    for r in replicas.replicas.values():
        r.reachable = True
    replicas.set_weights({u: k.weight for u, k in kinds.items()}, {u: k.rate for u, k in kinds.items()})
    router = Router(RouterConfig(backends=tuple(kinds), policy=Policy.LEAST_INFLIGHT), replicas)
    rng = random.Random(seed)
    # (time, order, the request whose next token is due, or None for an arrival)
    events: list[tuple[float, int, _Request | None]] = []
    order = 0
    t = rng.expovariate(rate)
    while t < seconds:
        order += 1
        heapq.heappush(events, (t, order, None))
        t += rng.expovariate(rate)
    running = dict.fromkeys(kinds, 0)
    queued: dict[str, list[_Request]] = {u: [] for u in kinds}
    done: list[_Request] = []

    def schedule(request: _Request) -> None:
        nonlocal order
        order += 1
        heapq.heappush(events, (request.due, order, request))

    def start(request: _Request, now: float) -> None:
        running[request.replica] += 1
        request.due = now + kinds[request.replica].curve.step_s(running[request.replica])
        schedule(request)

    while events:
        now, _, request = heapq.heappop(events)
        if request is None:
            chosen = router.choose(RequestFeatures("", 0)).replica
            chosen.inflight += 1
            arrival = _Request(now, chosen.url)
            if running[chosen.url] < kinds[chosen.url].curve.batch_cap:
                start(arrival, now)
            else:
                queued[chosen.url].append(arrival)
            continue
        request.tokens.append(now)
        name = request.replica
        if len(request.tokens) < output_tokens:
            # As the simulator: the next deadline is a step (at today's batch) after the last one.
            request.due = max(request.due + kinds[name].curve.step_s(running[name]), now)
            schedule(request)
            continue
        running[name] -= 1
        replicas.replicas[name].inflight -= 1
        done.append(request)
        if queued[name]:
            start(queued[name].pop(0), now)
    return [
        Replayed(r.at, r.replica.removeprefix("http://"), r.tokens[0] - r.at,
                 (r.tokens[-1] - r.tokens[0]) / (output_tokens - 1) if output_tokens > 1 else 0.0)
        for r in sorted(done, key=lambda r: r.at)
    ]  # fmt: skip
