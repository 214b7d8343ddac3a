"""Calibration data: ``--calib FILE`` (text or .jsonl) or the built-in calibration set, tokenized
into ``[b, s]`` sequences for the calibrated methods, KV-cache scales and static activation scales.

The built-in set is the "calibration" slice of the running Python's standard library source
(`cvt.corpus`: the language reference's prose interleaved with modules; about 1 MB, more than
``--calib-tokens``' default of 32768 tokens with any tokenizer). The default is a bound: when the
text gives fewer tokens, one warning says how many were used. A count the user gave is a demand:
a text that gives fewer tokens is refused, naming ``--calib-tokens``, the asked and the available
counts, before any calibration work (rather than silently calibrating on less)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from cvt.errors import CvtError

log = logging.getLogger(__name__)


def check_calib(path: Path | str) -> Path:
    """`path` if it is a regular file; else CvtError saying what it is instead (a FIFO or
    /dev/zero would block or never end; neither is "no such file")."""
    path = Path(path)
    if not path.exists():
        raise CvtError(f"--calib {path}: no such file (the calibration file does not exist)")
    if not path.is_file():
        from cvt.convert.reader import file_kind

        raise CvtError(f"--calib {path}: not a regular file ({file_kind(path)}); give a text or .jsonl file")
    return path


def calib_tokens(tokenizer, calib: Path | str | None = None, *, seq_len: int = 512, max_sequences: int = 128,
                 max_len: int | None = None, asked: int | None = None) -> torch.Tensor:
    """Token ids [b, s] for calibration: ``calib`` (text or .jsonl with "text"), or the built-in
    calibration set (`cvt.corpus`, slice "calibration") when None.

    Asked for: ``max_sequences * seq_len`` tokens. The texts are tokenized (each with the
    tokenizer's BOS), concatenated and cut into sequences of `seq_len`; when `max_len` (the
    model's positions) is shorter, sequences of `max_len` are cut, more of them, to the same
    total. A text shorter than one sequence gives one shorter sequence. Only what is used is
    read (`cvt.runtime.tokenizer.read_ids`; the built-in set a piece at a time). Fewer tokens
    than asked log one warning, unless `asked` (``--calib-tokens`` as the user gave it) is more
    than the text gives: a CvtError naming both counts. Missing / empty / non-regular files are errors."""
    from cvt.runtime.tokenizer import read_ids

    want = max_sequences * seq_len
    need = max(want, asked or 0)  # enough to tell whether the text holds `asked` tokens
    if max_len:
        seq_len = min(seq_len, max_len)
    if calib is not None:
        path = check_calib(calib)
        ids, used = read_ids(tokenizer, path, need, option="--calib", skip_blank=True)
        if not used:
            raise CvtError(f"--calib {path}: no text to calibrate on (the file is empty; expected text, "
                           "or .jsonl lines with a \"text\" field)")
        where = f"--calib {path}"
    else:
        where = "the built-in calibration set"
        ids = _builtin_ids(tokenizer, need)
    if asked is not None and len(ids) < asked:
        more = "a --calib file with more text" if calib is None else "a longer --calib file"
        raise CvtError(f"--calib-tokens {asked}: more than the {len(ids)} tokens {where} gives with this model's "
                       f"tokenizer; give --calib-tokens {len(ids)} or fewer, or {more}")
    ids = ids[:want]
    if len(ids) < 2:
        raise CvtError(f"{where}: {len(ids)} token(s), too few to calibrate")
    n = min(want // seq_len, len(ids) // seq_len)
    got = n * seq_len if n else min(len(ids), seq_len)
    if got < want:
        log.warning("%s gives %d calibration tokens, fewer than the %d asked for (--calib-tokens); "
                    "calibrating on %d", where, len(ids), want, got)
    if n == 0:
        return torch.tensor(ids[:seq_len], dtype=torch.long)[None]
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def _builtin_ids(tokenizer, want: int) -> list[int]:
    """The built-in set tokenized a piece at a time (one BOS at the start) until `want` tokens:
    a big model's tokenizer need not read the whole megabyte."""
    from cvt import corpus

    ids: list[int] = []
    for piece in corpus.chunks(corpus.text("calibration"), 65536):
        part = tokenizer.encode(piece)
        ids += part if not ids or not part or part[0] != getattr(tokenizer, "bos_id", None) else part[1:]
        if len(ids) >= want:
            break
    return ids
