"""The CPU KV cache's anonymous pages: zero at start, released in place, counted with mincore."""

import pytest
import torch

from plimsoll.runtime.engine import kv_pages

pytestmark = pytest.mark.skipif(not kv_pages.supported(), reason="needs madvise and mincore (Linux)")

SHAPE = (64, 16, 2, 64)  # 512 KiB of float32: whole pages


def test_a_fresh_cache_is_zero_and_resident_at_once() -> None:
    t = kv_pages.allocate(SHAPE, torch.float32)
    assert t.shape == SHAPE and t.dtype == torch.float32 and t.data_ptr() % kv_pages.PAGE == 0
    assert kv_pages.resident_bytes([t]) == t.nbytes  # taken at start, as the cache was sized
    assert float(t.abs().sum()) == 0.0


def test_release_gives_the_pages_back_in_place_and_they_read_as_zeros() -> None:
    t = kv_pages.allocate(SHAPE, torch.float32)
    t.fill_(3.0)
    address = t.data_ptr()
    assert kv_pages.resident_bytes([t]) == t.nbytes
    assert kv_pages.release(t) == t.nbytes
    assert kv_pages.resident_bytes([t]) == 0  # counted before anything reads them
    assert t.data_ptr() == address and float(t.abs().sum()) == 0.0
    kv_pages.populate(t)
    assert kv_pages.resident_bytes([t]) == t.nbytes and float(t.abs().sum()) == 0.0
    t[0].fill_(2.0)
    assert float(t.sum()) == 2.0 * t[0].numel()


def test_an_int8_cache_releases_its_whole_pages_and_keeps_the_edge() -> None:
    t = kv_pages.allocate((3, 5000), torch.int8)  # 15,000 bytes: whole pages and a partial one
    t.fill_(1)
    released = kv_pages.release(t)
    assert released == 15000 // kv_pages.PAGE * kv_pages.PAGE > 0
    flat = t.view(-1)
    assert int(flat[:released].abs().sum()) == 0
    assert bool((flat[released:] == 1).all())  # the last, partial page is not given back
