"""Kubernetes quantities ("16Gi", "500M", 4) as byte counts, for engine flags. Pure."""

import re
from decimal import Decimal

_SUFFIXES = {
    "": 1,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}  # fmt: skip
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?(k|[KMGTPE]i|[MGTPE])?$")


def to_bytes(quantity: int | str) -> int:
    """Bytes in a memory quantity; raise ValueError for anything that is not one."""
    if isinstance(quantity, int):
        return quantity
    match = _QUANTITY.match(quantity.strip())
    if match is None or (match.group(3) or "") not in _SUFFIXES:
        raise ValueError(f"{quantity!r} is not a memory quantity; write e.g. 8Gi, 8G or 8589934592")
    number, exponent, suffix = match.groups()
    value = Decimal(number) * (Decimal(10) ** int(exponent[1:]) if exponent else 1) * _SUFFIXES[suffix or ""]
    return int(value)
