"""Loopback pod ranges claimed per control plane, so two local clusters never hand out the same pod IP.

Found when two test sessions ran at once: a pod of one cluster got the IP of a
running replica of the other; its readiness probe answered from the other
cluster's server ("model `realscale` does not exist. Valid model names: routed").
"""

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from plimsoll.devcluster.podnet import claim_pod_cidr, release_pod_cidr
from plimsoll.devcluster.process import ProcessRecord, start_ticks

PREFERRED = "127.1.0.0/16"
FALLBACK = "127.10.0.0/16"


@pytest.fixture
def live_process() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _write_claim(folder: Path, cidr: str, state_file: Path, pid: int = 0, ticks: int = 0) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    claim = {"cidr": cidr, "state_file": str(state_file), "pid": pid, "start_ticks": ticks}
    (folder / (cidr.replace("/", "_") + ".claim")).write_text(json.dumps(claim))


def test_a_free_range_is_claimed_and_released_by_its_owner_only(tmp_path: Path) -> None:
    claims, mine, other = tmp_path / "claims", tmp_path / "a" / "state.json", tmp_path / "b" / "state.json"
    assert claim_pod_cidr(mine, PREFERRED, claims) == PREFERRED
    release_pod_cidr(other, PREFERRED, claims)  # not the owner: the claim stays
    assert (claims / "127.1.0.0_16.claim").exists()
    release_pod_cidr(mine, PREFERRED, claims)
    assert not (claims / "127.1.0.0_16.claim").exists()


def test_a_range_held_by_a_running_cluster_is_skipped(
    tmp_path: Path, live_process: subprocess.Popen[bytes]
) -> None:
    claims = tmp_path / "claims"
    # The other cluster runs: a process recorded in its state file is alive (its claimer is gone).
    other_state = tmp_path / "other" / "state.json"
    other_state.parent.mkdir()
    record = ProcessRecord("etcd", live_process.pid, start_ticks(live_process.pid) or 0, "log", ["etcd"])
    other_state.write_text(json.dumps({"processes": [record.to_json()]}))
    _write_claim(claims, PREFERRED, other_state, pid=999_999_999)
    assert claim_pod_cidr(tmp_path / "me" / "state.json", PREFERRED, claims) == FALLBACK
    # A claimer still starting (no state file yet, but its process alive) holds its range too.
    _write_claim(
        claims,
        FALLBACK,
        tmp_path / "starting" / "state.json",
        live_process.pid,
        start_ticks(live_process.pid) or 0,
    )
    assert claim_pod_cidr(tmp_path / "third" / "state.json", PREFERRED, claims) == "127.11.0.0/16"


def test_stale_and_own_claims_are_reused(tmp_path: Path) -> None:
    claims, mine = tmp_path / "claims", tmp_path / "me" / "state.json"
    _write_claim(claims, PREFERRED, tmp_path / "gone" / "state.json", pid=999_999_999)  # owner stopped
    assert claim_pod_cidr(mine, PREFERRED, claims) == PREFERRED
    # Our own leftover (a cluster in this state dir not stopped cleanly) is ours to take again.
    assert claim_pod_cidr(mine, PREFERRED, claims) == PREFERRED


def test_only_loopback_ranges(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"outside 127\.0\.0\.0/8"):
        claim_pod_cidr(tmp_path / "state.json", "10.244.0.0/16", tmp_path / "claims")
