"""A loud placeholder for CLI commands whose issue has not landed yet."""

import typer


def not_built(command: str, issue: str) -> None:
    """Say that `command` is not built yet and exit with status 2."""
    typer.echo(f"plimsoll {command}: not built yet (tracked in the issue '{issue}').", err=True)
    raise typer.Exit(code=2)
