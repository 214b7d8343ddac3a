"""SRC's content identity: what a resumable run checks the state an earlier run left in DST
against (the calibration state ``DST/.cvt-calib``, `cvt.quant.methods.stream`), so that a
state computed from another checkpoint is never consumed.

Names, sizes and modification times do not tell two checkpoints apart (a fine-tune has its
base's tensor names, shapes and file sizes; ``touch -r`` or a copy keeps mtimes), and a mere
``touch`` of an unchanged SRC must not throw hours of calibration away; hashing every byte
of a 700 GB source on each run is minutes of I/O. So the identity is content, read cheaply:
per weight file its size, the sha256 of its safetensors header (every tensor's name, dtype,
shape and offset) and of `SAMPLES` blocks of `BLOCK` bytes spread evenly over its data (a
file up to `WHOLE` bytes is hashed whole), plus the checksum recorded for it in SRC's
cvt manifest when SRC is a cvt output; and the sha256 of config.json and the weight index. A
different checkpoint with the same names and sizes (a fine-tune changes nearly every weight)
differs in the sampled blocks; an in-place edit of a few bytes between samples is not seen
(re-run with ``--no-resume`` after editing SRC in place).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from cvt.convert import checksum
from cvt.errors import CheckpointError, ManifestError

BLOCK = 4096       # bytes per sampled block (a page: one read each)
SAMPLES = 64       # blocks per weight file: ~10k reads for a 163-file DeepSeek-V3
WHOLE = 1 << 20    # a weight file up to this size is hashed whole


def source_identity(ckpt) -> dict[str, str]:
    """name -> digest for config.json, the weight index and every weight file of `ckpt` (a
    `cvt.convert.reader.Checkpoint`), as the module doc describes; equal dicts, same content."""
    out = {"config.json": ckpt.config_sha256 or ""}
    if ckpt.index_path is not None:
        out[ckpt.index_path.name] = ckpt.index_sha256 or ""
    recorded: dict[str, str] = {}
    if ckpt.has_manifest:
        try:
            recorded = {f.path: checksum.recorded(f)[1] for f in ckpt.manifest.files} \
                if ckpt.manifest is not None else {}
        except ManifestError:  # refused where the manifest is used; here it only adds nothing
            recorded = {}
    for path in ckpt.weight_files:
        try:
            rel = str(path.relative_to(ckpt.root))
        except ValueError:
            rel = path.name
        out[rel] = file_identity(path, recorded.get(rel, ""))
    return out


def file_identity(path: Path, recorded: str = "") -> str:
    """sha256 over one weight file's size, header and sampled data blocks (module doc), plus
    `recorded` (its checksum in SRC's manifest, if any)."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            h.update(f"{size}:{recorded}:".encode())
            if size <= WHOLE:
                h.update(f.read())
                return h.hexdigest()
            head = f.read(8)
            base = 8 + min(int.from_bytes(head, "little"), size - 8)  # the index checked the header
            h.update(head + f.read(base - 8))
            span = size - base - BLOCK
            for k in range(SAMPLES):
                h.update(os.pread(f.fileno(), BLOCK, base + max(0, span) * k // (SAMPLES - 1)))
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc.strerror or exc}") from None
    return h.hexdigest()
