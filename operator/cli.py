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

    llmservice.CLUSTERWIDE = not namespace
    kopf.configure(verbose=verbose)
    kopf.run(
        standalone=True,
        clusterwide=not namespace,
        namespaces=namespace,
        liveness_endpoint=liveness,
    )
