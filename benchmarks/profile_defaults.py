"""The operator's capacity profile of the embedded model: the defaults against 32 requests a level.

Starts a fresh local control plane with the pod runner, installs the Helm chart, runs
the operator as a local process with the chart's ServiceAccount token, and profiles
one replica of SmolLM2-135M (`embedded://smollm2-135m`, `plimsoll serve` as a local
process bound to its pod IP) twice, one LLMService after the other:

* ``32-requests``: ``requestsPerLevel: 32``, no duration floor (what a profile did before);
* ``defaults``: the CRD's defaults (bench's ``max(100, 4 × c)`` requests and
  ``minSecondsPerLevel``).

Both sweep the same workload (``--input-tokens``/``--output-tokens``/``--levels``; the
CRD's own 512/128 over 1…64 takes hours on a shared CPU) and loosen the same client
gates, as the profiling tests do. For each it prints the Job's wall time, the knees, the
recommendation and ``status.capacity.measured`` (requests and seconds per level, and
the nodes the load generator and the replica ran on).

    python benchmarks/profile_defaults.py [--levels 1,2,4,8] [--input-tokens 128] [--output-tokens 32]

The CPU is shared by the control plane, the replica and the load generator, so the
figures are this machine's, not a GPU cluster's.
"""

import argparse
import datetime as dt
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "plimsoll"
sys.path.insert(0, str(ROOT / "tests" / "operator" / "handlers"))

from llms_k8s import apply, condition, get_json, llmservice, wait_for  # noqa: E402

from plimsoll.devcluster.cluster import Cluster  # noqa: E402
from plimsoll.operator.local import chart_operator  # noqa: E402
from plimsoll.operator.resources.profile_job import PROFILE_ARGS_ANNOTATION  # noqa: E402

GATES = "--max-client-lag-ms 1000 --min-concurrency-ratio 0.8"


def _get(cluster: Cluster, *args: str) -> Any:
    """kubectl get, or None when the API server is too slow to answer (a busy shared host)."""
    try:
        return get_json(cluster, *args)
    except subprocess.TimeoutExpired:
        return None


def _seconds(start: str, end: str) -> float:
    parse = dt.datetime.fromisoformat
    return (parse(end.replace("Z", "+00:00")) - parse(start.replace("Z", "+00:00"))).total_seconds()


def profile(cluster: Cluster, ns: str, name: str, workload: dict[str, Any], timeout: float) -> dict[str, Any]:
    manifest = llmservice(
        name,
        podAnnotations={},  # run the replica for real
        slo={"preset": "none"},  # knees from the curve alone, as the 32-request profile had them
        capacity={"mode": "Profile", "verifySeconds": 0, "profile": {"workload": workload}},
    )
    manifest["metadata"]["annotations"] = {PROFILE_ARGS_ANNOTATION: GATES}
    apply(cluster, ns, manifest)

    def profiled() -> dict[str, Any] | None:
        obj = _get(cluster, "llms", name, "-n", ns)
        c = condition(obj, "Profiled")
        if c and c["status"] == "False" and c["reason"] not in ("Profiling", "WaitingForReplica"):
            raise SystemExit(f"{name}: profiling failed: {c['reason']}: {c['message']}")
        return obj if c and c["status"] == "True" else None

    obj = wait_for(profiled, timeout, f"{name} Profiled=True", interval=2)
    job = get_json(cluster, "jobs", "-n", ns, "-l", f"plimsoll.dev/llmservice={name}")["items"][0]
    capacity = obj["status"]["capacity"]
    result = {
        "name": name,
        "job_seconds": _seconds(job["status"]["startTime"], job["status"]["completionTime"]),
        # A knee that is not there ("no knee within range") is left out of status.
        "throughput_knee": (capacity["knees"].get("throughput") or {}).get("concurrency"),
        "latency_knee": (capacity["knees"].get("latency") or {}).get("concurrency"),
        "per_replica": capacity["concurrencyPerReplica"],
        "measured": capacity.get("measured"),
        "disturbed": capacity.get("disturbedLevels"),
        "message": condition(obj, "Profiled")["message"],
    }
    cluster.kubectl("delete", "llms", name, "-n", ns, "--wait=true")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--levels", default="1,2,4,8", help="concurrency levels swept by both profiles")
    parser.add_argument("--input-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds to wait for each profile")
    parser.add_argument(
        "--variants",
        default="p32,pdefault",
        help="which profiles to run: p32 (32 requests), pdefault (defaults)",
    )
    args = parser.parse_args()
    levels = [int(c) for c in args.levels.split(",")]
    shape = {"inputTokens": args.input_tokens, "outputTokens": args.output_tokens, "concurrency": levels}
    known = {"p32": {**shape, "requestsPerLevel": 32, "minSecondsPerLevel": 0}, "pdefault": dict(shape)}
    variants = [(name, known[name]) for name in args.variants.split(",")]
    started = time.monotonic()
    rows = []
    with (
        tempfile.TemporaryDirectory(prefix="plimsoll-profile-") as tmp,
        Cluster(Path(tmp) / "cluster", pod_runner=True) as cluster,
        chart_operator(cluster, CHART, Path(tmp)),
    ):
        cluster.kubectl("create", "namespace", "bench")
        for name, workload in variants:
            print(f"{name}: profiling SmolLM2-135M with {json.dumps(workload)}", flush=True)
            row = profile(cluster, "bench", name, workload, args.timeout)
            print(json.dumps(row, indent=1), flush=True)
            rows.append(row)
    print(
        f"\n{'profile':10} {'Job s':>7} {'requests':>8} {'measured s':>10} {'thr knee':>8} {'lat knee':>8} {'target':>6}"
    )
    for row in rows:
        m = row["measured"] or {}
        print(
            f"{row['name']:10} {row['job_seconds']:7.0f} {m.get('requests', 0):8} {m.get('seconds', 0):10.0f} "
            f"{row['throughput_knee'] or '-':>8} {row['latency_knee'] or '-':>8} {row['per_replica']:6}"
        )
        for lv in m.get("levels", []):
            print(
                f"    c={lv['concurrency']:<3} {lv['requests']:5} requests {lv['seconds']:7.1f} s valid={lv['valid']}"
            )
        print(f"    load generator on {m.get('loadGeneratorNode')}, replica on {m.get('replicaNode')}")
    print(f"total run {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
