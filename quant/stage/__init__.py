"""The `cvt quantize` stage: a BF16, FP8 or compressed-tensors INT4 checkpoint -> quantized
weights in the Ascend (msModelSlim AscendV1) or compressed-tensors format.

Streaming like every stage: tensors are read one at a time (FP8 weights dequantized on the
fly, so no BF16 copy is ever written; a DeepSeek-V4 release's FP4 experts carried over or
requantized, `cvt.quant.stage.fp4_source`), each quantized linear is quantized once when its first
part is written, and the writer shards, hashes, resumes and writes the manifest. RTN goes
straight from the stored weight (BF16, or FP8 with its block scale, over the mmap) to the
on-disk tensors and the SQNR in one pass (`cvt.quant.qkernel`: the C kernel, or its blockwise
torch fallback), bit-identical to the unfused path ``layout.encode(scheme.quantize(float32
weight))``, which still serves calibrated, static-activation and packed-INT4-source modules,
layouts the kernels do not cover, and ``CVT_QUANT_KERNEL=reference``. Checked
before anything is written: names (architecture table), schemes against the format, group
sizes against every tensor, FP8 scales (present, shaped, finite). A NaN/Inf weight is refused
when its module is quantized (one pass over the weights, not two); like any failure, it
leaves no index, config or manifest behind. Which
linears are quantized, and how, is `cvt.quant.recipe.Policy`. Calibrated methods (gptq, awq,
smoothquant) first run the runtime model layer by layer on calibration text
(`cvt.quant.methods`); their results replace RTN for the modules they cover, and every
fallback to RTN is recorded in the manifest. DeepSeek-V4 (`cvt.quant.stage.deepseek_v4`): an Ascend
output also holds the MTP draft's copies of embed / head, which vllm-ascend's draft reads, and
compressed-tensors is refused up front.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cvt.lazy import torch

from cvt.version import __version__
from cvt.convert.arch import arch_for, text_config
from cvt.convert.config import SourceFormat, bf16_config, source_format
from cvt.convert.fp8 import kernel_name as fp8_kernel_name
from cvt.convert.fp8_to_bf16 import check_scales_finite, dequantized_pieces, pair_fp8_weights
from cvt.convert.quant_summary import fallback_lines
from cvt.convert.validate import check_weights
from cvt.convert.reader import Checkpoint, check_manifest_files, open_checkpoint
from cvt.dtypes import dtype_code
from cvt.convert.safetensors_io import TensorSpec
from cvt.convert.writer import DEFAULT_MAX_SHARD, OutTensor, WriteResult, default_workers, write_checkpoint
from cvt.errors import FormatError, OptionError
from cvt.qtensor.formats import DEFAULT_FORMAT, get_format
from cvt.qtensor.disk_specs import DiskLayouts
from cvt.qtensor.layouts import ASCEND, check_target, kernel_fmt_of
from cvt.qtensor.stack_versions import check_line, line_problem
from cvt.quant import qkernel
from cvt.quant.recipe import RTN, Policy, Recipe
from cvt.qtensor.schemes import scheme_from_options
from cvt.qtensor.schemes.base import QuantizedTensor
from cvt.schemas.manifest import Fallback, QuantInfo, QuantTensorInfo, StageInfo
from cvt.units import article
from cvt.quant.stage.assignment import CT_PARTS, FP8_SCALE, Plan, check_kv_target, make_plan, names_where, weight_shape
from cvt.quant.stage import deepseek_v4, fp4_source
from cvt.quant.stage.quantizer import Quantizer, Source

log = logging.getLogger("cvt")

def quantize(src, dst, *, scheme: str, fmt: str | None = None, method: str | None = None,
             group_size: int | None = None, asym: bool = False, fp4_format: str | None = None, calib: Path | None = None,
             calib_tokens: int = 32768, ignore: tuple[str, ...] = (), recipe: Recipe | None = None,
             static_attention: bool = False, revision: str | None = None, workers: int | None = None,
             max_shard_size: int = DEFAULT_MAX_SHARD, resume: bool = True, overwrite: bool = False,
             quiet: bool = False, target: str | None = None, device: str = "cpu",
             expert_memory: int | None = None, target_version: str | None = None,
             kv_dtype: str | None = None) -> WriteResult:
    """Quantize SRC into DST (see the module docstring) for the serving `target` (ascend:
    vllm-ascend, the default, or mindie; `cvt.qtensor.layouts`). Returns the writer's result,
    with counts in `.extra`. `expert_memory`: bytes of a MoE layer's routed experts calibration
    reads at once, as float32 (None: `cvt.quant.methods.stream.MAX_EXPERT_BYTES`). `target_version`:
    the vllm-ascend release line (`cvt.qtensor.stack_versions`); `kv_dtype`: the quantized KV
    cache's storage, int8 or fp8 (`cvt.qtensor.kv_tensors.kv_storage`)."""
    fmt, method = fmt or DEFAULT_FORMAT, method or RTN
    form = get_format(fmt)
    target = check_target(fmt, target)
    line = check_line(fmt, target, target_version)
    sch = scheme_from_options(scheme, fp4_format=fp4_format)  # unknown names fail here
    why = line_problem(line, kernel_fmt_of(sch), expert=True, group_size=group_size)
    if why is not None:  # e.g. per-group W4A8 on main: the line's reason before the scheme's own
        raise FormatError(why)
    if fp4_format is not None and not _takes_fp4_format(scheme, recipe):
        raise OptionError(f"--fp4-format applies to --scheme {names_where(lambda s: 'fp4_format' in s.options, 'scheme')} "
                          f"(or a recipe rule with it), not {scheme}")
    if static_attention and not (form.static_attention and getattr(sch, "static_attention", False)):
        raise FormatError("--static-attention (static W8A8 attention with input_scale / deq_scale / quant_bias) "
                          f"exists only in the {names_where(lambda f: f.static_attention, 'format')} format with --scheme "
                          f"{names_where(lambda s: getattr(s, 'static_attention', False), 'scheme')}")
    req = _Request(scheme, fmt, target, method, group_size, asym, getattr(sch, "fp4_format", None),
                   static_attention, workers, max_shard_size, resume, overwrite, quiet, line, kv_dtype)
    ckpt = open_checkpoint(src, revision)
    try:
        src_fmt = source_format(ckpt.config, ckpt.has_manifest)
        if src_fmt is SourceFormat.CVT:  # a cvt output is read as what it holds
            check_manifest_files(ckpt)
            m = ckpt.manifest
            src_fmt = {"hf-bf16": SourceFormat.BF16}.get(m.format, source_format(ckpt.config))
            if src_fmt is SourceFormat.BF16 and m.format != "hf-bf16":
                src_fmt = SourceFormat.OTHER_QUANT
        if src_fmt not in (SourceFormat.BF16, SourceFormat.FP8_BLOCK, SourceFormat.CT_INT4):
            raise FormatError(f"{src}: cannot quantize {article(src_fmt.value)} checkpoint (quantize reads BF16, FP8 block "
                              "and compressed-tensors pack-quantized INT4 checkpoints)")
        arch = arch_for(ckpt.config)
        why = form.refused_models.get(ckpt.config.get("model_type"))
        if why:  # the format's own knowledge of what its consumers load (`Format.refused_models`)
            raise FormatError(f"{ckpt.config['model_type']}: --format {fmt} is refused: {why}")
        policy = Policy(arch, scheme, method, group_size, ignore, recipe)
        plan = make_plan(ckpt, policy, form, scheme, group_size, asym, fp4_format, target, line)
        check_kv_target(ckpt.config, plan, fmt, target)
        kv_static = _kv_static(ckpt.config, plan, fmt)
        kv_codec = form.kv_codec
        c8 = any(getattr(s, "kv_cache", None) == "int8" for s in plan.schemes.values())
        if kv_dtype is not None and c8 and not kv_static and kv_dtype != "int8":  # V3.2's C8: the indexer's
            raise OptionError(f"--kv-dtype {kv_dtype}: this output's C8 is the lightning indexer's int8 cache (vllm-ascend's "
                              "sparse LI C8), not FAKQuant's latent cache; the fp8 cache applies to MLA models "
                              "without an indexer")
        if kv_dtype is not None:  # kv_tensors imports torch, which RTN otherwise never does
            from cvt.qtensor.kv_tensors import kv_storage

            kv_codec = kv_storage(form.name, form.kv_codec, target, kv_dtype, "kv_lora_rank" in text_config(ckpt.config),
                                  any(getattr(s, "kv_cache", None) == "int8" for s in plan.schemes.values()))
        source = Source(ckpt, src_fmt, arch.table.scale_param)
        if source.block is not None:  # an FP8 release: every scale present, well shaped and finite
            check_scales_finite(ckpt, pair_fp8_weights(ckpt, source.block, source.scale_param, fp4_experts=source.fp4))
        check_weights(ckpt, arch, "quantize", source.block or (128, 128))
        # DeepSeek-V4's FP4 experts on another grid than the scheme's: one line says so once the
        # output is written (a refused or failed run prints its error alone)
        note = fp4_source.requantized_note({m: s.name for m, s in plan.schemes.items()
                                            if source.is_fp4(plan.modules[m]["weight"]) and not fp4_source.carries(s)}) \
            if source.fp4 else None

        needs_model = any(m != RTN for m in plan.methods.values()) or static_attention or kv_static
        if calib is not None and needs_model:  # before DST is touched
            from cvt.quant.methods.data import check_calib

            check_calib(calib)
        if calib is not None and not needs_model:
            raise OptionError(f"--calib {calib}: nothing in this run calibrates (RTN needs no data); give --method "
                              "gptq / awq / smoothquant, --static-attention or an int8 KV cache, or drop --calib")
        if not needs_model:
            return _note(note, _write(ckpt, dst, plan, form, source, src_fmt, _Calib(), req))
        from cvt.runtime.models import family

        if (static_attention or kv_static) and not getattr(family(ckpt.config)[0].Model, "calibrates_kv", True):
            # before DST is touched: DeepSeek-V4 has no int8 KV cache and no static attention inputs
            raise OptionError(f"{arch.model_type}: {'--static-attention' if static_attention else 'an int8 KV cache'} "
                              "is not calibrated for this model family (--method gptq / awq / smoothquant are)")
        from cvt.convert.outdir import calibration_dir

        with calibration_dir(ckpt.source.confine_root, Path(dst), overwrite, resume) as state:
            # the KV cache in the form the format's stacks load (`Format.kv_codec`)
            cal = _calibrate(ckpt, plan, calib, calib_tokens, static_attention, kv_codec, state, device, quiet,
                             expert_memory, kv_static, ascend_names=form.kv_codec != kv_codec, source=source)
            return _note(note, _write(ckpt, dst, plan, form, source, src_fmt, cal, req))
    finally:
        ckpt.close()


def _note(note: str | None, result: WriteResult) -> WriteResult:
    if note is not None:
        log.warning(note)
    return result


def _kv_static(config: dict, plan: Plan, fmt: str) -> bool:
    """Whether the run calibrates static KV-cache scales: an int8 KV cache, except DeepSeek-V3.2's
    in the Ascend format, whose C8 is the indexer's dynamic one (`cvt.qtensor.indexer_c8`)."""
    from cvt.convert.arch import text_config
    from cvt.qtensor import indexer_c8

    c8 = any(getattr(s, "kv_cache", None) == "int8" for s in plan.schemes.values())
    return c8 and not indexer_c8.applies(text_config(config), fmt)


def _takes_fp4_format(scheme: str, recipe: Recipe | None) -> bool:
    """Whether the run quantizes anything with a scheme that has an fp4 format (the option's own
    scheme, or one a recipe rule names)."""
    from cvt.qtensor.schemes import SCHEMES

    names = {scheme, *(r.scheme for r in (recipe.rules if recipe else ()))}
    return any(n in SCHEMES and "fp4_format" in getattr(SCHEMES.get(n), "options", ()) for n in names)


@dataclass(frozen=True)
class _Request:
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


@dataclass
class _Calib:
    quantized: dict[str, QuantizedTensor] = field(default_factory=dict)
    float_overrides: dict[str, torch.Tensor] = field(default_factory=dict)  # e.g. norms after smoothing
    static_inputs: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    kv_scales: dict[str, torch.Tensor] = field(default_factory=dict)
    fallbacks: list[Fallback] = field(default_factory=list)
    methods_applied: dict[str, str] = field(default_factory=dict)
    sqnr: dict[str, float] = field(default_factory=dict)
    tokens: int = 0
    tokens_sha256: str | None = None
    # calibrated results stay in the state folder: `quantized` / `float_overrides` list the names,
    # these read one when the writer asks for it
    loader: Any = None
    float_loader: Any = None
    summary: dict | None = None


def _calibrate(ckpt: Checkpoint, plan: Plan, calib, calib_tokens: int, static_attention: bool,
               kv_codec: str, state_dir: Path, device, quiet: bool, expert_memory: int | None = None,
               kv_static: bool = True, ascend_names: bool = False, source: Source | None = None) -> _Calib:
    """Calibration text through the model, one decoder layer from disk at a time
    (`cvt.quant.methods.stream`): the calibrated methods, static activation scales of the
    attention projections (--static-attention: amax / 127 of what they see, after smoothing and
    with the earlier layers quantized) and KV-cache scales (w8a8c8). Resumable per layer."""
    import hashlib

    from cvt.quant.methods.data import calib_tokens as calib_tokens_of
    from cvt.quant.methods.stream import calibrate_streaming, kv_scales, text_prefix
    from cvt.runtime.models import family
    from cvt.runtime.tokenizer import load_tokenizer
    from cvt.schemas.manifest import Fallback as ManifestFallback

    mod, cfg = family(ckpt.config)
    tokens = calib_tokens_of(load_tokenizer(ckpt.root, ckpt.config), calib, seq_len=256,
                             max_sequences=max(1, calib_tokens // 256),
                             max_len=mod.Args.from_config(cfg).max_position_embeddings)
    c8 = kv_static and any(getattr(s, "kv_cache", None) == "int8" for s in plan.schemes.values())
    plan, frozen = fp4_source.calibration_plan(plan, source) if source is not None else (plan, frozenset())
    res = calibrate_streaming(ckpt, plan, tokens, state_dir, device=device, observe_kv=c8, quiet=quiet,
                              collect_stats=static_attention, frozen=frozen,
                              **({} if expert_memory is None else {"max_expert_bytes": expert_memory}))
    store = res.store
    out = _Calib(tokens=int(tokens.numel()), tokens_sha256=hashlib.sha256(tokens.numpy().tobytes()).hexdigest())
    out.quantized = {m: None for m in store.modules()}            # read from the state folder when written
    out.loader = store.quantized
    out.float_overrides = {n: None for n in store.floats()}
    out.float_loader = store.float_tensor
    out.fallbacks = [ManifestFallback(module=f.name, method=plan.methods.get(f.name, RTN), reason=f.reason,
                                      tokens=f.tokens) for f in res.fallbacks]
    out.methods_applied = {m: ("rtn-fallback" if a == RTN and plan.methods.get(m, RTN) != RTN else a)
                           for m, a in res.methods.items()}
    out.sqnr = {m: st["sqnr_db"] for m, st in res.stats.items() if "sqnr_db" in st}
    if static_attention:
        targets = {m for m, s in plan.schemes.items() if getattr(s, "static_attention", False) and ".self_attn." in m}
        out.static_inputs = {m: (torch.tensor([max(abs(st["act_min"]), abs(st["act_max"]), 1e-8) / 127.0]),
                                 torch.zeros(1)) for m, st in res.stats.items() if m in targets and "act_min" in st}
    if c8:
        out.kv_scales = kv_scales(res, ckpt.config, kv_codec, ascend_names, text_prefix(ckpt))
    out.summary = {"tokens": int(tokens.numel()), "layers": len(res.seconds_per_layer), "device": str(device),
                   "seconds_per_layer": [round(x, 3) for x in res.seconds_per_layer],
                   "peak_rss_bytes": max(res.peak_rss_per_rank or [res.peak_rss]), "resumed_layers": res.resumed_layers}
    if len(res.peak_rss_per_rank) > 1:  # a torchrun world: its size and each rank's peak
        out.summary.update(ranks=len(res.peak_rss_per_rank), peak_rss_per_rank=res.peak_rss_per_rank)
    return out


LINEAR_ROLES = ("linear", "expert", "shared_expert", "mtp_proj", "head", "router")


def _write(ckpt, dst, plan: Plan, form, source: Source, src_fmt: SourceFormat, cal: _Calib,
           req: _Request) -> WriteResult:
    import hashlib

    target = req.target
    arch = arch_for(ckpt.config)
    quantizer = Quantizer(source, plan, form, cal.static_inputs, cal.quantized, cal.methods_applied, cal.sqnr,
                           target, cal.loader)
    layouts = DiskLayouts(form, target)
    outs: list[OutTensor] = []
    tags: dict[str, str] = {}
    emitted: set[str] = set()
    float_linears: list[str] = []
    for name, ref in ckpt.tensors.items():
        if name.endswith(FP8_SCALE):
            continue
        info = arch.classify(name)
        if info.param == source.scale_param:  # DeepSeek-V4's X.scale: with its weight, or dropped
            continue
        module = info.module
        if module in plan.schemes:
            if module in emitted:
                continue
            emitted.add(module)
            sch = plan.schemes[module]
            shape = weight_shape(ckpt, plan.modules[module])
            static = module in cal.static_inputs
            has_bias = "bias" in plan.modules[module] and not static
            b = ckpt.tensors[plan.modules[module]["bias"]] if has_bias else None
            specs, module_tags = layouts.get(module, sch, shape, static, None if b is None else b.shape,
                                             None if b is None else getattr(torch, _torch_name(b.dtype)),
                                             plan.experts[module])
            tags.update(module_tags)
            streamed = qkernel.kernel_name() == "c"  # the packed weight in pieces where it is fused (`Quantizer.pieces`)
            for j, (disk_name, (shape_, dt)) in enumerate(specs.items()):
                outs.append(OutTensor(
                    spec=TensorSpec(disk_name, dt, shape_),
                    produce=(lambda m=module, n=disk_name, c=len(specs): quantizer.pieces(m, n, c)) if j == 0 and streamed
                    else (lambda m=module, n=disk_name, c=len(specs): quantizer.part(m, n, c)),
                    pieces=j == 0 and streamed,
                    read_bytes=ref.nbytes if j == 0 else 0,
                    meta=(lambda m=module: (m, quantizer.info[m].model_dump())) if j == 0 else None,
                    meta_key=module if j == 0 else None,
                ))
            continue
        if src_fmt is SourceFormat.CT_INT4 and info.param in CT_PARTS:
            if info.param != "weight_packed":
                continue  # a float module stored packed: written once, as BF16 weight
            params = plan.modules[module]
            wname = module + ".weight"
            shape = weight_shape(ckpt, params)
            outs.append(OutTensor(TensorSpec(wname, "BF16", shape),
                                  produce=lambda p=params: source.float_weight(p).to(torch.bfloat16)))
            tags[wname] = "FLOAT"
            float_linears.append(module)
            continue
        dt, shape = source.float_spec(name)
        pieces = name not in cal.float_overrides and ref.dtype == "F8_E4M3" and fp8_kernel_name() == "c"
        if name in cal.float_overrides:
            read = cal.float_loader or cal.float_overrides.get
            produce = (lambda n=name, d=dt, read=read: read(n).to(getattr(torch, _torch_name(d))).contiguous())
        elif pieces:  # FP8 dequantized to BF16 by the C kernel, in pieces
            produce = (lambda n=name: dequantized_pieces(ckpt, n, source.scale_of(n), source.block))
        elif dt != ref.dtype:  # FP8 (or DeepSeek-V4 FP4) dequantized to BF16
            produce = (lambda n=name: source.float_tensor(n))
        else:
            produce = (lambda n=name: ckpt.view(n))
        outs.append(OutTensor(TensorSpec(name, dt, shape), produce=produce,
                              release=(lambda n=name: ckpt.release(n)), read_bytes=ref.nbytes,
                              pieces=pieces))
        tags[name] = "FLOAT"
        if info.param == "weight" and len(ref.shape) == 2 and info.role.value in LINEAR_ROLES and module not in float_linears:
            float_linears.append(module)

    if form.name == ASCEND:  # DeepSeek-V4: the MTP draft's own embed / head copies (`deepseek_v4`)
        for alias, name in deepseek_v4.aliases(ckpt.config, ckpt.tensors).items():
            dt, shape = source.float_spec(name)
            outs.append(OutTensor(TensorSpec(alias, dt, shape), produce=lambda n=name: source.float_tensor(n)))
            tags[alias] = "FLOAT"

    c8 = any(getattr(s, "kv_cache", None) == "int8" for s in plan.schemes.values())
    kv_meta = None
    mla = "kv_lora_rank" in arch.config
    meta_kw: dict[str, Any] = {}
    if c8 and not _kv_static(ckpt.config, plan, req.fmt):  # DeepSeek-V3.2 on Ascend: the indexer C8
        from cvt.convert.arch import text_config
        from cvt.qtensor import indexer_c8

        lm = text_config(ckpt.config)
        rots = indexer_c8.rotation_tensors(lm)
        kv_meta = {"convention": indexer_c8.CONVENTION, "tensors": sorted(rots)}
        for n, t in rots.items():
            outs.append(OutTensor(TensorSpec(n, dtype_code(t.dtype), tuple(t.shape)), produce=lambda t=t: t))
            tags[n] = "FLOAT"
        c8, meta_kw = False, {"extra_keys": indexer_c8.description_keys(lm)}  # no MLA (FAKQuant) scales
    elif c8:
        from cvt.qtensor.kv_tensors import kv_tag

        kv_meta = form.kv_manifest(cal.kv_scales)  # Ascend int8 names, or compressed-tensors fp8 k_scale / v_scale
        if req.kv_dtype is not None and req.kv_dtype != form.kv_codec:  # Ascend 950's fp8 FAKQuant cache
            from cvt.qtensor.kv_tensors import FP8_FAKQUANT

            kv_meta["convention"] = {**kv_meta["convention"], **FP8_FAKQUANT}
        for n, t in cal.kv_scales.items():
            outs.append(OutTensor(TensorSpec(n, dtype_code(t.dtype), tuple(t.shape)), produce=lambda t=t: t.contiguous()))
            tags[n] = kv_tag(mla)
    config = bf16_config(ckpt.config)
    extra_files = form.write_metadata(config, tags, plan.schemes, float_linears=float_linears, kv_cache=c8, mla=mla,
                                      target=target, **meta_kw)

    calibrated = {f.module for f in cal.fallbacks}
    fallbacks = sorted(list(cal.fallbacks) + [Fallback(module=m, method=plan.methods[m], reason=why)
                                              for m, why in plan.group_fallbacks.items()],
                       key=lambda f: f.module)  # one order whichever way the layers were calibrated
    quant = QuantInfo(scheme=req.scheme, format=req.fmt, target=target, target_version=req.line,
                      method=req.method, group_size=req.group_size,
                      symmetric=not req.asym, fp4_format=req.fp4_format, kv_cache=kv_meta,
                      float_modules=dict(plan.float_reasons), fallbacks=fallbacks, calibration=cal.summary)

    def on_meta(meta: dict[str, dict]) -> None:
        quant.tensors = {m: QuantTensorInfo(**v) for m, v in sorted(meta.items())}
        for m, v in sorted(meta.items()):
            if v["method"] == "rtn-fallback" and m not in calibrated:
                calibrated.add(m)
                quant.fallbacks.append(Fallback(module=m, method=plan.methods[m], reason="not covered by calibration"))

    calib_id = None
    if cal.tokens:  # the calibration identity: a resumed run must have calibrated on the same tokens
        calib_id = {"tokens": cal.tokens, "sha256": cal.tokens_sha256}
    params = {"scheme": req.scheme, "format": req.fmt, "target": target, "target_version": req.line,
              "kv_dtype": req.kv_dtype, "method": req.method,
              "group_size": req.group_size, "asym": req.asym, "fp4_format": req.fp4_format,
              "static_attention": req.static_attention, "calibration": calib_id, "max_shard_size": req.max_shard_size}
    params["modules"] = hashlib.sha256(json.dumps(
        {m: [s.name, s.group_size, s.symmetric, plan.methods[m]] for m, s in plan.schemes.items()}, sort_keys=True
    ).encode()).hexdigest()
    result = write_checkpoint(
        ckpt, Path(dst), outs,
        stage=StageInfo(name="quantize", tool_version=__version__, parameters=params),
        source_format=src_fmt.value, out_format=f"{req.fmt}-{req.scheme}", config=config,
        summary={"quantized": len(plan.schemes), "float_modules": len(plan.float_reasons)},
        max_shard_size=req.max_shard_size, workers=default_workers(req.workers), resume=req.resume,
        overwrite=req.overwrite, quiet=req.quiet,
        prefix=form.weights_prefix, extra_files=extra_files, quant=quant, on_meta=on_meta, check_finite=True,
    )
    sqnrs = [v.sqnr_db for v in quant.tensors.values() if isinstance(v.sqnr_db, float)]
    result.extra.update(quantized=len(plan.schemes), float_modules=len(plan.float_reasons),
                        by_scheme=_counts(s.name for s in plan.schemes.values()), by_method=_counts(plan.methods.values()),
                        fallbacks=len(quant.fallbacks), min_sqnr_db=f"{min(sqnrs):.1f} dB" if sqnrs else "exact",
                        fallback_lines=fallback_lines(quant, ckpt.config))  # by reason, saying where
    return result


def _counts(names) -> dict[str, int]:
    """{name: how many}, most frequent first (a mixed recipe's summary counts each scheme / method)."""
    from collections import Counter

    return dict(sorted(Counter(names).items(), key=lambda kv: (-kv[1], kv[0])))


def _torch_name(code: str) -> str:
    from cvt.dtypes import DTYPES

    return DTYPES[code][0]
