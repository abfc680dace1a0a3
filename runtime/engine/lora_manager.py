"""Which LoRA adapters the engine knows, which sit in the device's slots, and who uses them.

What it is: pure-Python bookkeeping for ``--enable-lora``. :class:`LoRAManager` holds
the registered adapters (name -> :class:`LoRARequest`, what ``/v1/models`` lists),
a host cache of their weights (LRU of ``--max-cpu-loras``, re-read from disk on a
miss) and the slot table: ``--max-loras`` device slots, each with the adapter in it
and the number of running requests using it. The scheduler asks
:meth:`LoRAManager.acquire` before admitting a request: a request whose adapter is
in a slot, or can take a slot nobody uses, gets it; otherwise it waits and others
are admitted past it. So a request waits behind an adapter it does not use for at
most one swap: the first blocked adapter reserves the least-used slot, which takes
no new requests until it drains.

What it is not: the weights on the device or the per-row delta (``models/lora.py``),
or reading adapter files (``models/lora.read_peft_adapter``).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from plimsoll.runtime.engine.request import Request
    from plimsoll.runtime.models.lora import LoRAWeights

_IDS = itertools.count(1)


class LoRANotFoundError(LookupError):
    """A request or an unload named an adapter this engine has not loaded."""


class LoRAInUseError(RuntimeError):
    """An unload of an adapter that requests still use."""


@dataclass(frozen=True)
class LoRARequest:
    """A registered adapter. ``lora_int_id`` is new on every load, so a reloaded name never
    reuses the prefix-cache blocks or the slot contents of the adapter it replaced."""

    lora_name: str
    lora_path: str
    lora_int_id: int


class LoRAManager:
    def __init__(
        self, max_loras: int, max_cpu_loras: int, read: Callable[[str, str], LoRAWeights]
    ) -> None:
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.read = read  # (name, path) -> LoRAWeights; raises LoRAAdapterError
        self.adapters: dict[str, LoRARequest] = {}
        self.host: OrderedDict[int, LoRAWeights] = OrderedDict()  # LRU: front evicted first
        self.slot_lora: list[int | None] = [None] * max_loras  # lora_int_id in each slot
        self.slot_refs = [0] * max_loras  # running requests using each slot
        self.slot_used = [0] * max_loras  # last use, for LRU among idle slots
        self.reserved: dict[int, int] = {}  # slot -> lora_int_id waiting for it to drain
        self.pending_loads: list[tuple[int, LoRARequest]] = []  # (slot, adapter) to copy before the step
        self.num_swaps = 0
        self._clock = 0

    # ---- registration (engine thread) ------------------------------------------------

    def add(self, name: str, path: str, weights: LoRAWeights) -> LoRARequest:
        if name in self.adapters:
            raise ValueError(f"The lora adapter '{name}' has already been loaded; unload it first.")
        lora = LoRARequest(name, path, next(_IDS))
        self.adapters[name] = lora
        self._cache(lora.lora_int_id, weights)
        return lora

    def remove(self, name: str, active: Iterable[Request]) -> None:
        lora = self.get(name)
        users = sum(1 for r in active if r.lora is not None and r.lora.lora_int_id == lora.lora_int_id)
        if users:
            raise LoRAInUseError(
                f"The lora adapter '{name}' is used by {users} request(s) in flight; unload it once they "
                "finish (retry later)."
            )
        del self.adapters[name]
        self.host.pop(lora.lora_int_id, None)
        for slot, held in enumerate(self.slot_lora):
            if held == lora.lora_int_id:
                self.slot_lora[slot] = None
        self.reserved = {s: i for s, i in self.reserved.items() if i != lora.lora_int_id}

    def get(self, name: str) -> LoRARequest:
        lora = self.adapters.get(name)
        if lora is None:
            raise LoRANotFoundError(f"The lora adapter '{name}' cannot be found.")
        return lora

    def weights(self, lora: LoRARequest) -> LoRAWeights:
        """The adapter's host copy, read again from its path if the LRU dropped it."""
        cached = self.host.get(lora.lora_int_id)
        if cached is None:
            cached = self.read(lora.lora_name, lora.lora_path)
            self._cache(lora.lora_int_id, cached)
        self.host.move_to_end(lora.lora_int_id)
        return cached

    def _cache(self, lora_int_id: int, weights: LoRAWeights) -> None:
        self.host[lora_int_id] = weights
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)

    # ---- slots (scheduler) ------------------------------------------------------------

    def slot_of(self, lora: LoRARequest) -> int | None:
        for slot, held in enumerate(self.slot_lora):
            if held == lora.lora_int_id:
                return slot
        return None

    def _free_slot(self, lora: LoRARequest) -> int | None:
        """An idle slot this adapter may take: an empty one first, else the least recently used."""
        idle = [
            s for s in range(self.max_loras)
            if self.slot_refs[s] == 0 and self.reserved.get(s, lora.lora_int_id) == lora.lora_int_id
        ]
        if not idle:
            return None
        return min(idle, key=lambda s: (self.slot_lora[s] is not None, self.slot_used[s]))

    def begin_admission(self) -> None:
        """Forget last step's reservations: the waiting queue makes them again, in its order."""
        self.reserved.clear()

    def can_acquire(self, req: Request) -> bool:
        """Whether ``req`` could get a slot now; if not, its adapter reserves the least-used slot."""
        if req.lora is None or req.lora_slot >= 0:
            return True
        slot = self.slot_of(req.lora)
        if slot is not None:
            # In a slot: go, unless another adapter reserved that slot (then wait for it to drain).
            return bool(self.reserved.get(slot, req.lora.lora_int_id) == req.lora.lora_int_id)
        if self._free_slot(req.lora) is not None:
            return True
        if req.lora.lora_int_id not in self.reserved.values():
            busy = [s for s in range(self.max_loras) if s not in self.reserved]
            if busy:
                self.reserved[min(busy, key=lambda s: (self.slot_refs[s], self.slot_used[s]))] = req.lora.lora_int_id
        return False

    def acquire(self, req: Request) -> None:
        """Give ``req`` its adapter's slot (after :meth:`can_acquire` said yes), loading it if needed."""
        if req.lora is None or req.lora_slot >= 0:
            return
        slot = self.slot_of(req.lora)
        if slot is None:
            slot = self._free_slot(req.lora)
            assert slot is not None, "acquire() without can_acquire()"
            self.slot_lora[slot] = req.lora.lora_int_id
            self.pending_loads.append((slot, req.lora))
            self.num_swaps += 1
        if self.reserved.get(slot) == req.lora.lora_int_id:
            del self.reserved[slot]
        self.slot_refs[slot] += 1
        self._clock += 1
        self.slot_used[slot] = self._clock
        req.lora_slot = slot

    def release(self, req: Request) -> None:
        if req.lora_slot >= 0:
            self.slot_refs[req.lora_slot] -= 1
            req.lora_slot = -1

    def take_pending_loads(self) -> list[tuple[int, LoRARequest]]:
        loads, self.pending_loads = self.pending_loads, []
        return loads

    # ---- what the metrics read -------------------------------------------------------

    def names_in(self, requests: Iterable[Request]) -> list[str]:
        return sorted({r.lora.lora_name for r in requests if r.lora is not None})
