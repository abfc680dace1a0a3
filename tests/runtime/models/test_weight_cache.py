"""A CPU model's weights kept as served (models/weight_cache.py): built and written once, mapped after."""

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from test_loader_copies import NewBytes

from plimsoll.runtime.models.loader import load_model
from plimsoll.runtime.models.weight_cache import WeightCache


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach() for n, t in model.state_dict().items()}


def _files(cache: Path) -> list[Path]:
    return sorted((cache / "cpu-weights").glob("*.bin"))


def test_weights_are_built_once_then_mapped_without_a_copy(tiny_model_dir: Any, tmp_path: Path) -> None:
    model_dir = tiny_model_dir("llama")
    plain = load_model(str(model_dir), torch.float32).model
    built = load_model(str(model_dir), torch.float32, weight_cache=WeightCache(tmp_path)).model
    assert not built.weights_mapped and len(_files(tmp_path)) == 1
    with NewBytes() as counted:
        mapped = load_model(str(model_dir), torch.float32, weight_cache=WeightCache(tmp_path)).model
    assert mapped.weights_mapped
    weight_bytes = sum(t.nbytes for t in mapped.state_dict().values())
    assert counted.bytes < 0.01 * weight_bytes  # no fuse, no realignment copy: the file's pages
    assert _state(mapped).keys() == _state(plain).keys()
    for name, t in _state(mapped).items():
        assert torch.equal(t, _state(plain)[name]) and t.dtype == _state(plain)[name].dtype, name
        assert t.data_ptr() % 64 == 0, name
    assert mapped.checkpoint_fingerprint == plain.checkpoint_fingerprint  # the panel cache's key too
    torch.testing.assert_close(
        mapped.model.rotary_emb.inv_freq, plain.model.rotary_emb.inv_freq, rtol=0, atol=0
    )
    assert mapped.model.rotary_emb.inv_freq.dtype == torch.float32
    hidden = torch.randn(3, mapped.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(
            mapped.compute_logits(hidden), plain.compute_logits(hidden), rtol=0, atol=0
        )


def test_tied_embeddings_stay_one_tensor(tiny_model_dir: Any, tmp_path: Path) -> None:
    model_dir = tmp_path / "tied"
    shutil.copytree(tiny_model_dir("llama"), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (model_dir / "config.json").write_text(json.dumps(config))
    load_model(str(model_dir), torch.float32, weight_cache=WeightCache(tmp_path / "c"))
    mapped = load_model(str(model_dir), torch.float32, weight_cache=WeightCache(tmp_path / "c")).model
    assert mapped.weights_mapped and mapped.tie_word_embeddings


def test_a_rewritten_checkpoint_or_a_foreign_index_loads_the_checkpoint(
    tiny_model_dir: Any, tmp_path: Path
) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), model_dir)
    cache = WeightCache(tmp_path / "cache")
    load_model(str(model_dir), torch.float32, weight_cache=cache)
    weights = next(model_dir.glob("*.safetensors"))
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the checkpoint was rewritten
    stale = load_model(str(model_dir), torch.float32, weight_cache=cache).model
    assert not stale.weights_mapped  # built from the checkpoint...
    assert len(_files(tmp_path / "cache")) == 2  # ...and kept under its new key
    assert load_model(str(model_dir), torch.float32, weight_cache=cache).model.weights_mapped
    # An index that names other shapes (another model's file under this key) is not used...
    for index in (tmp_path / "cache" / "cpu-weights").glob("*.json"):
        meta = json.loads(index.read_text())
        meta["tensors"][0][1] = [1, *meta["tensors"][0][1]]
        index.write_text(json.dumps(meta))
    assert not load_model(str(model_dir), torch.float32, weight_cache=cache).model.weights_mapped
    assert load_model(str(model_dir), torch.float32, weight_cache=cache).model.weights_mapped  # rewritten
    # ...nor one written for another checkpoint.
    for index in (tmp_path / "cache" / "cpu-weights").glob("*.json"):
        meta = json.loads(index.read_text())
        meta["model"] = "another"
        index.write_text(json.dumps(meta))
    assert not load_model(str(model_dir), torch.float32, weight_cache=cache).model.weights_mapped


def test_only_plain_cpu_weights_are_kept(tiny_model_dir: Any, tmp_path: Path) -> None:
    model_dir = tiny_model_dir("llama")
    cache = WeightCache(tmp_path)
    load_model(str(model_dir), torch.float32, quantization="int8", weight_cache=cache)
    assert _files(tmp_path) == []
    load_model(str(model_dir), torch.bfloat16, weight_cache=cache)  # another dtype: its own file
    bf16 = load_model(str(model_dir), torch.bfloat16, weight_cache=cache).model
    assert bf16.weights_mapped and all(t.dtype == torch.bfloat16 for t in bf16.state_dict().values())
    assert not load_model(str(model_dir), torch.float32, weight_cache=cache).model.weights_mapped
