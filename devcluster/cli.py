"""`plimsoll dev up|down|status|kubeconfig`: the local control plane from the shell.

``up`` builds missing binaries (with progress), starts the control plane in the
background and returns; ``down`` in any later shell stops exactly what ``up``
started, found through the state file in the state dir.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from plimsoll.devcluster.cluster import Cluster

app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False)

STATE_DIR_OPTION = typer.Option(
    None, "--state-dir", help="Where PKI, logs, PIDs and data live (default ~/.cache/plimsoll/dev)."
)


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def _running_cluster(state_dir: Path | None) -> Cluster:
    """The control plane ``up`` started in ``state_dir``; exit 1 saying so when there is none."""
    from plimsoll.devcluster.cluster import Cluster

    try:
        return Cluster.load(state_dir)
    except FileNotFoundError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from exc


@app.command("up")
def up(
    state_dir: Path | None = STATE_DIR_OPTION,
    pod_runner: bool = typer.Option(
        True,
        "--pod-runner/--no-pod-runner",
        help="Run plimsoll pods as local processes bound to their pod IP.",
    ),
    build_only: bool = typer.Option(False, "--build-only", help="Build the binaries and exit."),
) -> None:
    """Build what is missing, start the control plane and the simulated GPU nodes."""
    from rich.console import Console

    from plimsoll.devcluster.builder import ensure_built
    from plimsoll.devcluster.cluster import Cluster
    from plimsoll.devcluster.process import ComponentError

    console = Console()
    try:
        ensure_built(console=Console(stderr=True))
        if build_only:
            console.print("binaries built")
            return
        running = Cluster.load_running(state_dir)
        if running is not None:
            console.print(f"already running; kubeconfig: {running.kubeconfig}")
            return
        cluster = Cluster(state_dir, pod_runner=pod_runner)
        started = time.monotonic()
        with console.status("starting etcd, kube-apiserver, controller-manager, scheduler, kwok …"):
            cluster.start()
        elapsed = time.monotonic() - started
    except ComponentError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(1) from exc
    console.print(
        f"control plane up in {elapsed:.1f}s, all nodes Ready; resident memory {_mib(cluster.resident_memory())}"
    )
    console.print(cluster.kubectl("get", "nodes", "-o", "wide").stdout.rstrip(), highlight=False)
    console.print(f"\nexport KUBECONFIG={cluster.kubeconfig}", highlight=False)
    console.print("stop it with: plimsoll dev down")


@app.command("down")
def down(state_dir: Path | None = STATE_DIR_OPTION) -> None:
    """Stop every process `plimsoll dev up` started."""
    from plimsoll.devcluster.cluster import Cluster

    try:
        cluster = Cluster.load(state_dir)
    except FileNotFoundError:
        typer.echo("nothing running")
        return
    names = [s.name for s in cluster.status() if s.alive]
    cluster.stop()
    typer.echo(f"stopped: {', '.join(names) if names else 'nothing was alive'}")


@app.command("status")
def status(state_dir: Path | None = STATE_DIR_OPTION) -> None:
    """Show each component's PID, liveness, memory and log; exit 1 if not all run."""
    from rich.console import Console
    from rich.table import Table

    cluster = _running_cluster(state_dir)
    table = Table("component", "pid", "state", "rss", "log")
    rows = cluster.status()
    for s in rows:
        table.add_row(
            s.name, str(s.pid), "running" if s.alive else "[red]dead[/red]", _mib(s.rss_bytes), s.log
        )
    console = Console()
    console.print(table)
    console.print(
        f"server {cluster.server}  kubeconfig {cluster.kubeconfig}  total rss {_mib(cluster.resident_memory())}"
    )
    if not all(s.alive for s in rows):
        raise typer.Exit(1)


@app.command("kubeconfig")
def kubeconfig(state_dir: Path | None = STATE_DIR_OPTION) -> None:
    """Print the admin kubeconfig path (use: export KUBECONFIG=$(plimsoll dev kubeconfig))."""
    typer.echo(str(_running_cluster(state_dir).kubeconfig))
