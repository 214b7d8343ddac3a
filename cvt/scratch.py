"""One cvt command's private temporary folder, removed when the command ends.

torch creates ``$TMPDIR/torchinductor_<user>`` as soon as ``torch._dynamo`` is imported (the
loader's imports reach it), and torchrun's agent a ``$TMPDIR/torchelastic_*`` log folder per
launch; neither is removed, so every `run`, `verify` and `export` left folders behind in the
user's temp directory. `scratch_dir` makes one ``cvt-*`` folder in the temp directory, points
torch's cache there (``TORCHINDUCTOR_CACHE_DIR``, unless the user chose one) and, through
`child_env`, the temp directory of the processes cvt starts (torchrun and its ranks), and
deletes it at the end. cvt compiles nothing, so nothing of value is lost with it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

_current: Path | None = None


@contextlib.contextmanager
def scratch_dir():
    """The command's private temporary folder (see the module docstring); the environment
    variables it sets are restored when it ends."""
    global _current
    if _current is not None:  # nested (a library caller inside a command): one folder
        yield _current
        return
    path = Path(tempfile.mkdtemp(prefix="cvt-"))
    saved = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if saved is None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path / "torchinductor")
    _current = path
    try:
        yield path
    finally:
        _current = None
        if saved is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        shutil.rmtree(path, ignore_errors=True)


def child_env(env: dict[str, str]) -> dict[str, str]:
    """`env` for a process cvt starts: its temp folder (``TMPDIR``: torchrun's log folders) is
    the command's private one, when there is one."""
    if _current is not None:
        env = {**env, "TMPDIR": str(_current)}
    return env


__all__ = ["scratch_dir", "child_env"]
