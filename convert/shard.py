"""`cvt shard`: per-rank weight directories for an EP/TP layout, streamed from the source once.

Output (DST)::

    cvt_manifest.json              layout, every tensor's split, every rank's files (size, checksum)
    config.json, tokenizer*, ...   the source's, unchanged
    expert_placement.json          MindIE / vllm-ascend expert map  (MoE models)
    expert_placement_eplb.json     DeepSeek EPLB phy2log / log2phy / logcnt  (MoE models)
    rank-00000/
        model-00001-of-0000N.safetensors   bounded by --max-shard-size
        model.safetensors.index.json       the rank's weight map
        quant_model_description.json       Ascend sources: the rank's tensors' tags + global keys
    rank-00001/ ...

Tensor names never change (routed experts keep their global ids). A tensor is split along
the arch table's TP dim (`TensorInfo.split_dim`, extended below to per-output-channel 1-D
parts of column-parallel linears such as Ascend ``deq_scale`` / ``quant_bias``) by the degree
of its part of the model (`cvt.convert.memory_plan.axis_of`: tp, dense_tp, moe_tp, embed_tp,
lmhead_tp); the holder with coordinate ``i`` on that axis gets the ``i``-th of ``degree``
equal runs (of each part, where the table says the split dim holds several: a Gated DeltaNet's
q | k | v rows, `Rule.parts`; the manifest records them). Parts of a split linear that are
broadcast along the split dim (per-channel scales ``[n, 1]`` of a row-parallel linear, per-tensor ``[1]`` scales, compressed-tensors
``weight_shape``) are copied whole. Routed-expert tensors go only to the ranks whose EP rank
holds the expert (placement, redundant copies included). So for every tensor the manifest's
``TensorShard`` (axis, dim, degree, parts) says how to put it back together (a layer's experts
fused over dim 0, gpt-oss's, split there over ep: contiguous id ranges): concatenating the
holders' runs in coordinate order (part by part) gives the source bytes exactly. A tensor the
layout entry splits in diagonal blocks (`cvt.qtensor.layouts.DiskTensor.k_split`: a
W4A4_MXFP4_FLATQUANT row layer's ``left_trans``, whose consumer keeps only rank i's block) goes as
holder i's block, ``TensorShard.diagonal``; it is refused unless zero outside those blocks, so
the blocks on the diagonal give the source exactly too. A layout entry whose transforms allow
only some degrees along in_features (`Layout.max_tp`, `Layout.splits_k`) refuses the others.

FP8 block scales, packed int4 (two per byte / eight per int32) and group scales split
consistently with their weight because `cvt.convert.memory_plan.validate` refuses any degree that
does not keep 128-blocks, groups and packing units whole, and a per-tensor check refuses any
stored tensor whose split dim does not divide.

Streaming: source tensors are visited once (in `_visit_order`: by how far into their holders'
shares they sit, so every rank's file is fed at once); each tensor's distinct slices are
made once (zero-copy for dim-0 runs and whole tensors, one copy for dim-1 runs, into a pooled
buffer placed as its first holder file has it), charged once
against the writer's in-flight byte budget, and handed to every rank file that holds them (a
replicated 1.85 GB embedding goes to all W ranks at once, not one rank at a time). The files
are the writer's (`cvt.convert.fileset.FileSet`): a rank's files are consecutive runs of its
tensors in that same order, so at most one file per rank is open, each with a writer thread
(which hashes as it writes); peak memory is a few tensors whatever W or the model size. The source
tensor's pages are released once every rank file has hashed its slice. Resume, locking and
atomic files are the writer's too (`OutputDir`): finished rank files are skipped on a rerun
and source tensors only they need are not read.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass
from pathlib import Path

from cvt.version import __version__
from cvt.convert.arch import Parallel, Role, arch_for
from cvt.convert.config import fp8_block, quantization_config, source_format, with_explicit_defaults
from cvt.convert.placement import (PLACEMENT_FILES, Layout, Placement, contiguous_placement, coords, moe_layers,
                                   placement_json)
from cvt.convert.memory_plan import axis_of, check
from cvt.convert.reader import MANIFEST_NAME, Checkpoint, check_manifest_files, open_checkpoint, read_manifest
from cvt.convert.validate import check_weights
from cvt.dtypes import DTYPES
from cvt.convert.safetensors_io import TensorSpec, load_json
from cvt.convert.buffers import OUTPUTS, Countdown
from cvt.convert.fileset import FileSet
from cvt.convert.writer import (
    DEFAULT_MAX_SHARD,
    OutputDir,
    WriteResult,
    finish_output,
    gathered,
    plan_shards,
    ranked,
    run_plan_id,
    source_info,
    together,
)
from cvt.world import SINGLE, World
from cvt.errors import CvtError, ShapeError
from cvt.qtensor.layouts.base import DIAGONAL
from cvt.progress import make_progress
from cvt.units import article
from cvt.schemas.manifest import FileInfo, Manifest, RankShard, ShardInfo, StageInfo, TensorShard

RANK_DIR = "rank-{:05d}"
INDEX_NAME = "model.safetensors.index.json"
ASCEND_DESCRIPTION = "quant_model_description.json"
# 1-D per-output-channel parts of a linear (Ascend static W8A8): split like the weight's rows
_PER_CHANNEL = frozenset({"deq_scale", "quant_bias"})
_TWO_D_PARAMS = ("weight", "weight_scale_inv", "weight_packed", "weight_int4", "weight_fp4")


@dataclass(frozen=True)
class Split:
    """How one tensor is spread: along `axis` (a layout degree) at `dim` in `degree` runs (of
    each of its `parts`, when the dim holds several: `Rule.parts`)."""

    axis: str | None
    dim: int | None
    degree: int
    expert: tuple[int, int] | None  # (layer, global id) of a routed-expert tensor
    parts: tuple[int, ...] | None = None  # sizes of the consecutive parts along `dim`
    diagonal: bool = False  # a square tensor: holder i's run along dims 0 and 1 (its diagonal block)

    def runs(self, size: int, index: int) -> list[tuple[int, int]]:
        """(start, length) along `dim` of holder `index`'s run of each part, in order."""
        out, start = [], 0
        for part in self.parts or (size,):
            n = part // self.degree
            out.append((start + index * n, n))
            start += part
        return out


def split_of(arch, layout: Layout, name: str, shape: tuple[int, ...], quant_layout=None) -> Split:
    """The split of tensor `name` (stored shape `shape`) under `layout` (module docstring).
    `quant_layout`: the `cvt.qtensor.layouts.Layout` its module is stored in (from the manifest),
    whose data says which on-disk dim follows the module's split axis (None: the arch table's
    rule for float / FP8 tensors)."""
    info = arch.classify(name)
    if info.role is Role.EXPERT and info.expert is None:
        # a layer's experts fused over [E, ...] (gpt-oss): EP rank i holds experts [i E/ep, (i+1) E/ep)
        # of every such tensor, as vLLM's EP loader slices them (`cvt.convert.arch.gpt_oss`)
        return Split("ep", 0, layout.ep, None) if layout.ep > 1 else Split(None, None, 1, None)
    expert = (info.layer, info.expert) if info.role is Role.EXPERT else None  # a routed expert's [layer, id]
    axis = axis_of(info, layout.shared_experts)
    degree = getattr(layout, axis) if axis else 1
    disk = quant_layout.tensor(info.param) if quant_layout is not None else None
    if disk is not None:
        logical = {Parallel.COLUMN: "n", Parallel.VOCAB: "n", Parallel.ROW: "k"}.get(info.rule.parallel)
        if logical == "k" and degree > 1:
            _refuse_k_split(name, quant_layout, axis, degree)
            if disk.k_split == DIAGONAL:  # each rank keeps its diagonal block (`DiskTensor.k_split`)
                return Split(axis, 0, degree, expert, diagonal=True)
        along = disk.along(logical, 0, 0) if logical else None  # (dim, unit): the unit does not matter here
        if along is None or degree == 1:
            return Split(None, None, 1, expert)  # no dim along the split axis: every holder needs it whole
        return Split(axis, along[0], degree, expert, arch.split_parts(info, shape[0]) if along[0] == 0 else None)
    dim = info.split_dim
    if dim is None and info.param in _PER_CHANNEL and info.rule.parallel in (Parallel.COLUMN, Parallel.VOCAB):
        dim = 0
    if dim is None or degree == 1:
        return Split(None, None, 1, expert)
    if dim == 1 and len(shape) == 4:
        # ModelOpt FP8_PB_WO's block scale [ceil(n/bn), 1, ceil(k/bk), 1]: k's blocks are on dim 2,
        # where vLLM's ModelOptFp8PbWoLinearMethod slices it (input_dim=2; `cvt.convert.release_split`)
        dim = 2
    if info.param not in _TWO_D_PARAMS and (dim >= len(shape) or shape[dim] == 1):
        return Split(None, None, 1, expert)  # broadcast along the split dim: every holder needs it whole
    return Split(axis, dim, degree, expert, arch.split_parts(info, shape[dim]) if dim == 0 else None)


def _refuse_k_split(name: str, quant_layout, axis: str, degree: int) -> None:
    """ShapeError, one line, where `quant_layout`'s data says its modules cannot be split along
    in_features `degree` ways (`Layout.k_split_problem`)."""
    why = quant_layout.k_split_problem(axis, degree)
    if why is not None:
        raise ShapeError(f"{name}: {why}")


def _off_diagonal(ckpt: Checkpoint, splits: dict[str, Split]) -> None:
    """CvtError, one line, for a tensor split in diagonal blocks with a non-zero byte outside
    them: its ranks would drop those entries (vllm-ascend keeps only its diagonal block), so the
    shards would compute another layer (an older cvt wrote a dense W4A4_MXFP4_FLATQUANT row
    left_trans: `cvt.qtensor.schemes.flatquant_mx`). Read before anything is written."""
    import numpy as np

    for name, sp in splits.items():
        if not sp.diagonal:
            continue
        ref = ckpt.tensors[name]
        raw = np.frombuffer(ckpt.view(name), dtype=np.uint8).reshape(*ref.shape, DTYPES[ref.dtype][1])
        b = ref.shape[0] // sp.degree
        inside = np.kron(np.eye(sp.degree, dtype=bool), np.ones((b, b), dtype=bool))
        if raw[~inside].any():
            raise CvtError(f"{ref.describe()} is not block-diagonal in {sp.degree} blocks: each {sp.axis} rank keeps "
                           f"only its diagonal block, so {sp.axis} {sp.degree} would compute another layer (a dense "
                           f"left transform of an older cvt quantize); quantize it again with this cvt, or shard "
                           f"with {sp.axis} 1")


def quant_layouts(ckpt: Checkpoint) -> dict[str, object]:
    """module -> its on-disk `cvt.qtensor.layouts.Layout`, from a cvt quantize output's manifest
    (empty for float / FP8 checkpoints and outputs that predate the record)."""
    m = ckpt.manifest
    if m is None or m.quant is None:
        return {}
    from cvt.qtensor.layouts import LAYOUTS

    return {mod: LAYOUTS.get(info.layout) for mod, info in m.quant.tensors.items() if info.layout}


def expert_placement(layout: Layout, config) -> Placement | None:
    """The layout's expert placement, or the contiguous default; None for a model without routed experts."""
    if not moe_layers(config):
        return None
    return layout.placement or contiguous_placement(arch_for(config).num_experts, layout.ep)


def expert_holders(layout: Layout, config) -> dict[int, dict[int, list[int]]]:
    """MoE layer -> global expert id -> the EP ranks holding it."""
    placement = expert_placement(layout, config)
    if placement is None:
        return {}
    out: dict[int, dict[int, list[int]]] = {}
    for layer in moe_layers(config):
        per: dict[int, list[int]] = {}
        for r, ids in enumerate(placement.for_layer(layer)):
            for e in ids:
                per.setdefault(e, []).append(r)
        out[layer] = per
    return out


def weights_scheme(config, quant: dict | None, where: str = "SRC") -> tuple[str | None, int | None]:
    """(scheme, group size) stored weights follow, for `cvt.convert.memory_plan.check` / `memory_plan`:
    a cvt quantize output's (`quant`: its manifest's quant section); None for an FP8 release
    (plan reads its blocks from config.json); bf16 for a float checkpoint and for a quantized
    release shard carries as stored (`cvt.convert.release_split`: its own units are checked per
    tensor). CvtError for other quantized checkpoints."""
    if quant and quant.get("scheme"):
        return quant["scheme"], quant.get("group_size")
    qc = quantization_config(config) or {}  # wrapper configs keep it under text_config
    if qc.get("quant_method") == "fp8":
        return None, None
    if qc:
        _refuse_release(qc, where)
    return "bf16", None


def _refuse_release(qc: dict, where: str) -> None:
    """CvtError for a quantized release shard does not split as stored: one the quantize stage
    reads (`cvt.convert.sources`) names the way through it, any other its quant_method."""
    from cvt.convert.release_split import SHARDED_RELEASES
    from cvt.convert.sources import precision_of, readable

    fmt = precision_of(qc)
    if fmt in SHARDED_RELEASES:
        return
    if fmt.value not in readable("quantize"):
        raise CvtError(f"{where}: {article(str(qc.get('quant_method')))} checkpoint not written by cvt quantize; "
                       "shard the bf16 / FP8 release or a cvt quantize output")
    raise CvtError(f"{where}: cvt shard does not split {article(fmt.value)} release as stored: write it with cvt "
                   "quantize (or cvt fp8-to-bf16) first and shard that")


def source_weights(src, config) -> tuple[str, int | None, dict | None]:
    """What SRC's weights are, for planning it as `cvt shard` would write it: (scheme, group
    size, the cvt quantize manifest's quant section or None). An FP8 release is "fp8"; another
    tool's quantization is planned as "bf16" (the caller can name a scheme instead)."""
    quant = manifest_quant(src) if Path(src).is_dir() else None
    try:
        own, group = weights_scheme(config, quant, str(src))
    except CvtError:
        return "bf16", None, None
    return ("fp8" if own is None else own), group, (quant if quant and quant.get("scheme") else None)


def manifest_quant(root: Path) -> dict | None:
    """The quant section of ROOT's cvt manifest (None: no manifest, or not quantized)."""
    m = read_manifest(Path(root))
    return m.quant.model_dump() if m is not None and m.quant is not None else None


@dataclass
class _Holding:
    """One rank's share of one tensor."""

    name: str
    index: int  # run index along the split axis (0 when whole)
    spec: TensorSpec


def _layout_problems(ckpt: Checkpoint, arch, layout: Layout, splits: dict[str, Split]) -> list[str]:
    out, seen = [], set()
    for name, sp in splits.items():
        if sp.dim is None:
            continue
        shape = ckpt.tensors[name].shape
        if any(p % sp.degree for p in sp.parts or (shape[sp.dim],)):
            info = arch.classify(name)
            key = (info.rule.pattern, info.param)
            if key in seen:
                continue
            seen.add(key)
            sizes = sp.parts or (shape[sp.dim],)
            valid = [d for d in range(1, layout.world_size + 1) if layout.world_size % d == 0
                     and all(p % d == 0 for p in sizes)]
            of = f", parts {list(sp.parts)}" if sp.parts else ""
            out.append(f"{name} dim {sp.dim} (size {shape[sp.dim]}{of}, stored {ckpt.tensors[name].dtype} "
                       f"{list(shape)}): {sp.axis} {sp.degree} does not divide it; valid {sp.axis}: "
                       f"{', '.join(map(str, valid))}")
    return out


def _check_release_units(ckpt: Checkpoint, splits: dict[str, Split], world: int) -> None:
    """A compressed-tensors / ModelOpt release carried as stored (`cvt.convert.release_split`):
    its scales read as the other stages read them (a NaN / Inf / E8M0 0xFF scale, one line), and
    CvtError naming the first part the layout would cut (a group, an int32 of packed codes)."""
    from cvt.convert.release_split import SHARDED_RELEASES, release_units, unit_problem
    from cvt.convert.sources import CT_STREAMED, SourceFormat

    fmt = source_format(ckpt.config, ckpt.has_manifest)
    if fmt not in SHARDED_RELEASES:
        return
    qc = quantization_config(ckpt.config)
    if fmt in CT_STREAMED:
        from cvt.convert.ct_source import check_ct_scales, ct_linears

        check_ct_scales(ckpt, ct_linears(ckpt.tensors, fmt, qc))
    elif fmt is SourceFormat.GPT_OSS_MXFP4:
        from cvt.convert.mxfp4_source import check_mxfp4_scales, mxfp4_pairs

        check_mxfp4_scales(ckpt, mxfp4_pairs(ckpt.tensors, arch_for(ckpt.config).shapes()))
    bad = unit_problem(ckpt, release_units(ckpt, fmt, qc), splits, world)
    if bad is not None:
        raise CvtError(f"{ckpt.root}: the layout cannot shard this {fmt.value} release as stored: {bad}")


def plan_holdings(ckpt: Checkpoint, layout: Layout) -> tuple[dict[str, Split], list[list[_Holding]], list[str]]:
    """Every tensor's split, every rank's holdings and the visiting order (`_visit_order`; each
    rank's holdings are in it); CvtError naming each divisibility problem when the layout
    cannot shard this checkpoint."""
    arch = arch_for(ckpt.config)
    check_manifest_files(ckpt)  # a modified cvt output is refused here as `cvt run` refuses it
    quant = ckpt.manifest.quant if ckpt.manifest is not None else None
    scheme, group = weights_scheme(ckpt.config, quant.model_dump() if quant else None, str(ckpt.root))
    check(layout, ckpt.config, scheme, group)
    check_weights(ckpt, arch, "shard", fp8_block(ckpt.config, str(ckpt.root)) or (128, 128))
    layouts = quant_layouts(ckpt)
    splits = {name: split_of(arch, layout, name, ref.shape, layouts.get(name.rpartition(".")[0]))
              for name, ref in ckpt.tensors.items()}
    _check_release_units(ckpt, splits, layout.world_size)
    _off_diagonal(ckpt, splits)
    problems = _layout_problems(ckpt, arch, layout, splits)
    if problems:
        raise CvtError("the layout cannot shard these tensors:\n  " + "\n  ".join(problems))
    holders = expert_holders(layout, ckpt.config)
    ranks: list[list[_Holding]] = []
    for rank in range(layout.world_size):
        c = coords(layout, rank)
        mine = []
        for name, sp in splits.items():
            if sp.expert is not None:
                layer, e = sp.expert
                if c.ep_rank not in holders.get(layer, {}).get(e, ()):
                    continue
            ref = ckpt.tensors[name]
            shape = list(ref.shape)
            index = 0
            if sp.dim is not None:
                index = getattr(c, f"{sp.axis}_rank")
                shape[sp.dim] //= sp.degree
                if sp.diagonal:
                    shape[1] //= sp.degree
            mine.append(_Holding(name, index, TensorSpec(name, ref.dtype, tuple(shape))))
        ranks.append(mine)
    order = _visit_order(list(ckpt.tensors), ranks)
    pos = {name: i for i, name in enumerate(order)}
    for mine in ranks:
        mine.sort(key=lambda h: pos[h.name])
    return splits, ranks, order


def _visit_order(names: list[str], ranks: list[list[_Holding]]) -> list[str]:
    """The order source tensors are visited (and each rank's tensors stored) in: by how far into
    its holders' shares a tensor sits (bytes before it, least over its holders), ties in file
    order. Source order would feed one rank at a time through runs of its experts (one file's
    sha256 on one core); this keeps every rank's file busy at once."""
    before: dict[str, int] = {}
    for mine in ranks:
        off = 0
        for h in mine:
            before[h.name] = min(before.get(h.name, off), off)
            off += h.spec.nbytes
    pos = {n: i for i, n in enumerate(names)}
    return sorted(before, key=lambda n: (before[n], pos[n]))


def _plan_files(holdings: list[_Holding], rank: int, max_shard_size: int) -> list[tuple[str, list[_Holding]]]:
    """The rank's files: consecutive runs of its holdings, as the writer plans any checkpoint."""
    return plan_shards(holdings, max_shard_size, prefix=f"{RANK_DIR.format(rank)}/model")


def _slice(ckpt: Checkpoint, name: str, sp: Split, index: int, phase: int = 0):
    """The bytes of run `index` of `name`: a memoryview of the mmap when contiguous (dim-0 runs,
    whole tensors); otherwise one strided copy into a pooled buffer whose first byte sits `phase`
    bytes into a page, as the slice's first holder file has it (`OutputPool`: no fresh pages to
    zero, and O_DIRECT writes it with no staging copy)."""
    if sp.dim is None:
        return ckpt.view(name)
    import numpy as np

    ref = ckpt.tensors[name]
    # raw bytes as [*shape, itemsize] uint8, whatever the dtype: a run along `dim` is a plain
    # numpy slice (a view for dim 0, one strided copy otherwise), and torch is never imported
    raw = np.frombuffer(ckpt.view(name), dtype=np.uint8).reshape(*ref.shape, DTYPES[ref.dtype][1])
    runs = [raw[(slice(None),) * sp.dim + (slice(start, start + n),)] for start, n in sp.runs(ref.shape[sp.dim], index)]
    if sp.diagonal:  # the run's columns too: its diagonal block (one strided copy below)
        (start, n), = sp.runs(ref.shape[0], index)
        runs = [raw[start:start + n, start:start + n]]
    run = runs[0] if len(runs) == 1 else np.concatenate(runs, axis=sp.dim)  # a run of each part: one copy
    if run.size == 0:
        return b""
    if sp.dim == 0 and not sp.diagonal:
        return memoryview(np.ascontiguousarray(run)).cast("B")  # dim 0, one part: a view, already contiguous
    part = OUTPUTS.array(run.shape, np.uint8, phase=phase)
    np.copyto(part, run)
    return memoryview(part).cast("B")


def _write_ranks(ckpt: Checkpoint, out: OutputDir, splits: dict[str, Split], order: list[str],
                 files: list[tuple[str, list[_Holding]]], progress) -> tuple[list[FileInfo], int, int]:
    """Write every unfinished rank file through the writer's `FileSet`, visiting each needed
    source tensor once: each distinct slice is made once, charged once against the write
    budget and handed to every rank file holding it."""
    fs = FileSet(out, files, progress=progress)
    offsets = {rel: fs.offsets(rel) for rel, _ in fs.pending}
    consumers: dict[str, list[tuple[str, _Holding]]] = {name: [] for name in order}
    for rel, hs in fs.pending:
        for h in hs:
            consumers[h.name].append((rel, h))
    try:
        for name, uses in consumers.items():  # visiting order: the ranks' files hold their tensors in it
            if not uses:
                continue
            by_index: dict[int, list[tuple[str, _Holding]]] = {}
            for rel, h in uses:
                by_index.setdefault(h.index, []).append((rel, h))
            # the source tensor's pages go once every distinct slice of it is hashed by all its holders
            release = Countdown(len(by_index), functools.partial(ckpt.release, name))
            for index, holders in by_index.items():
                charge = fs.charge(holders[0][1].spec.nbytes, len(holders), release.done)
                try:
                    rel0 = holders[0][0]
                    data = _slice(ckpt, name, splits[name], index, offsets[rel0][name])
                except BaseException:
                    for _ in holders:
                        charge.done()
                    raise
                what = ckpt.tensors[name].describe()  # a NaN / Inf in a float tensor: named with its file
                for i, (rel, h) in enumerate(holders):
                    try:  # the same bytes for every holder: checked finite once
                        fs.put(rel, h.spec, data, charge, check=i == 0, what=what)
                    except BaseException:
                        for _ in holders[i + 1:]:
                            charge.done()
                        raise
                del data
        infos = fs.close()
    except BaseException:
        fs.abort()
        raise
    finally:
        OUTPUTS.clear()  # the recycled slice buffers: not kept past the stage
    return infos, len(fs.pending), len(files) - len(fs.pending)


def _ascend_description(ckpt: Checkpoint, names: list[str]) -> bytes | None:
    path = ckpt.root / ASCEND_DESCRIPTION
    if not path.is_file():
        return None
    desc = load_json(path)
    mine = set(names)
    keep = {k: v for k, v in desc.items() if k not in ckpt.tensors or k in mine}
    return (json.dumps(keep, indent=2) + "\n").encode()


def shard(src, dst, layout: Layout, *, revision: str | None = None, max_shard_size: int = DEFAULT_MAX_SHARD,
          resume: bool = True, overwrite: bool = False, quiet: bool = False, world: World = SINGLE) -> WriteResult:
    """Write SRC's tensors as per-rank directories under DST for `layout` (module docstring), by
    the processes of `world` (`cvt.world`; they split the files: not the layout's ranks)."""
    t0 = time.perf_counter()
    ckpt = open_checkpoint(src, revision)
    try:
        splits, ranks, order = plan_holdings(ckpt, layout)
        _ascend_description(ckpt, [])  # an unreadable description: refused before any rank file is written
        rank_files = [_plan_files(hs, r, max_shard_size) for r, hs in enumerate(ranks)]
        files = [f for per in rank_files for f in per]
        fmt = source_format(ckpt.config, ckpt.has_manifest).value
        src_info = source_info(ckpt, fmt)
        stage = StageInfo(name="shard", tool_version=__version__, parameters={
            "world_size": layout.world_size, "tp": layout.tp, "dp": layout.dp, "moe_tp": layout.moe_tp,
            "ep": layout.ep, "dense_tp": layout.dense_tp, "embed_tp": layout.embed_tp,
            "lmhead_tp": layout.lmhead_tp, "shared_experts": layout.shared_experts,
            "placement": layout.placement.source if layout.placement else "contiguous",
            "max_shard_size": max_shard_size})
        pid = run_plan_id(ckpt, src_info, stage, layout=layout.model_dump())
        total_out = sum(h.spec.nbytes for hs in ranks for h in hs)
        with OutputDir(Path(dst), pid, resume=resume, overwrite=overwrite, source=ckpt.source.confine_root,
                       verb="shard", world=world) as out:
            manifest = None

            def prepare() -> None:
                out.claim([*(RANK_DIR.format(r) for r in range(layout.world_size)), "config.json",
                           "expert_placement.json", "expert_placement_eplb.json",
                           *(p.name for p in ckpt.aux_files() if p.name != ASCEND_DESCRIPTION)])
                if world.main:
                    for r in range(layout.world_size):
                        out.subdir(RANK_DIR.format(r))  # a real directory: never written through a link
            together(world, prepare)  # every rank checks; rank 0 makes the rank folders
            mine = ranked(world, files, lambda hs: sum(h.spec.nbytes for h in hs))  # this process's files
            with make_progress(sum(h.spec.nbytes for _, hs in mine for h in hs), "shard", quiet or not world.main) as bar:
                infos, written, skipped = together(world, lambda: _write_ranks(ckpt, out, splits, order, mine, bar))
            infos, written, skipped = gathered(world, files, infos, written, skipped)
            if world.main:
                manifest = _finish(ckpt, out, layout, splits, ranks, rank_files, infos, src_info, stage, pid, fmt,
                                   total_out)
            world.barrier()
        return WriteResult(dst=Path(dst), files=infos, written_files=written, skipped_files=skipped,
                           bytes_in=sum(r.nbytes for r in ckpt.tensors.values()), bytes_out=total_out,
                           seconds=time.perf_counter() - t0, manifest=manifest, processes=world.size)
    finally:
        ckpt.close()


def _finish(ckpt: Checkpoint, out: OutputDir, layout: Layout, splits: dict[str, Split], ranks, rank_files, infos,
            src_info, stage, pid: str, fmt: str, total_out: int) -> Manifest:
    """Rank 0, once every rank file is in: the per-rank indexes and Ascend descriptions, config,
    placement files, then the manifest."""
    rank_entries = []
    placement = expert_placement(layout, ckpt.config)
    moe = moe_layers(ckpt.config)
    for r, per in enumerate(rank_files):
        d = RANK_DIR.format(r)
        weight_map = {h.name: rel[len(d) + 1:] for rel, hs in per for h in hs}
        nbytes = sum(h.spec.nbytes for h in ranks[r])
        infos.append(out.write_json(f"{d}/{INDEX_NAME}", {"metadata": {"total_size": nbytes},
                                                          "weight_map": weight_map}))
        desc = _ascend_description(ckpt, list(weight_map))
        if desc is not None:
            infos.append(out.write_small(f"{d}/{ASCEND_DESCRIPTION}", desc))
        c = coords(layout, r)
        experts = {str(L): list(placement.for_layer(L)[c.ep_rank]) for L in moe}
        rank_entries.append(RankShard(
            rank=r, dir=d, coords={k: v for k, v in vars(c).items() if k != "rank"},
            files=[rel for rel, _ in per], tensors=len(ranks[r]), bytes=nbytes, experts=experts))
    infos.append(out.write_json("config.json", with_explicit_defaults(ckpt.config)))
    if placement is not None:
        for fmt_name, (rel, _) in PLACEMENT_FILES.items():
            infos.append(out.write_small(rel, placement_json(placement, ckpt.config, fmt_name)))
    tensors = {name: TensorShard(shape=list(ckpt.tensors[name].shape), dtype=ckpt.tensors[name].dtype,
                                 axis=sp.axis, dim=sp.dim, degree=sp.degree,
                                 expert=list(sp.expert) if sp.expert else None,
                                 parts=list(sp.parts) if sp.parts else None, diagonal=sp.diagonal)
               for name, sp in splits.items()}
    return finish_output(
        out, ckpt, infos, src=src_info, stage=stage, pid=pid, out_format=f"sharded-{fmt}",
        tensor_count=sum(len(hs) for hs in ranks), total_size=total_out,
        summary={"source_tensors": len(ckpt.tensors), "split": sum(1 for s in splits.values() if s.dim is not None),
                 "ranks": layout.world_size},
        quant=ckpt.manifest.quant if ckpt.manifest is not None else None,
        shard=ShardInfo(layout=layout, tensors=tensors, ranks=rank_entries),
        skip_aux=(ASCEND_DESCRIPTION,))  # per rank instead


def read_shard_manifest(path) -> Manifest:
    """The manifest of a `cvt shard` output directory; CvtError when DST is not one."""
    m = read_manifest(Path(path), required=True)
    if m.shard is None:
        raise CvtError(f"{path}: not a sharded checkpoint (no 'shard' section in {MANIFEST_NAME}; run cvt shard)")
    return m


__all__ = ["Split", "split_of", "expert_placement", "expert_holders", "plan_holdings", "shard",
           "read_shard_manifest", "RANK_DIR", "weights_scheme", "manifest_quant"]
