"""Cold start from zero replicas, phase by phase, and a 3 → 1 scale-down under streaming load.

Starts a fresh local control plane with the pod runner, installs the Helm chart,
runs the operator as a local process with the chart's ServiceAccount token, and
plays the two scenarios of ``tests/operator/handlers/test_scale_to_zero_k8s.py`` on
replicas that are `plimsoll serve` on a tiny random model (local processes bound
to their pod IPs) behind `plimsoll route`:

* ``--rounds`` cold starts: the service idles to zero (``idleSeconds`` 8), then
  8 concurrent requests (half streaming) go to the router pod. Each cold start prints
  the phases as first seen by polling kubectl every 0.25 s: decision (first
  request sent → ``spec.replicas`` 1), pod start (→ a container running),
  engine start-up (→ the pod Ready) and release (→ the first byte of an answer),
  plus the operator's own record (``status.coldStart.last``) and the router's
  hold time before the decision.
* 3 → 1 under ``--clients`` closed-loop streaming clients through the router:
  streams, failures, which pods were drained and went, the drain's outcome and
  ``status.scaleDown.requestsCutTotal`` (the operator's
  ``plimsoll_operator_requests_cut_by_scale_down_total``).

    python benchmarks/scale_to_zero.py

The CPU is shared by the control plane, the replicas and the load, so the
figures are this machine's, not a GPU cluster's.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "plimsoll"
sys.path.insert(0, str(ROOT / "tests" / "operator" / "handlers"))  # the scenario drivers the k8s test uses

from llms_k8s import apply  # noqa: E402
from test_scale_to_zero_k8s import (  # noqa: E402
    IDLE_S,
    ZeroRun,
    _at_zero,
    last_cold_start,
    new_cold_start,
    phases,
    play_drain,
    zero_manifest,
)
from zero_k8s import Watch, burst, hold_state, router_ip, wait_until  # noqa: E402

from plimsoll.devcluster.cluster import Cluster  # noqa: E402
from plimsoll.operator.local import chart_cluster  # noqa: E402


def cold_starts(cluster: Cluster, ns: str, model: Path, rounds: int) -> list[dict[str, float]]:
    name = "zero"
    apply(cluster, ns, zero_manifest(name, model, hold_queue=8))
    results = []
    for r in range(rounds):
        wait_until(lambda: _at_zero(cluster, ns, name), IDLE_S + 300, f"cold start {r + 1}: scale to zero")
        ip = wait_until(lambda: router_ip(cluster, ns, name), 120, "a ready router pod")
        wait_until(lambda ip=ip: hold_state(ip)["coldStartMeasured"], 60, "the router to read a cold start")
        run = ZeroRun()
        before = last_cold_start(cluster, ns, name)
        with Watch(cluster, ns, name) as watch:
            run.sent_wall = time.time()
            run.sent_at, run.held = burst(f"http://{ip}:8000", name, 8, lambda i: i % 2 == 1)
        run.watch = watch
        run.cold_last = new_cold_start(cluster, ns, name, before)
        row = phases(run)
        ok = sum(o.status == 200 and o.complete for o in run.held)
        results.append(row)
        print(
            f"cold start {r + 1}: " + ", ".join(f"{k} {v:.1f} s" for k, v in row.items())
            + f"; {ok}/8 answered 200; operator: {run.cold_last}",
            flush=True,
        )  # fmt: skip
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2, help="cold starts from zero to measure")
    parser.add_argument(
        "--clients", type=int, default=2, help="streaming clients during the 3 → 1 scale-down"
    )
    args = parser.parse_args()
    from plimsoll.runtime.testing import pod_model

    model = pod_model()
    started = time.monotonic()
    with chart_cluster(CHART, "plimsoll-zero-", pod_runner=True) as (cluster, _):
        cluster.kubectl("create", "namespace", "bench")
        rows = cold_starts(cluster, "bench", model, args.rounds)
        cluster.kubectl("delete", "llms", "zero", "-n", "bench", "--wait=true")
        drain = play_drain(cluster, "bench", "drain3", model, clients=args.clients)
    print(f"\ncold start from 0 replicas, {len(rows)} cold start(s), median seconds:")
    for phase in ("decision", "pod start", "engine start-up", "release", "total"):
        print(f"  {phase:16} {statistics.median(r[phase] for r in rows):6.1f}")
    load = drain.load
    assert load is not None
    print(
        f"3 → 1 under {args.clients} streaming clients: {len(load.outcomes)} streams, {len(load.failed())} failed; "
        f"drained {drain.victims}, kept {drain.remaining}; drain {drain.status.get('reason')}: "
        f"{drain.status.get('message')}; requests cut by the scale-down: {drain.status.get('requestsCutTotal')}"
        f"\ntotal run {time.monotonic() - started:.0f} s"
    )


if __name__ == "__main__":
    main()
