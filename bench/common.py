"""What the benches share: `--dir` checked before any work, and a progress bar per row.

Imported by the bench scripts as `common` (they run as `python bench/NAME.py`, so bench/ is on
sys.path). cvt is imported only when a bar is made: the peers' inner processes run this file's
siblings in other virtual environments.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def scratch_dir(value: str) -> str:
    """argparse type of --dir: an existing, writable directory (argparse prints the one-line
    error and exits 2, before anything is built)."""
    p = Path(value)
    if not p.is_dir():
        raise argparse.ArgumentTypeError(f"{value}: no such directory (create it first)")
    if not os.access(p, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{value}: not writable")
    return value


def row_progress(total: int, desc: str, quiet: bool = False):
    """A progress bar on stderr for `total` rows of a bench (cvt's one progress bar)."""
    from cvt.progress import make_progress

    return make_progress(total, desc, quiet, unit="row")
