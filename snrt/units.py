"""Byte sizes written by people: 12GiB, 512MB, 1e9, 1073741824."""

import math
import numbers
import re
from typing import NewType

Bytes = NewType("Bytes", int)  # the type of a settings field written as a byte size (parsed by parse_bytes)

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
MAX_BYTES = 2**62  # 4 EiB: far beyond any device, small enough for int64 arithmetic
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*$")


def is_count(value, least=1):
    """Whether `value` is an int (a bool is not one) of at least `least`: a batch, a number of
    ranks or threads, a number of iterations (least 0)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= least


def parse_bytes(value):
    """An int number of bytes from an int or a string such as "12GiB" or "1.5 GB".

    Raises ValueError with the accepted forms when `value` is not one of them.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a byte size such as 12GiB, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"expected a non-negative byte size, got {value}")
        return _at_most_max(value)
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"expected a finite byte size such as 12GiB, got {value!r}")
    if isinstance(value, float) and value >= 0 and value == int(value):
        return _at_most_max(int(value))
    match = _PATTERN.match(value) if isinstance(value, str) else None
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"expected a byte size such as 12GiB, 512MiB, 8GB or 1000000, got {value!r}")
    unit = _UNITS[match.group(2).lower()]
    size = float(match.group(1)) * unit
    if not math.isfinite(size):
        raise ValueError(f"expected a finite byte size such as 12GiB, got {value!r}")
    if unit == 1 and size != int(size):
        raise ValueError(f"expected a whole number of bytes, got {value!r}: add a unit, such as {match.group(1)}GiB")
    return _at_most_max(int(size))


def _at_most_max(size):
    if size > MAX_BYTES:
        raise ValueError(f"expected a byte size of at most 4EiB, got {size}")
    return size
