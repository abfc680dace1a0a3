"""Stop a child process started in its own session, and every process it started.

What it is: :func:`stop_group`, SIGTERM to the child's process group, SIGKILL to it after a grace
period: a server started with ``start_new_session=True`` takes its workers (tokeniser pools,
compile workers) down with it. Used by the benchmark scripts that start servers.

What it is not: the local control plane's process supervision (``devcluster/process.py``,
which also reaps stragglers of a group whose leader is gone).
"""

from __future__ import annotations

import os
import signal
import subprocess


def stop_group(proc: subprocess.Popen[bytes], grace_s: float = 60.0) -> None:
    """SIGTERM to ``proc``'s group, SIGKILL after ``grace_s``; returns once ``proc`` has exited."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
