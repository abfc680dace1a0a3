"""LoRA slot bookkeeping: who gets a slot, who waits, and that a blocked adapter waits one swap at most."""

from plimsoll.runtime.engine.lora_manager import LoRAManager
from plimsoll.runtime.engine.request import Request
from plimsoll.runtime.engine.sampling_params import SamplingParams
from plimsoll.runtime.models.lora import LoRAWeights


def manager(slots: int) -> LoRAManager:
    m = LoRAManager(slots, slots, read=lambda name, path: LoRAWeights(name, path, 1))
    for name in ("x", "y", "z"):
        m.add(name, f"/{name}", LoRAWeights(name, f"/{name}", 1))
    return m


def req(m: LoRAManager, lora: str | None, i: int) -> Request:
    r = Request(f"r{i}", f"r{i}", 0, [1, 2], SamplingParams(), frozenset())
    r.lora = m.get(lora) if lora else None
    return r


def test_base_requests_need_no_slot_and_adapters_share_theirs() -> None:
    m = manager(1)
    base, x1, x2 = req(m, None, 0), req(m, "x", 1), req(m, "x", 2)
    for r in (base, x1, x2):
        assert m.can_acquire(r)
        m.acquire(r)
    assert base.lora_slot == -1 and x1.lora_slot == x2.lora_slot == 0
    assert m.slot_refs == [2] and m.num_swaps == 1
    assert [lora.lora_name for _, lora in m.take_pending_loads()] == ["x"]


def test_blocked_adapter_reserves_the_slot_and_gets_it_after_one_drain() -> None:
    m = manager(1)
    x1 = req(m, "x", 1)
    m.acquire(x1)
    y = req(m, "y", 2)
    m.begin_admission()
    assert not m.can_acquire(y)  # the only slot is busy with x
    late_x = req(m, "x", 3)
    assert not m.can_acquire(late_x), "x took new work past y: y could wait forever"
    m.release(x1)
    assert m.can_acquire(y)
    m.acquire(y)
    assert y.lora_slot == 0 and m.num_swaps == 2 and m.reserved == {}
    assert not m.can_acquire(late_x)  # now y holds the slot; x waits its turn


def test_idle_slot_taken_least_recently_used_first() -> None:
    m = manager(2)
    x, y = req(m, "x", 1), req(m, "y", 2)
    m.acquire(x)
    m.acquire(y)
    m.release(x)
    m.release(y)
    z = req(m, "z", 3)
    m.acquire(z)
    assert z.lora_slot == 0, "x (slot 0) was used longest ago"
    assert m.slot_of(m.get("y")) == 1
