"""Per-request block tables on top of the block pool: allocation, prefix hits, freeing.

What it is: the only place that decides which blocks a request owns. What it is
not: a scheduler (it never chooses whom to preempt; it only says "no room").
"""

from plimsoll.runtime.engine.block_pool import BlockPool, KVCacheBlock
from plimsoll.runtime.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}

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
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self, req: Request, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock] | None = None
    ) -> bool:
        """Make room for ``num_new_tokens`` after the computed ones; False if blocks run out.

        ``new_computed_blocks`` are prefix-cache hits (only when the request has no
        blocks yet); they become the head of its block table.
        """
        hits = new_computed_blocks or []
        blocks = self.req_blocks.setdefault(req.request_id, [])
        num_computed = req.num_computed_tokens + len(hits) * self.block_size
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = num_required - len(blocks) - len(hits)
        # Hits that are free right now leave the free queue when touched.
        num_evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_evictable_hits:
            if not blocks:
                del self.req_blocks[req.request_id]
            return False
        self.pool.touch(hits)
        blocks.extend(hits)
        if num_new_blocks > 0:
            blocks.extend(self.pool.get_new_blocks(num_new_blocks))
        req.block_ids = [b.block_id for b in blocks]
        self._cache_full_blocks(req, blocks, num_computed + num_new_tokens)
        return True

    def _cache_full_blocks(self, req: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        # Registering before the forward pass is safe: each layer stores all of a
        # step's KV before any attention reads it, so a same-step hit sees it.
        if req.cache_salt is None:
            return
        req.update_block_hashes(self.block_size)
        num_full = min(num_tokens // self.block_size, len(req.block_hashes))
        for i in range(num_full):
            self.pool.cache_block(blocks[i], req.block_hashes[i])

    def free(self, req: Request) -> None:
        """Release the request's blocks, tail first, so shared heads stay cached longest."""
        blocks = self.req_blocks.pop(req.request_id, [])
        self.pool.free_blocks(reversed(blocks))
        req.block_ids = []

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
