"""Streaming calibration: the quantize stage's data-driven work, one decoder layer in memory.

`calibrate_streaming` runs the calibration driver (`cvt.quant.methods.calib`: GPTQ, AWQ,
SmoothQuant, RTN in place, the true-sequential stages) over a runtime model built on the meta
device, so that a 0.7-2 TB checkpoint calibrates on a host with less RAM than the model:

1. The calibration tokens are embedded by reading only their rows of ``embed_tokens`` from the
   checkpoint (mmap), and the model's own forward gives the arguments of decoder layer 0 (rope,
   mask) through the driver's capture hook; no other weight is loaded.
2. For each decoder layer i: its tensors are read from the source and assigned in the compute
   dtype on `device` (FP8 blocks dequantized, compressed-tensors INT4 unpacked to float, BF16
   as is); the layer is calibrated; its quantized parts, changed float tensors, statistics and
   observed KV-cache ranges are written to the state folder (``DST/.cvt-calib``), with the
   layer's output (the next layer's input, float32); the layer's weights are dropped (back to
   meta) before the next is read. Layer inputs larger than `spill_bytes` are used from the
   state folder through mmap instead of RAM.
3. A killed run restarts after its last finished layer (`state.json` names the plan: SRC's
   content identity (`cvt.convert.identity`), schemes and methods, tokens, options, device;
   and records the size and checksum of every state file, hashed as it was written); the
   persisted inputs and results are the exact float32 bytes an uninterrupted run has, so the
   output is byte-identical. Before a resumed run uses the state, every recorded file is
   checked against its record: a changed file (a tensor scaled at the same size), one not
   recorded, or a state computed from another SRC is refused with one line, never consumed.

Peak memory: one decoder layer in float32, except a MoE layer whose routed experts pass
`max_expert_bytes` (DeepSeek-V3: ~45 GB per layer): those are read, calibrated and dropped a chunk
of experts at a time (`cvt.quant.methods.expert_stream`; not when AWQ / SmoothQuant smooth across
the experts, which needs them all; each chunk's quantized experts go to the state folder as it
finishes, and the layer keeps a few activation-sized lists: attention output, routed sums);
plus the layer's input and output activations (or mmap pages of them), the driver's statistics
(GPTQ Hessians bounded by `max_hessian_bytes`), and a constant. Everything else of the stage
streams as RTN does: the writer reads each calibrated module's parts from the state folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from cvt.convert.durable import write_safetensors_atomic
from cvt.convert.outdir import STATE_DIR, clear_dir  # noqa: F401  (STATE_DIR: the folder `calibration_dir` makes)
from cvt.errors import CvtError
from cvt.quant.recipe import AWQ, GPTQ, RTN, SMOOTHQUANT
from cvt.quant.tensor.schemes.base import QuantizedTensor

log = logging.getLogger(__name__)

SPILL_BYTES = 1 << 30  # layer activations above this are used through mmap from the state folder
MAX_EXPERT_BYTES = 4 << 30  # a MoE layer's routed experts above this (float32) are read a chunk at a time


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass
class StreamResult:
    """What the stage needs from calibration; tensors stay on disk until the writer asks."""

    store: "LayerStore"
    methods: dict[str, str] = field(default_factory=dict)
    fallbacks: list = field(default_factory=list)              # calib.Fallback
    stats: dict[str, dict] = field(default_factory=dict)
    kv_amax: list[dict[str, torch.Tensor]] = field(default_factory=list)
    seconds_per_layer: list[float] = field(default_factory=list)
    peak_rss: int = 0
    resumed_layers: int = 0


class LayerStore:
    """The state folder: per finished layer ``layer-{i}.safetensors`` (quantized parts as
    ``q/{module}/{part}``, changed float tensors as ``f/{name}``, KV ranges as ``kv/{role}``) +
    ``layer-{i}.json`` (the parts' QuantizedTensor fields, methods, stats, fallbacks), the next
    layer's input ``x-{i+1}.bin`` and ``state.json`` (plan id, SRC's content identity, layers
    done, and the size and checksum of every state file a resumed run may use)."""

    def __init__(self, root: Path, plan_id: str, source: dict[str, str] | None = None):
        self.root, self.plan_id, self.source = Path(root), plan_id, source or {}
        self._index: dict[str, tuple[int, dict]] = {}   # module -> (layer, QuantizedTensor fields)
        self._floats: dict[str, int] = {}                # float tensor name -> layer
        self._files: dict[str, dict] = {}                # state file -> {size, algorithm: digest}: checked or written here

    # -- state ------------------------------------------------------------------------------------
    def done(self) -> int:
        """Layers an earlier run of the same plan finished, every file they left checked against
        its record (`_check_files`); 0: start afresh, state cleared. A state computed from
        another SRC is refused (`_foreign`), not cleared: re-run with --no-resume for that."""
        p = self.root / "state.json"
        try:
            st = json.loads(p.read_text())
            source = st.get("source")
            if isinstance(source, dict) and self.source and source != self.source:
                raise _foreign(p, source, self.source)
            if st.get("plan_id") == self.plan_id:
                done, files = int(st["done"]), st["files"]
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
                                                     "files": self._files})

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
        self._record(name, write_safetensors_atomic(self.root / name, tensors))
        return {m: {**f, "file": name} for m, f in fields.items()}

    def save_layer(self, i: int, lres, kv_amax: dict[str, torch.Tensor], x_next: torch.Tensor,
                   parts: dict[str, dict] | None = None) -> None:
        """Layer i's results (and the fields of its experts already saved by `save_part`); then
        the layer counts as done."""
        from cvt.convert.durable import write_bytes_atomic, write_json_atomic

        tensors, fields = self._pack(lres.quantized)
        fields.update(parts or {})
        for name, t in lres.float_weights.items():
            tensors[f"f/{name}"] = t.detach().cpu().contiguous()
        for role, t in kv_amax.items():
            tensors[f"kv/{role}"] = t.detach().float().cpu().contiguous()
        self._record(f"layer-{i}.safetensors", write_safetensors_atomic(self.root / f"layer-{i}.safetensors", tensors))
        self._record(f"layer-{i}.json", write_json_atomic(self.root / f"layer-{i}.json", {
            "quantized": fields, "floats": sorted(lres.float_weights), "methods": lres.methods,
            "stats": lres.stats, "seconds": lres.seconds_per_layer,
            "fallbacks": [[f.name, f.tokens, f.reason] for f in lres.fallbacks]}))
        self._record(f"x-{i + 1}.bin", write_bytes_atomic(
            self.root / f"x-{i + 1}.bin", x_next.detach().float().cpu().contiguous().numpy().tobytes()))
        self._files.pop(f"x-{i}.bin", None)
        self._mark(i + 1)
        (self.root / f"x-{i}.bin").unlink(missing_ok=True)

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
        path = self._use(f"x-{i}.bin")
        n = 1
        for d in shape:
            n *= d
        try:
            size = path.stat().st_size
        except OSError as exc:
            raise _unreadable(path, exc) from None
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


def _trim() -> None:
    """Hand freed heap memory back to the OS (glibc keeps a dropped layer's many mid-sized
    buffers in its arenas otherwise, and RSS would creep up layer by layer)."""
    try:
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def stream_plan_id(ckpt, plan, tokens: torch.Tensor, device, opts: dict, source: dict | None = None) -> str:
    """The calibration's identity: a resumed run continues only the same one. `source`: SRC's
    content identity (`Checkpoint.content_identity` when not given)."""
    ident = {
        "source": source if source is not None else ckpt.content_identity,
        "modules": sorted((m, s.name, s.group_size, s.symmetric, getattr(s, "fp4_format", None),
                           plan.methods.get(m, RTN)) for m, s in plan.schemes.items()),
        "tokens": hashlib.sha256(tokens.numpy().tobytes()).hexdigest(), "shape": list(tokens.shape),
        # max_expert_bytes changes how much is read at once, not a byte of the result: a run killed
        # for memory may resume with a smaller --expert-memory
        "device": str(device), "opts": {k: str(v) for k, v in sorted(opts.items()) if k != "max_expert_bytes"},
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def _streams_experts(layer: nn.Module, prefix: str, plan, o: dict) -> bool:
    """Whether this layer's routed experts are calibrated a chunk at a time (module doc)."""
    from cvt.quant.methods.expert_stream import expert_bytes

    if not o["true_sequential"] or expert_bytes(layer) <= o["max_expert_bytes"]:
        return False
    smoothed = sorted(m for m, meth in plan.methods.items()
                      if m.startswith(prefix + "mlp.") and meth in (AWQ, SMOOTHQUANT))
    if smoothed:
        log.info("%smlp.experts: calibrated whole (%s smooths across them: %s)", prefix,
                 plan.methods[smoothed[0]], smoothed[0])
        return False
    return True


def _expert_stream(model, ckpt, device, block, layer: nn.Module, i: int, plan, o: dict, store: LayerStore):
    from cvt.quant.methods.expert_stream import ExpertStream
    from cvt.runtime.loader import assign_tensors

    prefix = f"model.layers.{i}"

    def gptq_sites(e: int) -> list[int]:
        ex, name = layer.mlp.experts[e], f"{prefix}.mlp.experts.{e}."
        ks = []
        if any(plan.methods.get(name + p) == GPTQ and name + p in plan.schemes for p in ("gate_proj", "up_proj")):
            ks.append(ex.gate_proj.weight.shape[1])
        if plan.methods.get(name + "down_proj") == GPTQ and name + "down_proj" in plan.schemes:
            ks.append(ex.down_proj.weight.shape[1])
        return ks

    def save(c: int, quantized: dict) -> dict:
        return store.save_part(i, c, quantized)

    def load(ids: list[int]) -> None:
        heads = tuple(f"{prefix}.mlp.experts.{e}." for e in ids)
        assign_tensors(model, ckpt, device, block, skip=lambda name: not name.startswith(heads))
        _dense_linears(layer)

    def drop(ids: list[int]) -> None:
        for e in ids:
            layer.mlp.experts[e].to("meta")
        _trim()

    chunks = ExpertStream.plan_chunks(layer, gptq_sites, o["max_expert_bytes"], o["max_hessian_bytes"],
                                      torch.finfo(o["hessian_dtype"]).bits // 8)
    log.info("%s: %d routed experts in %d chunks", prefix, len(layer.mlp.experts), len(chunks))
    return ExpertStream(layer, prefix, chunks, load, drop, save)


def _dense_linears(layer: nn.Module) -> None:
    """Quantized source modules (compressed-tensors INT4) become float Linears to calibrate."""
    from cvt.runtime.kernels import Linear

    for name, mod in list(layer.named_modules()):
        if isinstance(mod, Linear) and mod.fmt != "dense":
            parent, _, attr = name.rpartition(".")
            w = mod.dense_weight()
            setattr(layer.get_submodule(parent) if parent else layer, attr,
                    Linear.from_parts({"weight": w}, None if mod.bias is None else mod.bias.float()))


def calibrate_streaming(ckpt, plan, tokens: torch.Tensor, state_dir: Path, *, device="cpu",
                        observe_kv: bool = False, spill_bytes: int | None = None, quiet: bool = True,
                        on_layer: Callable[[int], None] | None = None, **opts) -> StreamResult:
    """Calibrate `plan` (``plan.schemes``, ``plan.methods``) on `tokens` [b, s], one decoder layer
    at a time (module doc). `opts` go to the driver (`cvt.quant.methods.calib.calibrate`'s
    options). `on_layer(i)` is called after layer i is saved (tests kill runs there)."""
    from cvt.convert import faults
    from cvt.quant.methods import calib as C
    from cvt.runtime import kv_cache
    from cvt.runtime.loader import assign_tensors, fp8_block
    from cvt.runtime.models import build_model
    from cvt.convert.config import source_format
    from cvt.progress import make_progress

    device = torch.device(device)
    o = dict(min_tokens=32, batch_size=8, damp=0.01, act_order=True, scale_search="hdiag", block_size=128,
             static_groups=None,
             true_sequential=True, alpha=0.5, n_grid=20, duo_scaling=True, awq_clip_search=True, max_samples=512,
             max_hessian_bytes=4 << 30, hessian_dtype=torch.float32, collect_stats=False,
             max_expert_bytes=MAX_EXPERT_BYTES)
    unknown = set(opts) - set(o)
    if unknown:
        raise CvtError(f"unknown calibration option(s) {sorted(unknown)}")
    o.update(opts)
    source = ckpt.content_identity
    store = LayerStore(state_dir, stream_plan_id(ckpt, plan, tokens, device, o, source), source)
    with torch.device("meta"):
        model = build_model(ckpt.config, dtype=torch.float32)
    n_layers = model.args.num_hidden_layers
    block = fp8_block(ckpt, source_format(ckpt.config))
    emb = ckpt.read("model.embed_tokens.weight")          # rows read through mmap, never the whole table
    model.model.embed_tokens.forward = lambda t: emb[t.cpu()].to(device=device, dtype=torch.float32)
    x, args, kwargs = C._layer_args(model, tokens.to(device))
    del model.model.embed_tokens.forward
    shape = tuple(x.shape)
    spill = x.numel() * 4 > (SPILL_BYTES if spill_bytes is None else spill_bytes)
    start = store.done()
    if start > n_layers:
        raise _unreadable(store.root / "state.json", f"{start} layers done, the model has {n_layers}")
    res = StreamResult(store, resumed_layers=start)
    for i in range(start):
        meta = store.load_layer(i)
        check_resumed(meta, plan, i, store.root / f"layer-{i}.json")
        _merge(res, meta)
        res.kv_amax.append(store.kv_amax(i))
    if start:
        x = store.x(start, shape, spill).to(device)
        log.info("calibration resumes after %d finished layers", start)
    observer = kv_cache.KVObserver(model) if observe_kv else None
    bar = make_progress(n_layers, "calibrate", quiet, unit="layer", initial=start)
    try:
        for i in range(start, n_layers):
            t0 = time.perf_counter()
            layer = model.model.layers[i]
            prefix = f"model.layers.{i}."
            streamed = _streams_experts(layer, prefix, plan, o)
            experts_at = prefix + "mlp.experts."
            assign_tensors(model, ckpt, device, block, skip=lambda name: not name.startswith(prefix)
                           or (streamed and name.startswith(experts_at)))
            _dense_linears(layer)
            es = _expert_stream(model, ckpt, device, block, layer, i, plan, o, store) if streamed else None
            if observer is not None:
                layer.self_attn.kv_observer = observer._observer(i)
            lres = C.CalibResult()
            C._LayerCalib(layer, f"model.layers.{i}", plan.schemes.get, lambda n: plan.methods.get(n, RTN),
                          lres, o, experts=es).run(x, args, kwargs)
            x = es.x_next if es is not None else C._run_layer(layer, x, args, kwargs, o["batch_size"])
            if observer is not None:
                layer.self_attn.kv_observer = None
            lres.seconds_per_layer.append(time.perf_counter() - t0)
            amax = observer.amax[i] if observer is not None else {}
            store.save_layer(i, lres, amax, x, es.saved if es is not None else None)
            if spill:  # the next input from the state file, not RAM
                x = store.x(i + 1, shape, True).to(device)
            layer.to("meta")                                  # the layer's weights are dropped here
            _trim()
            meta = store.load_layer(i)
            _merge(res, meta)
            res.kv_amax.append(amax)
            bar.update(1)
            bar.set_postfix_str(f"{lres.seconds_per_layer[0]:.1f} s/layer, peak RSS {peak_rss_bytes() / 2**30:.2f} GiB")
            log.info("calibrated layer %d/%d in %.1f s", i + 1, n_layers, lres.seconds_per_layer[0])
            faults.after_layer(i)
            if on_layer is not None:
                on_layer(i)
    finally:
        bar.close()
        ckpt.release("model.embed_tokens.weight")
    res.peak_rss = peak_rss_bytes()
    return res


def _merge(res: StreamResult, meta: dict) -> None:
    from cvt.quant.methods.calib import Fallback

    res.methods.update(meta["methods"])
    res.stats.update(meta["stats"])
    res.fallbacks += [Fallback(*f) for f in meta["fallbacks"]]
    res.seconds_per_layer += meta["seconds"]


def kv_scales(res: StreamResult, model_or_config, codec: str) -> dict[str, torch.Tensor]:
    """The KV-cache scales from the per-layer ranges observed while calibrating (the runtime's
    `KVObserver` rules: int8 Ascend C8 / FAKQuant, or fp8 compressed-tensors)."""
    from cvt.runtime import kv_cache

    class _Obs(kv_cache.KVObserver):
        def __init__(self):  # noqa: D401 - the observer's scale rules over stored ranges
            self.model = model_or_config
            self.mla = kv_cache.is_mla(model_or_config)
            self.amax = res.kv_amax

    obs = _Obs()
    return obs.fp8_scales() if codec == "fp8" else obs.scales()
