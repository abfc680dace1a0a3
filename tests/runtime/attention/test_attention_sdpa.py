"""The SDPA torch backend (``attention_sdpa``) against the einsum-loop oracle (``attention_torch``).

Ragged batches with GQA, shuffled non-contiguous block tables padded with -1, fresh
prefills (the causal flash path), prefix hits (queries end a longer context),
decode-only and mixed batches, sequences with no query this step, and an empty step.
"""

import pytest
import torch

from plimsoll.runtime.attention import reference as attention_torch
from plimsoll.runtime.attention import sdpa as attention_sdpa

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


@pytest.mark.parametrize("case", sorted(CASES))
def test_sdpa_paged_attention_equals_oracle(case: str) -> None:
    ctx, q = CASES[case]
    heads = (4, 4) if case == "no MHA grouping" else (6, 2)
    args = make_batch(ctx, q, num_heads=heads[0], num_kv_heads=heads[1])
    expected = attention_torch.paged_attention(*args)
    got = attention_sdpa.paged_attention(*args)
    assert got.shape == expected.shape
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_empty_step_gives_empty_output() -> None:
    args = make_batch([8], [1])
    empty = (
        args[0][:0],
        args[1],
        args[2],
        args[3][:0],
        torch.zeros(1, dtype=torch.int32),
        args[5][:0],
        args[6],
    )
    assert attention_sdpa.paged_attention(*empty).shape == (0, 6, 32)


def test_prefill_rows_of_a_mixed_batch_equal_a_prefill_only_batch() -> None:
    # The mixed path re-packs prefill rows; their outputs must not depend on decode batch-mates.
    ctx, q = [40, 17, 33], [40, 1, 6]
    args = make_batch(ctx, q, seed=3)
    mixed = attention_sdpa.paged_attention(*args)
    query, kc, vc, tables, _cu, lens, scale = args
    keep = [0, 2]
    rows = torch.cat([torch.arange(0, 40), torch.arange(41, 47)])
    cu_pre = torch.tensor([0, 40, 46], dtype=torch.int32)
    alone = attention_sdpa.paged_attention(query[rows], kc, vc, tables[keep], cu_pre, lens[keep], scale)
    torch.testing.assert_close(mixed[rows], alone)


def test_store_kv_equals_oracle_and_skips_padding() -> None:
    num_blocks, block_size, hkv, d = 6, 4, 3, 16
    gen = torch.Generator().manual_seed(1)
    key, value = torch.randn((2, 9, hkv, d), generator=gen)
    for padded in (False, True):
        slots = torch.randperm(num_blocks * block_size, generator=gen)[:9]
        if padded:
            slots[[2, 7]] = -1
        caches = [torch.zeros((num_blocks, block_size, hkv, d)) for _ in range(4)]
        attention_torch.store_kv(key, value, caches[0], caches[1], slots)
        attention_sdpa.store_kv(key, value, caches[2], caches[3], slots)
        assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
        assert int((caches[2].abs().sum(dim=(2, 3)) != 0).sum()) == (7 if padded else 9)
