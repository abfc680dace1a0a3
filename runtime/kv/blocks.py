"""Block identity: what names one block of KV, in this engine, on another replica, on the wire.

What it is: the engine's chained prefix-block hash (``engine/request.py``: sha256 over the
parent's hash, block 0's salt and the block's token ids) extended into a *content address*
that also names the model, the KV dtype and the cache layout. Two blocks with the same
address hold the same bytes, wherever they were computed, so the address keys the host and
disk tiers, the shared tier's keys and the check a reader makes before it trusts a block.
KV events carry the chained hash in vLLM's integer form (``event_hash``).

The salt is already in the chain (block 0's hash folds it in; every later block inherits
it through its parent), so a LoRA adapter, a per-request ``cache_salt`` or a tenant salt
changes every address of that request without a field of its own here.

What it is not: the hash chain itself (``engine/request.py`` keeps it; ``chain_hashes`` here
computes the same chain from token ids alone, for the router and for tests) or storage.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from plimsoll.runtime.engine.request import ROOT_HASH, hash_block

HASH_BYTES = 32  # sha256
# The version of this rule: a change to what an address covers changes every address.
ADDRESS_VERSION = b"plimsoll-kv-address-v1"


def chain_hashes(
    token_ids: Sequence[int], block_size: int, salt: str | None = None, parent: bytes = ROOT_HASH
) -> list[bytes]:
    """Chained hashes of every full block of ``token_ids``, exactly as the engine computes them."""
    out: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, list(token_ids[start : start + block_size]), salt if not out else None)
        out.append(parent)
    return out


def chain_hashes_fast(token_ids: Sequence[int], block_size: int, salt: str | None = None) -> list[bytes]:
    """``chain_hashes`` over one packed buffer (about 3x faster for long prompts; the router's path).

    Same bytes as ``hash_block``: sha256(parent, salt of block 0, little-endian int64 token ids).
    """
    import numpy as np

    n = len(token_ids) // block_size
    if n == 0:
        return []
    packed = np.asarray(token_ids[: n * block_size], dtype="<i8").tobytes()
    step = block_size * 8
    sha256 = hashlib.sha256
    out: list[bytes] = []
    first = ROOT_HASH + (salt.encode() if salt else b"")
    parent = sha256(first + packed[:step]).digest()
    out.append(parent)
    for i in range(1, n):
        parent = sha256(parent + packed[i * step : (i + 1) * step]).digest()
        out.append(parent)
    return out


def event_hash(chain_hash: bytes) -> int:
    """vLLM's integer form of a block hash in KV events: the digest's low 64 bits, unsigned."""
    return int.from_bytes(chain_hash[-8:], "big")


@dataclass(frozen=True, slots=True)
class BlockIdentity:
    """Everything besides the chained hash that decides a block's bytes.

    ``model`` is a fingerprint of the weights (``model_fingerprint``), ``kv_dtype`` the
    cache's element type (``float32``, ``bfloat16``, ``int8`` …) and ``layout`` the shape of
    one block as stored (layers × K/V × block_size × KV heads × row).
    """

    model: str
    kv_dtype: str
    layout: str

    @property
    def namespace(self) -> bytes:
        """16 bytes naming (model, dtype, layout): the part of an address shared by all its blocks."""
        h = hashlib.sha256(ADDRESS_VERSION)
        for part in (self.model, self.kv_dtype, self.layout):
            h.update(len(part).to_bytes(4, "big"))
            h.update(part.encode())
        return h.digest()[:16]

    def address(self, chain_hash: bytes) -> bytes:
        """The content address of one block: namespace (16 bytes) + chained hash (32 bytes)."""
        if len(chain_hash) != HASH_BYTES:
            raise ValueError(f"a chained block hash has {HASH_BYTES} bytes, got {len(chain_hash)}")
        return self.namespace + chain_hash

    def key(self, chain_hash: bytes, prefix: str = "plimsoll:kv:") -> str:
        """The shared tier's key for one block (printable: ``prefix`` + hex address)."""
        return prefix + self.address(chain_hash).hex()


def layout_of(num_layers: int, block_size: int, num_kv_heads: int, row: int) -> str:
    """The ``layout`` string of a cache: ``L{layers}xKVx{block_size}x{heads}x{row}``."""
    return f"L{num_layers}xKVx{block_size}x{num_kv_heads}x{row}"


def model_fingerprint(config_json: str, named_tensors: Sequence[tuple[str, object]]) -> str:
    """A short fingerprint of a model: its config and, per weight, name, shape, dtype and a sample.

    Reading every weight would cost seconds on a large model; the first and last 64 values of
    each tensor tell two checkpoints of one architecture apart (a fine-tune changes them all)
    at a cost of microseconds per tensor.
    """
    import torch

    h = hashlib.sha256(config_json.encode())
    for name, tensor in named_tensors:
        assert isinstance(tensor, torch.Tensor)
        flat = tensor.detach().reshape(-1)
        sample = torch.cat([flat[:64], flat[-64:]]).to(device="cpu", dtype=torch.float32)
        h.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        h.update(sample.numpy().tobytes())
    return h.hexdigest()[:32]
