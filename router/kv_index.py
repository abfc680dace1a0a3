"""Which replica holds which KV block in which tier, built from the replicas' KV events, and the score.

What it is: :class:`KVBlockIndex`, a map from a block hash (vLLM's 64-bit integer form) to one
Python int whose bits say who holds it: bit ``tier * stride + slot`` is set when the replica in
``slot`` holds the block in ``tier`` (GPU = the primary cache, CPU, DISK), and bit
``SHARED * stride`` when the service's shared tier holds it (any replica can load it from
there). One int per block keeps 100 replicas × 100k blocks in one process; a replica that
clears its cache or restarts gets a fresh slot and its old bits are ignored at once and
dropped by a later compaction, so a clear costs O(1).

:meth:`score` walks a prompt's block hashes in order and gives each replica the longest run
it can serve (held locally in any tier, or in the shared tier) and that run weighted by tier
(primary above host above disk above shared), with vertical (bit-sliced) counters so a pass
costs a few big-int operations per block whatever the number of replicas.

What it is not: the event transport (``kv_events.py``) or the routing decision (``policy.py``).
The shared tier announces stores but not its own LRU evictions, so shared entries are kept
in a bounded LRU of their own: a stale one costs a miss, then the replica recomputes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

TIERS = ("GPU", "CPU", "DISK")
SHARED = 3
# vLLM's tier names as llm-d lowercases them, and plimsoll's, mapped to a tier position.
_MEDIUM = {"GPU": 0, "CPU": 1, "CPU_TIER": 1, "DISK": 2, "STORAGE": 2, "SHARED": SHARED}
# Primary above host above disk above shared: a block already on the device costs nothing.
DEFAULT_WEIGHTS = (1.0, 0.8, 0.6, 0.5)


def tier_of(medium: str | None) -> int | None:
    """The tier position of an event's medium (None: vLLM's primary cache); None if unknown."""
    if medium is None:
        return 0
    return _MEDIUM.get(medium.upper())


@dataclass(frozen=True, slots=True)
class Score:
    blocks: int  # longest run of the prompt's blocks the replica can serve without recomputing
    weighted: float  # that run, each block weighted by the tier it comes from


class KVBlockIndex:
    def __init__(self, max_replicas: int = 256, shared_capacity: int = 4_000_000,
                 weights: tuple[float, float, float, float] = DEFAULT_WEIGHTS) -> None:  # fmt: skip
        self.stride = max_replicas
        self.entries: dict[int, int] = {}
        self.slot_of: dict[str, int] = {}
        self._free = list(range(max_replicas - 1, -1, -1))
        self._dead = 0  # slots whose bits are garbage until compaction
        self.live = 0  # mask of live slots
        self.shared: OrderedDict[int, None] = OrderedDict()
        self.shared_capacity = shared_capacity
        self.weights = weights
        self.stored_events = 0
        self.removed_events = 0

    def __len__(self) -> int:
        return len(self.entries)

    # -- replicas ----------------------------------------------------------------------

    def slot(self, replica: str) -> int:
        slot = self.slot_of.get(replica)
        if slot is None:
            if not self._free:
                self.compact()
            if not self._free:
                raise RuntimeError(
                    f"the KV index tracks at most {self.stride} replicas; shard routers by replica set "
                    "or raise max_replicas"
                )
            slot = self._free.pop()
            self.slot_of[replica] = slot
            self.live |= 1 << slot
        return slot

    def clear(self, replica: str) -> None:
        """Forget everything ``replica`` held (AllBlocksCleared, a restart, a sequence gap): O(1)."""
        slot = self.slot_of.pop(replica, None)
        if slot is not None:
            self.live &= ~(1 << slot)
            self._dead |= 1 << slot
            if self._dead.bit_count() * 4 >= self.stride:
                self.compact()  # a quarter of the slots are garbage: one pass over the entries

    def remove_replica(self, replica: str) -> None:
        self.clear(replica)

    def compact(self) -> None:
        """Drop the bits of cleared slots from every entry and make those slots free again."""
        dead = self._dead
        if not dead:
            return
        keep = ~sum(dead << (t * self.stride) for t in range(len(TIERS)))
        entries = self.entries
        for h in list(entries):
            v = entries[h] & keep
            if v:
                entries[h] = v
            else:
                del entries[h]
        self._free.extend(i for i in range(self.stride) if dead >> i & 1)
        self._dead = 0

    # -- events --------------------------------------------------------------------------

    def stored(self, replica: str, hashes: Iterable[int], medium: str | None) -> None:
        tier = tier_of(medium)
        if tier is None:
            return
        entries = self.entries
        if tier == SHARED:
            bit = 1 << (SHARED * self.stride)
            for h in hashes:
                entries[h] = entries.get(h, 0) | bit
                self.shared[h] = None
                self.shared.move_to_end(h)
            while len(self.shared) > self.shared_capacity:
                old, _ = self.shared.popitem(last=False)
                self._drop(old, bit)
            return
        bit = 1 << (tier * self.stride + self.slot(replica))
        for h in hashes:
            entries[h] = entries.get(h, 0) | bit
            self.stored_events += 1

    def removed(self, replica: str, hashes: Iterable[int], medium: str | None) -> None:
        tier = tier_of(medium)
        slot = self.slot_of.get(replica)
        if tier is None or tier == SHARED or slot is None:
            return
        bit = 1 << (tier * self.stride + slot)
        for h in hashes:
            self._drop(h, bit)
            self.removed_events += 1

    def _drop(self, h: int, bit: int) -> None:
        v = self.entries.get(h)
        if v is None:
            return
        v &= ~bit
        if v:
            self.entries[h] = v
        else:
            del self.entries[h]

    # -- scoring -------------------------------------------------------------------------

    def score(self, replicas: Sequence[str], hashes: Sequence[int]) -> dict[str, Score]:
        """Each replica's longest servable run of ``hashes`` and its tier-weighted value.

        Most blocks of a run sit in the primary cache of every replica still in the race, so
        only the exceptions are counted: blocks an alive replica serves from its host or disk
        tier, or only through the shared tier. A replica's weighted run is then
        ``run × w_gpu − Σ exceptions × (w_gpu − w_tier)``.
        """
        stride = self.stride
        s1, s2, s3 = stride, 2 * stride, SHARED * stride
        slots = {r: self.slot_of[r] for r in replicas if r in self.slot_of}
        alive = 0
        for s in slots.values():
            alive |= 1 << s
        ends: dict[int, int] = {}
        # Vertical (bit-sliced) counters of the exceptions, per tier: host, disk, shared only.
        planes: tuple[list[int], list[int], list[int]] = ([], [], [])
        shared_alive = True
        get = self.entries.get
        n = len(hashes)
        for i, h in enumerate(hashes):
            v = get(h, 0)
            g = v & alive
            if g == alive and alive:
                continue  # the common case: every replica still in the race holds it on its device
            in_shared = (v >> s3) & 1
            c = (v >> s1) & alive
            d = (v >> s2) & alive
            local = g | c | d
            present = alive if in_shared else local
            dropped = alive & ~present
            while dropped:
                low = dropped & -dropped
                ends[low.bit_length() - 1] = i
                dropped ^= low
            alive = present
            shared_alive = shared_alive and bool(in_shared)
            if not alive:
                n = i
                break
            c &= ~g
            d &= ~(g | c)
            sh = alive & ~local
            for plane, m in ((planes[0], c), (planes[1], d), (planes[2], sh)):
                k = 0
                while m:
                    if k == len(plane):
                        plane.append(0)
                    carry = plane[k] & m
                    plane[k] ^= m
                    m = carry
                    k += 1
        out: dict[str, Score] = {}
        wg, wc, wd, ws = self.weights
        for replica, slot in slots.items():
            run = ends.get(slot, n)
            host, disk, shared = (sum(((p[k] >> slot) & 1) << k for k in range(len(p))) for p in planes)
            weighted = run * wg - host * (wg - wc) - disk * (wg - wd) - shared * (wg - ws)
            out[replica] = Score(run, weighted)
        return out

    def shared_run(self, hashes: Sequence[int]) -> int:
        """Blocks at the head of ``hashes`` the shared tier holds (what a replica with nothing local can load)."""
        bit_pos = SHARED * self.stride
        n = 0
        for h in hashes:
            if not (self.entries.get(h, 0) >> bit_pos) & 1:
                break
            n += 1
        return n
