"""Where the control plane's binaries and run state live, and which versions they are.

This module is the single source of truth for the pinned versions and the cache
layout: ``build.sh`` receives both through its environment (``KVER``, ``EVER``,
``KWOKVER``, ``HELMVER``, ``PLIMSOLL_TESTPLANE_DIR``) rather than deciding them
itself. It does not build or start anything.

Layout::

    ~/.cache/plimsoll/testplane/<go version>-<arch>/<product>-v<version>/bin/<binary>
    ~/.cache/plimsoll/testplane/<go version>-<arch>/kwok-v<version>/stages.yaml
    ~/.cache/plimsoll/dev/            default state dir of `plimsoll dev up`
"""

from __future__ import annotations

import functools
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from plimsoll import model_cache

K8S_VERSION = "1.37.2"
ETCD_VERSION = "3.6.14"
KWOK_VERSION = "0.8.0"
HELM_VERSION = "4.3.1"

BUILD_SCRIPT = Path(__file__).resolve().parent / "build.sh"


def cache_root() -> Path:
    """``$PLIMSOLL_CACHE`` or ``~/.cache/plimsoll``."""
    return Path(os.environ.get("PLIMSOLL_CACHE") or Path.home() / ".cache" / "plimsoll")


def default_state_dir() -> Path:
    """State of the control plane started by `plimsoll dev up` (PKI, logs, PIDs, data)."""
    return cache_root() / "dev"


def model_cache_dir() -> Path:
    """The local model cache the pod runner maps model volumes to: the runtime's (``plimsoll.model_cache``)."""
    return model_cache.model_cache_dir()


@functools.cache
def go_version() -> str | None:
    """``go env GOVERSION`` (e.g. ``go1.26.8``), or None when Go is not installed."""
    go = shutil.which("go")
    if go is None:
        return None
    env = {**os.environ, "GOTOOLCHAIN": "local"}
    out = subprocess.run([go, "env", "GOVERSION"], capture_output=True, text=True, env=env, check=False)
    return out.stdout.strip() or None


def testplane_dir() -> Path:
    """The binary cache for this Go version and machine architecture.

    Binaries are keyed on the Go version that built them. Without Go on PATH, an
    existing cache for this architecture is reused (the newest), so a machine that
    only runs the control plane does not need Go.
    """
    base = cache_root() / "testplane"
    arch = platform.machine()
    gover = go_version()
    if gover is not None:
        return base / f"{gover}-{arch}"
    found = sorted(base.glob(f"*-{arch}"), key=lambda p: p.stat().st_mtime, reverse=True)
    if found:
        return found[0]
    return base / f"nogo-{arch}"


@dataclass(frozen=True, slots=True)
class Product:
    """One thing ``build.sh`` builds: a name, its pinned version and its binaries."""

    name: str
    version: str
    binaries: tuple[str, ...]

    @property
    def dir(self) -> Path:
        return testplane_dir() / f"{self.name}-v{self.version}"

    @property
    def bin_dir(self) -> Path:
        return self.dir / "bin"

    @property
    def build_log(self) -> Path:
        return self.dir / "build.log"

    def binary(self, name: str) -> Path:
        assert name in self.binaries, f"{name} is not a binary of {self.name}"
        return self.bin_dir / name

    def is_built(self) -> bool:
        done = all(os.access(self.bin_dir / b, os.X_OK) for b in self.binaries)
        if self.name == "kwok":
            done = done and (self.dir / "stages.yaml").is_file()
        return done


# Build order matters only for progress display: the short ones first.
PRODUCTS: dict[str, Product] = {
    "etcd": Product("etcd", ETCD_VERSION, ("etcd",)),
    "kwok": Product("kwok", KWOK_VERSION, ("kwok",)),
    "helm": Product("helm", HELM_VERSION, ("helm",)),
    "k8s": Product(
        "k8s", K8S_VERSION, ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
    ),
}


def binary(name: str) -> Path:
    """Path of a built binary by its name (``kube-apiserver``, ``etcd``, ``kwok`` …)."""
    for product in PRODUCTS.values():
        if name in product.binaries:
            return product.binary(name)
    raise KeyError(f"unknown control-plane binary {name!r}")


def kwok_stages() -> Path:
    """kwok's stock stages (node initialise/heartbeat, pod ready/complete/delete) as built."""
    return PRODUCTS["kwok"].dir / "stages.yaml"


def missing_products() -> list[str]:
    """Names of products whose binaries are not in the cache yet."""
    return [name for name, product in PRODUCTS.items() if not product.is_built()]


def build_env() -> dict[str, str]:
    """Environment for ``build.sh``: the versions and the cache dir decided here."""
    return {
        **os.environ,
        "KVER": K8S_VERSION,
        "EVER": ETCD_VERSION,
        "KWOKVER": KWOK_VERSION,
        "HELMVER": HELM_VERSION,
        "PLIMSOLL_TESTPLANE_DIR": str(testplane_dir()),
    }
