"""The host-memory tier (``--kv-offloading-size`` GiB) and the optional disk tier below it.

What it is: :class:`HostTier` is one tensor of ``capacity`` block slots allocated at start
(pinned on CUDA, so copies to and from the device run without staging; a plain host tensor
on a CPU engine, a pool apart from the primary cache so the flag means the same there), an
LRU index from content address to slot, pins that keep a slot from being reused while a load
reads it, and reuse-frequency gating as vLLM's ``store_threshold``: with a threshold of N ≥ 2
a block is stored only once lookups have asked for it N times. A slot the LRU gives up is
handed to :class:`DiskTier` when there is one: files of checked blocks (``transfer.pack_block``)
under a directory, LRU within ``capacity`` blocks, emptied at start (LoRA-salted hashes are
process-local, so nothing on it may outlive the process).

Thread safety: the engine thread looks up, pins and reads; the offload worker stores. One lock
guards the index; slot contents are written only into slots no reader has pinned.
What it is not: the policy of when to store or load (``connector.py``).
"""

from __future__ import annotations

import os
import shutil
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from plimsoll.runtime.kv.transfer import (
    BlockRejected,
    pack_block,
    payload_of,
    unpack_block,
)

# (medium, address, stored) for KV events: the connector turns them into BlockStored/BlockRemoved.
TierListener = Callable[[str, bytes, bool], None]


class DiskTier:
    """Checked block files under ``directory``; LRU within ``capacity`` blocks."""

    medium = "DISK"

    def __init__(self, directory: str, capacity: int, listener: TierListener | None = None) -> None:
        if capacity < 1:
            raise ValueError("the disk tier holds no block: raise --kv-offloading-disk-size")
        self.directory = Path(directory)
        if self.directory.exists():
            shutil.rmtree(self.directory)
        self.directory.mkdir(parents=True)
        self.capacity = capacity
        self.index: OrderedDict[bytes, None] = OrderedDict()
        self.lock = threading.Lock()
        self.listener = listener

    def _path(self, address: bytes) -> Path:
        return self.directory / address.hex()

    def __contains__(self, address: bytes) -> bool:
        with self.lock:
            return address in self.index

    def put(self, address: bytes, payload: bytes) -> None:
        with self.lock:
            if address in self.index:
                self.index.move_to_end(address)
                return
        tmp = self._path(address).with_suffix(".tmp")
        tmp.write_bytes(pack_block(address, payload))
        os.replace(tmp, self._path(address))
        dropped = []
        with self.lock:
            self.index[address] = None
            while len(self.index) > self.capacity:
                old, _ = self.index.popitem(last=False)
                dropped.append(old)
        for old in dropped:
            self._path(old).unlink(missing_ok=True)
            if self.listener is not None:
                self.listener(self.medium, old, False)
        if self.listener is not None:
            self.listener(self.medium, address, True)

    def get(self, address: bytes, payload_bytes: int) -> bytes | None:
        with self.lock:
            if address not in self.index:
                return None
            self.index.move_to_end(address)
        try:
            return unpack_block(address, self._path(address).read_bytes(), payload_bytes)
        except (OSError, BlockRejected):
            with self.lock:
                self.index.pop(address, None)
            return None


class HostTier:
    """``capacity`` block slots in host memory with an LRU index by content address."""

    medium = "CPU"

    def __init__(
        self,
        capacity: int,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        pin_memory: bool = False,
        store_threshold: int = 0,
        max_tracker_size: int = 64_000,
        disk: DiskTier | None = None,
        listener: TierListener | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(
                "--kv-offloading-size holds no block of this model's KV; raise it (one block is "
                f"{torch.Size(block_shape).numel() * torch.empty((), dtype=dtype).element_size()} bytes)"
            )
        self.capacity = capacity
        self.block_shape = block_shape
        self.dtype = dtype
        self.pool = torch.empty((capacity, *block_shape), dtype=dtype, pin_memory=pin_memory)
        self.block_nbytes = int(self.pool[0].numel() * self.pool.element_size())
        self.slots: OrderedDict[bytes, int] = OrderedDict()  # LRU: the front goes first
        self.free = list(range(capacity - 1, -1, -1))
        self.pins = [0] * capacity
        self.lock = threading.Lock()
        self.store_threshold = store_threshold
        self.max_tracker_size = max_tracker_size
        self.seen: OrderedDict[bytes, int] = OrderedDict()
        self.stores_skipped = 0
        self.disk = disk
        self.listener = listener

    def __len__(self) -> int:
        return len(self.slots)

    def __contains__(self, address: bytes) -> bool:
        with self.lock:
            return address in self.slots

    def record_lookup(self, addresses: list[bytes]) -> None:
        """Count a lookup of each address (reuse-frequency gating; a no-op below threshold 2)."""
        if self.store_threshold < 2:
            return
        with self.lock:
            for a in addresses:
                if a in self.seen:
                    self.seen.move_to_end(a)
                    self.seen[a] += 1
                else:
                    if len(self.seen) >= self.max_tracker_size:
                        self.seen.popitem(last=False)
                    self.seen[a] = 1

    def admits(self, address: bytes) -> bool:
        if self.store_threshold < 2:
            return True
        with self.lock:
            return self.seen.get(address, 0) >= self.store_threshold

    def pin_run(self, addresses: list[bytes]) -> list[int]:
        """The slots of the longest leading run of ``addresses`` held here, each pinned once."""
        out: list[int] = []
        with self.lock:
            for a in addresses:
                slot = self.slots.get(a)
                if slot is None:
                    break
                self.slots.move_to_end(a)
                self.pins[slot] += 1
                out.append(slot)
        return out

    def unpin(self, slots: list[int]) -> None:
        with self.lock:
            for s in slots:
                self.pins[s] -= 1

    def read(self, slots: list[int]) -> torch.Tensor:
        """``[n, *block_shape]`` of pinned slots (a gather: the caller may unpin afterwards)."""
        return self.pool[torch.tensor(slots, dtype=torch.long)]

    def store(self, address: bytes, block: torch.Tensor | bytes, gate: bool = True) -> bool:
        """Put one block (a ``block_shape`` tensor, or its payload bytes) under ``address``.

        False when gating or pinning leaves no room; an address already here is only touched.
        ``gate=False`` for blocks fetched from below (disk, the shared tier) for a request
        that is about to use them.
        """
        evicted: tuple[bytes, int] | None = None
        with self.lock:
            if address in self.slots:
                self.slots.move_to_end(address)
                return True
            if gate and self.store_threshold >= 2 and self.seen.get(address, 0) < self.store_threshold:
                self.stores_skipped += 1
                return False
            if self.free:
                slot = self.free.pop()
            else:
                victim = next((a for a, s in self.slots.items() if self.pins[s] == 0), None)
                if victim is None:
                    return False  # every slot is being read: drop this store
                slot = self.slots.pop(victim)
                evicted = (victim, slot)
            self.pins[slot] += 1  # nobody finds it until it is written; the pin keeps it ours
        if evicted is not None:
            self._spill(*evicted)
        dest = self.pool[slot]
        if isinstance(block, bytes):
            # A numpy copy: workers call this, and a torch op there would start an OpenMP pool of the
            # worker's own beside the engine thread's (async_engine.py says what that costs).
            np.copyto(dest.view(torch.uint8).numpy().reshape(-1), np.frombuffer(block, dtype=np.uint8))
        else:
            dest.copy_(block)
        with self.lock:
            self.pins[slot] -= 1
            self.slots[address] = slot
        if self.listener is not None:
            self.listener(self.medium, address, True)
        return True

    def _spill(self, address: bytes, slot: int) -> None:
        """The LRU gave up ``slot``: its block goes to disk (before the slot is overwritten)."""
        if self.disk is not None:
            self.disk.put(address, payload_of(self.pool[slot]))
        if self.listener is not None:
            self.listener(self.medium, address, False)

    def load_from_disk(self, address: bytes) -> bool:
        """Bring a block the disk tier holds back into host memory (the prefetch worker)."""
        if self.disk is None:
            return False
        payload = self.disk.get(address, self.block_nbytes)
        return payload is not None and self.store(address, payload, gate=False)

    def clear(self) -> None:
        with self.lock:
            gone = [a for a, s in self.slots.items() if self.pins[s] == 0]
            for a in gone:
                self.free.append(self.slots.pop(a))
        for a in gone:
            if self.listener is not None:
                self.listener(self.medium, a, False)
