"""Sizes as people type them: '5GB' (10^9), '64GiB' / '64G' (2^30), '1.5TB', '500MB', or bytes."""

from __future__ import annotations

from cvt.errors import CvtError

_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 10**3, "KIB": 2**10, "M": 2**20, "MB": 10**6, "MIB": 2**20,
          "G": 2**30, "GB": 10**9, "GIB": 2**30, "T": 2**40, "TB": 10**12, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    if isinstance(text, int):
        return text
    s = str(text).strip().upper().replace(" ", "")
    num = s.rstrip("KMGTIB")
    try:
        value = float(num)
        unit = _UNITS[s[len(num):]]
    except (KeyError, ValueError):
        value, unit = -1.0, 0
    if value <= 0 or unit == 0:
        raise CvtError(f"size {text!r} is not a size like 5GB, 500MB or 64GiB")
    return int(value * unit)
