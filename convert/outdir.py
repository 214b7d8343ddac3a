"""DST during a run: the lock, the journal of finished files, and the final manifest.

`OutputDir` is entered before anything in DST is touched: it refuses a DST that overlaps the
source (`cvt.convert.paths.check_disjoint`), locks DST (flock: a second concurrent run is
refused; the kernel drops the lock when a run dies, even by kill -9), and decides what an
earlier run left there: a resumable run of the same plan (its finished files are kept when
size and checksum still match), another run's output or foreign files (refused unless
``--overwrite``, which then deletes only what that run's manifest recorded writing, and never
replaces a file it did not record).

In a world of several ranks (`cvt.world`), rank 0 does all of that and the others follow with
its view of DST (which files are finished, what is foreign): each rank writes its share of the
files and journals them in its own ``.cvt-state.r{R}.json``, which rank 0 merges into the
journal when a later run (of any world size) enters DST.

`owned_dir` is the one way a stage makes or clears a folder of its own under DST (the
calibration state, rank directories, temporary folders): it must be a real directory there,
never a symlink (through which a clean-up would delete, or a writer write, outside DST).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import stat
import threading
from pathlib import Path

from cvt.convert.paths import check_disjoint, is_inside
from cvt.convert.reader import MANIFEST_NAME, read_manifest
from cvt.convert.checksum import ALGORITHM, recorded, verify
from cvt.convert.durable import AtomicFile, write_bytes_atomic, write_json_atomic
from cvt.errors import ManifestError, OutputError
from cvt.schemas.manifest import FileInfo, Manifest
from cvt.world import SINGLE, World

STATE_NAME = ".cvt-state.json"
RANK_STATE = ".cvt-state.r{}.json"  # the journal of rank R > 0 of a world of several ranks
STATE_DIR = ".cvt-calib"  # the calibration state (`calibration_dir`)


class OutputDir:
    """DST during a run: lock, state journal of finished files, final manifest.

    `source`: the checkpoint directory the run reads; DST may not be it, lie inside it or
    contain it (`cvt.convert.paths.check_disjoint`), checked before anything in DST is touched.
    `world`: the ranks that write DST (`cvt.world`; rank 0 enters it, the others take its view)."""

    def __init__(self, dst: Path, plan: str, resume: bool = True, overwrite: bool = False,
                 source: Path | None = None, verb: str = "cvt", world: World = SINGLE):
        self.dst = Path(dst)
        self.plan = plan
        self.resume = resume
        self.overwrite = overwrite
        self.source, self.verb = source, verb
        self._fd: int | None = None
        self._state: dict[str, dict] = {}
        self._lock = threading.Lock()
        self.prior_meta: dict[str, dict] = {}  # meta by key from a complete earlier manifest
        self._foreign: set[str] = set()  # DST entries no cvt run recorded (kept by --overwrite)
        self.world = world
        self.rank = 0

    def __enter__(self) -> "OutputDir":
        w = self.world
        if w.size == 1:
            return self._enter()
        # rank 0 makes DST (nothing in it is touched yet); every rank must see it and plan the same
        # output (the same SRC, cvt and command on every node); then rank 0 checks, locks and reads
        # DST and the others take its view
        shared_dst(self.dst, self.source, self.verb, w)
        plans = w.all_gather(self.plan)
        odd = [r for r, p in enumerate(plans) if p != plans[0]]
        if odd:
            raise OutputError(f"{self.dst}: rank {', '.join(map(str, odd))} plans another output than rank 0 (another "
                              "SRC, cvt version or command line): run the same command, on the same files, on every "
                              "rank")
        err = None
        if w.main:
            try:
                self._enter()
            except BaseException as exc:
                err = exc
        err = w.agree(err)
        if err is not None:
            raise err
        view = w.broadcast({"state": self._state, "prior_meta": self.prior_meta,
                                "foreign": sorted(self._foreign)} if w.main else None)
        if not w.main:
            self.rank = w.rank
            self._state, self.prior_meta, self._foreign = view["state"], view["prior_meta"], set(view["foreign"])
        return self

    def _enter(self) -> "OutputDir":
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
            records = {**records, **_rank_journals(self.dst, prior_plan)}  # what the other ranks finished
        else:
            try:
                manifest = read_manifest(self.dst)
            except ManifestError as exc:
                manifest, prior_plan, invalid = None, "unreadable", str(exc)
            if manifest is not None:
                prior_plan = manifest.plan_id
                records = {f.path: _record(f) for f in manifest.files}
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
        # a killed cvt run's half-written files (sharded outputs keep theirs in rank-*/ folders,
        # never looked into through a link); only now that DST is known to be ours (an empty dir,
        # a cvt output, or --overwrite)
        ranks = [d for d in self.dst.glob("rank-*") if d.is_dir() and not d.is_symlink()]
        for tmp in [*self.dst.glob(".*.tmp"), *(t for d in ranks for t in d.glob(".*.tmp"))]:
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
                unlink_recorded(self.dst, rel)
            (self.dst / MANIFEST_NAME).unlink(missing_ok=True)
        if prior_plan != self.plan:
            # what is left is not ours: --overwrite keeps it, and no write may replace it
            self._foreign = {p.name for p in self.dst.iterdir() if not p.name.startswith(".")}
        self._save()
        for p in _rank_journal_paths(self.dst):  # merged above: the ranks of this run start theirs afresh
            p.unlink(missing_ok=True)

    def _save(self) -> None:
        if self.rank:  # a rank > 0 journals what it wrote; rank 0 merges it when a run enters DST
            mine = {rel: rec for rel, rec in self._state.items() if rec.get("rank") == self.rank}
            write_json_atomic(self.dst / RANK_STATE.format(self.rank), {"plan_id": self.plan, "files": mine})
            return
        write_json_atomic(self.dst / STATE_NAME, {"plan_id": self.plan, "files": self._state})

    def finished(self, rel: str, keys: set[str] = frozenset()) -> tuple[FileInfo, dict] | None:
        """(record, meta) of `rel` if an earlier run finished it, the file still matches, and the
        stage metadata for `keys` is known; else None (the file is rewritten)."""
        rec = self._state.get(rel)
        path = self.dst / rel
        if not rec or path.is_symlink() or not path.is_file() or path.stat().st_size != rec["size"]:
            return None
        known = {**self.prior_meta, **(rec.get("meta") or {})}
        if not keys <= set(known):
            return None
        digests = verify(path, rec)  # an old journal's sha256 checked; BLAKE3 from the same read
        if digests is None:
            return None
        info = FileInfo(path=rel, size=rec["size"], tensors=rec.get("tensors", 0), **{ALGORITHM: digests[ALGORITHM]})
        return info, {k: known[k] for k in keys}

    def record(self, info: FileInfo, meta: dict | None = None) -> None:
        with self._lock:
            self._state[info.path] = {**_record(info), "meta": meta or {},
                                      **({"rank": self.rank} if self.rank else {})}
            self._save()

    def path(self, rel: str) -> Path:
        """``DST/rel``, for writing: refused (OutputError) where it would replace an entry of DST
        that no cvt run recorded (kept by --overwrite, which deletes only recorded files)."""
        top = rel.split("/", 1)[0]
        if top in self._foreign:
            raise OutputError(f"{self.dst / top}: exists and no cvt run recorded it; --overwrite deletes or replaces "
                              "only files an earlier cvt run recorded: move it away or choose another DST")
        return self.dst / rel

    def claim(self, rels) -> None:
        """Before anything is written: refuse (OutputError naming it) when one of `rels`, the
        files this run will write, would replace an entry of DST no cvt run recorded, so that
        the refusal leaves no half-written output (an index without its config)."""
        for rel in rels:
            self.path(rel)

    def subdir(self, name: str) -> Path:
        """``DST/name``, a folder of this run's files (`owned_dir`: a real directory, no link)."""
        self.path(name)
        return owned_dir(self.dst, name)

    def write_json(self, rel: str, obj) -> FileInfo:
        """A small JSON file (indented, UTF-8, trailing newline), atomically."""
        return self.write_small(rel, (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode())

    def write_small(self, rel: str, data: bytes, tensors: int = 0) -> FileInfo:
        size, digest = write_bytes_atomic(self.path(rel), data)
        return file_info(rel, size, digest, tensors)

    def copy_file(self, src: Path, rel: str) -> FileInfo:
        with AtomicFile(self.path(rel)) as f, open(src, "rb") as fin:
            shutil.copyfileobj(fin, _Sink(f), 16 << 20)
            size, digest = f.commit()
        return file_info(rel, size, digest)

    def finish(self, manifest: Manifest) -> None:
        write_bytes_atomic(self.dst / MANIFEST_NAME, manifest_bytes(manifest))
        (self.dst / STATE_NAME).unlink(missing_ok=True)
        for p in _rank_journal_paths(self.dst):
            p.unlink(missing_ok=True)


def shared_dst(dst: Path, source: Path | None, verb: str, world: World) -> None:
    """In a world of several ranks, before anything in DST is touched: rank 0 checks DST against
    SRC and makes it, then every rank must see it (`cvt.world.World.check_shared`)."""
    err = None
    if world.main:
        try:
            if source is not None:
                check_disjoint(source, dst, verb)
            if dst.exists() and not dst.is_dir():
                raise OutputError(f"{dst}: exists and is not a directory")
            dst.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            err = OutputError(f"{dst}: cannot create the output directory: {exc.strerror or exc}")
        except BaseException as exc:
            err = exc
    err = world.agree(err)
    if err is not None:
        raise err
    world.check_shared(dst)


def _rank_journal_paths(dst: Path) -> list[Path]:
    return [p for p in Path(dst).glob(RANK_STATE.format("*")) if p.is_file() and not p.is_symlink()]


def _rank_journals(dst: Path, plan: str) -> dict[str, dict]:
    """The files the ranks > 0 of an earlier run of `plan` journaled (each still checked against
    the disk by `OutputDir.finished` before it is kept); unreadable journals count for nothing."""
    out: dict[str, dict] = {}
    for p in sorted(_rank_journal_paths(dst)):
        try:
            data = json.loads(p.read_text())
            if data["plan_id"] == plan and isinstance(data["files"], dict):
                out.update({rel: {k: v for k, v in rec.items() if k != "rank"} for rel, rec in data["files"].items()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return out


def file_info(rel: str, size: int, digest: str, tensors: int = 0) -> FileInfo:
    """The manifest record of a file just written (`AtomicFile.commit`: its size and digest)."""
    return FileInfo(path=rel, size=size, tensors=tensors, **{ALGORITHM: digest})


def _record(info: FileInfo) -> dict:
    """A manifest record as the journal keeps it: size, tensors and the digest under its
    algorithm's name (sha256 in a journal or manifest written before BLAKE3)."""
    algorithm, digest = recorded(info)
    return {"size": info.size, algorithm: digest, "tensors": info.tensors}


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


def unlink_recorded(root: Path, rel: str) -> None:
    """Delete ``root/rel``, a file an earlier cvt run recorded writing there: only a regular file
    (not a link, not a folder) that resolves inside `root`; anything else is left alone."""
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


def owned_dir(dst: Path, name: str, *, clean: bool = False, keep: tuple[str, ...] = ()) -> Path:
    """``DST/name``, a folder cvt keeps its own files in (calibration state, a rank's files, a
    temporary folder), made if missing and, with `clean`, emptied except `keep`. It must be a
    real directory: a symlink there is refused (OutputError naming it), because clearing or
    writing through it would delete or write outside DST."""
    path = Path(dst) / name
    _refuse_link(path)
    try:
        path.mkdir(exist_ok=True)
    except OSError as exc:
        raise OutputError(f"{path}: cannot create cvt's folder: {exc.strerror or exc}") from None
    _refuse_link(path)  # replaced by a link between the check and mkdir
    if clean:
        clear_dir(path, keep)
    return path


def clear_dir(path: Path, keep: tuple[str, ...] = ()) -> None:
    """Delete everything inside `path` (a folder `owned_dir` made) except the names in `keep`;
    a link inside is removed itself, never followed."""
    _refuse_link(path)
    for p in Path(path).iterdir():
        if p.name in keep:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)  # removes links below it, never their targets
        else:
            p.unlink()


def remove_owned_dir(path: Path) -> None:
    """Remove a folder `owned_dir` made, with its contents (links removed, not followed)."""
    _refuse_link(path)
    shutil.rmtree(path, ignore_errors=True)


def _refuse_link(path: Path) -> None:
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISLNK(mode):
        raise OutputError(f"{path}: is a symlink; cvt makes this folder itself and never writes or deletes "
                          "through a link: remove the link")
    if not stat.S_ISDIR(mode):
        raise OutputError(f"{path}: exists and is not a directory (cvt keeps its own files there): move it away")


@contextlib.contextmanager
def calibration_dir(source: Path, dst: Path, overwrite: bool, resume: bool, world: World = SINGLE):
    """DST's hidden calibration state folder (``.cvt-calib``, `cvt.quant.methods.stream`), for a
    stage that calibrates before it writes: DST checked first as `OutputDir` will (not SRC, not
    foreign files unless --overwrite), DST locked for the whole run from here on, calibration
    included (a second run on DST is refused while this one calibrates; `OutputDir` finds the
    lock held), the folder (`owned_dir`: never a symlink) cleared with --no-resume, and removed
    once the stage finished. Several ranks: DST checked shared first (`shared_dst`), then rank 0
    does all of that and the others use the folder once it stands."""
    if world.size == 1:
        with _calibration_dir(source, dst, overwrite, resume) as state:
            yield state
        return
    shared_dst(Path(dst), source, "quantize", world)
    err, ctx, state = None, None, None
    if world.main:
        try:
            ctx = _calibration_dir(source, dst, overwrite, resume)
            state = ctx.__enter__()
        except BaseException as exc:
            err = exc
    err = world.agree(err)
    if err is not None:
        raise err
    if not world.main:
        yield Path(dst) / STATE_DIR
        return
    try:
        yield state
    except BaseException as exc:
        if not ctx.__exit__(type(exc), exc, exc.__traceback__):
            raise
    else:
        ctx.__exit__(None, None, None)


@contextlib.contextmanager
def _calibration_dir(source: Path, dst: Path, overwrite: bool, resume: bool):
    check_disjoint(source, dst, "quantize")
    if dst.exists() and not dst.is_dir():
        raise OutputError(f"{dst}: exists and is not a directory")
    if dst.is_dir() and not overwrite and not (dst / STATE_NAME).is_file() and not (dst / MANIFEST_NAME).is_file():
        visible = sorted(p.name for p in dst.iterdir() if not p.name.startswith("."))
        if visible:
            raise OutputError(f"{dst}: not empty ({len(visible)} entries, e.g. {visible[0]}) and not a cvt output to "
                              "resume; choose an empty directory or pass --overwrite")
    try:
        dst.mkdir(parents=True, exist_ok=True)
        fd = os.open(dst, os.O_RDONLY)
    except OSError as exc:
        raise OutputError(f"{dst}: cannot create the output directory: {exc.strerror or exc}") from None
    locked = False
    try:
        lock_dst(fd, dst)
        locked = True
        state = owned_dir(dst, STATE_DIR)
        if not resume:
            clear_dir(state)
        yield state
        remove_owned_dir(state)
    finally:
        if locked:
            unlock_dst(fd)
        os.close(fd)
