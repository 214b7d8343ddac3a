"""Where a checkpoint's files may live, and where an output may go: one rule each.

Confinement. Every file cvt reads from a checkpoint (config.json, the index and the weight
files it names, the tokenizer and other files copied into an output, a manifest's file list)
must resolve, symlinks followed, to a path inside the checkpoint's confinement root, or it is
refused naming the path. The root is the checkpoint directory; for a Hugging Face hub
snapshot it is the repository's cache folder (``models--owner--name``), because a snapshot's
files are symlinks into its ``blobs/``. A symlink to ``/etc/shadow`` or to another model is
neither read nor copied into an artifact.

Disjointness. A writing verb's DST never overlaps its SRC: not the same directory, not inside
it, and SRC not inside DST. Together with the writer's rule that ``--overwrite`` deletes only
files an earlier cvt run recorded in DST's own manifest, no verb can delete or rewrite a
source file. A folder a reading verb writes (`verify --report`) may not be nor lie inside a
checkpoint it reads (`check_outside`).
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

from cvt.errors import CheckpointError, OutputError


def resolved(path: str | os.PathLike) -> Path:
    """`path` made absolute with every symlink followed (also when it does not exist yet)."""
    return Path(os.path.realpath(Path(path).expanduser()))


def is_inside(root: Path, path: Path) -> bool:
    """True when the resolved `path` is `root` or below it (both resolved)."""
    r, p = resolved(root), resolved(path)
    return p == r or r in p.parents


def confine(root: Path, path: Path, what: str = "file", error: type[Exception] = CheckpointError) -> Path:
    """`path` resolved, or `error` naming it when it leaves `root` (through a symlink or ``..``)."""
    target = resolved(path)
    if not is_inside(root, target):
        raise error(f"{path}: {what} resolves to {target}, outside the checkpoint directory {resolved(root)}; "
                    "cvt reads only files inside the checkpoint")
    return target


def relative_inside(root: Path, rel: object, where: str, what: str = "file path",
                    error: type[Exception] = CheckpointError, confine_root: Path | None = None) -> Path:
    """``root / rel`` for a relative path `rel` written in a checkpoint file (`where`: an index,
    a manifest); `error` when it is not a plain relative path or resolves outside
    `confine_root` (default `root`)."""
    if not isinstance(rel, str) or not rel:
        raise error(f"{where}: {what} {rel!r} is not a file name")
    pp = PurePosixPath(rel)
    if pp.is_absolute() or rel.startswith(("\\", "/")) or (len(rel) > 1 and rel[1] == ":"):
        raise error(f"{where}: {what} {rel!r} is absolute; paths must stay inside {root}")
    if any(part == ".." for part in pp.parts) or "\\" in rel:
        raise error(f"{where}: {what} {rel!r} escapes the checkpoint directory {root}")
    path = Path(root).joinpath(*pp.parts)
    if path.exists() or path.is_symlink():
        confine(root if confine_root is None else confine_root, path, what, error)
    return path


def check_disjoint(src: str | os.PathLike, dst: str | os.PathLike, verb: str) -> None:
    """OutputError unless DST and SRC are separate trees (neither is, nor contains, the other)."""
    s, d = resolved(src), resolved(dst)
    if d == s:
        raise OutputError(f"{dst}: DST is the source directory {s}; {verb} never writes into its source: "
                          "choose another DST")
    if s in d.parents:
        raise OutputError(f"{dst}: DST is inside the source directory {s}; choose a DST outside it")
    if d in s.parents:
        raise OutputError(f"{dst}: DST contains the source directory {s}; choose a DST that does not")


def check_outside(checkpoint: str | os.PathLike, path: str | os.PathLike, option: str, what: str) -> None:
    """OutputError unless `path` (resolved, symlinks followed) lies outside `checkpoint`, a
    checkpoint the verb reads (`what`: "candidate", "reference"); `option` names the path's option."""
    c, p = resolved(checkpoint), resolved(path)
    if p == c or c in p.parents:
        raise OutputError(f"{path}: {option} is inside the {what} checkpoint {c}; cvt never writes into a checkpoint "
                          "it reads: choose a folder outside it")


__all__ = ["resolved", "is_inside", "confine", "relative_inside", "check_disjoint", "check_outside"]
