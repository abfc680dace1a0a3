"""Moving one block's KV between an engine's cache and bytes: export, import, and the checked wire form.

What it is: ``export_blocks`` copies whole blocks (every layer, K and V) out of the paged
cache into one host tensor ``[n, layers, 2, block_size, kv_heads, row]``; ``import_blocks``
writes such a tensor back into given block ids. ``pack_block``/``unpack_block`` turn one
block into self-checking bytes: a header naming the block's content address and a sha256
over address and payload, so a reader rejects a block that was corrupted, truncated, or
stored under another block's key (a *foreign* block) instead of serving it. The same pieces
serve the offload tiers, the shared tier and a transfer between a prefill and a decode
engine. What it is not: where blocks live (``host_tier.py``, ``shared_tier.py``).
"""

from __future__ import annotations

import hashlib
import struct

import torch

MAGIC = b"PLKV"
VERSION = 1
# magic, version, address length, payload length; then address, sha256(address + payload), payload.
_HEADER = struct.Struct(">4sHHQ")


class BlockRejected(ValueError):
    """A stored block failed its check (corrupt, truncated, foreign or of another layout)."""


def block_shape(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[int, ...]:
    """``[layers, 2, block_size, kv_heads, row]``: one block of this cache, as exported."""
    k = kv_caches[0][0]
    return (len(kv_caches), 2, *k.shape[1:])


def block_nbytes(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    k = kv_caches[0][0]
    return int(len(kv_caches) * 2 * k[0].numel() * k.element_size())


def export_blocks(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_ids: list[int], out: torch.Tensor | None = None
) -> torch.Tensor:
    """Copy ``block_ids`` out of the cache: ``[n, layers, 2, block_size, kv_heads, row]`` on the host.

    ``out`` (pinned on CUDA) receives the copy without waiting for it (``non_blocking``); the
    caller synchronises before reading it. Without ``out`` a new CPU tensor is returned, complete.
    """
    device = kv_caches[0][0].device
    idx = torch.tensor(block_ids, dtype=torch.long, device=device)
    # [n, layers, 2, bs, H, D]: one gather per layer and K/V, then one copy to the host.
    gathered = torch.stack(
        [torch.stack([k.index_select(0, idx), v.index_select(0, idx)], 1) for k, v in kv_caches], 1
    )
    if out is None:
        return gathered.to("cpu") if device.type != "cpu" else gathered
    out.copy_(gathered, non_blocking=True)
    return out


def import_blocks(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_ids: list[int], data: torch.Tensor
) -> None:
    """Write ``data`` (``[n, layers, 2, block_size, kv_heads, row]``, any device) into ``block_ids``."""
    device = kv_caches[0][0].device
    idx = torch.tensor(block_ids, dtype=torch.long, device=device)
    src = data.to(device, non_blocking=True)
    for layer, (k, v) in enumerate(kv_caches):
        k.index_copy_(0, idx, src[:, layer, 0])
        v.index_copy_(0, idx, src[:, layer, 1])


def payload_of(block: torch.Tensor) -> bytes:
    """One exported block's bytes (any dtype: bfloat16 and int8 are copied bit for bit)."""
    return block.contiguous().view(torch.uint8).numpy().tobytes()


def block_from_payload(payload: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return flat.view(dtype).view(shape)


def pack_block(address: bytes, payload: bytes) -> bytes:
    """The checked wire form of one block: header, address, digest, payload."""
    digest = hashlib.sha256(address + payload).digest()
    return _HEADER.pack(MAGIC, VERSION, len(address), len(payload)) + address + digest + payload


def unpack_block(address: bytes, blob: bytes, payload_bytes: int) -> bytes:
    """The payload of ``blob`` if it is exactly the block at ``address``; else ``BlockRejected``."""
    if len(blob) < _HEADER.size:
        raise BlockRejected("truncated header")
    magic, version, alen, plen = _HEADER.unpack_from(blob)
    if magic != MAGIC or version != VERSION:
        raise BlockRejected(f"not a plimsoll KV block (magic {magic!r}, version {version})")
    start = _HEADER.size
    stored_address = blob[start : start + alen]
    digest = blob[start + alen : start + alen + 32]
    payload = blob[start + alen + 32 :]
    if stored_address != address:
        raise BlockRejected("foreign block: its header names another address")
    if plen != payload_bytes or len(payload) != plen:
        raise BlockRejected(f"payload of {len(payload)} bytes, expected {payload_bytes}")
    if hashlib.sha256(address + payload).digest() != digest:
        raise BlockRejected("corrupt block: digest mismatch")
    return payload
