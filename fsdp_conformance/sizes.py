"""Byte sizes and world sizes: the one formatter and the two parsers (stdlib only).

Each caller keeps its own error type: the parsers raise :class:`ValueError` with the message,
and settings resolution wraps it as a ``SettingsError``, the planner as a ``PlanError``.
"""

from __future__ import annotations

import re
from typing import Literal

#: Decimal megabyte, the unit of the memory claim's bound and messages.
MB = 1e6
#: Binary mebibyte, the unit of reports, compare, plots and the init claim.
MiB = 2**20
KiB = 2**10

#: Units ``parse_bytes`` accepts (case-insensitive): decimal as device memory is quoted, and
#: binary with an ``i``.
UNITS_OF_BYTES = {
    "": 1,
    "B": 1,
    "KB": 1e3,
    "MB": 1e6,
    "GB": 1e9,
    "TB": 1e12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}

#: The formats in use:
#: ``binary``: MiB, or KiB below one MiB (reports: small models' units would all read 0.00 MiB);
#: ``decimal``: the largest of TB/GB/MB/KB that fits, else whole bytes (the planner, for device
#: sizes given in GB); ``iec``: the largest of TiB/GiB/MiB/KiB that fits, else whole bytes (the
#: planner's default: devices report their memory in GiB); ``MB``: always decimal MB (the
#: memory claim's messages).
ByteStyle = Literal["binary", "decimal", "iec", "MB"]

_DECIMAL_UNITS = (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3))
_IEC_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def format_bytes(n: float, style: ByteStyle = "binary") -> str:
    """``n`` bytes as text, with two decimals (one for KiB), in one of :data:`ByteStyle`."""
    if style == "binary":
        if abs(n) < MiB:
            return f"{n / KiB:.1f} KiB"
        return f"{n / MiB:.2f} MiB"
    if style in ("decimal", "iec"):
        for unit, size in _DECIMAL_UNITS if style == "decimal" else _IEC_UNITS:
            if abs(n) >= size:
                return f"{n / size:.2f} {unit}"
        return f"{int(n)} B"
    if style == "MB":
        return f"{n / MB:.2f} MB"
    raise ValueError(f"unknown byte style {style!r}; use one of binary, decimal, iec, MB")


def size_style(n: int) -> ByteStyle:
    """How a size the user gave is shown back: ``iec`` (GiB) for a whole number of MiB, as
    ``80GiB`` parses, ``decimal`` (GB) otherwise, as ``80GB`` (80 x 10^9 B) parses."""
    return "iec" if n % MiB == 0 else "decimal"


def parse_bytes(text: str, what: str = "--device-memory", allow_zero: bool = False) -> int:
    """``80GB``, ``141 GB``, ``80GiB``, ``8e10``: bytes (GB = 10^9 B, GiB = 2^30 B).

    ``what`` names the input in the message (the flag it came from); ``allow_zero`` accepts 0.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in UNITS_OF_BYTES:
        raise ValueError(f"{what} {text!r} is not a size; write e.g. 80GB, 141GB or 80GiB")
    value = float(m.group(1)) * UNITS_OF_BYTES[unit]
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{what} {text!r} must be positive")
    return int(value)


def parse_world_sizes(text: str) -> tuple[int, ...]:
    """``"2,4"`` or ``"2 4"``: world sizes, in order, duplicates dropped.

    Digits only: ``+3`` and ``-1`` are refused as written rather than read by ``int()``.
    """
    sizes = []
    for part in str(text).replace(" ", ",").split(","):
        if not part:
            continue
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"{part!r} is not a positive integer")
        sizes.append(int(part))
    if not sizes:
        raise ValueError("no world size given")
    # A duplicate would run (or plan) the same world twice.
    return tuple(dict.fromkeys(sizes))
