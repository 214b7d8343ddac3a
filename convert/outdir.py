"""DST during a run: the lock, the journal of finished files, and the final manifest.

`OutputDir` is entered before anything in DST is touched: it refuses a DST that overlaps the
source (`cvt.convert.paths.check_disjoint`), locks DST (flock: a second concurrent run is
refused; the kernel drops the lock when a run dies, even by kill -9), and decides what an
earlier run left there: a resumable run of the same plan (its finished files are kept when
size and sha256 still match), another run's output or foreign files (refused unless
``--overwrite``, which then deletes only what that run's manifest recorded writing).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import threading
from pathlib import Path

from cvt.convert.paths import check_disjoint, is_inside
from cvt.convert.reader import MANIFEST_NAME, read_manifest
from cvt.convert.safetensors_io import AtomicFile, sha256_file, write_bytes_atomic, write_json_atomic
from cvt.errors import ManifestError, OutputError
from cvt.schemas.manifest import FileInfo, Manifest

STATE_NAME = ".cvt-state.json"


class OutputDir:
    """DST during a run: lock, state journal of finished files, final manifest.

    `source`: the checkpoint directory the run reads; DST may not be it, lie inside it or
    contain it (`cvt.convert.paths.check_disjoint`), checked before anything in DST is touched."""

    def __init__(self, dst: Path, plan: str, resume: bool = True, overwrite: bool = False,
                 source: Path | None = None, verb: str = "cvt"):
        self.dst = Path(dst)
        self.plan = plan
        self.resume = resume
        self.overwrite = overwrite
        self.source, self.verb = source, verb
        self._fd: int | None = None
        self._state: dict[str, dict] = {}
        self._lock = threading.Lock()
        self.prior_meta: dict[str, dict] = {}  # meta by key from a complete earlier manifest

    def __enter__(self) -> "OutputDir":
        dst = self.dst
        if self.source is not None:
            check_disjoint(self.source, dst, self.verb)
        if dst.exists() and not dst.is_dir():
            raise OutputError(f"{dst}: exists and is not a directory")
        try:
            dst.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(dst, os.O_RDONLY)
        except OSError as exc:
            raise OutputError(f"{dst}: cannot create the output directory: {exc.strerror or exc}") from exc
        try:
            lock_dst(self._fd, dst)
        except OutputError:
            os.close(self._fd)
            self._fd = None
            raise
        if not os.access(dst, os.W_OK):
            self.__exit__()
            raise OutputError(f"{dst}: not writable")
        try:
            self._load()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            unlock_dst(self._fd)
            os.close(self._fd)  # closing the descriptor drops the flock (if this one took it)
            self._fd = None

    # -- state --------------------------------------------------------------------------
    def _load(self) -> None:
        state_path = self.dst / STATE_NAME
        prior_plan, records, invalid = None, {}, None
        if state_path.is_file():
            try:
                data = json.loads(state_path.read_text())
                prior_plan, records = data["plan_id"], data["files"]
            except (ValueError, KeyError, TypeError):
                prior_plan, records = "unreadable", {}
        else:
            try:
                manifest = read_manifest(self.dst)
            except ManifestError as exc:
                manifest, prior_plan, invalid = None, "unreadable", str(exc)
            if manifest is not None:
                prior_plan = manifest.plan_id
                records = {f.path: {"size": f.size, "sha256": f.sha256, "tensors": f.tensors} for f in manifest.files}
                self.prior_meta = {k: v.model_dump() for k, v in manifest.quant.tensors.items()} if manifest.quant else {}
        if prior_plan is None:
            visible = sorted(p.name for p in self.dst.iterdir() if not p.name.startswith("."))
            if visible and not self.overwrite:
                raise OutputError(
                    f"{self.dst}: not empty ({len(visible)} entries, e.g. {visible[0]}) and not a cvt output to resume; "
                    "choose an empty directory or pass --overwrite"
                )
        elif prior_plan != self.plan and not self.overwrite:
            what = f"an invalid cvt manifest ({invalid})" if invalid else \
                "the output of a different run (other source, stage or parameters)"
            raise OutputError(f"{self.dst}: holds {what}; choose another directory or pass --overwrite")
        # a killed cvt run's half-written files (sharded outputs keep theirs in rank-*/ folders);
        # only now that DST is known to be ours (an empty dir, a cvt output, or --overwrite)
        for tmp in [*self.dst.glob(".*.tmp"), *self.dst.glob("rank-*/.*.tmp")]:
            tmp.unlink(missing_ok=True)
        if self.resume and prior_plan == self.plan:
            self._state = dict(records)
        else:  # every file is rewritten: no manifest may claim the old ones meanwhile
            (self.dst / MANIFEST_NAME).unlink(missing_ok=True)
        if prior_plan is not None and prior_plan != self.plan:
            # --overwrite of another run's output: remove what that run recorded writing (and
            # nothing else: paths are confined to DST), so that no stale shard or manifest
            # survives next to ours
            for rel in records:
                _unlink_inside(self.dst, rel)
            (self.dst / MANIFEST_NAME).unlink(missing_ok=True)
        self._save()

    def _save(self) -> None:
        write_json_atomic(self.dst / STATE_NAME, {"plan_id": self.plan, "files": self._state})

    def finished(self, rel: str, keys: set[str] = frozenset()) -> tuple[FileInfo, dict] | None:
        """(record, meta) of `rel` if an earlier run finished it, the file still matches, and the
        stage metadata for `keys` is known; else None (the file is rewritten)."""
        rec = self._state.get(rel)
        path = self.dst / rel
        if not rec or not path.is_file() or path.stat().st_size != rec["size"]:
            return None
        known = {**self.prior_meta, **(rec.get("meta") or {})}
        if not keys <= set(known):
            return None
        if sha256_file(path) != rec["sha256"]:
            return None
        info = FileInfo(path=rel, size=rec["size"], sha256=rec["sha256"], tensors=rec.get("tensors", 0))
        return info, {k: known[k] for k in keys}

    def record(self, info: FileInfo, meta: dict | None = None) -> None:
        with self._lock:
            self._state[info.path] = {"size": info.size, "sha256": info.sha256, "tensors": info.tensors,
                                      "meta": meta or {}}
            self._save()

    def write_json(self, rel: str, obj) -> FileInfo:
        """A small JSON file (indented, UTF-8, trailing newline), atomically."""
        return self.write_small(rel, (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode())

    def write_small(self, rel: str, data: bytes, tensors: int = 0) -> FileInfo:
        size, sha = write_bytes_atomic(self.dst / rel, data)
        return FileInfo(path=rel, size=size, sha256=sha, tensors=tensors)

    def copy_file(self, src: Path, rel: str) -> FileInfo:
        with AtomicFile(self.dst / rel) as f, open(src, "rb") as fin:
            shutil.copyfileobj(fin, _Sink(f), 16 << 20)
            size, sha = f.commit()
        return FileInfo(path=rel, size=size, sha256=sha)

    def finish(self, manifest: Manifest) -> None:
        write_bytes_atomic(self.dst / MANIFEST_NAME, manifest_bytes(manifest))
        (self.dst / STATE_NAME).unlink(missing_ok=True)


def lock_fd(fd: int, dst: Path) -> None:
    """Take the exclusive run lock on `fd` (DST's directory, or a lock file beside DST): a second
    cvt run on the same DST is refused; the kernel drops the lock when the holder dies."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        raise OutputError(f"{dst}: another cvt run is writing to this directory (it is locked); wait for it or "
                          "choose another DST") from None


# DSTs this process holds locked, by (st_dev, st_ino) -> nesting count: a quantize run locks DST
# before it calibrates (`calibration_dir`) and its writer's `OutputDir` enters the same DST
# later; a second flock from this process would be refused (flock locks belong to one open
# file description), so the inner one finds the lock already held and takes nothing.
_HELD: dict[tuple[int, int], int] = {}
_HELD_LOCK = threading.Lock()


def lock_dst(fd: int, dst: Path) -> None:
    """`lock_fd` on DST's directory descriptor, unless this process already holds DST's lock."""
    st = os.fstat(fd)
    key = (st.st_dev, st.st_ino)
    with _HELD_LOCK:
        if key not in _HELD:
            lock_fd(fd, dst)
        _HELD[key] = _HELD.get(key, 0) + 1


def unlock_dst(fd: int) -> None:
    """Undo one `lock_dst` (the flock itself goes when its descriptor is closed)."""
    st = os.fstat(fd)
    key = (st.st_dev, st.st_ino)
    with _HELD_LOCK:
        if _HELD.get(key, 0) <= 1:
            _HELD.pop(key, None)
        else:
            _HELD[key] -= 1


def _unlink_inside(root: Path, rel: str) -> None:
    path = Path(root) / rel
    if not path.is_symlink() and is_inside(root, path) and path.is_file():
        path.unlink()


class _Sink:
    def __init__(self, f: AtomicFile):
        self.f = f

    def write(self, b) -> None:
        self.f.write(b)


def manifest_bytes(manifest: Manifest) -> bytes:
    return (manifest.model_dump_json(indent=2) + "\n").encode()


@contextlib.contextmanager
def calibration_dir(source: Path, dst: Path, overwrite: bool, resume: bool):
    """DST's hidden calibration state folder (``.cvt-calib``, `cvt.quant.methods.stream`), for a
    stage that calibrates before it writes: DST checked first as `OutputDir` will (not SRC, not
    foreign files unless --overwrite), DST locked for the whole run from here on, calibration
    included (a second run on DST is refused while this one calibrates; `OutputDir` finds the
    lock held), the folder cleared with --no-resume, and removed once the stage finished."""
    check_disjoint(source, dst, "quantize")
    if dst.exists() and not dst.is_dir():
        raise OutputError(f"{dst}: exists and is not a directory")
    if dst.is_dir() and not overwrite and not (dst / STATE_NAME).is_file() and not (dst / MANIFEST_NAME).is_file():
        visible = sorted(p.name for p in dst.iterdir() if not p.name.startswith("."))
        if visible:
            raise OutputError(f"{dst}: not empty ({len(visible)} entries, e.g. {visible[0]}) and not a cvt output to "
                              "resume; choose an empty directory or pass --overwrite")
    state = dst / ".cvt-calib"
    if state.is_symlink() or (state.exists() and not state.is_dir()):
        raise OutputError(f"{state}: exists and is not a folder (cvt keeps its calibration state there); "
                          "remove it or choose another DST")
    try:
        dst.mkdir(parents=True, exist_ok=True)
        fd = os.open(dst, os.O_RDONLY)
    except OSError as exc:
        raise OutputError(f"{dst}: cannot create the output directory: {exc.strerror or exc}") from None
    locked = False
    try:
        lock_dst(fd, dst)
        locked = True
        try:
            state.mkdir(exist_ok=True)
        except OSError as exc:
            raise OutputError(f"{state}: cannot create the calibration state folder: {exc.strerror or exc}") from None
        if not resume:
            for p in state.iterdir():
                if p.name != ".lock":
                    p.unlink()
        yield state
        shutil.rmtree(state, ignore_errors=True)
    finally:
        if locked:
            unlock_dst(fd)
        os.close(fd)
