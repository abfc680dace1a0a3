"""What this host's memory moves per second: the floor under a decode step.

What it is: :func:`bandwidth_gbs`, the read + write rate of a large tensor copy on
the intra-op threads (the best of a few), and :func:`floor_ms`, the time to read a
model's weights once at that rate — a decode step at batch 1 cannot be faster. The
benchmarks print both beside the TPOT they measure. What it is not: a STREAM
benchmark (one kernel, no triad), or a figure for a GPU.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch


def bandwidth_gbs(size_bytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Read+write GB/s of copying ``size_bytes`` with torch's intra-op threads (best of ``repeats``)."""
    src = torch.ones(size_bytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * size_bytes / best / 1e9


def weight_file_bytes(model_dir: Path) -> int:
    """Bytes of a Hugging Face directory's weight files (``*.safetensors``, else ``*.bin``)."""
    files = sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("*.bin"))
    return sum(f.stat().st_size for f in files)


def floor_ms(weight_bytes: int, gbs: float) -> float:
    """Milliseconds to read ``weight_bytes`` once at ``gbs``."""
    return weight_bytes / (gbs * 1e9) * 1e3
