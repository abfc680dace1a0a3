"""How long this replica took to start, phase by phase: imports, weights, KV cache, warm-up, ready.

What it is: :data:`STARTUP`, the process's one :class:`StartupTimeline`. The
places that finish a phase call :meth:`StartupTimeline.mark` (the serve command
after its heavy imports, the engine after loading weights and allocating the KV
cache, after warm-up, the server once it answers ``/ready``); the server exports
the marks as ``plimsoll_startup_phase_seconds{phase}`` (seconds from process
start to the end of the phase, beside ``process_start_time_seconds``) and in the
``/ready`` body, where the operator's scale-up timeline reads them.

What it is not: a profiler. Each mark is one wall-clock reading; phases are
cumulative (the gap between two marks is the phase in between). The timeline
is per process, so it is module state: a second engine built in the same
process (tests) marks its phases again, and the later marks win.
"""

from __future__ import annotations

import os
import threading
import time

# In start-up order; the metric's ``phase`` label takes these values.
PHASES = ("imports", "weights_loaded", "kv_cache_allocated", "warmup_done", "ready")


def process_start_time() -> float:
    """Unix time this process started (Linux ``/proc``), or now when that cannot be read."""
    try:
        with open("/proc/self/stat", "rb") as f:
            # Field 22 is the start time in clock ticks after boot; the command name (2) may hold spaces.
            fields = f.read().rsplit(b")", 1)[1].split()
        ticks = float(fields[19])
        with open("/proc/stat", "rb") as f:
            boot = next(float(line.split()[1]) for line in f if line.startswith(b"btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


class StartupTimeline:
    """Phase -> Unix time it ended, from one process start."""

    def __init__(self, started_at: float | None = None) -> None:
        self.started_at = started_at if started_at is not None else process_start_time()
        self._marks: dict[str, float] = {}
        self._lock = threading.Lock()  # the engine marks from its build thread

    def mark(self, phase: str, at: float | None = None) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown start-up phase {phase!r}; one of {', '.join(PHASES)}")
        with self._lock:
            self._marks[phase] = at if at is not None else time.time()

    def seconds(self) -> dict[str, float]:
        """Phase -> seconds from process start to its end, in start-up order, only phases reached."""
        with self._lock:
            marks = dict(self._marks)
        return {p: round(max(0.0, marks[p] - self.started_at), 3) for p in PHASES if p in marks}

    def last_phase(self) -> str | None:
        reached = self.seconds()
        return next(reversed(reached)) if reached else None

    def to_json(self) -> dict[str, object]:
        """For the ``/ready`` body: when the process started and how far in each phase ended."""
        return {"processStartTime": round(self.started_at, 3), "phaseSeconds": self.seconds()}


STARTUP = StartupTimeline()
