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


def test_rich_help_is_loaded_only_to_print_help() -> None:
    """typer's rich help (and the patch that keeps option names whole) is imported by a help that
    prints, not by the entry point: `plimsoll serve` starting a replica does not pay for it."""
    probe = (
        "import sys\nfrom plimsoll import cli\nprint('IMPORTED', 'typer.rich_utils' in sys.modules)\n"
        + PROBE
        + "print('HELPED', 'typer.rich_utils' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert "IMPORTED False" in out and "HELPED True" in out
    assert "Run the inference server" in out
