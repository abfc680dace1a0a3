"""Live progress of a bench command: where it is, how much is left, how long that will take.

What it is: :class:`Live`, the per-level callbacks a :class:`BenchSession` calls
(``start`` when a level or repeat begins, ``level`` when one is summarised). On a
terminal it draws a rich progress display: one bar for the whole run ("level 3/10")
with requests done of the total and a time-remaining estimate, one bar for the
current level. Off a terminal (CI, pipes) it prints one plain line per level start
and end, so logs stay readable. ``plan_line`` says up front how big the run is.
What it is not: measurement (loadgen.py) or the final table (report.py).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from plimsoll.bench.config import BenchConfig


def level_requests(cfg: BenchConfig, concurrency: int) -> int | None:
    """Requests one repeat of a closed-loop level sends (warm-up included); None in duration mode."""
    measured = cfg.measured_requests(concurrency)
    return None if measured is None else measured + cfg.warmup_for(concurrency)


def plan_line(cfg: BenchConfig, kind: str) -> str:
    """One line before load starts: levels, requests (or seconds) and how to stop early."""
    levels = cfg.levels
    n = len(levels) * cfg.repeats
    span = f"c={levels[0]}" if len(levels) == 1 else f"c={levels[0]}..{levels[-1]}"
    if cfg.duration_per_level_s is not None:
        size = f"{cfg.duration_per_level_s:g} s measured per level"
    else:
        total = sum(level_requests(cfg, c) or 0 for c in levels) * cfg.repeats
        size = f"{total} requests in all (warm-up included; --requests-per-level sets the count)"
    return f"bench {kind}: {n} level(s) {span}, {size}; Ctrl-C stops and writes a partial report"


class Live:
    """Progress per level: rich bars on a terminal, one line per level otherwise."""

    def __init__(self, cfg: BenchConfig | None = None, console: Console | None = None) -> None:
        self.cfg = cfg
        self.console = console or Console(stderr=True)
        self.tty = self.console.is_terminal and sys.stderr.isatty()
        self.progress: Progress | None = None
        self.overall: TaskID | None = None
        self.started = 0
        self.total_levels = len(cfg.levels) * cfg.repeats if cfg is not None else None

    @contextmanager
    def running(self) -> Iterator[Live]:
        if not self.tty:
            yield self
            return
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("requests"),
            TimeElapsedColumn(),
            TextColumn("left"),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        ) as progress:
            self.progress = progress
            self.overall = progress.add_task("all levels", total=self._total_requests())
            yield self

    def _total_requests(self) -> int | None:
        if self.cfg is None:
            return None
        counts = [level_requests(self.cfg, c) for c in self.cfg.levels]
        return None if None in counts else sum(c or 0 for c in counts) * self.cfg.repeats

    def _name(self, label: str, repeat: int) -> str:
        self.started += 1
        of = f"/{self.total_levels}" if self.total_levels and label.startswith("c=") else ""
        name = f"level {self.started}{of} {label}"
        return f"{name} (repeat {repeat + 1})" if repeat else name

    def start(self, label: str, repeat: int) -> Callable[[int, int], None]:
        name = self._name(label, repeat)
        concurrency = int(label[2:]) if label.startswith("c=") and label[2:].isdigit() else None
        total = level_requests(self.cfg, concurrency) if self.cfg and concurrency else None
        if self.progress is None:
            size = f" ({total} requests)" if total else ""
            self.console.print(f"{name}: running{size}", markup=False, highlight=False)
            return lambda done, failed: None
        progress, overall = self.progress, self.overall
        task = progress.add_task(name, total=total)
        seen = [0]

        def update(done: int, failed: int) -> None:
            failures = f", {failed} failed" if failed else ""
            progress.update(task, completed=done, description=f"{name}{failures}")
            if overall is not None:
                progress.advance(overall, done - seen[0])
            seen[0] = done

        return update

    def level(self, lv: dict[str, Any]) -> None:
        lat = lv["latency_ms"]
        ttft = lat["ttft"]["p95"] if lat["ttft"] else float("nan")
        tpot = lat["tpot"]["p50"] if lat["tpot"] else float("nan")
        flag = "" if lv["valid"] else "  INVALID: " + "; ".join(lv["invalid_reasons"])
        self.console.print(
            f"level c={lv['concurrency']} done: {lv['throughput']['output_tokens_per_s']:.1f} out tok/s, "
            f"TTFT p95 {ttft:.0f} ms, TPOT p50 {tpot:.1f} ms, errors {lv['requests']['failed']}{flag}",
            markup=False,
            highlight=False,
        )
