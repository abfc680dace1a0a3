"""Builds the missing control-plane binaries by running ``build.sh``, showing progress.

The Go work lives in ``build.sh``; this module passes it the versions and cache
dir from ``paths.py``, shows its step lines with elapsed time (a live spinner on a
terminal, plain lines otherwise), and turns a failure into an error that names
the product and its build log. A build of the Kubernetes binaries takes tens of
minutes the first time; nothing is rebuilt once present.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Sequence

from rich.console import Console

from plimsoll.devcluster import paths
from plimsoll.devcluster.process import ComponentError


def ensure_built(products: Sequence[str] | None = None, console: Console | None = None) -> list[str]:
    """Build the products (default: every missing one); return the names built."""
    todo = [p for p in (products or paths.missing_products()) if not paths.PRODUCTS[p].is_built()]
    if not todo:
        return []
    if shutil.which("go") is None:
        raise ComponentError(
            "build",
            f"binaries for {', '.join(todo)} are missing and Go is not on PATH; "
            "install Go 1.26 (https://go.dev/dl) and run `plimsoll dev up` again",
        )
    console = console or Console(stderr=True)
    console.print(
        f"Building {', '.join(todo)} from Go modules into {paths.testplane_dir()} "
        "(once per version; the Kubernetes binaries take 15-40 minutes on 2 cores)"
    )
    start = time.monotonic()
    proc = subprocess.Popen(
        ["bash", str(paths.BUILD_SCRIPT), *todo],
        env=paths.build_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    last = "starting"
    with console.status("building …", spinner="dots") if console.is_terminal else _NoStatus() as status:
        for line in proc.stdout:
            line = line.rstrip()
            if not line:
                continue
            last = line
            if console.is_terminal:
                console.print(line, highlight=False)
                status.update(f"[{time.monotonic() - start:5.0f}s] {line}")
            else:
                print(line, file=sys.stderr, flush=True)
    rc = proc.wait()
    if rc != 0:
        failed = next((p for p in todo if not paths.PRODUCTS[p].is_built()), todo[-1])
        raise ComponentError(
            f"build of {failed}", f"build.sh exited with {rc} ({last})", paths.PRODUCTS[failed].build_log
        )
    return todo


class _NoStatus:
    """Stands in for ``console.status`` when output is not a terminal."""

    def __enter__(self) -> _NoStatus:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, text: str) -> None:
        return None
