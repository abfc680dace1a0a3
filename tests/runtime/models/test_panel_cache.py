"""Packed CPU panels kept on disk (models/panel_cache.py): packed once, mapped on the next start."""

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from plimsoll.runtime.kernels import cpu_kernels
from plimsoll.runtime.models.cpu_plan import CPUOptions, CPUPlan
from plimsoll.runtime.models.loader import load_model

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="the CPU kernels are not built here")


def _plan(model_dir: Path, cache: Path) -> CPUPlan:
    model = load_model(str(model_dir), torch.float32).model
    return CPUPlan(model, CPUOptions(panel_cache_dir=str(cache)))


def _panels(plan: CPUPlan) -> list[torch.Tensor]:
    fused = plan.fused
    assert fused is not None
    return [p.data for layer in fused.panels for p in layer] + ([fused.head.data] if fused.head else [])


def test_panels_are_packed_once_then_mapped_from_the_cache(tiny_model_dir: Any, tmp_path: Path) -> None:
    model_dir = tiny_model_dir("llama")
    first = _plan(model_dir, tmp_path)
    assert first.fused is not None and first.fused.panels and not first.fused.mapped
    assert len(list((tmp_path / "cpu-panels").glob("*.bin"))) == 1
    second = _plan(model_dir, tmp_path)
    assert second.fused is not None and second.fused.mapped  # nothing packed at this start
    for packed, mapped in zip(_panels(first), _panels(second), strict=True):
        assert torch.equal(packed, mapped)
    # Both plans serve the same logits through their panels.
    hidden = torch.randn(3, first.model.config.hidden_size)
    torch.testing.assert_close(first.logits(hidden), second.logits(hidden), rtol=0, atol=0)


def test_a_changed_checkpoint_or_a_damaged_index_packs_again(tiny_model_dir: Any, tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), model_dir)
    cache = tmp_path / "cache"
    _plan(model_dir, cache)
    weights = next(model_dir.glob("*.safetensors"))
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the checkpoint was rewritten
    again = _plan(model_dir, cache)
    assert again.fused is not None and not again.fused.mapped
    assert len(list((cache / "cpu-panels").glob("*.bin"))) == 2
    for index in (cache / "cpu-panels").glob("*.json"):
        index.write_text('{"numels": [1], "offsets": [0], "size": 4}')
    damaged = _plan(model_dir, cache)
    assert damaged.fused is not None and not damaged.fused.mapped  # packed, not read from a bad file
    assert _plan(model_dir, cache).fused.mapped  # the store that followed repaired it
