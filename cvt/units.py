"""Sizes as people type them: '5GB' (10^9), '64GiB' / '64G' (2^30), '1.5TB', '500MB', or bytes;
and counts and names as messages say them (`plural`, `article`)."""

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


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """``"1 weight file"``, ``"3 weight files"``: `n` and the noun in the number it takes
    (`nouns`: an irregular plural; default the noun + "s")."""
    return f"{n} {noun if n == 1 else (nouns or noun + 's')}"


def article(word: str) -> str:
    """``"an other-quantized"``, ``"a bf16"``: `word` after the indefinite article its first letter takes."""
    return f"{'an' if str(word)[:1].lower() in 'aeiou' and str(word)[:1] else 'a'} {word}"
