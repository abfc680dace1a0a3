"""A step-load replay on real engines: TTFT SLO attainment with the autoscaler against one fixed replica.

Starts a fresh local control plane with the pod runner, installs the Helm chart,
runs the operator as a local process with the chart's ServiceAccount token, and
replays the same step load several times, one after the other, on an LLMService
whose replicas are `plimsoll serve` on a tiny random model (local processes bound
to their pod IPs, as a kubelet would start them):

* fixed: ``autoscaling.mode: off`` with each replica count of ``--fixed-counts``
  (all Ready before the load starts): the fewest replicas whose attainment after
  the step reaches ``--suffices`` is what the step's load needs;
* autoscaled: the built-in autoscaler, ``scaling 1..--max-replicas``, Manual
  capacity ``--target`` in flight per replica (the engine holds that many
  sequences, so a queue really forms), scale-up window ``--up-window`` s.

The load is ``plimsoll.devcluster.podload``: closed-loop streaming completions
(``ignore_eos``) against the ready pods' loopback IPs, each client sending to the
pod with the fewest of its requests outstanding; ``--low`` clients for
``--before`` s, then ``--high`` clients for ``--after`` s. It prints, for each
replay, the share of requests sent after the step whose TTFT met ``--ttft-slo-ms``
(failed requests count as misses), TTFT percentiles, and for the autoscaled one
the time from the step to the scale-up decision and to the first new replica
Ready, the replicas it used against the fewest that suffice, and its
``status.autoscaler.lastScaleUp`` timeline (every phase from the metric crossing
the target to the new pod's first answer). The CPU is shared by every replica and the load, so the figures are for
this machine, not a GPU cluster.

    python benchmarks/step_load_real.py
"""

import argparse
import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from plimsoll.devcluster.cluster import Cluster
from plimsoll.devcluster.podload import Completion, LoadConfig, PodLoad
from plimsoll.operator.local import chart_cluster

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "plimsoll"
NAME = "stepload"


@dataclass
class Result:
    label: str
    attainment: float
    requests: int
    failed: int
    ttft_p50_ms: float
    ttft_p95_ms: float
    decision_s: float | None = None
    new_ready_s: float | None = None
    all_ready_s: float | None = None
    replicas: str = ""
    max_desired: int = 0
    last_scale_up: dict[str, Any] | None = None
    decisions: list[str] = field(default_factory=list)  # each status.autoscaler decision after the step
    completions: list[Completion] = field(default_factory=list)  # sent after the step
    slo_s: float = 0.0

    def attainment_between(self, start_s: float, end_s: float) -> tuple[float, int]:
        """(share within the TTFT SLO, requests) for requests sent start_s..end_s after the step."""
        window = [c for c in self.completions if start_s <= c.sent_at < end_s]
        met = sum(c.error is None and c.ttft_s is not None and c.ttft_s <= self.slo_s for c in window)
        return (met / len(window) if window else float("nan")), len(window)


def tiny_model() -> Path:
    """The tiny random model for pods the pod runner starts (see ``pod_model``)."""
    from plimsoll.runtime.testing import pod_model

    return pod_model()


def manifest(
    args: argparse.Namespace, model: Path, autoscale: bool, replicas: int = 1, standby: int = 0
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"uri": f"file://{model}"},
        "engine": {"maxNumSeqs": args.target, "kvCacheMemory": "32Mi"},
        "resources": {"gpu": {"count": 0}},
        "replicas": replicas,
        "capacity": {"mode": "Manual", "concurrencyPerReplica": args.target},
        "autoscaling": {"mode": "off"},
    }
    if autoscale:
        spec["scaling"] = {"min": 1, "max": args.max_replicas}
        spec["autoscaling"] = {
            "mode": "builtin",
            "intervalSeconds": 1,
            "scaleUpStabilizationSeconds": args.up_window,
            "scaleDownStabilizationSeconds": 600,  # no scale-down within the replay
        }
        if standby:
            spec["autoscaling"]["standby"] = {"replicas": standby, "level": 1, "routerWake": not args.no_router_wake}
    if args.via_router:
        spec["router"] = {"enabled": True, "replicas": 1}
    return {
        "apiVersion": "plimsoll.dev/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": NAME},
        "spec": spec,
    }


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def wait(predicate: Any, timeout: float, what: str, load: PodLoad) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        load.check()
        if predicate():
            return
        time.sleep(0.25)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def router_url(cluster: Cluster, ns: str) -> str | None:
    """``http://<router pod IP>:8000`` once the one router pod is Ready, else None."""
    pods = json.loads(cluster.kubectl(
        "get", "pods", "-n", ns, "-l", f"app.kubernetes.io/instance={NAME},app.kubernetes.io/component=router",
        "-o", "json",
    ).stdout)["items"]  # fmt: skip
    for pod in pods:
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or [])
        if ready and pod["status"].get("podIP"):
            return f"http://{pod['status']['podIP']}:8000"
    return None


def parked_asleep(cluster: Cluster, ns: str) -> int:
    """How many replicas ``status.standby`` says are parked and asleep."""
    svc = json.loads(cluster.kubectl("get", "llmservice", NAME, "-n", ns, "-o", "json").stdout)
    return int(((svc.get("status") or {}).get("standby") or {}).get("asleep") or 0)


def replay(
    cluster: Cluster,
    args: argparse.Namespace,
    model: Path,
    autoscale: bool,
    replicas: int = 1,
    standby: int = 0,
) -> Result:
    label = "autoscaled" if autoscale else f"fixed {replicas} replica{'s' if replicas > 1 else ''}"
    label += f" + {standby} asleep" if standby else ""
    label += " via router" if args.via_router else ""
    ns = ("step-standby" if standby else "step-auto") if autoscale else f"step-fixed-{replicas}"
    cluster.kubectl("create", "namespace", ns)
    body = yaml.safe_dump(manifest(args, model, autoscale, replicas, standby))
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=body)
    config = LoadConfig(model=NAME, max_tokens=args.max_tokens)
    last_scale_up = None
    try:
        via = None
        if args.via_router:
            deadline = time.monotonic() + 300
            while (via := router_url(cluster, ns)) is None:
                if time.monotonic() > deadline:
                    raise TimeoutError("timed out after 300 s waiting for the router pod")
                time.sleep(0.5)
        with PodLoad(Path(cluster.kubeconfig), ns, NAME, config, via=via) as load:
            wait(
                lambda: bool(load.samples) and len(load.samples[-1].ready_pods) == replicas,
                300,
                f"{replicas} ready replica(s)",
                load,
            )
            if standby:
                wait(
                    lambda: parked_asleep(cluster, ns) >= standby,
                    300,
                    f"{standby} replica(s) parked asleep",
                    load,
                )
            print(
                f"{label}: ready; {args.low} client(s) for {args.before:.0f} s, then {args.high}", flush=True
            )
            load.set_clients(args.low)
            time.sleep(args.before)
            load.set_clients(args.high)
            # The load thread's own time of the step: the new clients' first requests (the step's burst)
            # are sent before this thread wakes, and belong to the step.
            step_at = load.steps[-1][0]
            time.sleep(args.after)
            load.set_clients(0)
            end_at = time.monotonic()
            load.check()
            if autoscale:
                svc = json.loads(cluster.kubectl("get", "llmservice", NAME, "-n", ns, "-o", "json").stdout)
                last_scale_up = (svc.get("status") or {}).get("autoscaler", {}).get("lastScaleUp")
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=true", "--timeout=120s", check=False)

    after = [c for c in load.completions if step_at <= c.sent_at <= end_at]
    ttfts = [c.ttft_s for c in after if c.error is None and c.ttft_s is not None]
    slo_s = args.ttft_slo_ms / 1000
    met = sum(c.error is None and c.ttft_s is not None and c.ttft_s <= slo_s for c in after)
    result = Result(
        label=label,
        attainment=met / len(after) if after else float("nan"),
        requests=len(after),
        failed=sum(c.error is not None for c in after),
        ttft_p50_ms=percentile(ttfts, 0.5) * 1000,
        ttft_p95_ms=percentile(ttfts, 0.95) * 1000,
        completions=[replace(c, sent_at=c.sent_at - step_at) for c in after],
        slo_s=slo_s,
    )
    samples = [s for s in load.samples if s.at >= step_at]
    scaled = next((s.at for s in samples if s.desired > 1), None)
    new_ready = next((s.at for s in samples if len(s.ready_pods) > 1), None)
    result.decision_s = None if scaled is None else scaled - step_at
    result.new_ready_s = None if new_ready is None else new_ready - step_at
    all_ready = next(
        (s.at for s in samples if s.desired > 1 and s.ready == s.desired == len(s.ready_pods)), None
    )
    result.all_ready_s = None if all_ready is None else all_ready - step_at
    changes = [
        s
        for i, s in enumerate(samples)
        if i == 0 or (s.desired, s.ready) != (samples[i - 1].desired, samples[i - 1].ready)
    ]
    result.replicas = ", ".join(f"{s.at - step_at:.0f}s:{s.desired}/{s.ready}" for s in changes)
    result.max_desired = max((s.desired for s in samples), default=replicas)
    result.last_scale_up = last_scale_up
    result.decisions = [
        f"+{d.seen_at - step_at:.1f} s {d.current}→{d.desired} {d.reason}: {d.formula}"
        for d in load.decisions
        if d.seen_at >= step_at and d.current != d.desired
    ]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", type=int, default=2, help="in flight per replica (and engine maxNumSeqs)")
    parser.add_argument("--max-replicas", type=int, default=4)
    parser.add_argument("--low", type=int, default=1, help="clients before the step")
    parser.add_argument("--high", type=int, default=6, help="clients after the step")
    parser.add_argument("--before", type=float, default=15.0, help="seconds of low load")
    parser.add_argument("--after", type=float, default=120.0, help="seconds of high load measured")
    parser.add_argument("--up-window", type=int, default=3, help="scale-up stabilisation window, s")
    parser.add_argument("--ttft-slo-ms", type=float, default=500.0)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument(
        "--standby",
        type=int,
        default=0,
        help="also replay the autoscaled service with this many replicas parked asleep "
        "(autoscaling.standby, level 1): a scale-up wakes them instead of starting pods",
    )
    parser.add_argument(
        "--via-router",
        action="store_true",
        help="send the load through the LLMService's router (router.enabled, one pod) instead of straight to the "
        "Ready pods: with --standby the router wakes a parked replica itself when every awake one is past target",
    )
    parser.add_argument(
        "--no-router-wake",
        action="store_true",
        help="with --standby --via-router: autoscaling.standby.routerWake false (every wake is the operator's)",
    )
    parser.add_argument(
        "--skip-plain-autoscaled",
        action="store_true",
        help="with --standby, replay only the autoscaled service with standby (not also without it)",
    )
    parser.add_argument(
        "--fixed-counts",
        default="1,2,3",
        help="replica counts replayed with autoscaling off, comma-separated (empty: none)",
    )
    parser.add_argument(
        "--suffices",
        type=float,
        default=0.99,
        help="a fixed count suffices when this share of requests after the step meets the TTFT SLO",
    )
    args = parser.parse_args()
    if not 1 <= args.low < args.high:
        parser.error(f"need 1 <= --low < --high, got --low {args.low} --high {args.high}")
    try:
        counts = sorted({int(c) for c in args.fixed_counts.split(",") if c.strip()})
    except ValueError:
        parser.error(f"--fixed-counts takes integers like 1,2,3, got {args.fixed_counts!r}")
    if any(c < 1 for c in counts):
        parser.error(f"--fixed-counts must be at least 1 each, got {args.fixed_counts!r}")

    model = tiny_model()
    started = time.monotonic()
    with chart_cluster(CHART, "plimsoll-stepload-", pod_runner=True) as (cluster, _):
        results = [replay(cluster, args, model, autoscale=False, replicas=c) for c in counts]
        autos = [] if args.standby and args.skip_plain_autoscaled else [replay(cluster, args, model, autoscale=True)]
        if args.standby:
            autos.append(replay(cluster, args, model, autoscale=True, standby=args.standby))
        results += autos

    print(
        f"\nstep {args.low} → {args.high} closed-loop clients, {args.after:.0f} s measured after the step; "
        f"target {args.target} in flight per replica (engine max {args.target} sequences), "
        f"max_tokens {args.max_tokens} with ignore_eos; TTFT SLO {args.ttft_slo_ms:.0f} ms; "
        f"total run {time.monotonic() - started:.0f} s"
    )
    print(f"{'':24} {'SLO attainment':>14} {'requests':>9} {'failed':>7} {'TTFT p50':>9} {'TTFT p95':>9}")
    for r in results:
        print(
            f"{r.label:24} {r.attainment:>14.0%} {r.requests:>9} {r.failed:>7} "
            f"{r.ttft_p50_ms:>7.0f}ms {r.ttft_p95_ms:>7.0f}ms"
        )
    fixed = results[: len(counts)]
    enough = [c for c, r in zip(counts, fixed, strict=True) if r.attainment >= args.suffices]
    for auto in autos:
        report_autoscaled(auto, args, counts, enough, fixed)


def report_autoscaled(
    auto: Result, args: argparse.Namespace, counts: list[int], enough: list[int], fixed: list[Result]
) -> None:
    """One autoscaled replay: its replicas against the fewest that suffice, its timeline, and its attainment
    while its new replicas start beside the fixed counts' over the same seconds."""
    print(f"\n{auto.label}:")
    if enough:
        above = auto.max_desired - enough[0]
        print(
            f"  fewest fixed replicas meeting the SLO for {args.suffices:.0%} of requests after the step: "
            f"{enough[0]}; the autoscaler used {auto.max_desired} ({above:+d})"
        )
    elif counts:
        print(
            f"  no fixed count in {counts} met the SLO for {args.suffices:.0%}; the autoscaler used {auto.max_desired}"
        )
    decision = "none" if auto.decision_s is None else f"{auto.decision_s:.1f} s"
    ready = "none within the replay" if auto.new_ready_s is None else f"{auto.new_ready_s:.1f} s"
    print(f"  scale-up decision {decision} after the step, first new replica Ready {ready} after it")
    print(f"  replicas (s since the step: desired/ready): {auto.replicas}")
    if auto.all_ready_s is not None:
        split = auto.all_ready_s
        print(
            f"  attainment while the new replicas start (0–{split:.0f} s) | once all are Ready "
            f"({split:.0f}–{args.after:.0f} s):"
        )
        for r in [*fixed, auto]:
            (a1, n1), (a2, n2) = r.attainment_between(0, split), r.attainment_between(split, args.after + 1)
            print(f"    {r.label:24} {a1:>5.0%} of {n1:<4} | {a2:>5.0%} of {n2}")
    shares = [(n, *auto.attainment_between(0, n)) for n in (1, 2, 5, 10)]
    print("  attainment of the requests sent in the first N s after the step: "
          + ", ".join(f"{n} s {a:.0%} of {k}" for n, a, k in shares))  # fmt: skip
    for line in auto.decisions:
        print(f"  {line}")
    timeline = auto.last_scale_up
    if timeline:
        print(
            f"  status.autoscaler.lastScaleUp ({timeline.get('fromReplicas')}→{timeline.get('toReplicas')}, "
            f"pod {timeline.get('pod')}, complete {timeline.get('complete')}): decision → Ready "
            f"{timeline.get('decisionToReadySeconds')} s, → first answer {timeline.get('decisionToFirstAnswerSeconds')} s"
        )
        for phase in timeline.get("phases") or []:
            print(f"    {phase['phase']:22} +{phase['seconds']:>6.2f} s  ({phase['at']})")


if __name__ == "__main__":
    main()
