"""The SDPA torch backend (``attention_sdpa``) against the einsum-loop oracle (``attention_torch``).

Ragged batches with GQA, shuffled non-contiguous block tables padded with -1, fresh
prefills (the causal flash path), prefix hits (queries end a longer context),
decode-only and mixed batches, sequences with no query this step, and an empty step.
"""

import pytest
import torch
from attention_batches import CASES, make_batch

from plimsoll.runtime.attention import reference as attention_torch
from plimsoll.runtime.attention import sdpa as attention_sdpa


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
