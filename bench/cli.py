"""`plimsoll bench ...` and `plimsoll diagnose`."""

import typer

from plimsoll.unbuilt import not_built

app = typer.Typer(no_args_is_help=True)


@app.command("sweep")
def sweep() -> None:
    """Closed-loop concurrency sweep."""
    not_built("bench sweep", "plimsoll bench and diagnose")


def diagnose() -> None:
    """Name the layer that limits a server."""
    not_built("diagnose", "plimsoll bench and diagnose")
