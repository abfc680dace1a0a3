"""Loaded weights start on 64-byte boundaries (models/loader.py ``realign_weights``).

safetensors packs tensors 8-byte aligned after its header; kept as loaded, most weights
start mid cache line and every vector load of them straddles two lines (16-row decode
steps ran 1.27x slower on an AMD EPYC host, benchmarks/results/2026-12-04-cpu-weights-aligned.md).
"""

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from plimsoll.runtime.models.llama import fuse_hf_state_dict
from plimsoll.runtime.models.loader import WEIGHT_ALIGNMENT, load_model, realign_weights


def test_every_loaded_weight_is_aligned_and_unchanged(tiny_model_dir: Any) -> None:
    directory: Path = tiny_model_dir("llama")
    raw = {}
    for f in sorted(directory.glob("*.safetensors")):
        raw.update(load_file(str(f)))
    assert any(t.data_ptr() % WEIGHT_ALIGNMENT for t in raw.values())  # the file's own layout is not
    net = load_model(str(directory), torch.float32).model
    for name, t in [*net.named_parameters(), *net.named_buffers()]:
        assert t.data_ptr() % WEIGHT_ALIGNMENT == 0, name
    want = fuse_hf_state_dict(raw)
    for name, t in net.named_parameters():
        torch.testing.assert_close(t, want[name].float(), rtol=0, atol=0, msg=name)


def test_realign_keeps_shared_weights_shared_and_copies_views() -> None:
    buf = torch.arange(64 * 3 + 10, dtype=torch.float32)
    a = torch.nn.Linear(8, 8, bias=False)
    b = torch.nn.Linear(8, 8, bias=False)
    shared = torch.nn.Parameter(buf[10 : 10 + 64].view(8, 8))  # offset 40 bytes: misaligned
    a.weight = shared
    b.weight = shared
    c = torch.nn.Linear(8, 8, bias=False)
    c.weight = torch.nn.Parameter(buf[16 : 16 + 64].view(8, 8))  # aligned, but a view of buf
    net = torch.nn.Sequential(a, b, c)
    assert realign_weights(net) == 2
    assert a.weight is b.weight and a.weight.data_ptr() % WEIGHT_ALIGNMENT == 0
    assert c.weight.untyped_storage().nbytes() == 64 * 4
    torch.testing.assert_close(a.weight, buf[10:74].view(8, 8), rtol=0, atol=0)
    torch.testing.assert_close(c.weight, buf[16:80].view(8, 8), rtol=0, atol=0)
