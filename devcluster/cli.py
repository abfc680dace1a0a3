"""`plimsoll dev up|down|status|kubeconfig`."""

import typer

from plimsoll.unbuilt import not_built

app = typer.Typer(no_args_is_help=True)


@app.command("up")
def up() -> None:
    """Build what is missing and start the control plane."""
    not_built("dev up", "Foundation: local Kubernetes control plane")
