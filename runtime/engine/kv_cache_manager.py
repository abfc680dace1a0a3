"""Per-request block tables on top of the block pool: allocation, prefix hits, freeing.

What it is: the only place that decides which blocks a request owns. What it is
not: a scheduler (it never chooses whom to preempt; it only says "no room").
"""

from typing import TYPE_CHECKING

from plimsoll.runtime.engine.block_pool import BlockPool, KVCacheBlock
from plimsoll.runtime.engine.request import Request

if TYPE_CHECKING:
    from plimsoll.runtime.kv.connector import KVConnector


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, connector: "KVConnector | None" = None) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        # KV tiers and events (runtime/kv/connector.py): evictions are offered to the host tier,
        # a primary miss may continue in it, registrations and evictions become KV events.
        self.connector = connector
        self._tier_blocks: dict[str, int] = {}  # request id -> blocks matched in the tiers, until allocated
        self.last_tier_tokens = 0  # of the last get_computed_blocks (the scheduler counts them apart)
        if connector is not None:
            self.pool.on_evicted = connector.on_evicted
            self.pool.on_cleared = connector.on_cleared

    @property
    def num_free_blocks(self) -> int:
        return int(self.pool.num_free_blocks)

    def usage(self) -> float:
        return float(self.pool.usage())

    def get_computed_blocks(self, req: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of the request's full blocks already in the cache, and its token count.

        Capped at ``num_tokens - 1`` so at least one token is recomputed to get logits.
        """
        if req.cache_salt is None:
            return [], 0
        req.update_block_hashes(self.block_size)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in req.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        num_tier = 0
        if self.connector is not None:
            # The run goes on in the host tier (blocks loaded back instead of recomputed).
            num_tier = self.connector.match(req, len(hits), max_blocks)
            self._tier_blocks[req.request_id] = num_tier
        self.last_tier_tokens = num_tier * self.block_size
        return hits, (len(hits) + num_tier) * self.block_size

    def allocate_slots(
        self, req: Request, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock] | None = None
    ) -> bool:
        """Make room for ``num_new_tokens`` after the computed ones; False if blocks run out.

        ``new_computed_blocks`` are prefix-cache hits (only when the request has no
        blocks yet); they become the head of its block table.
        """
        hits = new_computed_blocks or []
        blocks = self.req_blocks.setdefault(req.request_id, [])
        num_tier = self._tier_blocks.pop(req.request_id, 0) if new_computed_blocks is not None else 0
        num_computed = req.num_computed_tokens + (len(hits) + num_tier) * self.block_size
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = num_required - len(blocks) - len(hits)
        # Hits that are free right now leave the free queue when touched.
        num_evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_evictable_hits:
            if not blocks:
                del self.req_blocks[req.request_id]
            if num_tier and self.connector is not None:
                self.connector.release(req)
            return False
        self.pool.touch(hits)
        blocks.extend(hits)
        if num_new_blocks > 0:
            blocks.extend(self.pool.get_new_blocks(num_new_blocks))
        loaded = range(len(hits), len(hits) + num_tier)
        if num_tier and self.connector is not None:
            self.connector.take_match(req, [blocks[i].block_id for i in loaded])
        req.block_ids = [b.block_id for b in blocks]
        self._cache_full_blocks(req, blocks, num_computed + num_new_tokens, loaded)
        return True

    def _cache_full_blocks(
        self, req: Request, blocks: list[KVCacheBlock], num_tokens: int, loaded: range = range(0)
    ) -> None:
        # Registering before the forward pass is safe: each layer stores all of a
        # step's KV before any attention reads it, so a same-step hit sees it.
        if req.cache_salt is None:
            return
        req.update_block_hashes(self.block_size)
        num_full = min(num_tokens // self.block_size, len(req.block_hashes))
        for i in range(num_full):
            if self.pool.cache_block(blocks[i], req.block_hashes[i]) and self.connector is not None:
                self.connector.on_cached(req, i, blocks[i].block_id, loaded=i in loaded)

    def free(self, req: Request) -> None:
        """Release the request's blocks, tail first, so shared heads stay cached longest."""
        blocks = self.req_blocks.pop(req.request_id, [])
        self.pool.free_blocks(reversed(blocks))
        req.block_ids = []

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
