"""A CPU model's weights as serving holds them, kept on disk so a restart maps them instead of building them.

What it is: :class:`WeightCache`, a directory (``<compilation cache_dir>/cpu-weights``, beside
the packed panels of ``panel_cache.py``; mount a node-local volume there) of one file per
checkpoint: every tensor of the model's state after loading (q/k/v and gate/up already fused,
cast to the serving dtype), each at a page-aligned offset (so the loader's realignment has
nothing to copy), with a JSON index naming them. A start that finds its file maps it private
(copy-on-write, never written back) and assigns the tensors to the model: no safetensors read,
no ``torch.cat``, no copy; pages are read from the page cache where a step first touches them
(with the panels mapped too, most projections' plain rows are never touched), and replicas on
one node share them. A start that does not builds the model from the checkpoint as before and
writes the file (temporary names renamed into place: a reader never sees half of one); a
server's engine writes it after Ready, as the first piece of its deferred warm-up
(``load_model(defer_store=True)``), so a fresh pod's first answer does not wait for it.

The key, and a check of the index on every hit, is the checkpoint's fingerprint
(``loader.checkpoint_fingerprint``: its directory, the names, sizes and modification times of
its weight files, the dtype): a rewritten checkpoint never maps a stale file, it builds and
writes a new one; an index whose names, shapes or dtypes differ from the model built from the
config is not used either.

What it is not: used for a GGUF file, tensor parallelism, quantized or FP8 weights or an
accelerator (those load from the checkpoint each time), or a cleaner (old files stay until the
volume is emptied).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch

from plimsoll.runtime.models import mapped_file

log = logging.getLogger(__name__)

FORMAT = 1


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a dtype: {name!r}")
    return dtype


class WeightCache:
    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory) / "cpu-weights"

    @staticmethod
    def key(fingerprint: str) -> str:
        text = json.dumps({"format": FORMAT, "model": fingerprint})
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def load(self, fingerprint: str, expected: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor] | None:
        """The state of the model ``fingerprint`` names, mapped from disk, or ``None`` (no file, or one
        that is not this checkpoint's or whose names and shapes are not ``expected``). Tied weights
        (two names of one tensor) come back as one tensor under both names."""
        key = self.key(fingerprint)
        mapped = mapped_file.map_region(self.directory, key, populate=False)
        if mapped is None:
            return None
        region, meta = mapped
        try:
            if meta.get("format") != FORMAT or meta.get("model") != fingerprint:
                raise ValueError("written for another checkpoint")
            state: dict[str, torch.Tensor] = {}
            entries = meta["tensors"]
            for (names, shape, dtype), numel, offset in zip(
                entries, meta["numels"], meta["offsets"], strict=True
            ):
                t = torch.frombuffer(region, dtype=_dtype(dtype), count=numel, offset=offset).view(shape)
                for name in names:
                    state[name] = t
            if {n: tuple(t.shape) for n, t in state.items()} != expected:
                raise ValueError("names or shapes differ from the model's")
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            log.warning("weight cache %s not used (%s); loading the checkpoint", self.directory / key, exc)
            return None
        return state

    def store(self, fingerprint: str, model: torch.nn.Module) -> Path | None:
        """Write ``model``'s state (CPU tensors) under ``fingerprint``; the file, or ``None`` when the
        directory cannot be written."""
        groups: dict[int, tuple[list[str], torch.Tensor]] = {}  # one entry per tensor: tied names share it
        for name, t in model.state_dict(keep_vars=True).items():
            ident = t.data_ptr() if t.numel() else id(t)
            groups.setdefault(ident, ([], t.detach()))[0].append(name)
        entries = [(names, list(t.shape), str(t.dtype)) for names, t in groups.values()]
        tensors = [t.contiguous() for _, t in groups.values()]
        fields = {"format": FORMAT, "model": fingerprint, "tensors": entries}
        return mapped_file.write(self.directory, self.key(fingerprint), tensors, fields)


__all__ = ["WeightCache"]
