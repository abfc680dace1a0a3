"""A 10× burst's TTFT with the HPA formula alone, with the predicted-TTFT rule, and with admission, side by side.

What runs: the operator's own replica planner (``ReplicaPlanner.plan``, applied as the
handler applies it: ``tests/operator/scaling/planner_cases.py``) every
``--interval`` s of a virtual clock, over replicas simulated by the same service
model the replicas' TTFT predictor uses (``plimsoll.ttft_prediction``): ``--slots``
sequences at once, prompts prefilled one after another at ``--prefill-rate``
tokens/s, one decode step of ``--step`` s per token. Requests arrive open-loop
(Poisson, one seed for every variant): ``--base`` per second, then ``--factor`` ×
that for ``--burst`` s, then ``--base`` again; each goes to the Ready replica with
the fewest in flight (the router's default). A replica the planner asks for is Ready
``--cold-start`` s after the decision (the local control plane's measured cold start). The first scale-up
is timed from the burst's start.

Variants, all on the same arrivals:

* ``hpa``: ``autoscaling.tokenAware: false`` — in-flight per replica against
  ``capacity.concurrencyPerReplica`` (the HPA formula) alone;
* ``predictive``: ``slo.ttftP95Ms`` with the predicted-TTFT rule (the replicas'
  backlog in seconds, starting replicas credited);
* ``predictive+admission``: as ``predictive``, and a request every Ready replica is
  predicted to answer past the SLO is refused at once (429) instead of queued;
* ``predictive, wake``: as ``predictive`` with replicas back in ``--wake`` s (a
  parked standby replica woken; ``benchmarks/scaleup_wake.py`` measures it).

It prints per variant: the share of the burst's requests that met the TTFT SLO (refused
ones count as misses; "admitted": of those served),
TTFT p50/p95/max, refused requests, when the first scale-up after the burst's start was
decided, the replicas at the burst's start and at the peak and replica-seconds, and the ratios against ``hpa``. This is the
planner on a simulated fleet (deterministic, no CPU noise), not real engines:
``benchmarks/step_load_real.py`` runs real ones on the local control plane.

    python benchmarks/scaleup_burst.py
"""

import argparse
import random
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "operator" / "scaling"))  # the planner driver the planner tests use

from planner_cases import Service  # noqa: E402

from plimsoll.bench.script_args import add_options  # noqa: E402
from plimsoll.operator.api.spec import LLMServiceSpec  # noqa: E402
from plimsoll.operator.scaling.metrics import PodSample  # noqa: E402
from plimsoll.operator.scaling.observations import PodObservation  # noqa: E402
from plimsoll.ttft_prediction import ServiceRates  # noqa: E402

T0 = 1_000_000.0  # the virtual clock's origin (a Unix-like time)


@dataclass
class SimReplica:
    """One replica in the predictor's model: committed slot release times and the prefill lane."""

    name: str
    ready_at: float
    rates: ServiceRates
    # Per admitted request: (start of its prefill, end of its prefill, slot release).
    admitted: list[tuple[float, float, float]] = field(default_factory=list)
    lane: float = 0.0

    def slots(self, now: float) -> list[float]:
        live = sorted(release for _, _, release in self.admitted if release > now)
        return live[-self.rates.max_num_seqs :]

    def admit(self, now: float, prompt: int, out: int) -> float:
        """Commit a request arriving now (FCFS on this replica); its TTFT."""
        slots = self.slots(now)
        # FCFS: the slot this one takes frees when all but max_num_seqs - 1 of those admitted before it are done.
        free = min(slots) if len(slots) == self.rates.max_num_seqs else now
        start = max(free, self.lane, now)
        self.lane = start + self.rates.prefill_s(prompt)
        first = self.lane + self.rates.decode_step_s
        self.admitted.append((start, self.lane, self.lane + max(1, out) * self.rates.decode_step_s))
        return float(first - now)

    def in_flight(self, now: float) -> tuple[int, int]:
        running = sum(1 for s, _, r in self.admitted if s <= now < r)
        waiting = sum(1 for s, _, _ in self.admitted if s > now)
        return running, waiting

    def predicted(self, now: float, prompt: int) -> float:
        """The TTFT a request of ``prompt`` tokens arriving now would see (what the replica exports)."""
        slots = [max(0.0, r - now) for r in self.slots(now)]
        slots += [0.0] * (self.rates.max_num_seqs - len(slots))
        start = max(min(slots), max(0.0, self.lane - now))
        return float(start + self.rates.prefill_s(prompt) + self.rates.decode_step_s)

    def sample(self, now: float, prompt: int) -> PodSample:
        running, waiting = self.in_flight(now)
        ttft = self.predicted(now, prompt)
        own = self.rates.prefill_s(prompt) + self.rates.decode_step_s
        return PodSample(
            engine="plimsoll", running=float(running), waiting=float(waiting), kv_usage=None, ttft=None,
            tpot=None, backlog_s=ttft - own, predicted_ttft_s=ttft,
            prefill_tokens_per_s=self.rates.prefill_tokens_per_s, decode_step_s=self.rates.decode_step_s,
        )  # fmt: skip


def arrivals(args: argparse.Namespace) -> list[float]:
    rng = random.Random(args.seed)
    t, out = 0.0, []
    end = args.before + args.burst + args.after
    while t < end:
        rate = args.base * (args.factor if args.before <= t < args.before + args.burst else 1.0)
        t += rng.expovariate(rate)
        out.append(t)
    return out


def spec_for(args: argparse.Namespace, token_aware: bool) -> LLMServiceSpec:
    return LLMServiceSpec.model_validate({
        "model": {"uri": "embedded://smollm2-135m"},
        "replicas": 1,
        "scaling": {"min": 1, "max": args.max_replicas},
        "capacity": {"mode": "Manual", "concurrencyPerReplica": args.slots},
        "slo": {"ttftP95Ms": args.slo_ms},
        "autoscaling": {"mode": "builtin", "scaleUpStabilizationSeconds": 0, "intervalSeconds": args.interval,
                        "tokenAware": token_aware},
    })  # fmt: skip


def run(
    args: argparse.Namespace, times: list[float], token_aware: bool, admission: bool, start_s: float
) -> dict[str, Any]:
    rates = ServiceRates(args.prefill_rate, args.step, args.slots)
    svc = Service(
        spec_for(args, token_aware), {"coldStart": {"samplesSeconds": [start_s], "p95Seconds": start_s}}
    )
    replicas = [SimReplica("r0", ready_at=-1.0, rates=rates)]
    created = {"r0": T0 - 600.0}
    ttfts: list[tuple[float, float]] = []  # (arrival, ttft)
    refused: list[float] = []
    first_up: float | None = None
    peak, replica_s, last, at_burst = 1, 0.0, 0.0, None
    next_tick = 0.0
    end = args.before + args.burst + args.after
    pending = iter(times)
    arrival = next(pending, None)
    while True:
        now = min(next_tick, arrival if arrival is not None else float("inf"))
        if now > end:
            break
        replica_s += len(replicas) * (now - last)
        if at_burst is None and now >= args.before:
            at_burst = len(replicas)
        last = now
        if arrival is not None and arrival <= next_tick:
            ready = [r for r in replicas if r.ready_at <= now]
            if admission:  # as the router does: only replicas predicted to meet the bound, else refuse
                ready = [r for r in ready if r.predicted(now, args.prompt) <= args.slo_ms / 1000]
            if not ready:
                refused.append(now)
            else:
                target = min(ready, key=lambda r: sum(r.in_flight(now)))
                ttfts.append((now, target.admit(now, args.prompt, args.output)))
            arrival = next(pending, None)
            continue
        pods = [
            PodObservation(r.name, ready=r.ready_at <= now, created_at=created[r.name],
                           sample=r.sample(now, args.prompt) if r.ready_at <= now else None)
            for r in replicas
        ]  # fmt: skip
        plan = svc.tick(T0 + now, pods)
        for count in plan.changes():
            if count.desired > len(replicas):
                if now >= args.before and first_up is None:
                    first_up = now
                for i in range(len(replicas), count.desired):
                    replicas.append(SimReplica(f"r{i}", ready_at=now + start_s, rates=rates))
                    created[f"r{i}"] = T0 + now
        peak = max(peak, len(replicas))
        next_tick += args.interval
    burst = [t for a, t in ttfts if args.before <= a < args.before + args.burst]
    burst_refused = sum(1 for a in refused if args.before <= a < args.before + args.burst)
    slo = args.slo_ms / 1000
    judged = len(burst) + burst_refused
    q = statistics.quantiles(burst, n=20) if len(burst) >= 2 else [float("nan")] * 19
    return {
        "met": sum(1 for t in burst if t <= slo) / judged if judged else float("nan"),
        "met_admitted": sum(1 for t in burst if t <= slo) / len(burst) if burst else float("nan"),
        "p50": statistics.median(burst) if burst else float("nan"),
        "p95": q[18],
        "max": max(burst) if burst else float("nan"),
        "refused": burst_refused,
        "requests": judged,
        "first_up": None if first_up is None else first_up - args.before,
        "peak": peak,
        "at_burst": at_burst,
        "replica_s": replica_s,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slots", type=int, default=4, help="sequences a replica runs at once (max_num_seqs)")
    p.add_argument("--step", type=float, default=0.05, help="decode step, seconds")
    p.add_argument("--prefill-rate", type=float, default=1000.0, help="prompt tokens per second")
    p.add_argument("--base", type=float, default=1.0, help="requests per second before and after the burst")
    add_options(p, prompt=200, output=40, factor=10.0, before=30.0, burst=60.0, after=30.0)  # the workload
    add_options(p, slo_ms=1000.0, max_replicas=12)  # the service
    p.add_argument("--interval", type=int, default=2, help="seconds between planner ticks")
    p.add_argument(
        "--cold-start", type=float, default=10.8, help="seconds from the decision to a new replica Ready"
    )
    p.add_argument("--wake", type=float, default=1.0, help="seconds to wake a parked standby replica")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    times = arrivals(args)
    variants = {
        "hpa": run(args, times, False, False, args.cold_start),
        "predictive": run(args, times, True, False, args.cold_start),
        "predictive+admission": run(args, times, True, True, args.cold_start),
        "predictive, wake": run(args, times, True, False, args.wake),
    }
    print(f"{args.factor:g}× burst for {args.burst:g} s ({args.base:g} → {args.base * args.factor:g} req/s), "
          f"TTFT SLO {args.slo_ms:g} ms, cold start {args.cold_start:g} s, planner every {args.interval} s")  # fmt: skip
    print(f"{'variant':22} {'met SLO':>8} {'admitted':>8} {'p50 s':>7} {'p95 s':>7} {'max s':>7} {'refused':>8} "
          f"{'1st up s':>9} {'start':>5} {'peak':>5} {'replica·s':>10}")  # fmt: skip
    for name, r in variants.items():
        up = "-" if r["first_up"] is None else f"{r['first_up']:.1f}"
        print(f"{name:22} {r['met']:8.1%} {r['met_admitted']:8.1%} {r['p50']:7.2f} {r['p95']:7.2f} {r['max']:7.2f} "
              f"{r['refused']:5}/{r['requests']:<4} {up:>7} {r['at_burst']:5} {r['peak']:5} {r['replica_s']:10.0f}")  # fmt: skip
    base = variants["hpa"]
    for name, r in variants.items():
        if name != "hpa":
            print(f"{name} ÷ hpa: burst TTFT p95 {r['p95'] / base['p95']:.2f}×, max {r['max'] / base['max']:.2f}×, "
                  f"replica-seconds {r['replica_s'] / base['replica_s']:.2f}×")  # fmt: skip


if __name__ == "__main__":
    main()
