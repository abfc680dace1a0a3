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
