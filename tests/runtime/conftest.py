"""Fixtures for the runtime engine tests: tiny models built once per session."""

from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import build_tiny_model

# Tiny models gain nothing from intra-op threads, and on a shared, oversubscribed
# CPU OpenMP spin-waiting makes them 10-20x slower.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    cache: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in cache:
            cache[arch] = build_tiny_model(arch, tmp_path_factory.mktemp(f"tiny-{arch}"))
        return cache[arch]

    return get


@pytest.fixture()
def triton_interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton kernels run in Triton's interpreter on the CPU for this test (TRITON_INTERPRET=1).

    The kernels are decorated on first use, reading TRITON_INTERPRET then (and cached per mode);
    they call no triton standard-library jit function, so it may be set after ``import triton``.
    """
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _cpu_kernels_back_to_auto() -> Any:
    """A test that made the process run another build of the CPU kernels, or none (an engine with
    cpu_kernels="off", ``cpu_kernels.select("avx2")``, a load made to fail) hands the next one the
    default back."""
    yield
    import sys

    cpu_kernels = sys.modules.get("plimsoll.runtime.kernels.cpu_kernels")
    selected = None if cpu_kernels is None else cpu_kernels._selection
    if selected is not None and (selected.choice != "auto" or selected.library is None):
        cpu_kernels.select()
