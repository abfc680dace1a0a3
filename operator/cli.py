"""`plimsoll operator`: run the LLMService operator (kopf), or print its CRD.

The command parses flags and starts kopf; everything it does to the cluster lives
in ``plimsoll.operator.handlers``. kopf and the handlers are imported inside the
command body so `plimsoll --help` stays fast.
"""

import sys

import typer


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
) -> None:
    """Run the LLMService operator (kopf, standalone: one active replica, no peering)."""
    if print_crd:
        from plimsoll.operator.api.crd import render

        sys.stdout.write(render())
        return
    import kopf

    # Importing registers the handlers: reconcile (llmservice), the built-in autoscaler daemon
    # and the capacity-profiling timer.
    from plimsoll.operator.handlers import autoscaling, llmservice, profiling  # noqa: F401

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
