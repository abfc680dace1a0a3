"""Block identity, the checked wire form, vLLM's event schema, the host/disk tiers and the breaker."""

from __future__ import annotations

import random

import msgpack
import pytest
import torch

from plimsoll.runtime.engine.request import Request
from plimsoll.runtime.engine.sampling_params import SamplingParams
from plimsoll.runtime.kv.blocks import BlockIdentity, chain_hashes, chain_hashes_fast, event_hash
from plimsoll.runtime.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventsConfig,
    decode_batch,
    encode_batch,
)
from plimsoll.runtime.kv.host_tier import DiskTier, HostTier
from plimsoll.runtime.kv.shared_tier import CircuitBreaker
from plimsoll.runtime.kv.transfer import BlockRejected, pack_block, payload_of, unpack_block


def _engine_hashes(tokens: list[int], salt: str, block_size: int) -> list[bytes]:
    req = Request("r", "r", 0, tokens, SamplingParams(), frozenset(), cache_salt=salt)
    req.update_block_hashes(block_size)
    return req.block_hashes


@pytest.mark.parametrize("salt", ["", "lora:3:", "tenant-a"])
def test_chain_hashes_are_the_engines(salt: str) -> None:
    rng = random.Random(1)
    tokens = [rng.randrange(50_000) for _ in range(100)]
    expected = _engine_hashes(tokens, salt, 16)
    assert len(expected) == 6
    assert chain_hashes(tokens, 16, salt or None) == expected
    assert chain_hashes_fast(tokens, 16, salt or None) == expected


def test_address_names_model_dtype_and_layout() -> None:
    h = chain_hashes(list(range(16)), 16)[0]
    base = BlockIdentity("m1", "float32", "L2xKVx16x2x16")
    others = [BlockIdentity("m2", "float32", base.layout), BlockIdentity("m1", "int8", base.layout),
              BlockIdentity("m1", "float32", "L2xKVx16x2x20")]  # fmt: skip
    assert len({base.address(h), *(o.address(h) for o in others)}) == 4
    assert base.address(h).endswith(h) and event_hash(h) == int.from_bytes(h[-8:], "big")


def test_checked_block_rejects_corrupt_foreign_and_truncated() -> None:
    ident = BlockIdentity("m", "float32", "l")
    a, b = (ident.address(h) for h in chain_hashes(list(range(32)), 16))
    payload = payload_of(torch.arange(24, dtype=torch.float32))
    blob = pack_block(a, payload)
    assert unpack_block(a, blob, len(payload)) == payload
    corrupt = bytearray(blob)
    corrupt[-1] ^= 1
    with pytest.raises(BlockRejected, match="corrupt"):
        unpack_block(a, bytes(corrupt), len(payload))
    with pytest.raises(BlockRejected, match="foreign"):
        unpack_block(b, blob, len(payload))  # a's block stored under b's key
    with pytest.raises(BlockRejected):
        unpack_block(a, blob[:-3], len(payload))


def test_event_batch_is_vllms_array_layout() -> None:
    batch = EventBatch(12.5, [BlockStored([1, 2], None, [5, 6, 7, 8], 2, None, "GPU"), BlockRemoved([1], "CPU"),
                              AllBlocksCleared()])  # fmt: skip
    raw = msgpack.unpackb(encode_batch(batch))
    # What llm-d's and Dynamo's decoders read: [ts, events]; events tag-first in field order.
    assert raw == [12.5, [["BlockStored", [1, 2], None, [5, 6, 7, 8], 2, None, "GPU", None],
                          ["BlockRemoved", [1], "CPU"], ["AllBlocksCleared"]]]  # fmt: skip
    assert decode_batch(encode_batch(batch)) == batch


def test_decode_reads_the_map_layout_and_byte_hashes() -> None:
    digest = bytes(range(32))
    payload = msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [digest], "parent_block_hash": None,
                                    "token_ids": [1], "block_size": 1, "lora_id": None, "medium": "GPU"},
                                   {"type": "SomethingNew", "x": 1}], 0])  # fmt: skip
    batch = decode_batch(payload)
    assert batch.events == [BlockStored([int.from_bytes(digest[-8:], "big")], None, [1], 1, None, "GPU")]
    assert batch.data_parallel_rank == 0
    with pytest.raises(ValueError):
        decode_batch(b"\xc1not msgpack")


def test_kv_events_config_is_vllms() -> None:
    cfg = KVEventsConfig.parse('{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000", "topic": "kv"}')
    assert cfg is not None and cfg.publisher == "zmq" and cfg.enabled
    assert KVEventsConfig.parse("{}").publisher == "null"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="JSON object"):
        KVEventsConfig.parse("{not json")


def _block(value: float) -> torch.Tensor:
    return torch.full((2, 2, 4, 1, 3), value)


def test_host_tier_lru_pins_and_disk(tmp_path: object) -> None:
    events: list[tuple[str, bytes, bool]] = []
    disk = DiskTier(str(tmp_path), capacity=2)
    host = HostTier(2, (2, 2, 4, 1, 3), torch.float32, disk=disk, listener=lambda *e: events.append(e))
    disk.listener = host.listener
    addr = [bytes([i]) * 48 for i in range(4)]
    assert host.store(addr[0], _block(0)) and host.store(addr[1], _block(1))
    pinned = host.pin_run([addr[0], addr[1], addr[2]])
    assert len(pinned) == 2  # the run stops at the first block not held
    assert not host.store(addr[2], _block(2))  # every slot pinned: the store is dropped, not forced
    host.unpin(pinned)
    assert host.store(addr[2], _block(2))  # evicts the least recently used (addr[0]) to disk
    assert addr[0] not in host and addr[0] in disk
    assert host.load_from_disk(addr[0])  # back from disk, checked
    assert torch.equal(host.read(host.pin_run([addr[0]]))[0], _block(0))
    assert ("CPU", addr[0], False) in events and ("DISK", addr[0], True) in events


def test_reuse_gating_stores_only_blocks_asked_for_often_enough() -> None:
    host = HostTier(4, (1,), torch.float32, store_threshold=2)
    a, b = b"a" * 48, b"b" * 48
    host.record_lookup([a, b])
    host.record_lookup([a])
    assert host.store(a, torch.ones(1)) and not host.store(b, torch.ones(1))
    assert host.stores_skipped == 1
    assert host.store(b, torch.ones(1), gate=False)  # fetched for a request about to use it


def test_circuit_breaker_opens_then_tries_once() -> None:
    now = [0.0]
    breaker = CircuitBreaker(failures=2, cooldown_s=5.0, clock=lambda: now[0])
    breaker.failure()
    assert breaker.allow()
    breaker.failure()
    assert breaker.state == "open" and not breaker.allow()
    now[0] = 6.0
    assert breaker.allow() and not breaker.allow()  # one trial in half-open
    breaker.failure()
    assert not breaker.allow()
    now[0] = 12.0
    assert breaker.allow()
    breaker.success()
    assert breaker.state == "closed" and breaker.allow()
