"""Tensors written to one file at page-aligned offsets with a JSON index, and mapped back.

What it is: :func:`write` (each tensor's bytes at a page-aligned offset of ``<stem>.bin``,
the offsets, element counts, total size and the caller's own fields in ``<stem>.json``;
both written to temporary names and renamed into place, data first, so a reader never
sees half of one) and :func:`map_region` (the index, checked against the data file's size,
and the file mapped private: copy-on-write, never written back; populated from the page
cache in one call when asked). The panel cache (``panel_cache.py``) and the weight cache
(``weight_cache.py``) keep their files this way.

What it is not: a key scheme or a check of what the tensors mean (the callers key the file
by the checkpoint's fingerprint and compare the index with what they expect).
"""

from __future__ import annotations

import ctypes
import json
import logging
import mmap
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

ALIGN = mmap.PAGESIZE


def paths(directory: Path, stem: str) -> tuple[Path, Path]:
    return directory / f"{stem}.bin", directory / f"{stem}.json"


def write(directory: Path, stem: str, tensors: list[torch.Tensor], fields: dict[str, Any]) -> Path | None:
    """Write ``tensors`` (contiguous, CPU) under ``stem``; the data file, or ``None`` when the
    directory cannot be written (logged: a cache that cannot be kept is not an error)."""
    data, index = paths(directory, stem)
    offsets, position = [], 0
    for t in tensors:
        position = -(-position // ALIGN) * ALIGN
        offsets.append(position)
        position += t.numel() * t.element_size()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                for t, offset in zip(tensors, offsets, strict=True):
                    f.seek(offset)
                    # The bytes where they lie (Tensor.numpy() would pin its storage's size: sleep
                    # level 2 frees a tensor by resizing its storage).
                    nbytes = t.numel() * t.element_size()
                    f.write(memoryview((ctypes.c_char * nbytes).from_address(t.contiguous().data_ptr())))
                f.truncate(position)
            meta = {**fields, "numels": [t.numel() for t in tensors], "offsets": offsets, "size": position}
            index_tmp = f"{tmp}.json"
            Path(index_tmp).write_text(json.dumps(meta))
            os.replace(tmp, data)  # the data first: an index never names a missing or partial file
            os.replace(index_tmp, index)
        finally:
            for leftover in (tmp, f"{tmp}.json"):
                if os.path.exists(leftover):
                    os.unlink(leftover)
    except OSError as exc:
        log.warning("could not keep %s in %s: %s", stem, directory, exc)
        return None
    return data


def map_region(directory: Path, stem: str, populate: bool) -> tuple[mmap.mmap, dict[str, Any]] | None:
    """The data file of ``stem`` mapped private and its index, or ``None`` when either is missing,
    unreadable or the sizes disagree. ``populate``: the whole file read ahead now, from the page
    cache, instead of a fault per page where it is first read."""
    data, index = paths(directory, stem)
    try:
        meta = json.loads(index.read_text())
        if not isinstance(meta, dict) or data.stat().st_size != int(meta["size"]):
            return None
        meta["offsets"] = [int(o) for o in meta["offsets"]]
        meta["numels"] = [int(n) for n in meta["numels"]]
        if len(meta["offsets"]) != len(meta["numels"]):
            return None
        with open(data, "rb") as f:
            flags = mmap.MAP_PRIVATE | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            region = mmap.mmap(f.fileno(), 0, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return region, meta


__all__ = ["ALIGN", "map_region", "paths", "write"]
