"""Cold start from zero replicas with a node-local model cache, cold then warm, phase by phase.

Starts a fresh local control plane with the pod runner, installs the Helm chart, runs
the operator as a local process with the chart's ServiceAccount token, and serves the
model (by default the embedded SmolLM2-135M, 538 MB of safetensors; ``--model tiny`` for
the tiny random test model) from ``plimsoll.devcluster.hubmirror.HubMirror``, a local
server that answers like the Hugging Face Hub. The LLMService is ``hf://`` with
``model.cache.hostPath`` on an empty directory, ``scaling.min 0`` and a router that holds
requests while no replica is Ready.

Each start: the service is at zero replicas; one streaming request goes to the router;
the operator scales to one; the replica pod's ``fetch-model`` init container fills the
node cache (the first start: cold, everything downloaded and hashed; the next ones: warm,
present and verified by the stored digests), then ``plimsoll serve`` starts. Printed per
start, in seconds from the request (wall clock; API-server timestamps have whole-second
resolution, the replica's own marks are exact):

* pod created (the operator's decision and the Deployment's pod) and scheduled
  (``PodScheduled``),
* init: the ``fetch-model`` container's start and end, and what its log says it did,
* the engine process: its start and the end of each ``plimsoll_startup_phase_seconds``
  phase (imports, weights_loaded, kv_cache_allocated, warmup_done, ready),
* the pod ``Ready`` condition and the first byte of the answer (and the replica's own TTFT for
  the request, from its log: what of Ready → first byte is the engine's).

There is no image pull here (the pod runner runs local processes), so "image" is zero.
Between starts the service idles back to zero (``idleSeconds``).

First (``--fetch-repeats``, 3 by default) the warm init step alone, side by side: the whole
CLI (``plimsoll fetch``) against ``python -m plimsoll.model_fetch``, and the stored digests
against ``--rehash``.

    python benchmarks/cold_start_phases.py [--warm 2] [--model embedded|tiny] [--no-cluster]

The CPU is shared by the control plane, the replica, the hub stand-in and the client,
so the figures are this machine's, not a GPU node's.
"""

import argparse
import json
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "plimsoll"
sys.path.insert(0, str(ROOT / "tests" / "operator" / "handlers"))  # the drivers the k8s tests use

from llms_k8s import apply, condition, get_json, llmservice  # noqa: E402
from zero_k8s import Outcome, _wall, is_ready, pods, router_ip, send_one, wait_until  # noqa: E402

from plimsoll.devcluster.cluster import Cluster  # noqa: E402
from plimsoll.devcluster.hubmirror import HubMirror, HubRepo  # noqa: E402
from plimsoll.operator.local import chart_operator  # noqa: E402

NAME = "cold"
REPO = "bench/model"
IDLE_S = 8
ENGINE_PHASES = ("imports", "weights_loaded", "kv_cache_allocated", "warmup_done", "ready")


def manifest(endpoint: str, cache: Path) -> dict[str, Any]:
    return llmservice(
        NAME,
        model={"uri": f"hf://{REPO}", "cache": {"hostPath": {"path": str(cache)}}},
        engine={
            "maxNumSeqs": 2,
            "kvCacheMemory": "256Mi",
            "env": [{"name": "HF_ENDPOINT", "value": endpoint}],
        },
        podAnnotations={},  # run replicas and router for real
        replicas=0,
        scaling={"min": 0, "max": 1, "idleSeconds": IDLE_S, "drainSeconds": 10},
        capacity={"mode": "Manual", "concurrencyPerReplica": 2},
        autoscaling={"mode": "builtin", "intervalSeconds": 1, "scaleDownStabilizationSeconds": 5},
        router={"replicas": 1, "holdQueue": 8, "holdTimeoutSeconds": 600},
    )


def at_zero(cluster: Cluster, ns: str) -> bool:
    obj = get_json(cluster, "llms", NAME, "-n", ns) or {}
    return (obj.get("spec") or {}).get("replicas") == 0 and not pods(cluster, ns, NAME)


def startup_marks(ip: str) -> tuple[float | None, dict[str, float]]:
    """The replica's process start (Unix time, from its ``/ready`` body) and seconds from it to the end
    of each phase (``plimsoll_startup_phase_seconds``)."""
    ready = httpx.get(f"http://{ip}:8000/ready", timeout=10, trust_env=False).json()
    start = (ready.get("startup") or {}).get("processStartTime")
    text = httpx.get(f"http://{ip}:8000/metrics", timeout=10, trust_env=False).text
    pattern = r'^plimsoll_startup_phase_seconds\{[^}]*phase="([a-z_]+)"[^}]*\} ([0-9.e+-]+)$'
    marks = {m.group(1): float(m.group(2)) for m in re.finditer(pattern, text, re.M)}
    return (float(start) if start is not None else None), marks


def fetch_summary(cluster: Cluster, ns: str, pod: str) -> str:
    log = cluster.state_dir / "pods" / "logs" / f"{ns}_{pod}_fetch-model.log"
    try:
        lines = log.read_text().splitlines()
    except OSError:
        return "(no fetch log)"
    said = [ln.split(": ", 1)[-1] for ln in lines if "nothing to download" in ln or "fetched " in ln]
    return said[-1] if said else (lines[-1] if lines else "(empty fetch log)")


def replica_ttft(cluster: Cluster, ns: str, pod: str) -> float | None:
    """The replica's own TTFT for the first request it finished (its request_finished log line)."""
    log = cluster.state_dir / "pods" / "logs" / f"{ns}_{pod}_engine.log"
    for line in log.read_text().splitlines() if log.exists() else []:
        if '"request_finished"' in line:
            return float(json.loads(line[line.index("{") :]).get("ttft_s") or "nan")
    return None


def one_start(cluster: Cluster, ns: str, label: str) -> dict[str, float]:
    ip = wait_until(lambda: router_ip(cluster, ns, NAME), 120, "a ready router pod")
    outcome: list[Outcome] = []
    sent = time.time()
    client = threading.Thread(target=lambda: outcome.append(send_one(f"http://{ip}:8000", NAME, 0, True)))
    client.start()
    pod = wait_until(
        lambda: next((p for p in pods(cluster, ns, NAME) if is_ready(p)), None), 900, "a Ready replica"
    )
    client.join(timeout=900)
    name = pod["metadata"]["name"]
    pod = get_json(cluster, "pods", name, "-n", ns)
    status = pod["status"]
    fetch = next(s for s in status.get("initContainerStatuses") or [] if s["name"] == "fetch-model")
    fetch_state = (fetch.get("state") or {}).get("terminated") or {}
    engine = next(iter(status.get("containerStatuses") or []))
    process_start, marks = startup_marks(status["podIP"])
    answer = outcome[0] if outcome else None
    if answer is None or answer.status != 200 or answer.first_byte_wall is None:
        raise SystemExit(f"{label}: the held request failed: {answer}")

    def since(stamp: float | None) -> float:
        return float("nan") if stamp is None else stamp - sent

    timeline = {
        "pod created": since(_wall(pod["metadata"]["creationTimestamp"])),
        "pod scheduled": since(_wall((condition(pod, "PodScheduled") or {}).get("lastTransitionTime"))),
        "fetch-model started": since(_wall(fetch_state.get("startedAt"))),
        "fetch-model done": since(_wall(fetch_state.get("finishedAt"))),
        "engine container started": since(
            _wall(((engine.get("state") or {}).get("running") or {}).get("startedAt"))
        ),
        "engine process start": since(process_start),
        **{
            f"engine {p}": since(process_start + marks[p])
            for p in ENGINE_PHASES
            if process_start and p in marks
        },
        "pod Ready": since(_wall((condition(pod, "Ready") or {}).get("lastTransitionTime"))),
        "first byte": since(answer.first_byte_wall),
    }
    ttft = wait_until(lambda: replica_ttft(cluster, ns, name), 60, "the replica's request log")
    print(f"\n{label} start ({name}); fetch-model: {fetch_summary(cluster, ns, name)}", flush=True)
    print(f"  (the replica's own TTFT for this request, from its log: {ttft:.2f} s)", flush=True)
    for what, at in timeline.items():
        print(f"  {what:28} {at:7.2f} s", flush=True)
    return timeline


def fetch_step(endpoint: str, repeats: int) -> None:
    """The init step alone on this host, warm node cache, side by side: the whole CLI against the module
    entry point, and trusting the stored digests against hashing every file again (``--rehash``)."""
    import os
    import subprocess

    env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_TELEMETRY": "1"}
    plimsoll = str(Path(sys.executable).with_name("plimsoll"))
    with tempfile.TemporaryDirectory(prefix="plimsoll-fetch-") as tmp:
        target = Path(tmp) / "hf" / REPO / "main"
        variants = {
            "plimsoll fetch (whole CLI)": [plimsoll, "fetch"],
            "python -m plimsoll.model_fetch": [sys.executable, "-m", "plimsoll.model_fetch"],
            "python -m plimsoll.model_fetch --rehash": [
                sys.executable,
                "-m",
                "plimsoll.model_fetch",
                "--rehash",
            ],
        }
        uri = f"hf://{REPO}"
        subprocess.run([*variants["python -m plimsoll.model_fetch"], uri, "--local-dir", str(target)],
                       env=env, check=True, capture_output=True)  # fmt: skip
        time.sleep(1.0)  # older than a timestamp tick: the stored digests are trusted, as on a node
        seconds: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(repeats):
            for label, command in variants.items():
                t0 = time.monotonic()
                subprocess.run(
                    [*command, uri, "--local-dir", str(target)], env=env, check=True, capture_output=True
                )
                seconds[label].append(time.monotonic() - t0)
    print(f"\nthe warm init step alone (process start to exit), {repeats} repeats, interleaved:")
    for label, runs in seconds.items():
        print(
            f"  {label:42} median {statistics.median(runs):5.2f} s  ({', '.join(f'{r:.2f}' for r in runs)})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--warm", type=int, default=2, help="warm-cache starts after the cold one")
    parser.add_argument("--model", choices=("embedded", "tiny"), default="embedded")
    parser.add_argument(
        "--fetch-repeats", type=int, default=3, help="repeats of the init step alone (0: skip)"
    )
    parser.add_argument("--no-cluster", action="store_true", help="only the init step alone")
    args = parser.parse_args()
    if args.model == "embedded":
        from plimsoll.runtime.models.embedded import ensure_embedded_model

        model = ensure_embedded_model("smollm2-135m")
    else:
        from plimsoll.runtime.testing import pod_model

        model = pod_model()
    size = sum(p.stat().st_size for p in model.rglob("*") if p.is_file())
    print(f"model {args.model}: {model} ({size / 2**20:.0f} MiB)", flush=True)
    started = time.monotonic()
    if args.fetch_repeats:
        with HubMirror({REPO: HubRepo({"main": model})}) as hub:
            fetch_step(hub.endpoint, args.fetch_repeats)
    if args.no_cluster:
        return
    rows: list[tuple[str, dict[str, float]]] = []
    with (
        tempfile.TemporaryDirectory(prefix="plimsoll-cold-") as tmp,
        HubMirror({REPO: HubRepo({"main": model})}) as hub,
        Cluster(Path(tmp) / "cluster", pod_runner=True) as cluster,
        chart_operator(cluster, CHART, Path(tmp)),
    ):
        cache = Path(tmp) / "node-cache"  # the node's directory: empty, so the first start is cold
        cluster.kubectl("create", "namespace", "bench")
        apply(cluster, "bench", manifest(hub.endpoint, cache))
        for i in range(1 + args.warm):
            wait_until(lambda: at_zero(cluster, "bench"), IDLE_S + 300, "the service at zero replicas")
            label = "cold-cache" if i == 0 else f"warm-cache {i}"
            rows.append((label, one_start(cluster, "bench", label)))
        downloads = sorted(p.rsplit("/", 1)[-1] for p in hub.downloads())
    print(f"\nfiles downloaded from the hub over all starts: {downloads}")
    print("\nseconds from the request, per start:")
    keys = list(rows[0][1])
    print(f"  {'':28} " + " ".join(f"{label:>12}" for label, _ in rows))
    for key in keys:
        print(f"  {key:28} " + " ".join(f"{row.get(key, float('nan')):12.2f}" for _, row in rows))
    print(f"\ntotal run {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
