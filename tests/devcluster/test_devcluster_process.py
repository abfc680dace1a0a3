"""Process records: stop() ends the whole process group, and never signals a reused PID."""

import subprocess
import time
from pathlib import Path

import pytest

from plimsoll.devcluster.cluster import Cluster
from plimsoll.devcluster.process import ComponentError, ProcessRecord, start_process


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_stop_ends_the_process_and_the_children_it_forked(tmp_path: Path) -> None:
    # A shell that forks a grandchild which ignores SIGTERM: both must be gone after stop().
    script = f"trap '' TERM; sleep 300 & echo $! > {tmp_path}/child; wait"
    record, popen = start_process("sh", ["sh", "-c", script], tmp_path / "sh.log")
    deadline = time.monotonic() + 10
    while not (tmp_path / "child").exists() or not (tmp_path / "child").read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = int((tmp_path / "child").read_text())
    assert record.is_alive() and _alive(child)
    record.stop(timeout=1.0, popen=popen)
    assert not record.is_alive()
    for _ in range(40):
        if not _alive(child):
            break
        time.sleep(0.05)
    assert not _alive(child)


def test_a_record_whose_pid_was_reused_is_not_alive_and_not_signalled(tmp_path: Path) -> None:
    sleeper = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        stale = ProcessRecord("old", sleeper.pid, start_ticks=1, log=str(tmp_path / "x.log"), argv=["old"])
        assert not stale.is_alive()
        stale.stop(timeout=0.1)
        assert sleeper.poll() is None, "a PID with another start time must not be signalled"
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_component_that_exits_while_starting_is_named_with_its_log(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path / "plane")
    cluster.log_dir.mkdir(parents=True)
    cluster.ports = {"apiserver": 1}
    cluster._spawn("etcd", ["sh", "-c", "echo 'bad flag --nope' >&2; exit 3"])
    with pytest.raises(ComponentError) as err:
        cluster._wait("etcd", cluster._deadline(), lambda: False)
    message = str(err.value)
    assert message.startswith("etcd: exited with status 3")
    assert str(tmp_path / "plane" / "logs" / "etcd.log") in message
    assert "bad flag --nope" in message
    cluster.stop()
