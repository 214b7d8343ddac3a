"""Writing the quantize stage's output: the planned tensors (`cvt.quant.stage.outputs`), the format's
description files, and the manifest's quantization record (scheme, method, fallbacks, per-module
SQNR), through the checkpoint writer (`cvt.convert.writer`: shards, hashes, resumes)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from cvt.version import __version__
from cvt.convert.arch import arch_for
from cvt.convert.arch.base import ignore_entries
from cvt.convert.config import SourceFormat, bf16_config
from cvt.convert.quant_summary import fallback_lines, mixed_lines
from cvt.convert.writer import WriteResult, default_workers, write_checkpoint
from cvt.schemas.manifest import Fallback, QuantInfo, QuantTensorInfo, StageInfo
from cvt.quant.stage.calibrate import Calibrated
from cvt.quant.stage.outputs import OutputPlan, kv_outputs
from cvt.quant.stage.assignment import Plan
from cvt.quant.stage.quantizer import Source
from cvt.world import SINGLE, World


@dataclass(frozen=True)
class Request:
    """What the command asked for: recorded in the manifest, and how the output is written."""

    scheme: str
    fmt: str
    target: str
    method: str
    group_size: int | None
    asym: bool
    fp4_format: str | None  # the fp4 scheme's format (None for the other schemes)
    static_attention: bool
    workers: int | None
    max_shard_size: int
    resume: bool
    overwrite: bool
    quiet: bool
    line: str | None = None       # the vllm-ascend release line (ascend + vllm-ascend)
    kv_dtype: str | None = None   # --kv-dtype as given (None: the format's own)
    rotation: str | None = None   # --rotate, canonical (`cvt.quant.rotate.parse`)


def write(ckpt, dst, plan: Plan, form, source: Source, src_fmt: SourceFormat, cal: Calibrated,
          req: Request, world: World = SINGLE) -> WriteResult:
    """Write DST: SRC's tensors as the plan quantizes them, the format's metadata, the manifest
    (`world`: the ranks that write it)."""
    arch = arch_for(ckpt.config)
    out = OutputPlan(ckpt, arch, plan, form, source, src_fmt, cal, req.target).build()
    kv = kv_outputs(out, ckpt.config, plan, form, cal.kv_scales, req.fmt, req.kv_dtype)
    config = bf16_config(ckpt.config)
    # (``re:`` entries for the consumers' own module names and carried towers: compressed-tensors
    # reads them, the Ascend description has none)
    extra_files = form.write_metadata(config, out.tags, plan.schemes,
                                      float_linears=ignore_entries(arch.table, out.float_linears),
                                      float_experts=out.float_experts, kv_cache=kv.c8, mla=arch.table.attention.latent, target=req.target,
                                      **kv.meta_kw)
    quant = QuantInfo(scheme=req.scheme, format=req.fmt, target=req.target, target_version=req.line,
                      method=req.method, group_size=req.group_size,
                      symmetric=not req.asym, fp4_format=req.fp4_format, kv_cache=kv.manifest,
                      float_modules=dict(plan.float_reasons), fallbacks=_fallbacks(plan, cal), calibration=cal.summary,
                      mixed_precision=cal.mixed)
    result = write_checkpoint(
        ckpt, Path(dst), out.tensors,
        stage=StageInfo(name="quantize", tool_version=__version__, parameters=_parameters(plan, cal, req)),
        source_format=src_fmt.value, out_format=f"{req.fmt}-{req.scheme}", config=config,
        summary={"quantized": len(plan.schemes), "float_modules": len(plan.float_reasons)},
        max_shard_size=req.max_shard_size, workers=default_workers(req.workers), resume=req.resume,
        overwrite=req.overwrite, quiet=req.quiet,
        prefix=form.weights_prefix, extra_files=extra_files, quant=quant, on_meta=_on_meta(quant, plan, cal),
        world=world,
    )
    sqnrs = [v.sqnr_db for v in quant.tensors.values() if isinstance(v.sqnr_db, float)]
    result.extra.update(quantized=len(plan.schemes), float_modules=len(plan.float_reasons),
                        by_scheme=_counts(s.name for s in plan.schemes.values()), by_method=_counts(plan.methods.values()),
                        fallbacks=len(quant.fallbacks), min_sqnr_db=f"{min(sqnrs):.1f} dB" if sqnrs else "exact",
                        fallback_lines=fallback_lines(quant, ckpt.config),  # by reason, saying where
                        mixed_lines=mixed_lines(quant))  # --kl-budget's choice
    return result


def _fallbacks(plan: Plan, cal: Calibrated) -> list[Fallback]:
    """Calibration's fallbacks and the plan's group fallbacks, in one order whichever way the
    layers were calibrated."""
    return sorted(list(cal.fallbacks) + [Fallback(module=m, method=plan.methods[m], reason=why)
                                         for m, why in plan.group_fallbacks.items()], key=lambda f: f.module)


def _on_meta(quant: QuantInfo, plan: Plan, cal: Calibrated):
    """What the writer calls with every module's record (this run's and a resumed run's): the
    manifest's per-module entries, and a fallback for each calibrated module the layers missed."""
    calibrated = {f.module for f in cal.fallbacks}

    def on_meta(meta: dict[str, dict]) -> None:
        quant.tensors = {m: QuantTensorInfo(**v) for m, v in sorted(meta.items())}
        for m, v in sorted(meta.items()):
            if v["method"] == "rtn-fallback" and m not in calibrated:
                calibrated.add(m)
                quant.fallbacks.append(Fallback(module=m, method=plan.methods[m], reason="not covered by calibration"))

    return on_meta


def _parameters(plan: Plan, cal: Calibrated, req: Request) -> dict:
    """The stage's parameters in the manifest (and the plan id: a resumed run must ask the same)."""
    calib_id = None
    if cal.tokens:  # the calibration identity: a resumed run must have calibrated on the same tokens
        calib_id = {"tokens": cal.tokens, "sha256": cal.tokens_sha256}
    params = {"scheme": req.scheme, "format": req.fmt, "target": req.target, "target_version": req.line,
              "kv_dtype": req.kv_dtype, "method": req.method,
              "group_size": req.group_size, "asym": req.asym, "fp4_format": req.fp4_format,
              "static_attention": req.static_attention, "calibration": calib_id, "max_shard_size": req.max_shard_size}
    if req.rotation is not None:  # absent without --rotate: manifests and plan ids as before
        params["rotation"] = req.rotation
    params["modules"] = hashlib.sha256(json.dumps(
        {m: [s.name, s.group_size, s.symmetric, plan.methods[m]] for m, s in plan.schemes.items()}, sort_keys=True
    ).encode()).hexdigest()
    return params


def _counts(names) -> dict[str, int]:
    """{name: how many}, most frequent first (a mixed recipe's summary counts each scheme / method)."""
    from collections import Counter

    return dict(sorted(Counter(names).items(), key=lambda kv: (-kv[1], kv[0])))
