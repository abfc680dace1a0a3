"""The image installs what requirements.lock pins, hash-checked, from one index per step.

A static check (no image is built here): the lock covers every dependency pyproject.toml
declares (torch excepted: the Dockerfile takes it from the PyTorch index of the build), each
at a version the declared range allows and with a sha256 hash; the Dockerfile installs with
``--require-hashes`` and never with ``--extra-index-url``.
"""

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
# From the PyTorch index matching the image's base (CPU or a CUDA version), not the lock.
FROM_TORCH_INDEX = {"torch", "triton"}


def _locked() -> dict[str, tuple[str, int]]:
    """name -> (version, number of hashes) from requirements.lock."""
    text = (ROOT / "requirements.lock").read_text()
    found: dict[str, tuple[str, int]] = {}
    for block in re.split(r"\n(?=[A-Za-z0-9])", text):
        m = re.match(r"([A-Za-z0-9_.\-\[\]]+)==([^\s\\;]+)", block)
        if m:
            name = re.sub(r"[-_.]+", "-", m.group(1).split("[")[0]).lower()
            found[name] = (m.group(2), block.count("--hash=sha256:"))
    return found


def test_every_declared_dependency_is_locked_with_hashes() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [
        Requirement(r) for r in [*project["dependencies"], *project["optional-dependencies"]["profile"]]
    ]
    locked = _locked()
    for req in declared:
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        if name in FROM_TORCH_INDEX:
            assert name not in locked, f"{name} comes from the PyTorch index, not the lock"
            continue
        assert name in locked, f"{req} is not in requirements.lock; run scripts/lock-requirements.sh"
        version, hashes = locked[name]
        assert req.specifier.contains(version, prereleases=True), (
            f"{name}=={version} is outside {req.specifier}"
        )
        assert hashes >= 1, f"{name} has no hash in requirements.lock"
    assert not [n for n in locked if n.startswith("nvidia-")], "CUDA libraries come with torch from its index"
    assert Requirement("jinja2>=3.1.6").specifier.contains(locked["jinja2"][0])


def test_the_image_installs_from_the_lock_one_index_at_a_time() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    runs = " ".join(line for line in dockerfile.splitlines() if not line.lstrip().startswith("#"))
    assert "--extra-index-url" not in runs
    assert "--require-hashes --no-deps -r requirements.lock" in runs
    assert "pip install --no-deps --no-build-isolation ." in runs
    assert "chown -R 1000:1000 /opt/plimsoll" not in runs, "the weights stay read-only for the serving user"
