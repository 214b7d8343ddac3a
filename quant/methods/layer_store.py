"""The streaming calibration's state folder (``DST/.cvt-calib``, `cvt.quant.methods.stream`):
each finished decoder layer's results and the next layer's input, every file recorded with
its size and checksum as it is written and checked before a resumed run uses it; in a torchrun
world rank 0 writes the layers and each rank its share of the inputs (`cvt.world`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from cvt.world import SINGLE, World
from cvt.convert.durable import write_safetensors_atomic
from cvt.convert.outdir import clear_dir
from cvt.errors import CvtError
from cvt.quant.recipe import RTN
from cvt.qtensor.schemes.base import QuantizedTensor


class LayerStore:
    """The state folder: per finished layer ``layer-{i}.safetensors`` (quantized parts as
    ``q/{module}/{part}``, changed float tensors as ``f/{name}``, KV ranges as ``kv/{role}``) +
    ``layer-{i}.json`` (the parts' QuantizedTensor fields, methods, stats, fallbacks), the next
    layer's input ``x-{i+1}.bin`` and ``state.json`` (plan id, SRC's content identity, layers
    done, and the size and checksum of every state file a resumed run may use)."""

    def __init__(self, root: Path, plan_id: str, source: dict[str, str] | None = None, world: World = SINGLE):
        self.root, self.plan_id, self.source = Path(root), plan_id, source or {}
        self.world = world  # several ranks: rank 0 writes the layers, each rank its inputs
        self._index: dict[str, tuple[int, dict]] = {}   # module -> (layer, QuantizedTensor fields)
        self._floats: dict[str, int] = {}                # float tensor name -> layer
        self._files: dict[str, dict] = {}                # state file -> {size, algorithm: digest}: checked or written here

    # -- state ------------------------------------------------------------------------------------
    def done(self) -> int:
        """Layers an earlier run of the same plan finished, every file they left checked against
        its record (`_check_files`); 0: start afresh, state cleared. A state computed from
        another SRC is refused (`_foreign`), not cleared: re-run with --no-resume for that; so is
        one computed by another number of ranks (its statistics were combined otherwise).
        Several ranks: rank 0 decides, the others take its answer and records."""
        if self.world.size == 1:
            return self._done()
        done, err = 0, None
        if self.world.main:
            try:
                done = self._done()
            except BaseException as exc:
                err = exc
        err = self.world.agree(err)
        if err is not None:
            raise err
        done, self._files = self.world.broadcast((done, self._files) if self.world.main else None)
        return done

    def _done(self) -> int:
        p = self.root / "state.json"
        try:
            st = json.loads(p.read_text())
            source = st.get("source")
            if isinstance(source, dict) and self.source and source != self.source:
                raise _foreign(p, source, self.source)
            if st.get("plan_id") == self.plan_id:
                done, files = int(st["done"]), st["files"]
                ranks = int(st.get("world", 1))
                if ranks != self.world.size and done:
                    raise _world(p, ranks, self.world.size)
                self._check_files(files)
                return done
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            self._files.clear()  # not this plan's state (or not cvt's): discarded, never used
        if self.root.exists() or self.root.is_symlink():
            clear_dir(self.root)  # refuses a symlink: never clears a folder outside DST
        self.root.mkdir(parents=True, exist_ok=True)
        return 0

    def _check_files(self, files: dict) -> None:
        """Every state file an earlier run recorded, before any is used: its size and checksum
        (`cvt.convert.checksum`: the algorithm the record names, sha256 in an older state) must
        be those recorded as it was written; else refused with one line naming it."""
        from cvt.convert.checksum import file_digest, recorded

        for name, rec in files.items():
            path = self.root / name
            got = recorded(rec) if isinstance(rec, dict) else None
            if "/" in name or name.startswith(".") or got is None:
                raise _unreadable(self.root / "state.json", f"{name!r} is not a state file's record")
            algorithm, want = got
            try:
                size = path.stat().st_size
                digest = file_digest(path, algorithm) if size == rec["size"] else None
            except OSError as exc:
                raise _unreadable(path, exc) from None
            if size != rec["size"] or digest != want:
                what = f"{size} bytes, {rec['size']} recorded" if digest is None else \
                    f"{algorithm} {digest[:16]}..., {want[:16]}... recorded"
                raise _changed(path, what)
            self._files[name] = {"size": size, algorithm: digest}

    def _record(self, name: str, written: tuple[int, str]) -> None:
        from cvt.convert.checksum import ALGORITHM

        self._files[name] = {"size": written[0], ALGORITHM: written[1]}

    def _use(self, name: str) -> Path:
        """``root/name``, a state file this store checked or wrote; one it has no record of
        (listed by a layer's json, never recorded in state.json) is refused, never read."""
        path = self.root / name
        if name not in self._files:
            raise _changed(path, "state.json has no record of it")
        return path

    def _mark(self, done: int) -> None:
        from cvt.convert.durable import write_json_atomic

        write_json_atomic(self.root / "state.json", {"plan_id": self.plan_id, "source": self.source, "done": done,
                                                     "world": self.world.size, "files": self._files})

    def _x_name(self, i: int) -> str:
        """Layer i's input file: this rank's share of it in a world of several."""
        return f"x-{i}.bin" if self.world.size == 1 else f"x-{i}.r{self.world.rank}.bin"

    # -- per layer ----------------------------------------------------------------------------------
    @staticmethod
    def _pack(quantized: dict[str, QuantizedTensor]) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
        tensors, fields = {}, {}
        for module, q in quantized.items():
            for part, t in q.parts.items():
                tensors[f"q/{module}/{part}"] = t.detach().cpu().contiguous()
            for k, t in q.extra.items():
                if isinstance(t, torch.Tensor):
                    tensors[f"e/{module}/{k}"] = t.detach().cpu().contiguous()
            fields[module] = {"scheme": q.scheme, "kernel_fmt": q.kernel_fmt, "shape": list(q.shape),
                              "group_size": q.group_size, "symmetric": q.symmetric,
                              "extra": {k: v for k, v in q.extra.items() if not isinstance(v, torch.Tensor)}}
        return tensors, fields

    def save_part(self, i: int, c: int, quantized: dict[str, QuantizedTensor]) -> dict[str, dict]:
        """Chunk c of layer i's streamed experts (`expert_stream`): their quantized tensors in
        ``layer-{i}-e{c}.safetensors``, so a layer's experts are not all held until it ends;
        returns their fields for `save_layer`'s ``parts``."""
        tensors, fields = self._pack(quantized)
        name = f"layer-{i}-e{c}.safetensors"
        if self.world.main:  # every rank holds the same results: rank 0 keeps them
            self._record(name, write_safetensors_atomic(self.root / name, tensors))
        return {m: {**f, "file": name} for m, f in fields.items()}

    def save_layer(self, i: int, lres, kv_amax: dict[str, torch.Tensor], x_next: torch.Tensor,
                   parts: dict[str, dict] | None = None) -> None:
        """Layer i's results (and the fields of its experts already saved by `save_part`); then
        the layer counts as done."""
        from cvt.convert.durable import write_bytes_atomic, write_json_atomic

        x_name = self._x_name(i + 1)
        x_rec = write_bytes_atomic(self.root / x_name, x_next.detach().float().cpu().contiguous().numpy().tobytes())
        inputs = self.world.all_gather((self._x_name(i), x_name, x_rec))  # every rank's share of the next input
        if self.world.main:
            tensors, fields = self._pack(lres.quantized)
            fields.update(parts or {})
            for name, t in lres.float_weights.items():
                tensors[f"f/{name}"] = t.detach().cpu().contiguous()
            for role, t in kv_amax.items():
                tensors[f"kv/{role}"] = t.detach().float().cpu().contiguous()
            self._record(f"layer-{i}.safetensors",
                         write_safetensors_atomic(self.root / f"layer-{i}.safetensors", tensors))
            self._record(f"layer-{i}.json", write_json_atomic(self.root / f"layer-{i}.json", {
                "quantized": fields, "floats": sorted(lres.float_weights), "methods": lres.methods,
                "stats": lres.stats, "seconds": lres.seconds_per_layer,
                "phases": {k: round(v, 3) for k, v in lres.phases.seconds.items()},
                "fallbacks": [[f.name, f.tokens, f.reason] for f in lres.fallbacks]}))
            for old, new, rec in inputs:
                self._record(new, rec)
                self._files.pop(old, None)
            self._mark(i + 1)
        if self.world.size > 1:
            self._files = self.world.broadcast(self._files if self.world.main else None)
        (self.root / self._x_name(i)).unlink(missing_ok=True)

    def load_layer(self, i: int) -> dict:
        """The json of finished layer i, registering its tensors for `quantized` / `float_tensor`;
        a state file that is unreadable, truncated or not what this store writes is refused
        (`_unreadable`), never half consumed."""
        path = self._use(f"layer-{i}.json")
        try:
            meta = json.loads(path.read_text(encoding="utf-8"))
            _check_layer_meta(meta)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise _unreadable(path, exc) from None
        files: dict[str, set[str]] = {}
        for name in {f.get("file", f"layer-{i}.safetensors") for f in meta["quantized"].values()} | {
                f"layer-{i}.safetensors"}:
            files[name] = self._keys(self._use(name))
        for module, f in meta["quantized"].items():
            file = f.get("file", f"layer-{i}.safetensors")
            if not any(k.startswith(f"q/{module}/") for k in files[file]):
                raise _unreadable(self.root / file, f"no tensors of {module}, which layer-{i}.json lists")
        for name in meta["floats"]:
            if f"f/{name}" not in files[f"layer-{i}.safetensors"]:
                raise _unreadable(self.root / f"layer-{i}.safetensors", f"no tensor f/{name}, which layer-{i}.json lists")
        for module, f in meta["quantized"].items():
            self._index[module] = (i, f)
        for name in meta["floats"]:
            self._floats[name] = i
        return meta

    @staticmethod
    def _keys(path: Path) -> set[str]:
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(path, framework="pt") as h:
                return set(h.keys())
        except (OSError, SafetensorError, ValueError) as exc:
            raise _unreadable(path, exc) from None

    def kv_amax(self, i: int) -> dict[str, torch.Tensor]:
        from safetensors import SafetensorError, safe_open

        path = self._use(f"layer-{i}.safetensors")
        try:
            with safe_open(path, framework="pt") as h:
                return {k[3:]: h.get_tensor(k) for k in h.keys() if k.startswith("kv/")}
        except (OSError, SafetensorError, ValueError) as exc:
            raise _unreadable(path, exc) from None

    def x(self, i: int, shape: tuple[int, ...], spill: bool) -> torch.Tensor:
        """Layer i's input: read into RAM, or (`spill`) an mmap of the state file."""
        path = self._use(self._x_name(i))
        n = 1
        for d in shape:
            n *= d
        try:
            size = path.stat().st_size
        except OSError as exc:
            raise _unreadable(path, exc) from None
        if n == 0:  # a rank with no calibration sequence (more ranks than sequences)
            return torch.empty(shape)
        if size != 4 * n:
            raise _unreadable(path, f"{size} bytes, layer {i}'s input {list(shape)} float32 is {4 * n}")
        if spill:
            return torch.from_file(str(path), shared=False, size=n, dtype=torch.float32).view(shape)
        return torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.float32).view(shape).clone()

    # -- what the writer reads ---------------------------------------------------------------------
    def modules(self) -> list[str]:
        return list(self._index)

    def quantized(self, module: str) -> QuantizedTensor:
        from safetensors import safe_open

        i, f = self._index[module]
        with safe_open(self.root / f.get("file", f"layer-{i}.safetensors"), framework="pt") as h:
            keys = [k for k in h.keys() if k.startswith(f"q/{module}/") or k.startswith(f"e/{module}/")]
            parts = {k.rsplit("/", 1)[1]: h.get_tensor(k) for k in keys if k.startswith("q/")}
            extra = {**f["extra"], **{k.rsplit("/", 1)[1]: h.get_tensor(k) for k in keys if k.startswith("e/")}}
        return QuantizedTensor(f["scheme"], f["kernel_fmt"], tuple(f["shape"]), parts, f["group_size"],
                               f["symmetric"], extra)

    def floats(self) -> list[str]:
        return list(self._floats)

    def float_tensor(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self.root / f"layer-{self._floats[name]}.safetensors", framework="pt") as h:
            return h.get_tensor(f"f/{name}")


def _unreadable(path: Path, why) -> CvtError:
    """One line for a calibration state file cvt cannot use (truncated, garbage, another
    method's or another version's): refused, never consumed."""
    from cvt.errors import OutputError

    if isinstance(why, KeyError):
        why = f"no {why.args[0]!r} entry"
    why = getattr(why, "strerror", None) or why
    text = " ".join(str(why).split()) or type(why).__name__
    return OutputError(f"{path}: calibration state unreadable ({text}); remove it or re-run with --no-resume to "
                       "calibrate afresh")


def _changed(path: Path, what: str) -> CvtError:
    """One line for a state file that is not what cvt recorded writing (`LayerStore._check_files`)."""
    from cvt.errors import OutputError

    return OutputError(f"{path}: calibration state file changed since cvt wrote it ({what}); re-run with "
                       "--no-resume to calibrate afresh")


def _world(path: Path, theirs: int, ours: int) -> CvtError:
    """One line for a calibration state computed by another number of ranks."""
    from cvt.errors import OutputError

    return OutputError(f"{path}: calibration state computed by {theirs} rank{'s' if theirs != 1 else ''}, this run "
                       f"has {ours} (ranks combine statistics in an order fixed by their number): re-run with "
                       f"--procs {theirs} to resume, or with --no-resume to calibrate afresh")


def _foreign(path: Path, theirs: dict, ours: dict) -> CvtError:
    """One line for a calibration state computed from another SRC (`cvt.convert.identity`)."""
    from cvt.errors import OutputError

    name = next((k for k in sorted(set(theirs) | set(ours)) if theirs.get(k) != ours.get(k)), "?")
    why = f"SRC has no {name}" if name not in ours else f"it had no {name}" if name not in theirs else \
        f"{name} differs"
    return OutputError(f"{path}: calibration state of another source ({why}); re-run with --no-resume to "
                       "calibrate afresh")


def _check_layer_meta(meta) -> None:
    """TypeError / KeyError unless `meta` has the shape `LayerStore.save_layer` writes."""
    if not isinstance(meta, dict):
        raise TypeError(f"expected a JSON object, got {type(meta).__name__}")
    for key, kind in (("quantized", dict), ("floats", list), ("methods", dict), ("stats", dict),
                      ("seconds", list), ("fallbacks", list)):
        if not isinstance(meta[key], kind):
            raise TypeError(f"{key!r} is {type(meta[key]).__name__}, expected {kind.__name__}")
    for module, f in meta["quantized"].items():
        if not (isinstance(f, dict) and isinstance(f["scheme"], str) and isinstance(f["shape"], list)
                and isinstance(f["extra"], dict) and isinstance(f.get("file", ""), str) and "/" not in f.get("file", "")):
            raise TypeError(f"the entry of {module} is not a quantized module's record")
    if not all(isinstance(f, list) and len(f) == 3 for f in meta["fallbacks"]):
        raise TypeError("'fallbacks' entries are not [module, tokens, reason]")
    if not all(isinstance(s, (int, float)) for s in meta["seconds"]):
        raise TypeError("'seconds' holds non-numbers")


def check_resumed(meta: dict, plan, i: int, path: Path) -> None:
    """A resumed layer's record must be this plan's: every module it lists quantized with the
    plan's scheme, by the plan's method (or RTN, a fallback) -- not another method's or
    another scheme's state left in the folder."""
    for module, f in meta["quantized"].items():
        s = plan.schemes.get(module)
        if s is None or f["scheme"] != s.name:
            raise _unreadable(path, f"{module} is recorded as {f['scheme']}, this run plans "
                              f"{'it float' if s is None else s.name}")
    for module, method in meta["methods"].items():
        want = plan.methods.get(module, RTN)
        if method not in (want, RTN):
            raise _unreadable(path, f"{module} was calibrated by {method}, this run uses {want}")
