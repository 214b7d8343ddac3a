"""A checkpoint directory, indexed from its safetensors headers alone.

`open_checkpoint(src)` resolves SRC (local dir or hub id), reads config.json, parses every
referenced safetensors header, validates `model.safetensors.index.json` against the files,
and returns a `Checkpoint` whose tensors are read one at a time through mmap. Nothing is
unpickled: a `.bin`/`.pt`-only checkpoint is refused.

Index rules (each violation is a CheckpointError naming file and tensor):
  * every listed file is a relative path inside the directory (no `..`, not absolute, no
    symlink leading out: `cvt.convert.paths`) and exists;
  * every listed tensor is in the file the index names;
  * no tensor is listed twice (duplicate JSON keys) or stored in two files;
  * every tensor stored in a listed file is in the index.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path

from cvt.convert import source as source_mod
from cvt.convert.arch import expert_splits, release_names
from cvt.convert.config import HF_QUANT_CONFIG, fold_hf_quant_config
from cvt.convert.paths import confine, relative_inside
from cvt.convert.safetensors_io import MappedFile, TensorRef, load_json, read_header, tensor_from_view
from cvt.errors import CheckpointError, ManifestError, validation_summary

INDEX_NAMES = ("model.safetensors.index.json", "quant_model_weights.safetensors.index.json")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
WEIGHT_SUFFIXES = (".safetensors",) + PICKLE_SUFFIXES
MANIFEST_NAME = "cvt_manifest.json"


def sha256_of(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


@dataclass
class Checkpoint:
    """An indexed checkpoint. `tensors` is ordered by file name, then by offset in the file."""

    root: Path
    source: source_mod.Source
    config: dict
    tensors: dict[str, TensorRef]
    index_path: Path | None
    # {release name: stored name} of the tensors read under the release's names (a layout
    # transformers' save_pretrained wrote: `release_layout`); empty for a release layout
    renamed: dict[str, str] = field(default_factory=dict)
    _files: dict[Path, MappedFile] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    # -- identity ---------------------------------------------------------------------
    @property
    def config_sha256(self) -> str | None:
        return sha256_of(self.root / "config.json")

    @property
    def index_sha256(self) -> str | None:
        return sha256_of(self.index_path) if self.index_path else None

    @functools.cached_property
    def content_identity(self) -> dict[str, str]:
        """What SRC holds, read cheaply (`cvt.convert.identity.source_identity`); computed once per
        opened checkpoint (a calibrating quantize keys its state and its plan id on it)."""
        from cvt.convert.identity import source_identity

        return source_identity(self)

    @property
    def has_manifest(self) -> bool:
        return (self.root / MANIFEST_NAME).is_file()

    @property
    def manifest(self):
        """The checkpoint's cvt manifest (`read_manifest`; None: not a cvt output)."""
        if not hasattr(self, "_manifest"):
            self._manifest = read_manifest(self.root, self.source.confine_root)
        return self._manifest

    @property
    def weight_files(self) -> list[Path]:
        return sorted({r.path for r in self.tensors.values()})

    def aux_files(self) -> list[Path]:
        """Non-weight files a converted checkpoint carries over (tokenizer, generation config,
        remote code, README...): everything at the top level except weights, indexes,
        config.json (and a ModelOpt hf_quant_config.json: read into `config`, which each output
        rewrites) and cvt's own files."""
        skip = {"config.json", HF_QUANT_CONFIG, MANIFEST_NAME, *INDEX_NAMES}
        out = []
        for p in sorted(self.root.iterdir()):
            if p.name.startswith(".") or p.name in skip or not p.is_file():
                continue
            if p.name.endswith(WEIGHT_SUFFIXES) or p.name.endswith(".index.json"):
                continue
            out.append(p)
        return out

    # -- reading ----------------------------------------------------------------------
    def ref(self, name: str) -> TensorRef:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.root}: no tensor named {name}") from None

    def _mapped(self, ref: TensorRef) -> MappedFile:
        with self._lock:  # writer threads read concurrently: one mapping per file
            mf = self._files.get(ref.path)
            if mf is None:
                mf = self._files[ref.path] = MappedFile(ref.path)
            return mf

    def view(self, name: str) -> memoryview:
        """The raw bytes of a tensor (zero-copy mmap view)."""
        ref = self.ref(name)
        return self._mapped(ref).view(ref)

    def read(self, name: str):
        """The tensor, as a torch tensor over the mmap (no copy). Call `release` when done."""
        ref = self.ref(name)
        return tensor_from_view(self._mapped(ref).view(ref), ref.dtype, ref.shape)

    def release(self, name: str) -> None:
        """Drop a tensor's pages from the resident set, keeping RSS at a few tensors."""
        ref = self.ref(name)
        self._mapped(ref).release(ref)

    def close(self) -> None:
        for mf in self._files.values():
            mf.close()
        self._files.clear()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _refuse_pickles(root: Path) -> None:
    pickles = sorted(p.name for p in root.iterdir() if p.name.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise CheckpointError(
            f"{root}: only pickle weights found ({', '.join(pickles[:3])}{'...' if len(pickles) > 3 else ''}); "
            "cvt never unpickles: convert them to safetensors with a tool you trust first"
        )


def index_directory(root: Path, confine_root: Path | None = None) -> tuple[dict[str, TensorRef], Path | None]:
    """Header-only index of the safetensors files in `root`, validated against index.json;
    every file read resolves inside `confine_root` (default `root`)."""
    confine_root = root if confine_root is None else confine_root
    index_path = next((root / n for n in INDEX_NAMES if (root / n).is_file()), None)
    tensors: dict[str, TensorRef] = {}
    if index_path is not None:
        index = load_json(index_path, " (a safetensors index)")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: no weight_map object")
        by_file: dict[Path, list[str]] = {}
        for name, rel in weight_map.items():
            if not isinstance(rel, str) or not rel:
                raise CheckpointError(f"{index_path}: weight_map entry {rel!r} for {name} is not a file name")
            path = relative_inside(root, rel, str(index_path), "weight file", confine_root=confine_root)
            by_file.setdefault(path, []).append(name)
        for path in sorted(by_file):
            if not path.is_file():
                names = by_file[path]
                raise CheckpointError(
                    f"{index_path}: lists {path.name} (for {len(names)} tensors, e.g. {names[0]}) but the file is missing"
                )
        headers = {path: read_header(path)[0] for path in sorted(by_file)}
        for path, names in by_file.items():
            header = headers[path]
            for name in names:
                if name not in header:
                    raise CheckpointError(f"{index_path}: says {name} is in {path.name}, but that file has no such tensor")
            extra = sorted(set(header) - set(names))
            for name in extra:
                other = weight_map.get(name)
                if other is not None:
                    raise CheckpointError(f"tensor {name} is stored in both {path.name} and {other}")
            if extra:
                raise CheckpointError(
                    f"{path}: holds {len(extra)} tensors the index does not list (e.g. {extra[0]})"
                )
        for path in sorted(headers):
            tensors.update(headers[path])
        return tensors, index_path
    files = sorted(p for p in root.iterdir() if p.name.endswith(".safetensors") and not p.name.startswith("."))
    for path in files:
        confine(confine_root, path, "weight file")
    if not files:
        _refuse_pickles(root)
        raise CheckpointError(f"{root}: no .safetensors files and no model.safetensors.index.json")
    for path in files:
        for name, ref in read_header(path)[0].items():
            if name in tensors:
                raise CheckpointError(f"tensor {name} is stored in both {tensors[name].path.name} and {path.name}")
            tensors[name] = ref
    return tensors, None


def open_checkpoint(src, revision: str | None = None, need_config: bool = True) -> Checkpoint:
    """Resolve, index and validate a checkpoint; raises CvtError subclasses on bad input."""
    source = src if isinstance(src, source_mod.Source) else source_mod.resolve(src, revision)
    root = source.path
    check_top_level(root, source.confine_root)
    config_path = root / "config.json"
    if config_path.is_file():
        config = load_json(config_path)
    elif need_config:
        raise CheckpointError(f"{root}: no config.json")
    else:
        config = {}
    side = root / HF_QUANT_CONFIG
    config = fold_hf_quant_config(config, load_json(side) if side.is_file() else None, str(side))
    tensors, index_path = index_directory(root, source.confine_root)
    renamed = release_names(config, tensors)
    tensors = split_experts(tensors, expert_splits(config, tensors))
    return Checkpoint(root=root, source=source, config=config, tensors=release_layout(tensors, renamed),
                      index_path=index_path, renamed={v: k for k, v in renamed.items()})


def split_experts(tensors: dict[str, TensorRef], splits: dict[str, tuple[str, ...]]) -> dict[str, TensorRef]:
    """`tensors` with each fused routed-expert tensor [E, n, k] (`splits`: {stored name: the names
    of its row blocks, "{E}" the expert; `cvt.convert.arch.expert_splits`) replaced, in place of
    it, by its per-expert row blocks [n / blocks, k], expert by expert: each a contiguous byte range
    of the stored tensor, read through the same mmap. CheckpointError for a fused tensor of
    another rank or rows its blocks do not divide."""
    if not splits:
        return tensors
    out: dict[str, TensorRef] = {}
    for name, ref in tensors.items():
        parts = splits.get(name)
        if parts is None:
            out[name] = ref
            continue
        if len(ref.shape) != 3 or not ref.shape[0] or ref.shape[1] % len(parts):
            blocks = f" with rows a multiple of {len(parts)} ({', '.join(p.rsplit('.', 2)[-2] for p in parts)})"
            raise CheckpointError(f"{ref.describe()}: fused routed experts must be [experts, rows, columns]"
                                  f"{blocks if len(parts) > 1 else ''}")
        shape = (ref.shape[1] // len(parts), ref.shape[2])
        size = ref.nbytes // (ref.shape[0] * len(parts))
        for e in range(ref.shape[0]):
            for j, part in enumerate(parts):
                start = ref.start + (e * len(parts) + j) * size
                piece = part.replace("{E}", str(e))
                out[piece] = dataclasses.replace(ref, name=piece, shape=shape, start=start, end=start + size)
    return out


def release_layout(tensors: dict[str, TensorRef], renamed: dict[str, str]) -> dict[str, TensorRef]:
    """`tensors` under the release's names, in the same order: a checkpoint transformers'
    save_pretrained wrote (`renamed`: {stored name: release name}, `cvt.convert.arch.release_names`)
    reads like the release; a release layout is returned as is."""
    if not renamed:
        return tensors
    return {renamed.get(n, n): dataclasses.replace(ref, name=renamed.get(n, n)) for n, ref in tensors.items()}


def check_top_level(root: Path, confine_root: Path) -> None:
    """CheckpointError for a top-level file of the checkpoint (config, index, weights, tokenizer,
    anything a stage reads or copies into its output) that is a symlink leading outside
    `confine_root`, or a dangling one."""
    for p in sorted(root.iterdir()):
        if p.is_symlink() and not p.name.startswith(".") and not p.is_dir():
            confine(confine_root, p, "symlink")
        if not p.name.startswith(".") and not p.is_dir() and not p.is_file():
            # a FIFO, socket or device: reading it blocks or never ends, skipping it drops a file
            # (a tokenizer.json) the output needs
            raise CheckpointError(f"{p}: not a regular file ({file_kind(p)}); a checkpoint holds regular files "
                                  "and folders only")


def file_kind(path: Path) -> str:
    """What a path that is not a regular file is, in words ("a FIFO", "a character device", ...)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        return f"unreadable: {exc.strerror or exc}"
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    return next((k for test, k in kinds if test(mode)), "not a file")


# ----------------------------------------------------------------------------- manifest
def read_manifest(root: Path, confine_root: Path | None = None, *, required: bool = False):
    """ROOT/cvt_manifest.json as a `cvt.schemas.manifest.Manifest`, or None when there is none
    (ManifestError when `required`). The one reader of manifests, with one error policy: an
    unreadable or invalid manifest, or one whose file paths (``files[].path``, a shard's rank
    dirs and files) are absolute, contain ``..`` or resolve outside the checkpoint, is a
    ManifestError naming the file and every invalid field."""
    from cvt.schemas.manifest import Manifest

    root = Path(root)
    path = root / MANIFEST_NAME
    if not path.is_file():
        if required:
            raise ManifestError(f"{root}: no {MANIFEST_NAME} (not a cvt output, or its run did not finish)")
        return None
    confine_root = root if confine_root is None else confine_root
    confine(confine_root, path, "manifest", ManifestError)
    try:
        manifest = Manifest.model_validate_json(path.read_bytes())
    except ValueError as exc:
        raise ManifestError(f"{path}: not a valid cvt manifest: {validation_summary(exc)}") from None
    except OSError as exc:
        raise ManifestError(f"{path}: unreadable: {exc.strerror or exc}") from None
    rels = [f.path for f in manifest.files]
    if manifest.shard is not None:
        rels += [r.dir for r in manifest.shard.ranks] + [f for r in manifest.shard.ranks for f in r.files]
    for rel in rels:
        relative_inside(root, rel, str(path), "listed path", ManifestError, confine_root)
    return manifest


def sharded_manifest(path):
    """The manifest of a `cvt shard` output at local directory `path`, else None (not a
    directory, no manifest, an unsharded one, or an invalid one: the verb's own reader says
    what is wrong with that)."""
    if not isinstance(path, (str, os.PathLike)) or not Path(path).is_dir():
        return None
    try:
        manifest = read_manifest(Path(path))
    except ManifestError:
        return None
    return manifest if manifest is not None and manifest.shard is not None else None


def unsharded_source(manifest) -> str:
    """What `cvt shard` read to make this output (a local path or a hub id), as one would pass it."""
    src = manifest.source
    if src.kind == "local":
        return str(src.path)
    return str(src.repo_id) + (f" --revision {src.revision}" if src.revision else "")


def file_problems(root: Path, files, verify_files: bool = False) -> list[str]:
    """Manifest file records (`FileInfo`, paths already confined by `read_manifest`) that the
    files under `root` do not match: missing, another size, or (`verify_files`) another checksum
    (`cvt.convert.checksum`: the algorithm each record names)."""
    from cvt.convert.checksum import recorded, verify

    out = []
    for f in files:
        p = Path(root) / f.path
        if not p.is_file():
            out.append(f"{p}: missing (the manifest lists it: {f.size} bytes)")
        elif p.stat().st_size != f.size:
            out.append(f"{p}: {p.stat().st_size} bytes, the manifest says {f.size}: the file was modified")
        elif verify_files and verify(p, f) is None:
            out.append(f"{p}: {recorded(f)[0]} differs from the manifest: the file was modified")
    return out


def check_manifest_files(ckpt: Checkpoint) -> None:
    """ManifestError naming the first weight file of a cvt output that is missing or of another
    size than its manifest records (`cvt run` refuses it; a writer reading it as SRC would carry
    a truncated or swapped shard on). Edited side files (config.json) are the readers' to judge."""
    manifest = ckpt.manifest
    if manifest is not None:
        problems = file_problems(ckpt.root, [f for f in manifest.files if f.path.endswith(".safetensors")])
        if problems:
            raise ManifestError(problems[0])


def manifest_problems(ckpt: Checkpoint, manifest, verify_files: bool = False) -> list[str]:
    """What disagrees between a (single-directory) cvt output's manifest and its files: files
    missing or of another size (checksum too with `verify_files`), tensor count or byte total."""
    where = ckpt.root / MANIFEST_NAME
    out = file_problems(ckpt.root, manifest.files, verify_files)
    if manifest.shard is None:
        total = sum(r.nbytes for r in ckpt.tensors.values())
        if manifest.tensor_count != len(ckpt.tensors) or manifest.total_size != total:
            out.append(f"{where}: records {manifest.tensor_count} tensors / {manifest.total_size} bytes, "
                       f"the files hold {len(ckpt.tensors)} / {total}")
    return out

