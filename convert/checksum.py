"""The per-file checksum of cvt's outputs: one place that hashes what cvt writes and checks it.

Each file a cvt output records (`cvt_manifest.json` files, the resume journal, the calibration
state, an ONNX export's manifest) carries its digest under the algorithm's name: new files
``"blake3"``, manifests written before BLAKE3 ``"sha256"``, which still verify and resume.

Why BLAKE3 (bench/checksum.py, docs/formats.md "Checksums"): the checksum makes resume and verification
safe; nothing downstream needs ours (huggingface_hub computes its own sha256 at upload). On the
2-core bench VM BLAKE3 (AVX-512) ran at ~4.3 GB/s a core from memory against sha256's ~1.5 GB/s
(with SHA extensions; ~0.2-0.5 GB/s without). xxh3-128 is faster still, but it is not collision
resistant: a file crafted to match a recorded digest would pass, which BLAKE3 rules out.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path

BLAKE3 = "blake3"
SHA256 = "sha256"
ALGORITHM = BLAKE3            # what new files are recorded with
ALGORITHMS = (BLAKE3, SHA256)  # every algorithm a record may carry, the preferred first


def hasher(algorithm: str = ALGORITHM):
    """A fresh incremental hasher (``update(bytes-like)``, ``hexdigest()``) for `algorithm`."""
    if algorithm == BLAKE3:
        import blake3  # a dependency (pyproject); imported here so the CLI's start does not pay it

        return blake3.blake3()
    if algorithm == SHA256:
        return hashlib.sha256()
    raise ValueError(f"unknown checksum algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})")


def file_digests(path: Path, algorithms=(ALGORITHM,), chunk: int = 16 << 20, progress=None) -> dict[str, str]:
    """algorithm -> hex digest of the bytes of `path`, every algorithm in one read of the file
    (a resume from an old sha256 journal checks sha256 and records BLAKE3 from one pass)."""
    hs = {a: hasher(a) for a in algorithms}
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            for h in hs.values():
                h.update(view[:n])
            if progress is not None:
                progress(n)
    return {a: h.hexdigest() for a, h in hs.items()}


def file_digest(path: Path, algorithm: str = ALGORITHM, chunk: int = 16 << 20, progress=None) -> str:
    """Hex digest of the bytes of `path` under `algorithm`."""
    return file_digests(path, (algorithm,), chunk, progress)[algorithm]


def recorded(rec) -> tuple[str, str] | None:
    """(algorithm, hex digest) a record carries -- a manifest `FileInfo` or a journal dict with
    a key named after its algorithm -- or None when it carries none cvt knows."""
    for a in ALGORITHMS:
        digest = rec.get(a) if isinstance(rec, Mapping) else getattr(rec, a, None)
        if isinstance(digest, str) and digest:
            return a, digest
    return None


def verify(path: Path, rec, progress=None) -> dict[str, str] | None:
    """The digests of `path` (its recorded algorithm's and `ALGORITHM`'s, in one read) when
    they match what `rec` records for it; None when they differ or `rec` records no digest."""
    got = recorded(rec)
    if got is None:
        return None
    algorithm, want = got
    digests = file_digests(path, tuple(dict.fromkeys((algorithm, ALGORITHM))), progress=progress)
    return digests if digests[algorithm] == want else None
