"""The KV block index and the precise scorer: events in, longest tier-weighted runs out."""

from __future__ import annotations

from plimsoll.router.kv_events import KVEventSubscriber
from plimsoll.router.kv_index import KVBlockIndex
from plimsoll.runtime.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, encode_batch


def test_longest_run_weighted_by_tier() -> None:
    index = KVBlockIndex(max_replicas=8)
    index.stored("a", [1, 2, 3, 4], "GPU")
    index.stored("b", [1, 2], "GPU")
    index.stored("b", [3, 4, 5], "CPU")
    index.stored("c", [2, 3], "GPU")  # not a prefix: block 1 missing
    s = index.score(["a", "b", "c", "d"], [1, 2, 3, 4, 5, 6])
    assert (s["a"].blocks, s["b"].blocks, s["c"].blocks) == (4, 5, 0)
    assert s["a"].weighted == 4.0 and abs(s["b"].weighted - (2 + 3 * 0.8)) < 1e-9
    assert "d" not in s  # never seen: holds nothing
    # The shared tier extends every replica's run (any replica can load it).
    index.stored("x", [1, 2, 3, 4, 5, 6], "SHARED")
    s = index.score(["a", "b", "c"], [1, 2, 3, 4, 5, 6])
    assert [s[r].blocks for r in "abc"] == [6, 6, 6]
    assert abs(s["a"].weighted - (4 + 2 * 0.5)) < 1e-9 and abs(s["c"].weighted - (0.5 + 2 + 3 * 0.5)) < 1e-9


def test_removed_and_cleared() -> None:
    index = KVBlockIndex(max_replicas=2)
    index.stored("a", [1, 2, 3], "GPU")
    index.removed("a", [2], "GPU")
    assert index.score(["a"], [1, 2, 3])["a"].blocks == 1
    index.stored("b", [1], "GPU")
    index.clear("a")
    assert "a" not in index.score(["a", "b"], [1])
    index.stored("c", [1], "GPU")  # reuses a's slot after compaction: a's old bits must be gone
    assert index.score(["c"], [1, 2, 3])["c"].blocks == 1 and len(index) == 1


def test_subscriber_resyncs_on_gaps_and_restarts() -> None:
    index = KVBlockIndex()
    sub = KVEventSubscriber(index, stale_after_s=1.0)
    sub.watch("a", "tcp://127.0.0.1:1")

    def send(seq: int, *events: object) -> None:
        sub.handle("a", seq, encode_batch(EventBatch(0.0, list(events))), now=float(seq))  # type: ignore[arg-type]

    send(0, BlockStored([1, 2], None, [0] * 32, 16, None, "GPU"))
    send(1, BlockStored([3], 2, [0] * 16, 16, None, "GPU"))
    assert index.score(["a"], [1, 2, 3])["a"].blocks == 3 and sub.block_size == 16
    send(5, BlockStored([9], None, [0] * 16, 16, None, "GPU"))  # seq 2..4 lost: cleared, then rebuilt
    assert sub.feeds["a"].gaps == 1 and index.score(["a"], [1])["a"].blocks == 0
    send(0, AllBlocksCleared())  # a restart starts again at 0
    assert sub.feeds["a"].restarts == 1
    send(1, BlockRemoved([9], "GPU"))
    index.compact()  # the cleared slots' bits are garbage until a compaction drops them
    assert len(index) == 0


def test_staleness_only_after_routed_work_goes_unanswered() -> None:
    sub = KVEventSubscriber(KVBlockIndex(), stale_after_s=2.0)
    sub.watch("a", "tcp://127.0.0.1:1")
    assert sub.is_fresh("a", now=100.0)  # idle and silent: fresh
    sub.note_routed("a", now=100.0)
    assert sub.is_fresh("a", now=101.0)
    assert not sub.is_fresh("a", now=103.0)  # routed at 100, still nothing at 103
    sub.handle(
        "a", 0, encode_batch(EventBatch(0.0, [BlockStored([1], None, [0], 1, None, "GPU")])), now=103.5
    )
    assert sub.is_fresh("a", now=104.0)
    assert not sub.is_fresh("unknown")


def test_a_restart_whose_first_batches_were_missed_still_clears_the_old_entries() -> None:
    """Each publisher numbers from its start in microseconds: a restarted replica's first batch
    that the router sees is far past the old process's last, never its exact successor."""
    index = KVBlockIndex()
    sub = KVEventSubscriber(index)
    sub.watch("a", "tcp://127.0.0.1:1")

    def send(seq: int, now: float, block: int) -> None:
        sub.handle("a", seq, encode_batch(EventBatch(0.0, [BlockStored([block], None, [0] * 16, 16, None, "GPU")])),
                   now=now)  # fmt: skip

    old = 1_733_000_000_000_000
    send(old, 0.0, 7)
    assert index.score(["a"], [7])["a"].blocks == 1
    send(old + 3_600_000_000, 1.0, 9)  # the new process, started an hour later
    assert sub.feeds["a"].restarts == 1 and sub.feeds["a"].gaps == 0
    assert "a" not in index.score(["a"], [7]) or index.score(["a"], [7])["a"].blocks == 0
    assert index.score(["a"], [9])["a"].blocks == 1
