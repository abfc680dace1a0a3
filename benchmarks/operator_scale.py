"""How the operator copes with many LLMServices at once: apply→Ready latency, CPU and memory.

Starts a fresh local control plane (simulated nodes, no pod runner), installs the
Helm chart, runs the operator as a local process with the chart's ServiceAccount
token, applies N LLMServices in one `kubectl apply`, and prints p50/p95/max time
from apply to Ready plus the operator's CPU seconds and peak RSS. Replicas are
CPU-only and simulated by kwok, so this measures the operator and the control
plane, not model loading.

    python benchmarks/operator_scale.py --count 50
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "plimsoll"
sys.path.insert(0, str(ROOT / "tests" / "operator" / "handlers"))  # the manifests the k8s tests apply

# The k8s tests' simulated, CPU-only LLMService: autoscaling off, capacity given (reconcile, not
# benchmark Jobs, is what is measured).
from llms_k8s import llmservice  # noqa: E402

from plimsoll.operator.local import chart_cluster  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--count", type=int, default=50, help="LLMServices applied at once")
    parser.add_argument("--timeout", type=float, default=600, help="seconds to wait for all to be Ready")
    args = parser.parse_args()

    # The operator's default resync period: what reconciling a fleet costs in production.
    with chart_cluster(CHART, "plimsoll-opscale-", PLIMSOLL_RESYNC_SECONDS="30") as (cluster, operator):
        cluster.kubectl("create", "namespace", "fleet")
        idle_rss = operator.rss_bytes()
        cpu0 = operator.cpu_seconds()
        start = time.monotonic()
        docs = [llmservice(f"fleet-{i:03d}") for i in range(args.count)]
        cluster.kubectl("apply", "-n", "fleet", "-f", "-", input=yaml.safe_dump_all(docs))
        applied = time.monotonic() - start
        ready: dict[str, float] = {}
        peak_rss = idle_rss
        while len(ready) < args.count and time.monotonic() - start < args.timeout:
            items = json.loads(cluster.kubectl("get", "llms", "-n", "fleet", "-o", "json").stdout)["items"]
            now = time.monotonic() - start
            for obj in items:
                for c in obj.get("status", {}).get("conditions", []):
                    if c["type"] == "Ready" and c["status"] == "True":
                        ready.setdefault(obj["metadata"]["name"], now)
            peak_rss = max(peak_rss, operator.rss_bytes())
            time.sleep(0.25)
        busy_cpu = operator.cpu_seconds() - cpu0
        times = sorted(ready.values())
        print(f"LLMServices applied at once: {args.count} (kubectl apply took {applied:.1f}s)")
        print(f"Ready: {len(times)}/{args.count}")
        if times:
            print(
                f"apply->Ready seconds: p50 {percentile(times, 0.5):.1f}  p95 {percentile(times, 0.95):.1f}  "
                f"max {times[-1]:.1f}  mean {statistics.mean(times):.1f}"
            )
            print(
                f"operator CPU: {busy_cpu:.1f} s over {times[-1]:.1f} s ({busy_cpu / times[-1]:.2f} cores on average)"
            )
        print(f"operator RSS: idle {idle_rss / 2**20:.0f} MiB, peak {peak_rss / 2**20:.0f} MiB")
        print(f"machine: {len(os.sched_getaffinity(0))} CPUs shared with the control plane")


if __name__ == "__main__":
    main()
