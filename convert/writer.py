"""Writing a checkpoint directory: bounded shards, atomic files, resume, lock, manifest.

Every stage describes its output as an ordered list of `OutTensor` (name, dtype, shape and
a function producing the bytes). `write_checkpoint` then

1. plans shards up front (greedy, in order, each at most `max_shard_size` unless one tensor
   is larger): the plan depends only on the tensor list, so a resumed run writes the same
   file names with the same contents;
2. locks DST (flock on the directory: a second concurrent run is refused; the kernel drops
   the lock when a run dies, even by kill -9);
3. skips files that an earlier run of the same plan finished (recorded in
   `.cvt-state.json` after each file, trusted only when size and sha256 on disk still match);
4. writes the rest, `workers` files at a time, each to a hidden temp file that is fsynced and
   renamed into place, hashing as it writes;
5. writes the index, config.json and copied files, then `cvt_manifest.json` last, and
   removes the state file. Until the manifest exists nothing in DST claims to be complete.

Peak memory is about `workers` x (largest output tensor + its input), whatever the model size.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from cvt import __version__
from cvt.convert.paths import check_disjoint, is_inside
from cvt.convert.reader import MANIFEST_NAME, Checkpoint, read_manifest
from cvt.convert.safetensors_io import (
    AtomicFile,
    TensorSpec,
    dtype_code,
    encode_header,
    sha256_file,
    write_bytes_atomic,
    write_json_atomic,
)
from cvt.errors import ManifestError, OutputError
from cvt.schemas.manifest import FileInfo, Manifest, SourceInfo, StageInfo, Summary, ToolInfo

STATE_NAME = ".cvt-state.json"
DEFAULT_MAX_SHARD = 5 * 10**9


@dataclass(frozen=True)
class OutTensor:
    """One output tensor: its spec, a producer of its bytes, and what reading it costs.

    `produce()` returns a torch tensor of exactly `spec`'s dtype and shape, or a buffer of
    `spec.nbytes` bytes; `release()` (optional) is called once the bytes are written.
    """

    spec: TensorSpec
    produce: Callable[[], Any]
    release: Callable[[], None] | None = None
    read_bytes: int = 0
    # stage metadata about this tensor (e.g. a quantized module's SQNR), journaled per file so
    # that a resumed run can rebuild the manifest without recomputing finished files
    meta: Callable[[], tuple[str, dict]] | None = None
    meta_key: str | None = None


@dataclass
class WriteResult:
    dst: Path
    files: list[FileInfo]
    written_files: int
    skipped_files: int
    bytes_in: int
    bytes_out: int
    seconds: float
    manifest: Manifest | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, dict] = field(default_factory=dict)

    @property
    def throughput(self) -> float:
        return self.bytes_out / self.seconds if self.seconds > 0 else 0.0


def plan_shards(tensors: list, max_shard_size: int, prefix: str = "model") -> list[tuple[str, list]]:
    """Greedy file plan: consecutive runs of `tensors` (anything with a ``.spec``) of at most
    `max_shard_size` bytes each (a larger tensor alone), named ``{prefix}-00001-of-0000N.safetensors``."""
    groups: list[list[OutTensor]] = []
    size = 0
    for t in tensors:
        if not groups or (size + t.spec.nbytes > max_shard_size and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.spec.nbytes
    n = len(groups)
    return [(f"{prefix}-{i + 1:05d}-of-{n:05d}.safetensors", g) for i, g in enumerate(groups)]


def plan_id(parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def source_info(ckpt: Checkpoint, fmt: str) -> SourceInfo:
    src = ckpt.source
    return SourceInfo(
        kind=src.kind,
        path=str(src.path) if src.kind == "local" else None,
        repo_id=src.repo_id,
        revision=src.revision,
        config_sha256=ckpt.config_sha256,
        index_sha256=ckpt.index_sha256,
        format=fmt,
    )


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
            lock_fd(self._fd, dst)
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
            os.close(self._fd)  # closing the descriptor drops the flock
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


def _as_buffer(data, spec: TensorSpec) -> memoryview:
    if hasattr(data, "dtype") and hasattr(data, "shape") and not isinstance(data, memoryview):
        code = dtype_code(data.dtype)
        if code != spec.dtype or tuple(data.shape) != spec.shape:
            raise RuntimeError(f"internal: {spec.name} produced {code} {list(data.shape)}, planned {spec.dtype} {list(spec.shape)}")
        import torch

        data = data.contiguous().reshape(-1).view(torch.uint8).numpy()
    mv = memoryview(data).cast("B")
    if len(mv) != spec.nbytes:
        raise RuntimeError(f"internal: {spec.name} produced {len(mv)} bytes, planned {spec.nbytes}")
    return mv


def _meta_keys(tensors: list[OutTensor]) -> set[str]:
    """The metadata keys a file's tensors carry (the key is known without producing: `meta_key`)."""
    return {t.meta_key for t in tensors if t.meta is not None and t.meta_key}


class _Cancelled(Exception):
    pass


IN_FLIGHT_BYTES = 512 << 20


class _ByteBudget:
    """A counting gate in bytes: `acquire(n)` waits while others hold bytes and n would pass
    the limit (a single tensor larger than the limit still goes through, alone)."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0
        self._cond = threading.Condition()

    def acquire(self, n: int) -> None:
        with self._cond:
            while self.used and self.used + n > self.limit:
                self._cond.wait()
            self.used += n

    def release(self, n: int) -> None:
        with self._cond:
            self.used -= n
            self._cond.notify_all()


class _FilePipeline:
    """One output file's back half: a writer thread (file.write) and a hasher thread (sha256)
    working on consecutive buffers, while the caller's thread produces the next tensor.

    On this class of machine sha256 (~0.3 GB/s a core) is slower than the disk, so hashing
    must overlap with dequantizing and writing. Each buffer releases its tensor's input pages
    and its budget bytes once hashed (the last stage)."""

    _END = object()

    def __init__(self, f: AtomicFile, budget: _ByteBudget, update: Callable[[int], None], depth: int = 2):
        import queue

        self.f, self.budget, self.update = f, budget, update
        self.error: BaseException | None = None
        # depth 0: unbounded queues, memory bounded by the byte budget alone (many files fed by
        # one thread: a full queue would stall every other file)
        self.q_write: "queue.Queue" = queue.Queue(maxsize=depth)
        self.q_hash: "queue.Queue" = queue.Queue(maxsize=depth)
        self.threads = [threading.Thread(target=self._writer, name="cvt-file-write", daemon=True),
                        threading.Thread(target=self._hasher, name="cvt-file-hash", daemon=True)]
        for t in self.threads:
            t.start()

    def put(self, buf: memoryview, keep, tensor: OutTensor) -> None:
        if self.error is not None:
            self.budget.release(tensor.spec.nbytes)
            raise self.error
        self.q_write.put((buf, keep, tensor))

    def _writer(self) -> None:
        while (item := self.q_write.get()) is not self._END:
            if self.error is None:
                try:
                    self.f.write_unhashed(item[0])
                except BaseException as exc:  # reported by close()
                    self.error = exc
            self.q_hash.put(item)
        self.q_hash.put(self._END)

    def _hasher(self) -> None:
        while (item := self.q_hash.get()) is not self._END:
            buf, keep, tensor = item
            try:
                if self.error is None:
                    self.f.sha.update(buf)
                del buf, keep, item
                if tensor.release is not None:
                    tensor.release()
                if self.error is None:
                    self.update(tensor.spec.nbytes)
            except BaseException as exc:  # reported by close(); keep draining so nobody blocks
                if self.error is None:
                    self.error = exc
            finally:
                self.budget.release(tensor.spec.nbytes)

    def close(self, abort: bool = False) -> None:
        if abort and self.error is None:
            self.error = _Cancelled()
        self.q_write.put(self._END)
        for t in self.threads:
            t.join()
        if self.error is not None and not abort:
            raise self.error


def write_shards(
    out: OutputDir,
    shards: list[tuple[str, list[OutTensor]]],
    *,
    workers: int = 1,
    progress=None,
    metadata: dict[str, str] | None = None,
    meta: dict[str, dict] | None = None,
) -> tuple[list[FileInfo], int, int]:
    """Write every planned shard not already finished. Returns (file infos, written, skipped);
    the tensors' stage metadata is collected into `meta` (finished files' from the journal)."""
    meta = {} if meta is None else meta
    meta_lock = threading.Lock()
    header_meta = {"format": "pt"} if metadata is None else metadata
    results: dict[str, FileInfo] = {}
    stop = threading.Event()
    update = progress.update if progress is not None else (lambda n: None)
    pending = []
    skipped = 0
    # bytes of produced tensors not yet written and hashed, over all workers: at most one
    # tensor beyond IN_FLIGHT_BYTES, so peak memory stays ~ largest tensor + the budget
    budget = _ByteBudget(IN_FLIGHT_BYTES)
    for rel, tensors in shards:
        size = len(encode_header([t.spec for t in tensors], header_meta)) + sum(t.spec.nbytes for t in tensors)
        keys = _meta_keys(tensors)
        done = out.finished(rel, keys)
        if done is not None and done[0].size == size:
            results[rel] = done[0]
            meta.update(done[1])
            skipped += 1
            update(sum(t.spec.nbytes for t in tensors))
        else:
            pending.append((rel, tensors))

    def write_one(rel: str, tensors: list[OutTensor]) -> FileInfo:
        file_meta: dict[str, dict] = {}
        with AtomicFile(out.dst / rel) as f:
            f.write(encode_header([t.spec for t in tensors], header_meta))
            pipe = _FilePipeline(f, budget, update)
            try:
                for t in tensors:
                    if stop.is_set():
                        raise _Cancelled
                    budget.acquire(t.spec.nbytes)
                    try:
                        data = t.produce()
                        buf = _as_buffer(data, t.spec)
                    except BaseException:
                        budget.release(t.spec.nbytes)
                        raise
                    pipe.put(buf, data, t)
                    del data, buf
                    if t.meta is not None:
                        key, value = t.meta()
                        file_meta[key] = value
            except BaseException:
                pipe.close(abort=True)
                raise
            pipe.close()
            size, sha = f.commit()
        info = FileInfo(path=rel, size=size, sha256=sha, tensors=len(tensors))
        out.record(info, file_meta)
        with meta_lock:
            meta.update(file_meta)
        return info

    if pending:
        with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="cvt-write") as pool:
            futures = {pool.submit(write_one, rel, ts): rel for rel, ts in pending}
            try:
                done, _ = wait(futures, return_when=FIRST_EXCEPTION)
                for fut in done:
                    if fut.exception() is not None:
                        raise fut.exception()
                for fut in futures:
                    results[futures[fut]] = fut.result()
            except BaseException:
                stop.set()
                for fut in futures:
                    fut.cancel()
                raise
    return [results[rel] for rel, _ in shards], len(pending), skipped


def make_progress(total: int, desc: str, quiet: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, disable=quiet,
                dynamic_ncols=True, smoothing=0.1)


def write_checkpoint(
    ckpt: Checkpoint,
    dst: Path,
    tensors: list[OutTensor],
    *,
    stage: StageInfo,
    source_format: str,
    out_format: str,
    config: dict,
    summary: dict[str, int],
    max_shard_size: int = DEFAULT_MAX_SHARD,
    workers: int = 1,
    resume: bool = True,
    overwrite: bool = False,
    quiet: bool = False,
    prefix: str = "model",
    extra_files: Iterable[tuple[str, bytes]] = (),
    quant=None,
    on_meta: Callable[[dict[str, dict]], None] | None = None,
) -> WriteResult:
    """Plan, write and finalize a Hugging Face style checkpoint directory (see module doc)."""
    t0 = time.perf_counter()
    shards = plan_shards(tensors, max_shard_size, prefix)
    src = source_info(ckpt, source_format)
    prior = _prior_stages(ckpt)
    pid = plan_id({
        "tool": __version__,
        "source": src.model_dump(),
        # fine-tunes share config and index with their base: the weight files themselves
        # (size and modification time) tell one source from another without reading them
        "source_files": [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in ckpt.weight_files],
        "stage": stage.model_dump(),
        "max_shard_size": max_shard_size,
        "prefix": prefix,
        "tensors": [(t.spec.name, t.spec.dtype, t.spec.shape) for t in tensors],
        "quant": quant.model_dump(exclude={"tensors", "fallbacks", "float_modules"}) if quant is not None else None,
    })
    total_out = sum(t.spec.nbytes for t in tensors)
    with OutputDir(Path(dst), pid, resume=resume, overwrite=overwrite, source=ckpt.source.confine_root,
                   verb=stage.name) as out:
        meta: dict[str, dict] = {}
        with make_progress(total_out, stage.name, quiet) as bar:
            files, written, skipped = write_shards(out, shards, workers=workers, progress=bar, meta=meta)
        if on_meta is not None:
            on_meta(meta)
        weight_map = {t.spec.name: rel for rel, ts in shards for t in ts}
        index = {"metadata": {"total_size": total_out}, "weight_map": weight_map}
        index_name = f"{prefix}.safetensors.index.json"
        files.append(out.write_small(index_name, (json.dumps(index, indent=2) + "\n").encode()))
        files.append(out.write_small("config.json", (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode()))
        for rel, data in extra_files:
            files.append(out.write_small(rel, data))
        for path in ckpt.aux_files():
            files.append(out.copy_file(path, path.name))
        manifest = Manifest(
            tool=ToolInfo(version=__version__),
            source=src,
            stages=[*prior, stage],
            format=out_format,
            plan_id=pid,
            tensor_count=len(tensors),
            total_size=total_out,
            files=files,
            summary=Summary(counts=summary),
            quant=quant,
        )
        out.finish(manifest)
    return WriteResult(
        dst=Path(dst),
        files=files,
        written_files=written,
        skipped_files=skipped,
        bytes_in=sum(t.read_bytes for t in tensors),
        bytes_out=total_out,
        seconds=time.perf_counter() - t0,
        manifest=manifest,
        meta=meta,
    )


def _prior_stages(ckpt: Checkpoint) -> list[StageInfo]:
    """Stages recorded by a cvt source's manifest (a later stage extends the history)."""
    return list(ckpt.manifest.stages) if ckpt.manifest is not None else []
