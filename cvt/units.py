"""Numbers and words as people type and read them: sizes ('5GB' (10^9), '64GiB' / '64G' (2^30),
'1.5TB', '500MB', or bytes: `parse_size`, whole bytes from 1 to 2**63 - 1), sizes as messages
write them (`binary_size`: '11.49 GiB', '1.4 MiB'), counts and names as messages say them
(`plural`, `article`). The CLI's option types over them are in
`cvt.cli.options` (SIZE, FiniteFloat)."""

from __future__ import annotations

import decimal

from cvt.errors import CvtError

_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 10**3, "KIB": 2**10, "M": 2**20, "MB": 10**6, "MIB": 2**20,
          "G": 2**30, "GB": 10**9, "GIB": 2**30, "T": 2**40, "TB": 10**12, "TIB": 2**40}
MAX_SIZE = 2**63 - 1  # what a file offset or a C size can hold; more than any disk or memory


def parse_size(text: str | int) -> int:
    """Whole bytes of `text`, 1 .. `MAX_SIZE`; CvtError saying why not. With a unit a fraction is
    rounded down to whole bytes ('1.3GiB'); plain bytes must be whole ('0.5' is refused), and a
    size that rounds to 0 bytes ('1e-30GB'), NaN, infinity or 1e400 are refused."""
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise CvtError(f"size {text!r} is not a size like 5GB, 500MB or 64GiB")
    if isinstance(text, int):
        value, unit = decimal.Decimal(text), 1
    else:
        s = text.strip().upper().replace(" ", "")
        num = s.rstrip("KMGTIB")
        try:
            value, unit = decimal.Decimal(num), _UNITS[s[len(num):]]
        except (KeyError, decimal.InvalidOperation):
            raise CvtError(f"size {text!r} is not a size like 5GB, 500MB or 64GiB") from None
    if not value.is_finite() or value <= 0:
        raise CvtError(f"size {text!r} must be a finite number of bytes above 0, like 5GB, 500MB or 64GiB")
    if value > MAX_SIZE:  # before multiplying: 1e999999999 would overflow the decimal context
        raise CvtError(f"size {text!r} is more than {MAX_SIZE} bytes")
    exact = value * unit
    if unit == 1 and exact != exact.to_integral_value():
        raise CvtError(f"size {text!r} is not a whole number of bytes")
    n = int(exact)  # toward zero: whole bytes
    if n < 1:
        raise CvtError(f"size {text!r} is less than one byte")
    if n > MAX_SIZE:
        raise CvtError(f"size {text!r} is more than {MAX_SIZE} bytes")
    return n


BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def binary_size(n: float, digits: int = 2) -> str:
    """``"11.49 GiB"``, ``"1.43 MiB"``, ``"512 B"``: `n` bytes in the largest binary unit it holds
    at least one of (TiB at most), with `digits` decimals (whole bytes below 1 KiB), so that a
    size above 0 never reads as 0."""
    value = float(n)
    for unit in BINARY_UNITS:
        if abs(value) < 1024 or unit == BINARY_UNITS[-1]:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.{digits}f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """``"1 weight file"``, ``"3 weight files"``: `n` and the noun in the number it takes
    (`nouns`: an irregular plural; default the noun + "s")."""
    return f"{n} {noun if n == 1 else (nouns or noun + 's')}"


def article(word: str) -> str:
    """``"an other-quantized"``, ``"a bf16"``: `word` after the indefinite article its first letter takes."""
    return f"{'an' if str(word)[:1].lower() in 'aeiou' and str(word)[:1] else 'a'} {word}"
