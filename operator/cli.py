"""`plimsoll operator`: run the LLMService operator (kopf), or print its CRD.

The command parses flags and starts kopf; everything it does to the cluster lives
in ``plimsoll.operator.handlers``. kopf and the handlers are imported inside the
command body so `plimsoll --help` stays fast.
"""

import os
import socket
import sys
from pathlib import Path
from urllib.parse import urlsplit

import typer

HINT = "start a local one with `plimsoll dev up` and export the KUBECONFIG it prints, or set KUBECONFIG"


def cluster_problem() -> str | None:
    """Why kopf could not reach a cluster, checked in a second instead of its retry loop; None if it can."""
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return None  # in a pod: kopf uses the service account
    paths = [Path(p) for p in os.environ.get("KUBECONFIG", "").split(os.pathsep) if p]
    paths = paths or [Path.home() / ".kube" / "config"]
    existing = [p for p in paths if p.is_file()]
    if not existing:
        return f"no Kubernetes cluster configured (no kubeconfig at {', '.join(map(str, paths))}); {HINT}"
    import yaml

    try:
        conf = yaml.safe_load(existing[0].read_text()) or {}
        contexts = {c["name"]: c["context"] for c in conf.get("contexts") or []}
        clusters = {c["name"]: c["cluster"] for c in conf.get("clusters") or []}
        server = clusters[contexts[conf["current-context"]]["cluster"]]["server"]
    except (yaml.YAMLError, KeyError, TypeError) as exc:
        return f"kubeconfig {existing[0]} has no usable current-context ({exc!r}); {HINT}"
    url = urlsplit(server)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname or "", port), timeout=5).close()
    except OSError as exc:
        return f"the cluster at {server} (kubeconfig {existing[0]}) is not reachable ({exc.strerror or exc}); {HINT}"
    return None


def run_operator(
    namespace: list[str] = typer.Option(
        [], "--namespace", "-n", help="Watch only this namespace (repeatable). Default: all namespaces."
    ),
    liveness: str | None = typer.Option(
        None, "--liveness", help="Serve a liveness probe at this URL, e.g. http://0.0.0.0:8080/healthz."
    ),
    print_crd: bool = typer.Option(False, "--print-crd", help="Print the LLMService CRD YAML and exit."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log every handler step."),
    metrics_bind_address: str | None = typer.Option(
        None,
        "--metrics-bind-address",
        help="Serve the operator's own Prometheus metrics (process, Python, build info) at /metrics "
        "on HOST:PORT, e.g. 0.0.0.0:8081.",
    ),
    otlp_traces_endpoint: str | None = typer.Option(
        None,
        "--otlp-traces-endpoint",
        envvar="OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        help="OTLP/HTTP URL for the operator's own OpenTelemetry traces (a span per reconcile pass and "
        "per autoscaler decision), e.g. http://collector:4318/v1/traces.",
    ),
) -> None:
    """Run the LLMService operator (kopf, standalone: one active replica, no peering)."""
    if print_crd:
        from plimsoll.operator.api.crd import render

        sys.stdout.write(render())
        return
    problem = cluster_problem()
    if problem is not None:
        typer.echo(f"plimsoll operator: {problem}", err=True)
        raise typer.Exit(code=2)
    import kopf

    # Importing registers the handlers: reconcile (llmservice), the replica-planning daemon
    # and the capacity-profiling timer.
    from plimsoll.operator.handlers import llmservice, profiling, replica_planning, runtime_profile  # noqa: F401

    if metrics_bind_address is not None:
        from prometheus_client import Info, start_http_server

        from plimsoll import __version__

        host, _, port = metrics_bind_address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            typer.echo(
                f"plimsoll operator: --metrics-bind-address {metrics_bind_address!r} is not HOST:PORT",
                err=True,
            )
            raise typer.Exit(code=2)
        # The default registry: process_* and python_* collectors come with it.
        Info("plimsoll_operator_build", "Version of the running operator.").info({"version": __version__})
        start_http_server(int(port), addr=host.strip("[]"))
    if otlp_traces_endpoint:
        from plimsoll.tracing import configure_tracing

        try:
            configure_tracing("plimsoll-operator", otlp_traces_endpoint)
        except ValueError as exc:
            typer.echo(f"plimsoll operator: {exc}", err=True)
            raise typer.Exit(code=2) from None
    llmservice.CLUSTERWIDE = not namespace
    # Each line names its object ("[namespace/name] ..."), as `kopf run` does: a log reader
    # (and the Kubernetes tests) can tell which LLMService a handler ran for.
    kopf.configure(verbose=verbose, log_prefix=True)
    kopf.run(
        standalone=True,
        clusterwide=not namespace,
        namespaces=namespace,
        liveness_endpoint=liveness,
    )
