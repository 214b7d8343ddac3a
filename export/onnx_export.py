"""`cvt export onnx SRC DST`: a runnable checkpoint -> ONNX graphs + export_manifest.json.

SRC is anything the runtime loads (a cvt output -- BF16, quantized Ascend or
compressed-tensors -- or a Hugging Face BF16 / FP8 directory). The runtime model is loaded in
float32 on the CPU and its modules are written as ONNX nodes (`cvt.export.onnx_models`); DST
holds:

* ``model.onnx`` (``--scope model``), ``layer_N.onnx`` (``--scope layer``) or
  ``layer_N.self_attn.onnx`` + ``layer_N.mlp.onnx`` (``--scope block``); weights inline, or in
  ``<graph>.onnx.data`` when they exceed 2 GB (ONNX external data);
* ``config.json`` and the tokenizer files of SRC (so `cvt run --backend onnxruntime DST` works);
* ``export_manifest.json``, written last: the source, every option, each graph's inputs and
  outputs with dtypes and symbolic shapes, the linears by format, and every file with its
  size and checksum (`cvt.convert.checksum.ALGORITHM`, under its name).

Everything is written into a hidden temporary folder inside DST (``DST/.cvt-tmp``, a real
directory: `cvt.convert.outdir.owned_dir`) and renamed into place at the end, manifest last, so
DST never looks complete unless it is; nothing is written beside DST. DST itself is locked
(flock on the directory, as every writing verb does) against a second run; a crashed run's
temporary folder is removed only under that lock. A DST that is not empty is refused unless
``--overwrite``, which deletes, once the new export is complete, only the files an earlier cvt
run recorded in DST's manifest (``export_manifest.json`` or ``cvt_manifest.json``), and refuses
to replace any file it did not record. DST may not be, lie inside or contain SRC; a DST that did
not exist is removed again when the export fails.

MoE: ``--moe gated`` (default) runs an expert (an ``If`` node) only when some token selected
it; ``--moe dense`` runs every expert for every token (no control flow, for atc). Both weight
expert outputs by the top-k routing mask: the runtime's sum, exactly.

Defaults: ``--opset`` 21 with ``--int4-op qdq`` (int4 DequantizeLinear with block_size needs
it), else 17; ``--dtype fp32`` (float weights stored as float32; fp16 / bf16 halve the file
and are cast to float32 in the graph -- onnxruntime 1.31 folds fp16 casts at load but repeats
bf16 casts on every run on CPU).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from cvt.convert import checksum
from cvt.convert.arch import TABLES
from cvt.convert.arch.attention import GQA, MLA
from cvt.convert.paths import check_disjoint
from cvt.errors import ArchError, CheckpointError, CvtError, OutputError

log = logging.getLogger(__name__)

MANIFEST = "export_manifest.json"
TMP_DIR = ".cvt-tmp"
SCOPES = ("model", "layer", "block")
DTYPES = ("fp32", "fp16", "bf16")
INT4_OPS = ("matmulnbits", "qdq")
W8A8_OPS = ("integer", "qdq")
MOE_MODES = ("gated", "dense")
BLOCKS = ("self_attn", "mlp")
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja")

# the attention kinds `cvt.export.onnx_models.GRAPHS` emits (named here so that checking a source
# needs no onnx import; tests/export hold the two equal)
EXPORTED_KINDS = (MLA.name, GQA.name)


def exportable_types() -> list[str]:
    """The model_types whose every attention kind (`cvt.convert.arch.attention`) is exported, in
    registration order."""
    return [mt for mt in TABLES.names() if all(k.name in EXPORTED_KINDS for k in TABLES[mt].attention.kinds)]


@dataclass
class ExportResult:
    dst: Path
    graphs: list[dict]
    manifest: dict
    seconds: float
    bytes_out: int
    parity: object = None
    extra: dict = field(default_factory=dict)


def default_opset(int4_op: str) -> int:
    from cvt.export.onnx_graph import QDQ_INT4_OPSET

    return QDQ_INT4_OPSET if int4_op == "qdq" else 17


def check_options(scope: str, dtype: str, int4_op: str, w8a8_op: str, opset: int | None, accuracy_level: int,
                  moe: str = "gated") -> int:
    """Validate the options; returns the opset to use."""
    from cvt.extras import require

    onnx = require("onnx", "cvt export onnx")  # first: onnx_graph imports it at module level
    from cvt.export.onnx_graph import MIN_OPSET, QDQ_INT4_OPSET

    for what, value, valid in (("--scope", scope, SCOPES), ("--dtype", dtype, DTYPES), ("--int4-op", int4_op, INT4_OPS),
                               ("--w8a8-op", w8a8_op, W8A8_OPS), ("--moe", moe, MOE_MODES)):
        if value not in valid:
            raise CvtError(f"{what} {value!r} is not one of {', '.join(valid)}")
    if accuracy_level not in (0, 1, 2, 3, 4):
        raise CvtError(f"--accuracy-level {accuracy_level} is not one of 0, 1, 2, 3, 4")
    opset = default_opset(int4_op) if opset is None else int(opset)
    top = onnx.defs.onnx_opset_version()
    if not MIN_OPSET <= opset <= top:
        raise CvtError(f"--opset {opset} is outside the range this exporter writes ({MIN_OPSET}..{top})")
    if int4_op == "qdq" and opset < QDQ_INT4_OPSET:
        raise CvtError(f"--int4-op qdq needs --opset {QDQ_INT4_OPSET} or higher (int4 DequantizeLinear with "
                       f"block_size arrived in opset 21); got --opset {opset}. Use --opset {QDQ_INT4_OPSET} or "
                       "--int4-op matmulnbits")
    return opset


def check_source(src) -> dict | None:
    """Refuse, before loading anything, a local SRC that is not a model directory (the reader's
    header-only index says why: pickles, index paths, symlinks, missing files), a `cvt shard`
    output, or one whose architecture has no exporter. Returns its (text) config, None for a
    hub repo id (resolved by the loader)."""
    from cvt.convert.arch import text_config
    from cvt.convert.reader import open_checkpoint, sharded_manifest, unsharded_source

    p = Path(src)
    sharded = sharded_manifest(p)
    if sharded is not None:
        raise CheckpointError(f"{src}: a cvt shard output ({sharded.shard.layout.world_size} per-rank directories); "
                              f"export onnx needs an unsharded checkpoint: pass the one it was sharded from, "
                              f"{unsharded_source(sharded)}")
    if not p.exists():
        if str(src).count("/") == 1 and not str(src).startswith((".", "/")):
            return None  # a hub repo id: resolved by the loader
        raise CheckpointError(f"{src}: no such directory")
    if p.is_dir() and (p / MANIFEST).is_file() and not any(p.glob("*.safetensors")):
        raise CheckpointError(f"{src}: an ONNX export, not a checkpoint; export reads safetensors checkpoints")
    with open_checkpoint(p) as ckpt:
        cfg = text_config(ckpt.config)
    mt = cfg.get("model_type")
    supported = exportable_types()
    if mt not in supported:
        raise ArchError(f"{src}: model_type {mt!r} cannot be exported (supported: {', '.join(supported)})")
    return cfg


def _check_layer(scope: str, layer: int | None, n_layers: int) -> int | None:
    """The decoder layer to export (scope layer / block: default 0), or CvtError naming --layer."""
    if scope != "model":
        layer = 0 if layer is None else int(layer)
        if not 0 <= layer < n_layers:
            raise CvtError(f"--layer {layer} is outside 0..{n_layers - 1} ({n_layers} decoder layers)")
    elif layer is not None:
        raise CvtError("--layer applies to --scope layer or block only")
    return layer


def _sha256(path: Path) -> str:
    """sha256 of a source file (the identity fields ``*_sha256`` name it)."""
    from cvt.convert.checksum import SHA256, file_digest

    return file_digest(path, SHA256)


def _check_dst(src_root: Path | None, dst: Path, overwrite: bool) -> None:
    if src_root is not None:  # before anything else: --overwrite must never reach SRC's files
        check_disjoint(src_root, dst, "export onnx")
    if dst.exists() and not dst.is_dir():
        raise OutputError(f"{dst}: exists and is not a directory")
    if dst.is_dir() and not overwrite:
        visible = sorted(p.name for p in dst.iterdir() if not p.name.startswith("."))
        if visible:
            raise OutputError(f"{dst}: already exists and is not empty ({len(visible)} entries, e.g. {visible[0]}); "
                              "pass --overwrite to replace it (only files an earlier cvt run recorded are deleted)")


def _lock_dst(dst: Path) -> tuple[int, bool]:
    """DST made if missing and locked (held until the returned descriptor is closed); whether
    this run created it."""
    from cvt.convert.outdir import lock_fd

    created = not dst.exists()
    try:
        dst.mkdir(parents=True, exist_ok=True)
        fd = os.open(dst, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise OutputError(f"{dst}: cannot create the output directory: {exc.strerror or exc}") from None
    try:
        lock_fd(fd, dst)
    except BaseException:
        os.close(fd)
        raise
    return fd, created


def _prepare_dst(dst: Path) -> Path:
    """DST's temporary folder, emptied (call with the lock held: a crashed earlier run's files
    go, never a live one's); a symlink there is refused."""
    from cvt.convert.outdir import owned_dir

    return owned_dir(dst, TMP_DIR, clean=True)


def _recorded(dst: Path) -> set[str]:
    """The files an earlier cvt run recorded in DST's manifests (their own names included): what
    --overwrite may delete or replace. An unreadable manifest records nothing."""
    from cvt.convert.reader import MANIFEST_NAME, read_manifest

    out: set[str] = set()
    try:
        m = json.loads((dst / MANIFEST).read_text())
        out |= {f["path"] for f in m["files"] if isinstance(f.get("path"), str)} | {MANIFEST}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    try:
        cm = read_manifest(dst)
    except CvtError:
        cm = None
    if cm is not None:
        out |= {f.path for f in cm.files} | {MANIFEST_NAME}
    return out


def _install(tmp: Path, dst: Path, recorded: set[str]) -> None:
    """Move the finished export from `tmp` into DST, manifest last: first the earlier run's
    recorded files go (its manifests before anything else, so DST stops looking complete);
    a name in DST that no cvt run recorded is never replaced (OutputError naming it)."""
    from cvt.convert.outdir import unlink_recorded

    names = sorted(p.name for p in tmp.iterdir())
    for n in names:
        if n not in recorded and ((dst / n).exists() or (dst / n).is_symlink()):
            raise OutputError(f"{dst / n}: exists and no cvt run recorded it; --overwrite deletes or replaces only "
                              "files an earlier cvt run recorded: move it away or choose another DST")
    first = [r for r in recorded if Path(r).name.endswith("manifest.json") and "/" not in r]
    for rel in [*sorted(first), *sorted(set(recorded) - set(first))]:
        unlink_recorded(dst, rel)
    for n in sorted(names, key=lambda n: n == MANIFEST):  # the manifest last
        os.replace(tmp / n, dst / n)
    fd = os.open(dst, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    tmp.rmdir()


def _io(vi) -> dict:
    import onnx
    from onnx import helper

    t = vi.type.tensor_type
    return {"name": vi.name, "dtype": "bfloat16" if t.elem_type == onnx.TensorProto.BFLOAT16
            else helper.tensor_dtype_to_np_dtype(t.elem_type).name,
            "shape": [d.dim_param if d.HasField("dim_param") else int(d.dim_value) for d in t.shape.dim]}


def export_onnx(src, dst, *, scope: str = "model", layer: int | None = None, dtype: str = "fp32",
                int4_op: str = "matmulnbits", w8a8_op: str = "integer", opset: int | None = None,
                accuracy_level: int = 0, moe: str = "gated", verify: bool = False, overwrite: bool = False,
                external_threshold: int | None = None, revision: str | None = None,
                quiet: bool = False) -> ExportResult:
    """Export SRC to ONNX in DST (see the module docstring). With `verify`, runs the parity
    check (`cvt.export.ort.parity`) and stores it in the result (`.parity`)."""
    t0 = time.perf_counter()
    opset = check_options(scope, dtype, int4_op, w8a8_op, opset, accuracy_level, moe)
    if verify:  # before the model is loaded and exported, not after
        from cvt.extras import require

        require("onnxruntime", "cvt export onnx --verify")
    cfg = check_source(src)
    if cfg is not None and isinstance(cfg.get("num_hidden_layers"), int):  # before the (long) load
        _check_layer(scope, layer, cfg["num_hidden_layers"])
    dst = Path(dst)
    _check_dst(Path(src) if Path(src).exists() else None, dst, overwrite)

    import torch

    from cvt.export import onnx_models as om
    from cvt.export.onnx_graph import EXTERNAL_THRESHOLD
    from cvt.runtime.loader import load_model

    threshold = EXTERNAL_THRESHOLD if external_threshold is None else int(external_threshold)
    loaded = load_model(src, device="cpu", dtype=torch.float32, revision=revision, quiet=quiet)
    model = loaded.model
    om.check_exportable(model)
    n_layers = model.args.num_hidden_layers
    layer = _check_layer(scope, layer, n_layers)

    _check_dst(loaded.checkpoint_path, dst, overwrite)  # a hub source resolved to its snapshot
    lock, created = _lock_dst(dst)
    installed = False
    try:
        _check_dst(None, dst, overwrite)  # again, under the lock
        recorded = _recorded(dst) if overwrite else set()
        result = _export(src, dst, loaded, tmp=_prepare_dst(dst), recorded=recorded, scope=scope, layer=layer,
                         dtype=dtype, opset=opset, int4_op=int4_op, w8a8_op=w8a8_op, accuracy_level=accuracy_level,
                         moe=moe, verify=verify, threshold=threshold, quiet=quiet, t0=t0, n_layers=n_layers)
        installed = result.extra.get("installed", True)
        return result
    except OSError as exc:
        if exc.filename:
            raise
        raise OutputError(f"{dst}: writing the export failed: {exc.strerror or exc}; nothing was installed") from exc
    finally:
        if created and not installed:  # a DST this run made goes again (only when empty: never another's files)
            try:
                dst.rmdir()
            except OSError:
                pass
        os.close(lock)


def _export(src, dst: Path, loaded, *, tmp: Path, recorded: set[str], scope, layer, dtype, opset, int4_op, w8a8_op, accuracy_level, moe,
            verify, threshold, quiet, t0, n_layers) -> ExportResult:
    from cvt.export.onnx_graph import LinearOptions
    from cvt.progress import make_progress

    model = loaded.model
    bar = make_progress(None, "export onnx (weights)", quiet)
    try:
        opts = LinearOptions(int4_op=int4_op, w8a8_op=w8a8_op, accuracy_level=accuracy_level, moe=moe)
        graphs = _graphs(model, tmp, scope, layer, dtype, opset, opts, threshold, bar)
        for name in SIDE_FILES:
            p = loaded.checkpoint_path / name
            if p.is_file():
                shutil.copy2(p, tmp / name)
        manifest = _manifest(src, loaded, graphs, opts, scope=scope, layer=layer, dtype=dtype, opset=opset,
                             int4_op=int4_op, w8a8_op=w8a8_op, accuracy_level=accuracy_level, moe=moe,
                             n_layers=n_layers)
        _write_manifest(tmp, manifest)
        checks = None
        if verify:  # on the staged export: a failed parity check leaves no installed DST
            from cvt.export.ort import parity

            checks = parity(tmp, model)
        installed = checks is None or all(p.passed for p in checks)
        if installed:
            _install(tmp, dst, recorded)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        from cvt.convert.outdir import remove_owned_dir

        remove_owned_dir(tmp)
        raise
    finally:
        bar.close()
    bytes_out = sum(f["size"] for f in manifest["files"])
    res = ExportResult(dst, graphs, manifest, time.perf_counter() - t0, bytes_out, parity=checks)
    res.extra["installed"] = installed
    return res


def _graphs(model, tmp: Path, scope, layer, dtype, opset, opts, threshold, bar) -> list[dict]:
    """Each graph of the scope (the model, one layer, or one layer's blocks) built with its weights
    streaming into its data file, saved and checked in `tmp`; their manifest entries."""
    import onnx

    from cvt.export import onnx_models as om
    from cvt.export.onnx_graph import Graph, save_graph

    targets = ([("model", None)] if scope == "model" else [("layer", None)] if scope == "layer"
               else [("block", b) for b in BLOCKS])
    graphs = []
    for kind, block in targets:
        stem = {"model": "model", "layer": f"layer_{layer}", "block": f"layer_{layer}.{block}"}[kind]
        g = Graph(opset=opset, weight_dtype=dtype, data_path=tmp / f"{stem}.onnx.data", progress=bar)
        try:  # weights stream into the data file while the graph is built
            if kind == "model":
                spec = om.build_model_graph(g, model, opts)
            elif kind == "layer":
                spec = om.build_layer_graph(g, model, layer, opts)
            else:
                spec = om.build_block_graph(g, model, layer, block, opts)
            path = tmp / spec.file
            data = save_graph(g, g.model(spec.name), path, threshold)
        finally:
            g.close_data()
        onnx.checker.check_model(str(path), full_check=True)
        entry = {"name": spec.name, "file": spec.file, "external_data": data.name if data else None,
                 "inputs": [_io(v) for v in g.inputs], "outputs": [_io(v) for v in g.outputs],
                 "nodes": len(g.nodes), "weight_bytes": g.weight_bytes}
        graphs.append(entry)
        log.debug("wrote %s (%d nodes, %d weight bytes%s)", spec.file, len(g.nodes), g.weight_bytes,
                  f", external data {data.name}" if data else "")
    return graphs


def _manifest(src, loaded, graphs: list[dict], opts, *, scope, layer, dtype, opset, int4_op, w8a8_op,
              accuracy_level, moe, n_layers) -> dict:
    """The export's manifest: its source, options, model sizes, KV-cache and MoE conventions,
    graphs; `files` filled in by `_write_manifest`."""
    from cvt.version import __version__
    from cvt.export import onnx_models as om

    model = loaded.model
    src_manifest = loaded.checkpoint_path / "cvt_manifest.json"
    attn0 = model.model.layers[0].self_attn
    return {
        "format": "cvt-onnx", "version": 1, "tool": f"cvt {__version__}",
        "source": {"path": str(src), "resolved": str(loaded.checkpoint_path), "format": loaded.source_format,
                   "model_type": loaded.config.get("model_type"),
                   "cvt_manifest_sha256": _sha256(src_manifest) if src_manifest.is_file() else None,
                   "config_sha256": _sha256(loaded.checkpoint_path / "config.json")},
        "scope": scope, "layer": layer, "opset": opset, "dtype": dtype, "compute_dtype": "fp32",
        "int4_op": int4_op, "w8a8_op": w8a8_op, "accuracy_level": accuracy_level,
        "family": om.family_name(model), "num_hidden_layers": n_layers,
        "vocab_size": model.args.vocab_size, "hidden_size": model.args.hidden_size,
        "max_positions": int(model.max_positions),
        "kv_cache": {"layout": om.kind_of(model).layout,
                     "dtype": "int8" if getattr(attn0, "kv_scales", None) is not None else "float32",
                     "inputs": "past_key_values.{i}.*", "outputs": "present.{i}.*"},
        "moe": {"mode": moe, "math": "sum over experts of routing weight (0 where not selected) x expert "
                                      "output, in expert order: exact" + ("; an If per expert runs it only when "
                                      "some token selected it" if moe == "gated" else "; every expert runs")},
        "linears": dict(sorted(opts.counts.items())),
        "graphs": graphs,
        "files": [],
    }


def _write_manifest(tmp: Path, manifest: dict) -> None:
    """Every staged file with its size and checksum into `manifest`, then the manifest itself,
    last: its presence means the export is complete."""
    for p in sorted(tmp.iterdir()):
        manifest["files"].append({"path": p.name, "size": p.stat().st_size,
                                  checksum.ALGORITHM: checksum.file_digest(p)})
    data = json.dumps(manifest, indent=2) + "\n"
    with open(tmp / MANIFEST, "w") as f:  # last: its presence means the export is complete
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
