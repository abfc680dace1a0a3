"""The fixed pool of KV blocks: reference counts, the free queue, the prefix-cache index.

What it is: pure-Python bookkeeping over block ids allocated once at start. A block
with ``ref_cnt == 0`` sits in the free queue; if it still carries a hash it stays
findable in the prefix cache until it is reused (lazy LRU eviction). What it is not:
per-request logic (``kv_cache_manager.py``) or the tensors themselves (``model_runner.py``).
"""

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(eq=False, slots=True)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set once the block is full and registered


class BlockPool:
    """``num_blocks`` blocks; evicts the least recently freed cached block first."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least 1 block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # Insertion order is eviction order: front = reused first. OrderedDict gives
        # O(1) removal from the middle when a cached free block is hit again.
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, KVCacheBlock] = {}
        # Called with (block id, hash) just before a cached block is reused for other contents
        # (the KV tiers copy it out; KV events announce it gone); and when the cache is reset.
        self.on_evicted: Callable[[int, bytes], None] | None = None
        self.on_cleared: Callable[[], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        """Fraction of blocks referenced by some request (cached-but-free counts as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, num: int) -> list[KVCacheBlock]:
        if num > self.num_free_blocks:
            raise ValueError(f"asked for {num} blocks, only {self.num_free_blocks} free")
        out = []
        for _ in range(num):
            _, block = self.free_queue.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                if self.on_evicted is not None:
                    self.on_evicted(block.block_id, block.block_hash)
            block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the free queue in the order given.

        Uncached blocks go to the front (nothing to lose by reusing them), cached
        ones to the back so their contents survive as long as possible.
        """
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed more often than referenced"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block
                if block.block_hash is None:
                    self.free_queue.move_to_end(block.block_id, last=False)

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> bool:
        """Register a full block under its chained hash (first writer wins on duplicates).

        True when this call registered it (not already cached, no other block under the hash).
        """
        if block.block_hash is not None:
            return False
        if block_hash not in self.cached:
            self.cached[block_hash] = block
            block.block_hash = block_hash
            return True
        return False

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            if block.ref_cnt == 0:
                self._evict(block)
        if self.on_cleared is not None:
            self.on_cleared()
