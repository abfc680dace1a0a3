"""The distribution's layout: folders map to import names, and nothing shadows the stdlib."""

import collections
import importlib
import operator
import sys
import tomllib
from pathlib import Path

from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]


def test_no_operator_init_shadows_stdlib() -> None:
    assert not (ROOT / "operator" / "__init__.py").exists(), (
        "operator/__init__.py shadows the standard library's operator module; delete it"
    )
    # The stdlib module is the one imported, and collections (which needs it) works.
    assert hasattr(operator, "itemgetter")
    assert Path(operator.__file__ or "").parent != ROOT / "operator"
    assert collections.OrderedDict is not None


def _import_name(folder: Path) -> str | None:
    """The import name a source folder maps to through package-dir."""
    rel = folder.relative_to(ROOT)
    top, rest = rel.parts[0], rel.parts[1:]
    for name, path in SETUPTOOLS["package-dir"].items():
        if path == top:
            return ".".join([name, *rest])
    return None


def test_every_source_folder_is_packaged() -> None:
    packages = set(SETUPTOOLS["packages"])
    roots = set(SETUPTOOLS["package-dir"].values())
    missing = []
    for py in ROOT.rglob("*.py"):
        folder = py.parent
        rel = folder.relative_to(ROOT)
        if not rel.parts or rel.parts[0] not in roots or "__pycache__" in rel.parts:
            continue
        name = _import_name(folder)
        if name is not None and name not in packages:
            missing.append(f"{rel} -> {name}")
    assert not missing, f"source folders missing from [tool.setuptools] packages: {sorted(set(missing))}"


def test_every_listed_package_imports() -> None:
    for name in SETUPTOOLS["packages"]:
        module = importlib.import_module(name)
        assert module is sys.modules[name]


def test_cli_lists_every_subcommand() -> None:
    from plimsoll.cli import app

    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0, result.output
    for command in ("serve", "bench", "plan", "diagnose", "route", "operator", "dev", "demo"):
        assert command in result.output
