"""Random paged-attention batches shared by the attention and kernel tests.

Ragged batches with GQA, shuffled non-contiguous block tables padded with -1, and
the cases every backend is compared on (decode-only, fresh prefills, prefix hits,
mixed, empty queries, no grouping).
"""

import torch

Args = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]


def make_batch(
    context_lens: list[int],
    q_lens: list[int],
    *,
    num_heads: int = 6,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    block_size: int = 4,
    seed: int = 0,
) -> Args:
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + 5  # spare blocks hold garbage nobody may read
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.full((len(context_lens), max(blocks_per_seq, default=0) + 2), -1, dtype=torch.int32)
    for b, n in enumerate(blocks_per_seq):
        block_tables[b, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens, dtype=torch.int32).cumsum(0)
    query = torch.randn((int(cu[-1]), num_heads, head_dim), generator=gen)
    return (
        query,
        k_cache,
        v_cache,
        block_tables,
        cu,
        torch.tensor(context_lens, dtype=torch.int32),
        head_dim**-0.5,
    )


CASES = {
    "decode only": ([37, 5, 16, 1, 90], [1, 1, 1, 1, 1]),
    "fresh prefills": ([37, 29, 3, 64], [37, 29, 3, 64]),
    "prefix hits": ([37, 29, 24], [5, 17, 1 + 23]),
    "mixed": ([37, 29, 24, 11, 8], [37, 5, 1, 1, 8]),
    "with empty queries": ([12, 9, 30], [0, 9, 1]),
    "no MHA grouping": ([20, 7], [20, 1]),
}
