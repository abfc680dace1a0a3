"""KV cache events as vLLM publishes them: ``--kv-events-config``, the msgpack schema, a ZMQ publisher.

What it is: :class:`KVEventsConfig` (vLLM's ``KVEventsConfig`` fields: ``enable_kv_cache_events``,
``publisher``, ``endpoint``, ``replay_endpoint``, ``buffer_steps``, ``hwm``, ``max_queue_size``,
``topic``), the three events (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``) with vLLM's
field order, and :class:`ZmqEventPublisher`: a PUB socket sending multipart messages
``(topic, seq as 8 bytes big-endian, payload)`` from a thread, with vLLM's replay ROUTER socket
(a subscriber that saw a gap sends the first missing ``seq`` and gets the buffered batches,
then ``seq = -1``).

Wire form: the array layout every vLLM-events consumer reads (vLLM's msgspec structs with
``array_like``; llm-d's and Dynamo's decoders): a batch is ``[ts, [event, ...]]`` (a third
element ``data_parallel_rank`` when set), an event is ``[tag, field, ...]`` in declaration
order: ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
medium, lora_name]``, ``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``.
Block hashes are vLLM's integer form (the chained sha256's low 64 bits, ``blocks.event_hash``).
``medium`` names the tier: ``GPU`` (the engine's primary cache, on whatever device it lives),
``CPU`` (host tier), ``DISK`` and ``SHARED`` (the tier shared by replicas).
:func:`decode_batch` also reads the map layout newer vLLM versions send (tagged maps).

What it is not: the router's index (``router/kv_index.py``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal

import msgpack
from pydantic import BaseModel, ConfigDict, Field, model_validator

from plimsoll.runtime.kv.json_flag import json_flag

log = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"  # vLLM's name for the primary cache
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"
MEDIUM_SHARED = "SHARED"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVEventsConfig(BaseModel):
    """vLLM's ``--kv-events-config`` (a JSON object); ``publisher`` defaults to zmq when enabled."""

    model_config = ConfigDict(extra="forbid")

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = Field(10_000, ge=1)
    hwm: int = Field(100_000, ge=1)
    max_queue_size: int = Field(100_000, ge=1)
    topic: str = ""

    @model_validator(mode="after")
    def _default_publisher(self) -> KVEventsConfig:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        return self

    @classmethod
    def parse(cls, value: object) -> KVEventsConfig | None:
        if value is None or isinstance(value, KVEventsConfig):
            return value
        example = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}'
        return cls.model_validate(json_flag(value, "--kv-events-config", example))

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None

    def encode(self) -> list[Any]:
        return ["BlockStored", self.block_hashes, self.parent_block_hash, self.token_ids, self.block_size,
                self.lora_id, self.medium, self.lora_name]  # fmt: skip


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None

    def encode(self) -> list[Any]:
        return ["BlockRemoved", self.block_hashes, self.medium]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    def encode(self) -> list[Any]:
        return ["AllBlocksCleared"]


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


def encode_batch(batch: EventBatch) -> bytes:
    body: list[Any] = [batch.ts, [e.encode() for e in batch.events]]
    if batch.data_parallel_rank is not None:
        body.append(batch.data_parallel_rank)
    packed: bytes = msgpack.packb(body, use_bin_type=True)
    return packed


def _as_int_hash(value: Any) -> int:
    """vLLM sends ints, or raw digests as bytes (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``)."""
    if isinstance(value, bytes | bytearray):
        return int.from_bytes(bytes(value[-8:]), "big")
    return int(value) & ((1 << 64) - 1)


def _event_from(raw: Any) -> KVEvent | None:
    if isinstance(raw, dict):  # map layout: {"type": tag, field: value, ...}
        tag = raw.get("type")
        fields = raw
        get = fields.get
    elif isinstance(raw, list | tuple) and raw:
        tag = raw[0]
        names = {
            "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                            "lora_name"),
            "BlockRemoved": ("block_hashes", "medium"),
        }.get(tag, ())  # fmt: skip
        fields = dict(zip(names, raw[1:], strict=False))
        get = fields.get
    else:
        return None
    if tag == "BlockStored":
        parent = get("parent_block_hash")
        return BlockStored(
            [_as_int_hash(h) for h in get("block_hashes") or []],
            None if parent is None else _as_int_hash(parent),
            list(get("token_ids") or []),
            int(get("block_size") or 0),
            get("lora_id"),
            get("medium"),
            get("lora_name"),
        )
    if tag == "BlockRemoved":
        return BlockRemoved([_as_int_hash(h) for h in get("block_hashes") or []], get("medium"))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None  # an event type this reader does not know: skipped, as vLLM's consumers do


def decode_batch(payload: bytes) -> EventBatch:
    """Parse one payload (array or map layout); unknown event types are dropped. ``ValueError`` if malformed."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several types for bad input
        raise ValueError(f"not a msgpack KV event batch: {exc}") from None
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list | tuple) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    else:
        raise ValueError("a KV event batch is [ts, events(, data_parallel_rank)]")
    if not isinstance(events, list | tuple):
        raise ValueError("a KV event batch's events must be a list")
    parsed = [e for e in (_event_from(r) for r in events) if e is not None]
    return EventBatch(float(ts or 0.0), parsed, rank)


class ZmqEventPublisher:
    """Publishes batches from a thread; keeps the last ``buffer_steps`` for replay.

    ``publish`` never blocks the caller: a full queue drops the batch (counted), and the
    subscriber sees the gap in ``seq`` and resynchronises.
    """

    def __init__(self, config: KVEventsConfig) -> None:
        import zmq

        self.config = config
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        # vLLM's rule: bind a wildcard or ipc/inproc address, connect to anything else.
        endpoint = config.endpoint
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self._replay = None
        if config.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(config.replay_endpoint)
        self._topic = config.topic.encode()
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        # The sequence starts at this process's start in microseconds since the epoch, not at 0: a
        # subscriber whose subscription reconnects only after a restarted publisher's first batches
        # could otherwise see the new numbers continue the old ones exactly and keep the old
        # process's entries. This way a restart always shows as a jump, which clears them.
        self._seq = time.time_ns() // 1000
        self.dropped = 0
        self.published = 0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    @property
    def bound_endpoint(self) -> str:
        import zmq

        return self._pub.get_string(zmq.LAST_ENDPOINT)

    def publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        try:
            self._queue.put_nowait(EventBatch(time.time(), events))
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            payload = encode_batch(batch)
            seq = self._seq
            self._seq += 1
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except Exception as exc:  # a closed context at shutdown, a full pipe
                log.warning("KV event publish failed: %r", exc)
            self._buffer.append((seq, payload))
            self.published += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=2.0)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
