"""The prepared GPU check's command line, without a GPU: ``scripts/gpu_check.sh --help`` names
every section each part runs and the commands for a lent GPU, and a wrong ``--part`` is
refused before anything runs (the check itself needs a card; ``--cpu`` runs it on small models)."""

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def default_sections(script: str) -> list[str]:
    """The ``--sections`` default of a check script's argument parser, read from its source."""
    tree = ast.parse((ROOT / "scripts" / script).read_text())
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and node.args[0].value == "--sections"
        ):
            default = next(k.value for k in node.keywords if k.arg == "default")
            return str(ast.literal_eval(default)).split(",")
    raise AssertionError(f"{script} has no --sections option")


def test_help_names_every_section_and_the_lent_gpu_commands() -> None:
    result = subprocess.run(
        ["bash", str(SCRIPT), "--help"], cwd="/", capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    text = result.stdout
    for script in ("gpu_server_check.py", "gpu_check.py"):
        assert f"=== scripts/{script}" in text
        for name in default_sections(script):
            assert name.split("-")[0] in text, f"--help does not describe {script}'s section {name}"
    assert "bash scripts/gpu_check.sh --prepare" in text
    assert 'carry=["build/gpu-check"]' in text and "--part server --budget-s" in text


def test_a_wrong_part_is_refused_before_anything_runs() -> None:
    result = subprocess.run(
        ["bash", str(SCRIPT), "--part", "everything"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert "--part must be offline, server or all" in result.stdout
    assert "=== host ===" not in result.stdout
