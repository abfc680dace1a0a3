"""Keep freed activation memory in the process, so a step's buffers are not faulted in afresh.

What it is: :func:`keep_freed_memory`, called once per engine process. glibc's malloc
serves a request above its mmap threshold (128 KiB at start, raised only as far as the
largest block freed so far) with a fresh ``mmap`` and gives it back on ``free``; every
first touch of such memory is a page fault and a page the kernel zeroes. A prefill step
of 2,048 tokens allocates and frees hundreds of multi-MiB tensors (matmul outputs of 12
to 25 MiB, their 256-row chunks), so on CPU a third of its time went to ``aten::copy_``
into fresh pages (``benchmarks/step_profile.py``; the figures are in benchmarks/results/2026-12-03-cpu-larger-steps.md).
Raising the mmap threshold to glibc's largest (32 MiB) and the trim threshold above the
largest step's working set keeps those blocks on the heap for the next step, as vLLM's
CPU images get from preloading TCMalloc. The engine calls it unless its config says not to
(``EngineConfig.keep_freed_memory``; ``plimsoll serve`` says not to where ``MALLOC_*`` or
``GLIBC_TUNABLES`` malloc settings are in its environment), and it stays off where another
allocator (TCMalloc, jemalloc, mimalloc) is loaded into the process.

What it is not: a memory pool or a cap. Resident memory stays near the largest step's
peak instead of falling back between steps (``benchmarks/rss_growth.py`` checks it does
not grow).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

log = logging.getLogger(__name__)

# mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's maximum on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 512 * 2**20

_applied: bool | None = None


ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")


def _why_not(maps: str | None = None) -> str | None:
    """Why the thresholds must stay as they are (``maps``: ``/proc/self/maps``'s text, read if not given)."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return None
    loaded = sorted({name for name in ALLOCATORS if f"lib{name}" in maps})
    return f"another allocator is loaded ({', '.join(loaded)})" if loaded else None


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds (once per process); ``True`` when they were set."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    reason = _why_not()
    if reason is not None:
        log.info("malloc thresholds left as they are: %s", reason)
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018  # glibc only: musl and others have no such thresholds
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    return _applied
