"""The CPU KV cache's memory: anonymous pages, given back to the kernel on sleep without moving.

What it is: :func:`allocate` (one tensor on its own private anonymous ``mmap``: page-aligned,
zero-filled and made resident by the kernel at once, ``MAP_POPULATE``, so the cache's memory
is taken at start as the operator sized it, without a ``memset`` pass), :func:`release`
(``madvise(MADV_DONTNEED)`` over the tensor's pages: they leave the process at once and read
back as zeros, while the tensor keeps its address, shape and identity), :func:`populate`
(take them back, zeroed, before serving again: ``MADV_POPULATE_WRITE``, or a write of zeros
on kernels before 5.14) and :func:`resident_bytes` (``mincore``: how many of those bytes are
mapped now; the engine exports it as ``plimsoll_kv_cache_resident_bytes``). Sleep level 1 on
a CPU replica is :func:`release` of every KV tensor and waking :func:`populate`: nothing that
holds the cache (the attention backend, the fused step's address table, the KV tiers) sees
it change.

What it is not: an allocator for anything else (activations stay on glibc's heap, see
``kernels/host_memory.py``) or used on an accelerator (there the storages are resized, see
``engine/sleep_mode.py``). Where ``madvise``/``mincore`` cannot be called (not Linux),
:func:`supported` is false and the cache is plain ``torch.zeros``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap
from collections.abc import Iterable
from typing import Any

import torch

PAGE = mmap.PAGESIZE
MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)
MADV_POPULATE_WRITE = 23  # Linux 5.14 (<linux/mman.h>); older kernels answer EINVAL


def _libc() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()


def supported() -> bool:
    """Whether CPU KV tensors can be given back in place (Linux: ``madvise`` and ``mincore``)."""
    return _LIBC is not None and hasattr(mmap, "MADV_DONTNEED")


def allocate(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor on anonymous pages of its own (``torch.zeros`` where not :func:`supported`)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if not supported() or nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # Private: MADV_DONTNEED frees a private mapping's pages (a shared one's stay in shmem).
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    region = mmap.mmap(-1, nbytes, flags=flags)  # the tensor keeps it mapped
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)


def _pages(t: torch.Tensor) -> tuple[int, int]:
    """The start and length of the whole pages inside ``t``'s storage (its edge pages may be shared)."""
    storage = t.untyped_storage()
    start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    first = -(-start // PAGE) * PAGE
    last = end // PAGE * PAGE
    return first, max(0, last - first)


def release(t: torch.Tensor) -> int:
    """Give ``t``'s pages back to the kernel (they read as zeros afterwards); the bytes released."""
    if not supported() or t.device.type != "cpu":
        return 0
    start, length = _pages(t)
    if length and _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), MADV_DONTNEED) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) failed on the KV cache")
    return length


def populate(t: torch.Tensor) -> None:
    """Make ``t``'s released pages resident again (zeroed), so serving does not fault them in
    one by one and the memory is the process's before a request needs it."""
    if not supported() or t.device.type != "cpu":
        return
    start, length = _pages(t)
    if length and _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), MADV_POPULATE_WRITE) != 0:
        t.view(torch.uint8).view(-1)[: t.nbytes].zero_()  # an older kernel: the writes fault them in


def resident_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of these CPU tensors' whole pages that are in memory now (``mincore``); an
    accelerator's tensors count their storage's size. Where not :func:`supported`, the sizes."""
    total = 0
    for t in tensors:
        if t.device.type != "cpu" or not supported():
            total += t.untyped_storage().nbytes()
            continue
        start, length = _pages(t)
        if not length:
            continue
        pages = length // PAGE
        vec = (ctypes.c_ubyte * pages)()
        if _LIBC.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed on the KV cache")
        # One byte a page, its low bit "resident" (the others are reserved and 0): counted in C,
        # since a scrape of a many-GiB cache reads millions of them.
        total += (pages - bytes(vec).count(0)) * PAGE
    return total


__all__ = ["PAGE", "allocate", "populate", "release", "resident_bytes", "supported"]
