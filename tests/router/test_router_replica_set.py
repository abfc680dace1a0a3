"""The replica set's wait for a ready replica (what a request whose replica failed waits on)."""

from __future__ import annotations

import asyncio

from plimsoll.router.backends import ReplicaSet


async def test_wait_ready_returns_once_a_replica_not_excluded_is_ready() -> None:
    replica_set = ReplicaSet.static(["http://a", "http://b"])
    for replica in replica_set.replicas.values():
        replica.discovered_ready = True
    replica_set.replicas["http://a"].reachable = True  # ready, but the one that failed
    waiting = asyncio.create_task(replica_set.wait_ready({"http://a"}, timeout=60))
    await asyncio.sleep(0)
    replica_set.ready_changed()  # a scrape that changed nothing
    await asyncio.sleep(0)
    assert not waiting.done()
    replica_set.replicas["http://b"].reachable = True  # its probe answers (a restarted pod)
    replica_set.ready_changed()
    assert await waiting
    assert replica_set.on_ready == []  # the wait leaves no callback behind


async def test_wait_ready_gives_up_after_its_timeout() -> None:
    replica_set = ReplicaSet.static(["http://a"])
    assert not await replica_set.wait_ready(set(), timeout=0.01)
    assert await replica_set.wait_ready(set(), timeout=0) is False
    replica_set.replicas["http://a"].discovered_ready = True
    replica_set.replicas["http://a"].reachable = True
    assert await replica_set.wait_ready(set(), timeout=0)  # already there: no wait at all
