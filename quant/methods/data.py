"""Calibration data: ``--calib FILE`` (text or .jsonl) or the built-in sample, tokenized into
``[b, s]`` sequences for the calibrated methods, KV-cache scales and static activation scales."""

from __future__ import annotations

from pathlib import Path

import torch

from cvt.errors import CvtError


def check_calib(path: Path | str) -> Path:
    """`path` if it is a regular file; else CvtError saying what it is instead (a FIFO or
    /dev/zero would block or never end; neither is "no such file")."""
    path = Path(path)
    if not path.exists():
        raise CvtError(f"--calib {path}: no such file (the calibration file does not exist)")
    if path.is_dir():
        raise CvtError(f"--calib {path}: is a directory; give a text or .jsonl file")
    if not path.is_file():
        raise CvtError(f"--calib {path}: not a regular file (a FIFO, device or socket); give a text or .jsonl file")
    return path


def calib_tokens(tokenizer, calib: Path | str | None = None, *, seq_len: int = 512, max_sequences: int = 128,
                 max_len: int | None = None) -> torch.Tensor:
    """Token ids [b, s] for calibration: ``calib`` (text or .jsonl with "text"), or the
    built-in sample (`cvt.runtime.verify.SAMPLE_TEXT`) when None.

    All texts are tokenized (each with the tokenizer's BOS), concatenated and cut into up to
    `max_sequences` sequences of `seq_len` (capped at `max_len`, the model's positions); a text
    shorter than one sequence gives one shorter sequence. Only what these sequences use is read
    (`cvt.runtime.tokenizer.read_ids`). Missing / empty / non-regular files are errors."""
    from cvt.runtime.tokenizer import read_ids
    from cvt.runtime.verify import SAMPLE_TEXT

    if max_len:
        seq_len = min(seq_len, max_len)
    need = max_sequences * seq_len
    if calib is not None:
        path = check_calib(calib)
        ids, used = read_ids(tokenizer, path, need, option="--calib", skip_blank=True)
        if not used:
            raise CvtError(f"--calib {path}: no text to calibrate on (the file is empty; expected text, "
                           "or .jsonl lines with a \"text\" field)")
        where = str(path)
    else:
        ids, where = tokenizer.encode(SAMPLE_TEXT), "the built-in calibration sample"
    if len(ids) < 2:
        raise CvtError(f"{where}: {len(ids)} token(s), too few to calibrate")
    n = min(max_sequences, len(ids) // seq_len)
    if n == 0:
        return torch.tensor(ids[:seq_len], dtype=torch.long)[None]
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)
