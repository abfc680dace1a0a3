"""``stop_group``: the child and what it started go down; one that ignores SIGTERM is killed after the grace."""

import os
import subprocess
import sys
import time

from plimsoll.process_group import stop_group

PARENT = """
import subprocess, sys, time, signal
if sys.argv[1] == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(child.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is gone for our purpose
        return stat.read().rsplit(")", 1)[1].split()[0] != "Z"


def _start(kind: str) -> tuple[subprocess.Popen[bytes], int]:
    proc = subprocess.Popen(
        [sys.executable, "-c", PARENT, kind], stdout=subprocess.PIPE, start_new_session=True
    )
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def test_the_group_goes_down_and_a_stubborn_leader_is_killed() -> None:
    proc, child = _start("polite")
    stop_group(proc, grace_s=30)
    assert proc.returncode == -15
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)

    stubborn, _ = _start("stubborn")
    stop_group(stubborn, grace_s=0.5)
    assert stubborn.returncode == -9
    stop_group(stubborn)  # already gone: nothing to do
