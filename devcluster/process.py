"""One background process of the control plane: started with its own log file and
session, recorded by PID (and start time, so a reused PID is never signalled), and
stopped with SIGTERM then SIGKILL.

A record can be re-created from the state file in another Python process, which is
how `plimsoll dev down` stops what `plimsoll dev up` started. It does not know what
the process is for; readiness checks live in ``cluster.py``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


class ComponentError(RuntimeError):
    """A control-plane component failed to build, start or become ready."""

    def __init__(self, component: str, problem: str, log: Path | None = None) -> None:
        self.component = component
        self.log = log
        where = f"; its log is {log}" if log is not None else ""
        tail = ""
        if log is not None and log.is_file():
            lines = log.read_text(errors="replace").splitlines()[-15:]
            tail = "\n  last log lines:\n    " + "\n    ".join(lines) if lines else ""
        super().__init__(f"{component}: {problem}{where}{tail}")


def start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (field 22 of /proc/<pid>/stat), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces; the fields after its ')' are fixed.
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[19])


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` in bytes (0 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass(slots=True)
class ProcessRecord:
    """What the state file keeps about one started process."""

    name: str
    pid: int
    start_ticks: int
    log: str
    argv: list[str]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ProcessRecord:
        return cls(
            name=str(data["name"]),
            pid=int(data["pid"]),
            start_ticks=int(data["start_ticks"]),
            log=str(data["log"]),
            argv=[str(a) for a in data["argv"]],
        )

    def is_alive(self) -> bool:
        """True while the recorded process (same PID *and* same start time) runs."""
        ticks = start_ticks(self.pid)
        if ticks != self.start_ticks:
            return False
        try:
            state = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return False
        return state != "Z"

    def stop(self, timeout: float = 10.0, popen: subprocess.Popen[bytes] | None = None) -> None:
        """SIGTERM the process group, wait up to ``timeout`` s, then SIGKILL it.

        Each process leads its own session, so the group holds it and anything it
        forked; only groups led by a recorded, still-matching PID are signalled.
        """
        if not self.is_alive():
            _reap(popen)
            return
        _signal_group(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            _reap(popen)
            if not self.is_alive():
                break
            time.sleep(0.05)
        if self.is_alive():
            _signal_group(self.pid, signal.SIGKILL)
            for _ in range(100):
                _reap(popen)
                if not self.is_alive():
                    break
                time.sleep(0.05)
        # Stragglers of the group (children that outlived the leader) get SIGKILL too.
        _signal_group(self.pid, signal.SIGKILL)
        _reap(popen)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _reap(popen: subprocess.Popen[bytes] | None) -> None:
    if popen is not None:
        popen.poll()


def start_process(
    name: str,
    argv: Sequence[str | os.PathLike[str]],
    log: Path,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> tuple[ProcessRecord, subprocess.Popen[bytes]]:
    """Start ``argv`` in its own session with stdout and stderr appended to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    args = [os.fspath(a) for a in argv]
    with log.open("ab") as out:
        out.write(f"\n==== {time.strftime('%H:%M:%S')} starting: {' '.join(args)}\n".encode())
        out.flush()
        try:
            popen = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=dict(env) if env is not None else None,
                cwd=cwd,
                start_new_session=True,
            )
        except OSError as exc:
            raise ComponentError(name, f"could not start {args[0]}: {exc}", log) from exc
    ticks = start_ticks(popen.pid)
    if ticks is None:  # exited before we could look
        popen.wait()
        raise ComponentError(name, f"exited at once with status {popen.returncode}", log)
    return ProcessRecord(name, popen.pid, ticks, str(log), args), popen
