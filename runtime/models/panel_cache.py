"""Packed CPU weight panels kept on disk, so a restart maps them instead of packing them again.

What it is: :class:`PanelCache`, a directory (``<compilation cache_dir>/cpu-panels``; mount a
volume there, as for the compile caches) of one file per checkpoint and kernel build: every
panel ``FusedDecode`` packs (``cpu_kernels.pack_f32``), each at a page-aligned offset, and a
JSON index beside it. A hit maps the file private (copy-on-write, never written) and populated
from the page cache in one call: nothing is packed at start, and replicas on one node share the
cached pages. A miss packs as before and writes the file (to a temporary
name, renamed into place, so a reader never sees half of one).

The key is the checkpoint's fingerprint (``loader.checkpoint_fingerprint``: its directory, the
names, sizes and modification times of its weight files, the dtype, the quantization, the
tensor-parallel rank) with the panels' shapes, the build's panel width and this file format's
version: a changed checkpoint or another build never reads a stale file.

What it is not: a cache of anything but float32 column panels (a bfloat16 model's oneDNN
layout is opaque to us and stays packed at load), or a cleaner (old files stay until the
volume is emptied).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import mmap
import os
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

FORMAT = 1
ALIGN = mmap.PAGESIZE


class PanelCache:
    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory) / "cpu-panels"

    @staticmethod
    def key(fingerprint: str, shapes: list[tuple[int, ...]], cols: int) -> str:
        text = json.dumps({"format": FORMAT, "model": fingerprint, "shapes": shapes, "cols": cols})
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def _paths(self, key: str) -> tuple[Path, Path]:
        return self.directory / f"{key}.bin", self.directory / f"{key}.json"

    def load(self, key: str, numels: list[int]) -> list[torch.Tensor] | None:
        """The panels of ``key`` mapped from disk (float32, ``numels`` elements each), or ``None``."""
        data, index = self._paths(key)
        try:
            meta = json.loads(index.read_text())
            offsets = [int(o) for o in meta["offsets"]]
            if [int(n) for n in meta["numels"]] != numels or data.stat().st_size != int(meta["size"]):
                log.warning("packed panel cache %s does not match this model; packing again", data)
                return None
            with open(data, "rb") as f:
                # Private (never written back), and populated now: one read-ahead of the whole file
                # from the page cache instead of a fault per page in the first steps' kernels.
                flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0)
                region = mmap.mmap(f.fileno(), 0, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return [
            torch.frombuffer(region, dtype=torch.float32, count=n, offset=o)
            for n, o in zip(numels, offsets, strict=True)
        ]

    def store(self, key: str, panels: list[torch.Tensor]) -> Path | None:
        """Write ``panels`` under ``key``; the file, or ``None`` when the directory cannot be written."""
        data, index = self._paths(key)
        offsets, position = [], 0
        for p in panels:
            position = -(-position // ALIGN) * ALIGN
            offsets.append(position)
            position += p.numel() * p.element_size()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    for p, offset in zip(panels, offsets, strict=True):
                        f.seek(offset)
                        # The panel's bytes where they lie (Tensor.numpy() would pin its storage's
                        # size: sleep level 2 frees a panel by resizing it).
                        nbytes = p.numel() * p.element_size()
                        f.write(memoryview((ctypes.c_char * nbytes).from_address(p.contiguous().data_ptr())))
                    f.truncate(position)
                meta = {
                    "format": FORMAT,
                    "numels": [p.numel() for p in panels],
                    "offsets": offsets,
                    "size": position,
                }
                index_tmp = f"{tmp}.json"
                Path(index_tmp).write_text(json.dumps(meta))
                os.replace(tmp, data)  # the data first: an index never names a missing or partial file
                os.replace(index_tmp, index)
            finally:
                for leftover in (tmp, f"{tmp}.json"):
                    if os.path.exists(leftover):
                        os.unlink(leftover)
        except OSError as exc:
            log.warning("could not keep the packed panels in %s: %s", self.directory, exc)
            return None
        return data


__all__ = ["PanelCache"]
