"""Loopback pod networks: one 127.N.0.0/16 per local control plane, claimed so two never share one.

Every control plane on a machine hands out pod IPs from kwok's ``--cidr``. With
the pod runner, a pod's processes bind to that IP, so two control planes with the
same range (two test sessions, a test and `plimsoll dev up`) can give two pods the
same IP: one pod's readiness probe then answers from the other cluster's server,
and its own process cannot bind. A claim file per range, under a lock, keeps
them apart: the preferred range if it is free, else the first free one.

A claim is held while its owner's control plane runs (any process recorded in
the owner's state file alive) or while the process that made it runs (the
window before the first component starts); otherwise it is stale and reused.
What it is not: an IP allocator for pods (kwok does that inside the range).
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
from collections.abc import Iterator
from pathlib import Path

from plimsoll.devcluster import paths
from plimsoll.devcluster.process import ProcessRecord, start_ticks

# 127.2/16 holds Service IPs, 127.3/16 is what the demo test asks for; fall back past both.
FALLBACK_SECOND_OCTETS = range(10, 250)


def claims_dir() -> Path:
    return Path(paths.cache_root()) / "podnets"


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / ".lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _claim_path(folder: Path, cidr: str) -> Path:
    return folder / (cidr.replace("/", "_") + ".claim")


def _is_live(claim: dict[str, object], state_file: Path) -> bool:
    owner = Path(str(claim.get("state_file", "")))
    if owner == state_file:
        return False  # our own leftover (a cluster in this state dir that was not stopped cleanly)
    pid, ticks = int(str(claim.get("pid", 0))), int(str(claim.get("start_ticks", 0)))
    if pid and start_ticks(pid) == ticks:
        return True
    try:
        state = json.loads(owner.read_text())
    except (OSError, ValueError):
        return False
    return any(ProcessRecord.from_json(r).is_alive() for r in state.get("processes", []))


def claim_pod_cidr(state_file: Path, preferred: str, folder: Path | None = None) -> str:
    """Claim ``preferred`` (a 127.x range), or the first free /16, for the cluster whose state file
    (its recorded PIDs) is ``state_file``."""
    network = ipaddress.ip_network(preferred)
    if not isinstance(network, ipaddress.IPv4Network) or not network.subnet_of(
        ipaddress.IPv4Network("127.0.0.0/8")
    ):
        raise ValueError(f"pod CIDR {preferred} is outside 127.0.0.0/8; pods must get loopback IPs")
    folder = folder or claims_dir()
    candidates = [preferred] + [
        f"127.{n}.0.0/16" for n in FALLBACK_SECOND_OCTETS if f"127.{n}.0.0/16" != preferred
    ]
    me = {"state_file": str(state_file), "pid": os.getpid(), "start_ticks": start_ticks(os.getpid()) or 0}
    with _locked(folder):
        for cidr in candidates:
            path = _claim_path(folder, cidr)
            try:
                claim = json.loads(path.read_text())
            except FileNotFoundError:
                claim = None
            except (OSError, ValueError):
                claim = {}  # unreadable: treat as stale
            if claim is None or not _is_live(claim, state_file):
                path.write_text(json.dumps({"cidr": cidr, **me}))
                return cidr
    raise RuntimeError(
        f"every loopback pod range is claimed by a running control plane (claims in {folder}); "
        "stop one with `plimsoll dev down`"
    )


def release_pod_cidr(state_file: Path, cidr: str, folder: Path | None = None) -> None:
    """Drop the claim on ``cidr`` if the cluster with ``state_file`` holds it."""
    folder = folder or claims_dir()
    if not folder.is_dir():
        return
    with _locked(folder):
        path = _claim_path(folder, cidr)
        try:
            claim = json.loads(path.read_text())
        except (OSError, ValueError):
            return
        if Path(str(claim.get("state_file", ""))) == state_file:
            path.unlink(missing_ok=True)
