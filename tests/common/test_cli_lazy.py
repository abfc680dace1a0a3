"""The `plimsoll` entry point imports only the sub-command it runs."""

import subprocess
import sys

from typer.testing import CliRunner

from plimsoll.cli import SUBCOMMANDS, app

PROBE = """
import sys
from plimsoll import cli
sys.argv = ["plimsoll", "serve", "--help"]
try:
    cli.main()
except SystemExit:
    pass
print("LOADED", " ".join(sorted(m for m, _, _ in cli.SUBCOMMANDS.values() if m in sys.modules)))
"""


def test_serve_imports_no_other_subcommand_module() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout
    assert "Run the inference server" in out
    loaded = next(line for line in out.splitlines() if line.startswith("LOADED")).split()[1:]
    assert loaded == ["plimsoll.runtime.cli"]


def test_every_subcommand_is_listed_and_unknown_ones_are_refused() -> None:
    result = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    for name in SUBCOMMANDS:
        assert f" {name} " in result.output, name
    result = CliRunner().invoke(app, ["serv"])
    assert result.exit_code == 2
    assert "No such command" in result.output
