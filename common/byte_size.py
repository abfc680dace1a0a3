"""Byte sizes as people write them: ``"80GiB"``, ``"512 MB"``, ``"24Gi"``, or a plain number.

What it is: the one parser for memory sizes on every command line and config
field (``plimsoll serve --kv-cache-memory``, ``plimsoll plan --gpu-memory``).
GB is decimal and GiB binary, as on a GPU's label and in Kubernetes quantities.
What it is not: a formatter, nor Kubernetes' full quantity grammar (no ``m``,
no exponents).
"""

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2,
    "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2,
    "gi": 1024**3, "gib": 1024**3, "ti": 1024**4, "tib": 1024**4,
}  # fmt: skip
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*")


def parse_bytes(value: str | int | float) -> int:
    """``"2GiB" -> 2147483648``; ``"512MB" -> 512000000``; plain numbers are bytes.

    Raises ValueError, saying how to write a size, on anything else or on a size
    that is not positive.
    """
    if isinstance(value, bool):  # bool is an int; True bytes is a mistake, not 1
        raise ValueError(f"expected a byte size like '2GiB' or 1073741824, got {value!r}")
    if isinstance(value, int | float):
        if int(value) <= 0:  # 0.2 bytes would floor to an empty budget
            raise ValueError(f"byte size must be a positive whole number of bytes, got {value!r}")
        return int(value)
    match = _SIZE.fullmatch(value)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"cannot read {value!r} as a byte size; write e.g. 80GiB, 512MB or 24Gi "
            "(B, KB, MB, GB, TB are powers of 1000; KiB, MiB, GiB, TiB powers of 1024)"
        )
    size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size <= 0:
        raise ValueError(f"byte size must be positive, got {value!r}")
    return size
