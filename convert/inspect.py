"""`cvt inspect PATH`: what a checkpoint is, what it holds, and what is wrong with it.

Reads config.json, the safetensors headers and (for cvt outputs) the manifest - never the
weights - so it is instant on a 1 TB checkpoint. A `cvt shard` output (per-rank directories)
is described from its manifest: the layout, and each rank's directory, tensors, bytes and
experts; its files are checked against the manifest's sizes. Problems that make the checkpoint
unreadable (bad headers, index paths, missing files) are errors; problems a stage would
trip over later (unmapped tensors, FP8 weights without scales, misshaped scales, experts
missing from a layer) are collected and listed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from cvt.convert import source as source_mod
from cvt.convert.arch import arch_for, carried_names
from cvt.convert.config import SourceFormat, describe_quant, fp8_block, quantization_config, source_format
from cvt.convert.sources import summary_of
from cvt.convert.reader import (MANIFEST_NAME, file_problems, manifest_problems, open_checkpoint, sharded_manifest,
                                unsharded_source)
from cvt.convert.safetensors_io import load_json
from cvt.convert.validate import survey
from cvt.errors import ArchError, ManifestError


@dataclass
class InspectReport:
    path: str
    source: str
    model_type: str | None
    architecture: str | None
    source_format: str
    format_detail: str
    num_tensors: int
    total_bytes: int
    layers: dict[str, Any] = field(default_factory=dict)
    bytes_by_dtype: dict[str, int] = field(default_factory=dict)
    bytes_by_role: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    layout: dict[str, Any] = field(default_factory=dict)   # a cvt shard output: its parallel degrees
    ranks: list[dict[str, Any]] = field(default_factory=list)  # ... and each rank: dir, tensors, bytes, experts
    format_summary: str | None = None  # the source-precision registry's line (`cvt.convert.sources`)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def render(self) -> str:
        if self.ranks:
            return self._render_sharded()
        lines = [
            f"path            {self.path}",
            f"source          {self.source}",
            f"model_type      {self.model_type}  (table: {self.architecture or '-'})",
            f"format          {self.source_format}: {self.format_detail}",
        ] + ([f"precision       {self.format_summary}"] if self.format_summary else []) + [
            f"tensors         {self.num_tensors}, {_fmt_bytes(self.total_bytes)}",
        ]
        for key, value in self.layers.items():
            lines.append(f"{key:<15} {value}")
        lines.append("bytes by dtype  " + ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in self.bytes_by_dtype.items()))
        lines.append("bytes by role")
        lines += [f"  {k:<22} {_fmt_bytes(v):>12}" for k, v in self.bytes_by_role.items()]
        return "\n".join(lines + self._render_problems())

    def _render_problems(self) -> list[str]:
        if not self.problems:
            return ["problems        none"]
        lines = [f"problems        {len(self.problems)}"] + [f"  - {p}" for p in self.problems[:50]]
        if len(self.problems) > 50:
            lines.append(f"  ... and {len(self.problems) - 50} more")
        return lines

    def _render_sharded(self) -> str:
        L, sizes = self.layout, [r["bytes"] for r in self.ranks]
        lines = [
            f"path            {self.path}",
            f"source          {self.source}",
            f"model_type      {self.model_type}  (table: {self.architecture or '-'})",
            f"format          {self.source_format}: {self.format_detail}",
            f"layout          world {L['world_size']}: attention tp {L['tp']} x dp {L['dp']}; MoE moe_tp "
            f"{L['moe_tp']} x ep {L['ep']}; dense_tp {L['dense_tp']}, embed_tp {L['embed_tp']}, lmhead_tp "
            f"{L['lmhead_tp']}; shared experts {L['shared_experts']}; placement {L['placement']}",
            f"tensors         {self.num_tensors} source tensors; the ranks hold {sum(r['tensors'] for r in self.ranks)}, "
            f"{_fmt_bytes(self.total_bytes)} in all",
            f"bytes per rank  min {_fmt_bytes(min(sizes))}, max {_fmt_bytes(max(sizes))}, "
            f"mean {_fmt_bytes(sum(sizes) // len(sizes))}",
            "ranks",
        ]
        for r in self.ranks[:64]:
            experts = f", experts per MoE layer {r['experts']}" if r["experts"] else ""
            lines.append(f"  {r['rank']:>5}  {r['dir']:<12} {r['tensors']:>6} tensors {_fmt_bytes(r['bytes']):>12} "
                         f"in {r['files']} file{'s' * (r['files'] != 1)}{experts}")
        if len(self.ranks) > 64:
            lines.append(f"  ... and {len(self.ranks) - 64} more ranks (--json lists all)")
        return "\n".join(lines + self._render_problems())


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def inspect_checkpoint(path, revision: str | None = None) -> InspectReport:
    source = source_mod.resolve(path, revision)
    manifest = sharded_manifest(source.path)
    if manifest is not None:
        return _inspect_sharded(source, manifest)
    ckpt = open_checkpoint(source, need_config=True)
    cfg = ckpt.config
    fmt = source_format(cfg, ckpt.has_manifest)
    problems: list[str] = []
    detail = describe_quant(quantization_config(cfg))
    if fmt is SourceFormat.CVT:
        try:  # the runtime's reader and checks: inspect lists what `cvt run` would refuse
            m = ckpt.manifest
            detail = f"{m.format} written by cvt {m.tool.version}, stages: " + " -> ".join(s.name for s in m.stages)
            problems += manifest_problems(ckpt, m)
        except ManifestError as exc:
            detail = "cvt output with an invalid manifest"
            problems.append(str(exc))
    elif fmt is SourceFormat.FP8_BLOCK:
        qc = quantization_config(cfg) or {}
        detail = f"FP8 {qc.get('fmt', 'e4m3')} weights, {qc.get('weight_block_size')} block scales"
        if qc.get("scale_fmt"):
            detail += f" (scale_fmt {qc['scale_fmt']})"

    by_dtype: Counter = Counter()
    for ref in ckpt.tensors.values():
        by_dtype[ref.dtype] += ref.nbytes

    arch = None
    try:
        arch = arch_for(cfg)
    except ArchError as exc:
        problems.append(str(exc))
    block = fp8_block(cfg, str(ckpt.root)) or (128, 128)
    found = survey(ckpt, arch, block)
    problems += found.problems
    by_role = found.by_role

    layers: dict[str, Any] = {}
    if arch is not None:
        n, mtp = arch.num_layers, arch.num_mtp_layers
        seen = found.layers_seen
        layers["layers"] = f"{n} in config, {len([i for i in seen if i < n])} present"
        if arch.num_experts:
            moe = sorted(i for i in found.experts_seen if i < n)
            layers["moe layers"] = f"{len(moe)} (dense: {n - len(moe)})"
            layers["experts"] = f"{arch.num_experts} routed per MoE layer, top-{arch.counts.get('experts_per_token', '?')}"
        layers["mtp layers"] = f"{mtp} in config, {len([i for i in seen if i >= n])} present"
        carried = carried_names(cfg, ckpt.tensors)
        if carried:
            layers["carried"] = (f"{len(carried)} tensors ({', '.join(sorted({c.split('.')[0] for c in carried}))}): "
                                 "float, copied byte for byte by every stage, replicated; the runtime runs text only")

    return InspectReport(
        path=str(ckpt.root),
        source=ckpt.source.describe(),
        model_type=(arch.model_type if arch else cfg.get("model_type")),
        architecture=arch.table.name if arch else None,
        source_format=fmt.value,
        format_detail=detail,
        format_summary=summary_of(fmt),
        num_tensors=len(ckpt.tensors),
        total_bytes=sum(by_dtype.values()),
        layers=layers,
        bytes_by_dtype=dict(by_dtype.most_common()),
        bytes_by_role=dict(by_role.most_common()),
        problems=problems,
    )


def _inspect_sharded(source, m) -> InspectReport:
    """A `cvt shard` output, from its manifest (module doc); files checked by size."""
    root = source.path
    problems = file_problems(root, m.files)
    cfg = load_json(root / "config.json") if (root / "config.json").is_file() else {}
    arch = None
    try:
        arch = arch_for(cfg)
    except ArchError as exc:
        problems.append(str(exc))
    ranks = m.shard.ranks
    held = (sum(r.tensors for r in ranks), sum(r.bytes for r in ranks))
    if held != (m.tensor_count, m.total_size):
        problems.append(f"{root / MANIFEST_NAME}: records {m.tensor_count} tensors / {m.total_size} bytes, its ranks "
                        f"{held[0]} / {held[1]}")
    L = m.shard.layout
    layout = {k: getattr(L, k) for k in ("world_size", "tp", "dp", "moe_tp", "ep", "dense_tp", "embed_tp",
                                         "lmhead_tp", "shared_experts")}
    layout["placement"] = L.placement.source if L.placement is not None else "contiguous"

    def experts(r) -> str:  # slots per MoE layer, e.g. "2", or "2-3" when layers differ
        counts = sorted({len(ids) for ids in r.experts.values()})
        return "" if not counts else str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"

    stages = " -> ".join(s.name for s in m.stages)
    return InspectReport(
        path=str(root),
        source=source.describe(),
        model_type=arch.model_type if arch else cfg.get("model_type"),
        architecture=arch.table.name if arch else None,
        source_format=m.format,
        format_detail=f"cvt shard output of {unsharded_source(m)} ({m.source.format}), written by cvt "
                      f"{m.tool.version}, stages: {stages}",
        num_tensors=len(m.shard.tensors),
        total_bytes=m.total_size,
        layout=layout,
        ranks=[{"rank": r.rank, "dir": r.dir, "tensors": r.tensors, "bytes": r.bytes, "files": len(r.files),
                "experts": experts(r)} for r in ranks],
        problems=problems,
    )
