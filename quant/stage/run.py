"""The `cvt quantize` stage's entry (`quantize`): the request checked against the format, target and
scheme registries, SRC opened and checked (its format, names, FP8 scales, weights), the plan made,
calibration run when a method or the KV cache needs data, then the output written
(`cvt.quant.stage.write`). Every refusal comes before DST is touched."""

from __future__ import annotations

import logging
from pathlib import Path

from cvt.convert.arch import arch_for
from cvt.convert.config import SourceFormat, source_format
from cvt.convert.ct_source import check_ct_scales
from cvt.convert.mxfp4_source import check_mxfp4_scales, mxfp4_pairs
from cvt.convert.sources import readable
from cvt.convert.fp8_to_bf16 import check_scales_finite, pair_fp8_weights
from cvt.convert.validate import check_weights
from cvt.convert.reader import Checkpoint, check_manifest_files, open_checkpoint
from cvt.convert.writer import DEFAULT_MAX_SHARD, WriteResult
from cvt.errors import FormatError, OptionError
from cvt.qtensor.formats import DEFAULT_FORMAT, get_format
from cvt.qtensor.layouts import check_target, kernel_fmt_of
from cvt.qtensor.stack_versions import check_line, line_problem
from cvt.quant.recipe import FLATQUANT, RTN, Policy, Recipe
from cvt.qtensor.schemes import scheme_from_options
from cvt.units import article
from cvt.world import SINGLE, World
from cvt.quant.stage.assignment import (Plan, check_fused_methods, check_kv_target, check_method, make_plan,
                                        names_where)
from cvt.quant.stage import fp4_source
from cvt.quant.stage import kl_budget as KB
from cvt.quant.stage.calibrate import Calibrated, calib_data, calibrate
from cvt.quant.stage.outputs import int8_kv, kv_static as _kv_static
from cvt.quant.stage.quantizer import Source
from cvt.quant.stage.write import Request, write

log = logging.getLogger("cvt")


def quantize(src, dst, *, scheme: str, fmt: str | None = None, method: str | None = None,
             group_size: int | None = None, asym: bool = False, fp4_format: str | None = None, calib: Path | None = None,
             calib_tokens: int | None = None, ignore: tuple[str, ...] = (), recipe: Recipe | None = None,
             static_attention: bool = False, revision: str | None = None, workers: int | None = None,
             max_shard_size: int = DEFAULT_MAX_SHARD, resume: bool = True, overwrite: bool = False,
             quiet: bool = False, target: str | None = None, device: str = "cpu",
             expert_memory: int | None = None, target_version: str | None = None,
             kv_dtype: str | None = None, rotate: str | None = None, world: World = SINGLE,
             kl_budget: float | None = None, kl_high: str | None = None, fit: dict | None = None) -> WriteResult:
    """Quantize SRC into DST (see the package docstring) for the serving `target` (ascend:
    vllm-ascend, the default, or mindie; `cvt.qtensor.layouts`). Returns the writer's result,
    with counts in `.extra`. `expert_memory`: bytes of a MoE layer's routed experts calibration
    reads at once, as float32 (None: `cvt.quant.methods.stream.MAX_EXPERT_BYTES`). `target_version`:
    the vllm-ascend release line (`cvt.qtensor.stack_versions`); `kv_dtype`: the quantized KV
    cache's storage, int8 or fp8 (`cvt.qtensor.kv_tensors.kv_storage`). `calib_tokens`: the
    calibration tokens asked for, refused when the text gives fewer (None: up to
    `cvt.corpus.CALIB_TOKENS`, fewer with a warning when the text is shorter). `world`: the ranks
    that share the work (`cvt.world`: a started torchrun world; one process by default). `rotate`:
    ``hadamard[:SEED]``, a residual-stream rotation folded into the weights first (`cvt.quant.rotate`).
    `kl_budget`, `kl_high` (or the recipe's): mixed precision by a KL budget (`cvt.quant.stage.kl_budget`).
    `fit`: ``flatquant_steps`` / ``flatquant_lr`` / ``flatquant_seed`` of ``--method flatquant``'s fit
    (`cvt.quant.methods.flatquant`), refused when no module is fitted."""
    fmt, method = fmt or DEFAULT_FORMAT, method or RTN
    high, kl_budget = KB.resolve_budget(kl_budget, kl_high, recipe, scheme, world.size)
    form, target, line, sch = _check_request(scheme, fmt, target, target_version, group_size, fp4_format, recipe,
                                             static_attention)
    if recipe is None:  # --method against --scheme, before anything is read (a recipe's rules: per module)
        check_method(method, sch)
    rotate = _rotate_spec(rotate)
    req = Request(scheme, fmt, target, method, group_size, asym, getattr(sch, "fp4_format", None),
                  static_attention, workers, max_shard_size, resume, overwrite, quiet, line, kv_dtype, rotate)
    ckpt = open_checkpoint(src, revision)
    try:
        src_fmt = _source_format(ckpt, src)
        arch = arch_for(ckpt.config)
        why = form.refused_models.get(ckpt.config.get("model_type"))
        if why:  # which formats serve which model: the format's data (`Format.refused_models`)
            raise FormatError(f"{ckpt.config['model_type']}: --format {fmt} is refused: {why}")
        rotation = _rotation_table(arch, ckpt.config, src_fmt, rotate)
        policy, plan_args = Policy(arch, scheme, method, group_size, ignore, recipe), (form, scheme, group_size, asym,
                                                                                      fp4_format, target, line)
        plan = _first_plan(ckpt, policy, plan_args, high)
        if high is None:  # the run's plan (a --kl-budget's is checked once made, below)
            check_fused_methods(arch, plan)
        _check_calibrates(arch, plan, static_attention or kl_budget is not None)
        check_kv_target(ckpt.config, plan, fmt, target)
        kv_static = _kv_static(ckpt.config, plan, fmt)
        if kv_static:  # before --kv-dtype's own rules, which are about the stacks of the families that have one
            _check_kv_family(ckpt.config, arch, scheme, kv_dtype)
        kv_codec = _kv_codec(ckpt.config, plan, form, target, kv_dtype, kv_static)
        source = _checked_source(ckpt, src_fmt, arch)
        if rotation is not None:  # from here on SRC is read as the rotated BF16 model
            ckpt = _rotated(ckpt, arch, rotation, rotate)
            source = Source(ckpt, SourceFormat.BF16, arch.table.scale_param)
            plan = _first_plan(ckpt, policy, plan_args, high)
        note = _fp4_note(plan, source)
        plan, mixed, tokens = _kl_budget(ckpt, policy, plan, high, kl_budget, calib, calib_tokens, device, plan_args)
        needs_model = any(m != RTN for m in plan.methods.values()) or static_attention or kv_static
        _check_calib(calib, needs_model or tokens is not None)
        _check_fit(fit or {}, plan)
        if high is not None:  # the budget's plan: units it keeps higher may change a fused pair's scheme
            check_fused_methods(arch, plan)
        if not needs_model:
            return _note(note, write(ckpt, dst, plan, form, source, src_fmt, Calibrated(mixed=mixed), req, world))
        from cvt.runtime.models import family

        if static_attention and not getattr(family(ckpt.config)[0].Model, "calibrates_kv", True):
            # before DST is touched: DeepSeek-V4 has no static attention inputs (nor a KV cache: above)
            raise OptionError(f"{arch.model_type}: --static-attention is not calibrated for this model family "
                              "(--method gptq / awq / smoothquant are)")
        from cvt.convert.outdir import calibration_dir

        tokens = calib_data(ckpt, calib, calib_tokens) if tokens is None else tokens  # too few: refused before DST
        with calibration_dir(ckpt.source.confine_root, Path(dst), overwrite, resume, world) as state:
            # the KV cache in the form the format's stacks load (`Format.kv_codec`)
            cal = calibrate(ckpt, plan, tokens, static_attention, kv_codec, state, device, quiet,
                            expert_memory, kv_static, ascend_names=form.kv_codec != kv_codec, source=source,
                            world=world, mixed=mixed, fit=fit)
            return _note(note, write(ckpt, dst, plan, form, source, src_fmt, cal, req, world))
    finally:
        ckpt.close()


def _checked_source(ckpt: Checkpoint, src_fmt: SourceFormat, arch) -> Source:
    """SRC's `Source`, its quantized parts checked before DST: an FP8 release's every scale present,
    well shaped and finite; a compressed-tensors release's finite, none overflowing bfloat16;
    gpt-oss's MXFP4 pairs against config.json's shapes, no scale NaN or overflowing; the weights'."""
    source = Source(ckpt, src_fmt, arch.table.scale_param)
    if source.block is not None:
        check_scales_finite(ckpt, pair_fp8_weights(ckpt, source.block, source.scale_param, fp4_experts=source.fp4))
    if source.ct_linears:
        check_ct_scales(ckpt, source.ct_linears)
    if source.mxfp4:
        check_mxfp4_scales(ckpt, mxfp4_pairs(ckpt.tensors, arch.shapes()))
    check_weights(ckpt, arch, "quantize", source.block or (128, 128))
    return source


def _check_calibrates(arch, plan, other_data: bool) -> None:
    """FormatError (before DST) when the run calibrates and a kind of the family's layers is one
    calibration does not run through (`AttentionKind.calibrates`; every kind cvt declares today does)."""
    methods = sorted({m for m in plan.methods.values() if m != RTN})
    if not (methods or other_data):
        return
    stuck = [k.name for k in arch.table.attention.kinds if not k.calibrates]
    if stuck:
        what = f"--method {', '.join(methods)}" if methods else "--static-attention / --kl-budget"
        raise FormatError(f"{arch.model_type}: {what} calibrates layer by layer, and cvt's calibration does not run "
                          f"through its {', '.join(stuck)} attention layers yet; use --method rtn")


def _rotated(ckpt: Checkpoint, arch, rotation, rotate: str) -> Checkpoint:
    from cvt.quant.rotate import RotatedCheckpoint  # torch: only when a rotation is asked for

    return RotatedCheckpoint(ckpt, arch, rotation, rotate, arch.table.scale_param)


def _rotate_spec(rotate: str | None) -> str | None:
    """--rotate in its canonical form (None: no rotation); OptionError before anything is read."""
    if rotate is None:
        return None
    from cvt.quant.rotate import parse  # torch: only when a rotation is asked for

    return parse(rotate)


def _rotation_table(arch, config: dict, src_fmt: SourceFormat, rotate: str | None):
    """The family's rotation table when --rotate is given (refused with one line where the rotation
    cannot be exact), else None."""
    if rotate is None:
        return None
    from cvt.quant.rotate import check

    return check(arch, config, src_fmt)


def _first_plan(ckpt: Checkpoint, policy: Policy, plan_args: tuple, high: str | None) -> Plan:
    """The run's plan before --kl-budget (its warnings held when a budget replaces it)."""
    with KB.plan_warnings_held(high is not None):
        return make_plan(ckpt, policy, *plan_args)


def _kl_budget(ckpt: Checkpoint, policy: Policy, plan: Plan, high: str | None, budget: float | None, calib,
               calib_tokens: int | None, device, plan_args: tuple):
    """(the plan with the units `cvt.quant.stage.kl_budget` keeps at `high`, its manifest record,
    the calibration tokens it measured on); (plan, None, None) without a budget. Before DST is
    touched."""
    if high is None:
        return plan, None, None
    from cvt.quant.methods.sensitivity import check_family

    check_family(ckpt.config)
    _check_calib(calib, True)
    tokens = calib_data(ckpt, calib, calib_tokens)  # the calibrated methods' too, when the run has some
    eligible = {m: "" for m in plan.schemes if not policy.choose(m).explicit}
    high_plan = Plan() if high == KB.FLOAT else make_plan(ckpt, KB.BudgetPolicy(policy, eligible, high), *plan_args)
    units = KB.units_of(ckpt, plan, policy, high_plan, plan_args[0].name, plan_args[5])
    if not units:
        raise OptionError(f"--kl-budget: no linear of the decoder layers gets --scheme {plan_args[1]} by default "
                          "(float, ignored or a recipe's): nothing to keep higher")
    kept, record = KB.choose(ckpt, tokens, plan, high_plan, units, budget, high, device)
    return make_plan(ckpt, KB.BudgetPolicy(policy, kept, high), *plan_args), record, tokens  # (says its warnings)


def _check_request(scheme: str, fmt: str, target: str | None, target_version: str | None,
                   group_size: int | None, fp4_format: str | None, recipe: Recipe | None, static_attention: bool):
    """(format, target, vllm-ascend line, scheme) of the request, every option checked against the
    registries before SRC is opened."""
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
    return form, target, line, sch


def _source_format(ckpt: Checkpoint, src) -> SourceFormat:
    """What SRC holds (a cvt output read as what it holds); FormatError for what quantize cannot read."""
    src_fmt = source_format(ckpt.config, ckpt.has_manifest)
    if src_fmt is SourceFormat.CVT:  # a cvt output is read as what it holds
        check_manifest_files(ckpt)
        m = ckpt.manifest
        src_fmt = {"hf-bf16": SourceFormat.BF16}.get(m.format, source_format(ckpt.config))
        if src_fmt is SourceFormat.BF16 and m.format != "hf-bf16":
            src_fmt = SourceFormat.OTHER_QUANT
    if src_fmt.value not in readable("quantize"):
        raise FormatError(f"{src}: cannot quantize {article(src_fmt.value)} checkpoint (quantize reads "
                          f"{', '.join(readable('quantize'))})")
    return src_fmt


def _check_kv_family(config: dict, arch, scheme: str, kv_dtype: str | None) -> None:
    """OptionError when the model family has no KV-cache quantization in cvt (its attention kind
    has none: DeepSeek-V4), whatever --kv-dtype asks for."""
    if arch.table.attention.kv_quant is not None:
        return
    asked = f"--scheme {scheme}" + (f" --kv-dtype {kv_dtype}" if kv_dtype else "")
    raise OptionError(f"{arch.model_type}: {asked} quantizes the KV cache, and cvt has no KV-cache quantization for "
                      f"{arch.table.display} (its cache is not calibrated); give a scheme without a KV cache")


def _kv_codec(config: dict, plan: Plan, form, target: str, kv_dtype: str | None, kv_static: bool) -> str:
    """How the output stores a quantized KV cache: the format's own, or what --kv-dtype asks
    (`cvt.qtensor.kv_tensors.kv_storage`), refused where the C8 is DeepSeek-V3.2's indexer's."""
    kv_codec = form.kv_codec
    c8 = int8_kv(plan)
    if kv_dtype is not None and c8 and not kv_static and kv_dtype != "int8":  # V3.2's C8: the indexer's
        raise OptionError(f"--kv-dtype {kv_dtype}: this output's C8 is the lightning indexer's int8 cache (vllm-ascend's "
                          "sparse LI C8), not FAKQuant's latent cache; the fp8 cache applies to MLA models "
                          "without an indexer")
    if kv_dtype is not None:  # kv_tensors imports torch, which RTN otherwise never does
        from cvt.qtensor.kv_tensors import kv_storage

        kv_codec = kv_storage(form.name, form.kv_codec, target, kv_dtype, arch_for(config).table.attention.latent, c8)
    return kv_codec


def _fp4_note(plan: Plan, source: Source) -> str | None:
    """FP4 weights of the release (DeepSeek-V4's experts, compressed-tensors mxfp4 / nvfp4 or ModelOpt nvfp4 linears)
    the run requantizes rather than carries: one line says so once the output is written (a
    refused or failed run prints its error alone)."""
    carried = fp4_source.carried_modules(plan, source)
    grids = {m: g for m in plan.schemes if m not in carried and (g := source.carry_grid(plan.modules[m])) is not None}
    if not grids:
        return None
    grid = next(iter(grids.values()))  # one source format, so one grid
    if source.fmt in (SourceFormat.MODELOPT_NVFP4, SourceFormat.MODELOPT_MIXED):
        return fp4_source.requantized_note({m: plan.schemes[m].name for m in grids}, "ModelOpt nvfp4 linear(s)",
                                           grid, fp4_source.MODELOPT_CARRIED_BY)
    what = "FP4 routed expert(s)" if source.fp4 else f"compressed-tensors {grid} linear(s)"
    return fp4_source.requantized_note({m: plan.schemes[m].name for m in grids}, what, grid)


def _check_calib(calib: Path | None, needs_model: bool) -> None:
    """--calib readable when the run calibrates (before DST is touched), refused when nothing does."""
    if calib is not None and needs_model:  # before DST is touched
        from cvt.quant.methods.data import check_calib

        check_calib(calib)
    if calib is not None and not needs_model:
        raise OptionError(f"--calib {calib}: nothing in this run calibrates (RTN needs no data); give --method "
                          "gptq / awq / smoothquant, --static-attention or an int8 KV cache, or drop --calib")


def _check_fit(fit: dict, plan: Plan) -> None:
    """--flatquant-* refused when no module is fitted (they would change nothing), before DST."""
    if fit and FLATQUANT not in plan.methods.values():
        opts = " / ".join("--" + k.replace("_", "-") for k in fit)
        raise OptionError(f"{opts}: no module is quantized with --method flatquant in this run (they set its fit); "
                          "give --method flatquant (--scheme w4a4_flatquant) or drop them")


def _note(note: str | None, result: WriteResult) -> WriteResult:
    if note is not None:
        log.warning(note)
    return result


def _takes_fp4_format(scheme: str, recipe: Recipe | None) -> bool:
    """Whether the run quantizes anything with a scheme that has an fp4 format (the option's own
    scheme, or one a recipe rule names)."""
    from cvt.qtensor.schemes import SCHEMES

    names = {scheme, *(r.scheme for r in (recipe.rules if recipe else ()))}
    return any(n in SCHEMES and "fp4_format" in getattr(SCHEMES.get(n), "options", ()) for n in names)
