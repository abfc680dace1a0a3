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
