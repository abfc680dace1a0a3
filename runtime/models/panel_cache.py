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

import hashlib
import json
import logging
from pathlib import Path

import torch

from plimsoll.runtime.models import mapped_file

log = logging.getLogger(__name__)

FORMAT = 1
ALIGN = mapped_file.ALIGN


class PanelCache:
    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory) / "cpu-panels"

    @staticmethod
    def key(fingerprint: str, shapes: list[tuple[int, ...]], cols: int) -> str:
        text = json.dumps({"format": FORMAT, "model": fingerprint, "shapes": shapes, "cols": cols})
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def load(self, key: str, numels: list[int]) -> list[torch.Tensor] | None:
        """The panels of ``key`` mapped from disk (float32, ``numels`` elements each), or ``None``."""
        # Populated now: one read-ahead of the whole file from the page cache instead of a fault
        # per page in the first steps' kernels (every panel is read by the first decode step).
        mapped = mapped_file.map_region(self.directory, key, populate=True)
        if mapped is None:
            return None
        region, meta = mapped
        if meta["numels"] != numels:
            log.warning(
                "packed panel cache %s does not match this model; packing again", self.directory / key
            )
            return None
        return [
            torch.frombuffer(region, dtype=torch.float32, count=n, offset=o)
            for n, o in zip(numels, meta["offsets"], strict=True)
        ]

    def store(self, key: str, panels: list[torch.Tensor]) -> Path | None:
        """Write ``panels`` under ``key``; the file, or ``None`` when the directory cannot be written."""
        return mapped_file.write(self.directory, key, panels, {"format": FORMAT})


__all__ = ["PanelCache"]
