"""The distribution's layout: folders map to import names, and nothing shadows the stdlib."""

import importlib
import os
import subprocess
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
    # Run from the checkout with its folders first on sys.path, as `python -c` and
    # scripts do: the stdlib operator module must still win, and collections
    # (whose OrderedDict and namedtuple need operator.itemgetter) must work.
    probe = (
        "import collections, operator; "
        "collections.namedtuple('P', 'x')(1); collections.OrderedDict(a=1).move_to_end('a'); "
        "print(operator.__file__)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert not Path(result.stdout.strip()).resolve().is_relative_to(ROOT), result.stdout


def test_checkout_root_does_not_shadow_the_installed_package() -> None:
    # Scripts, tests and tools run from the checkout root with it first on sys.path:
    # no folder there may be named like the distribution's import name.
    assert not (ROOT / "plimsoll").exists(), "a plimsoll/ folder at the checkout root shadows the package"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    probe = "import plimsoll, plimsoll.operator.api.spec, plimsoll.runtime.engine; print(plimsoll.__file__)"
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).resolve().parent == (ROOT / "common").resolve(), result.stdout


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


def _source_folder(package: str) -> Path:
    """The folder package-dir maps a package to (the longest mapped prefix wins)."""
    mapped = max(
        (n for n in SETUPTOOLS["package-dir"] if package == n or package.startswith(n + ".")), key=len
    )
    rest = package.removeprefix(mapped).lstrip(".").split(".")
    return ROOT / SETUPTOOLS["package-dir"][mapped] / Path(*[p for p in rest if p])


def test_every_listed_package_imports_its_own_folder() -> None:
    # The installed package holds exactly the source folder's modules, byte for byte:
    # a module added or removed without reinstalling (strict editable installs link
    # files one by one) or a package-dir pointing elsewhere fails here.
    for name in SETUPTOOLS["packages"]:
        module = importlib.import_module(name)
        installed = {p.name: p.read_bytes() for d in module.__path__ for p in Path(d).glob("*.py")}
        source = {p.name: p.read_bytes() for p in _source_folder(name).glob("*.py")}
        assert installed.keys() == source.keys(), (
            f"{name}: installed {sorted(installed)} but {_source_folder(name)} has {sorted(source)}; reinstall"
        )
        assert installed == source, f"{name}: installed modules differ from {_source_folder(name)}; reinstall"


def test_every_package_data_pattern_matches_a_file() -> None:
    empty = [
        f"{package}: {pattern}"
        for package, patterns in SETUPTOOLS["package-data"].items()
        for pattern in patterns
        if not any(_source_folder(package).glob(pattern))
    ]
    assert not empty, f"package-data patterns that match no file (delete them or add the files): {empty}"


def test_cli_lists_every_subcommand() -> None:
    from plimsoll.cli import app

    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0, result.output
    for command in ("serve", "bench", "plan", "diagnose", "route", "operator", "dev", "demo"):
        assert command in result.output
