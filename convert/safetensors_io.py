"""Safetensors at the byte level: strict header parsing, mmap reads, streaming writes.

Why not only `safetensors.safe_open` / `save_file`: the library's writer needs every tensor of
a file in memory at once, and its reader keeps the whole file mapped, so touched pages stay
resident for the handle's lifetime. A 1 TB conversion needs one tensor at a time on both
sides. The format is tiny (8-byte little-endian header length, a JSON header, one data
buffer), so cvt parses headers itself - with messages that name the file and tensor - and
the tests use the safetensors library as the referee for everything written here.

Layout: ``[u64 N][N bytes JSON, space padded to 8][data]``; every tensor's
``data_offsets [a, b)`` are relative to the data buffer, contiguous and covering it.
"""

from __future__ import annotations

import json
import mmap
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from cvt.dtypes import DTYPES, torch_dtype
from cvt.errors import CheckpointError

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit
PAGE = mmap.PAGESIZE




def _no_duplicate_keys(where: str):
    def hook(pairs):
        seen: dict = {}
        for key, value in pairs:
            if key in seen:
                raise CheckpointError(f"{where}: key {key!r} is listed twice")
            seen[key] = value
        return seen

    return hook


def load_json(path: Path, what: str = "") -> dict:
    """Parse a JSON object, refusing duplicate keys (a tensor listed twice in an index)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:  # a binary file
        raise CheckpointError(f"{path}: not UTF-8 JSON text{what} (byte 0x{exc.object[exc.start]:02x} at offset "
                              f"{exc.start})") from None
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicate_keys(str(path)))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON{what}: {exc}") from exc
    except RecursionError:  # [[[[... nested beyond the parser's stack: no config is
        raise CheckpointError(f"{path}: JSON nested too deeply{what} (not a config cvt can read)") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a JSON object{what}, got {type(obj).__name__}")
    return obj


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor's bytes live: `path` plus absolute byte range [start, end)."""

    name: str
    path: Path
    dtype: str  # safetensors code, e.g. "F8_E4M3"
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def describe(self) -> str:
        return f"{self.name} ({self.dtype} {list(self.shape)}, {self.path.name})"


def read_header(path: Path) -> tuple[dict[str, TensorRef], dict[str, str]]:
    """Parse and validate one safetensors header.

    Returns (tensors by name in file order, __metadata__). Raises CheckpointError naming the
    file (and tensor) for: a file shorter than 8 bytes, a header length beyond the file, a
    header that is not a JSON object, unknown dtypes, byte sizes that disagree with
    shape x dtype, offsets past the end of the file, overlaps or holes in the data buffer.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(
                    f"{path}: truncated safetensors file ({size} bytes; the 8-byte header length is missing)"
                )
            hlen = int.from_bytes(head, "little")
            if hlen > size - 8:
                raise CheckpointError(
                    f"{path}: header length {hlen} exceeds the file ({size} bytes): truncated or not a safetensors file"
                )
            if hlen > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: header length {hlen} is over the {MAX_HEADER_BYTES}-byte limit")
            raw = f.read(hlen)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys(str(path)))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: safetensors header is not valid JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{path}: __metadata__ is not a JSON object")
    base = 8 + hlen
    data_len = size - base
    refs: list[TensorRef] = []
    for name, info in header.items():
        where = f"{path}: tensor {name}"
        if not isinstance(info, dict) or set(info) - {"dtype", "shape", "data_offsets"} or len(info) != 3:
            raise CheckpointError(f"{where}: header entry must have exactly dtype, shape, data_offsets")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in DTYPES:
            raise CheckpointError(f"{where}: unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise CheckpointError(f"{where}: shape {shape!r} is not a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise CheckpointError(f"{where}: data_offsets {offsets!r} is not [begin, end]")
        a, b = offsets
        ref = TensorRef(name, path, dtype, tuple(shape), base + a, base + b)
        if not 0 <= a <= b:
            raise CheckpointError(f"{where}: data_offsets [{a}, {b}] are not increasing")
        if b > data_len:
            raise CheckpointError(
                f"{where}: data_offsets [{a}, {b}] end past the end of the file (data section is {data_len} bytes): "
                "truncated file or lying header"
            )
        want = ref.numel * DTYPES[dtype][1]
        if b - a != want:
            raise CheckpointError(
                f"{where}: {b - a} bytes on disk but {dtype} {list(shape)} needs {want}"
            )
        refs.append(ref)
    expected = base
    for ref in sorted(refs, key=lambda r: (r.start, r.end)):
        if ref.start != expected:
            kind = "overlaps the previous tensor" if ref.start < expected else "leaves a hole before it"
            raise CheckpointError(f"{path}: tensor {ref.name} {kind} (starts at byte {ref.start - base} of the data)")
        expected = ref.end
    if expected != size:
        raise CheckpointError(
            f"{path}: {size - expected} bytes after the last tensor are not described by the header"
        )
    refs.sort(key=lambda r: r.start)
    return {r.name: r for r in refs}, {str(k): str(v) for k, v in metadata.items()}


class MappedFile:
    """A read-only (copy-on-write) mmap of one safetensors file, opened on first use."""

    def __init__(self, path: Path):
        self.path = path
        self._mm: mmap.mmap | None = None
        self._lock = threading.Lock()

    def _map(self) -> mmap.mmap:
        with self._lock:
            return self._map_locked()

    def _map_locked(self) -> mmap.mmap:
        if self._mm is None:
            try:
                with open(self.path, "rb") as f:
                    # ACCESS_COPY gives a writable buffer (torch.frombuffer wants one) whose
                    # pages stay file-backed until written, which cvt never does.
                    self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"{self.path}: cannot map: {exc}") from exc
        return self._mm

    def view(self, ref: TensorRef) -> memoryview:
        return memoryview(self._map())[ref.start : ref.end]

    def release(self, ref: TensorRef) -> None:
        """Drop the pages of `ref` from this process's resident set (they stay in the page cache)."""
        if self._mm is None or ref.nbytes == 0:
            return
        a = ref.start - ref.start % PAGE
        try:
            self._mm.madvise(mmap.MADV_DONTNEED, a, ref.end - a)
        except (AttributeError, OSError, ValueError):  # not on every platform; only an RSS nicety
            pass

    def close(self) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a tensor view is still alive; the GC unmaps it later
                pass
            self._mm = None


def tensor_from_view(view: memoryview, dtype: str, shape: tuple[int, ...]):
    """Zero-copy torch tensor over `view` (bytes of one tensor)."""
    import torch

    if len(view) == 0:
        return torch.empty(shape, dtype=torch_dtype(dtype))
    t = torch.frombuffer(view, dtype=torch.uint8)
    return t.view(torch_dtype(dtype)).reshape(shape)


# ----------------------------------------------------------------------------------------
# Writing


@dataclass(frozen=True)
class TensorSpec:
    """What a writer will put in a file: name, safetensors dtype code, shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = DTYPES[self.dtype][1]
        for d in self.shape:
            n *= d
        return n


def encode_header(specs: Iterable[TensorSpec], metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length plus JSON header for `specs` laid out in the given order.

    Deterministic (no timestamps, fixed key order), padded with spaces to a multiple of 8 as
    the safetensors library does, so that the data buffer is aligned.
    """
    header: dict = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for s in specs:
        header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw
