"""`--help` at 80 columns prints every option name whole, for every command."""

import re

import pytest
import typer
from typer.testing import CliRunner

from plimsoll.cli import app


def _commands(
    group: typer.core.TyperGroup, path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], object]]:
    # Through click's lookup, not group.commands: the root group loads its sub-commands lazily.
    found: list[tuple[tuple[str, ...], object]] = []
    for name in group.list_commands(None):  # type: ignore[arg-type]
        command = group.get_command(None, name)  # type: ignore[arg-type]
        assert command is not None, name
        found.append(((*path, name), command))
        if isinstance(command, typer.core.TyperGroup):
            found += _commands(command, (*path, name))
    return found


COMMANDS = _commands(typer.main.get_command(app))  # type: ignore[arg-type]


def test_every_command_is_covered() -> None:
    paths = {" ".join(p) for p, _ in COMMANDS}
    assert {"serve", "bench sweep", "bench soak", "diagnose", "plan", "operator"} <= paths


@pytest.mark.parametrize("path,command", COMMANDS, ids=[" ".join(p) for p, _ in COMMANDS])
def test_help_at_80_columns_prints_option_names_whole(path: tuple[str, ...], command: object) -> None:
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert not [line for line in lines if "…" in line], result.output
    names = [
        o for p in getattr(command, "params", []) for o in (*p.opts, *p.secondary_opts) if o.startswith("-")
    ]
    for name in names:
        assert re.search(rf"(^|[\s,│]){re.escape(name)}($|[\s,│])", result.output, re.M), (
            name,
            result.output,
        )
