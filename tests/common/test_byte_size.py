"""The one byte-size parser: decimal and binary units, plain numbers, and errors that say how to write one."""

import pytest

from plimsoll.byte_size import parse_bytes


@pytest.mark.parametrize(
    ("text", "size"),
    [("80GiB", 80 * 2**30), ("80GB", 80 * 10**9), ("24Gi", 24 * 2**30), ("512 MiB", 512 * 2**20),
     ("1.5kb", 1500), ("4096", 4096), (" 2 TiB ", 2 * 2**40), (4096, 4096), (1e9, 10**9)],
)  # fmt: skip
def test_sizes_in_every_spelling(text: str | int | float, size: int) -> None:
    assert parse_bytes(text) == size


@pytest.mark.parametrize("bad", ["lots", "80 GiBs", "-1GiB", "GiB", ""])
def test_unreadable_sizes_say_how_to_write_one(bad: str) -> None:
    with pytest.raises(ValueError, match=r"write e\.g\. 80GiB"):
        parse_bytes(bad)


@pytest.mark.parametrize("bad", [0, -5, 0.2, "0MiB", True])
def test_sizes_must_be_positive_bytes(bad: object) -> None:
    with pytest.raises(ValueError, match="byte size"):
        parse_bytes(bad)  # type: ignore[arg-type]
