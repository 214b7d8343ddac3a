"""The quantize stage's plan: per module of SRC its source tensors and the scheme and method it
gets (`make_plan`, from the recipe's `Policy`, the format and the target), what each method
accepts (`method_kernels`), and the KV-cache target rule; nothing is read but headers."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field


from cvt.convert.arch import Parallel, Role, arch_for, text_config
from cvt.convert.arch.attention import SPARSE_MLA
from cvt.convert.fp4 import FP4_DTYPES
from cvt.convert.reader import Checkpoint
from cvt.errors import CvtError, FormatError, OptionError, TensorError
from cvt.qtensor.formats import default_group, group_fallback
from cvt.quant.recipe import FLATQUANT, METHOD_TABLE, Policy, method_schemes, mixed_site
from cvt.quant.stage.fp4_source import fp4_experts
from cvt.qtensor.schemes import scheme_from_options
from cvt.qtensor.schemes.base import Scheme

log = logging.getLogger("cvt")

FP8_SCALE = "_scale_inv"
CT_PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_global_scale")


@dataclass
class Plan:
    """Per module: its source tensors, and the scheme chosen (None: float)."""

    modules: dict[str, dict[str, str]] = field(default_factory=dict)  # module -> param -> tensor name
    schemes: dict[str, Scheme] = field(default_factory=dict)  # quantized module -> scheme
    methods: dict[str, str] = field(default_factory=dict)
    float_reasons: dict[str, str] = field(default_factory=dict)
    experts: dict[str, bool] = field(default_factory=dict)  # quantized module -> is a routed expert
    # quantized module -> the fused group sharing its per-tensor scale (NVFP4's global scale;
    # `ArchTable.fused_groups`), members quantized with the same scheme
    shared: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # quantized module -> why it is per channel though the scheme has groups (`group_fallback`)
    group_fallbacks: dict[str, str] = field(default_factory=dict)


def scheme_for(name: str, fmt_name: str, group_size: int | None, asym: bool, fp4_format: str,
                cache: dict) -> Scheme:
    """One instance per distinct request (a recipe's modules share it: the plan groups by identity)."""
    gs = group_size if group_size is not None else default_group(fmt_name, name)
    key = (name, gs, asym, fp4_format)
    if key not in cache:
        cache[key] = scheme_from_options(name, group_size=gs, symmetric=not asym, fp4_format=fp4_format)
    return cache[key]


def make_plan(ckpt: Checkpoint, policy: Policy, fmt, scheme_name: str, group_size: int | None, asym: bool,
              fp4_format: str, target: str | None = None, line: str | None = None) -> Plan:
    """`line`: the vllm-ascend release line (`cvt.qtensor.stack_versions`); a routed expert or a
    recipe-chosen module that line no longer loads is refused with the reason."""
    from cvt.qtensor import layouts
    from cvt.qtensor.stack_versions import line_problem, shape_problem

    arch = policy.arch
    target = layouts.check_target(fmt.name, target)
    plan = Plan()
    for name in ckpt.tensors:
        if name.endswith(FP8_SCALE):
            continue
        info = arch.classify(name)
        plan.modules.setdefault(info.module, {})[info.param] = name
    cache: dict = {}
    for module, params in plan.modules.items():
        if "weight" not in params and "weight_packed" not in params:
            continue
        choice = policy.choose(module)
        if choice.scheme is None:
            plan.float_reasons[module] = choice.reason
            continue
        expert = arch.classify(module + ".weight").role is Role.EXPERT
        if line is not None and (expert or choice.explicit):  # before the scheme's own refusals
            why = line_problem(line, layouts.kernel_fmt_of(choice.scheme), expert=expert,
                               group_size=choice.group_size)
            if why is not None:
                raise FormatError(f"{module}: {why}")
        scheme = scheme_for(choice.scheme, fmt.name, choice.group_size, asym, fp4_format, cache)
        if getattr(scheme, "row_sensitive", False):  # sized by the module's TP role (the architecture table's)
            scheme = scheme.for_parallel(arch.classify(module + ".weight").rule.parallel is Parallel.ROW)
        fmt.supports(scheme, target)
        why = None if choice.explicit else (layouts.linears_only_reason if expert else layouts.experts_only_reason)(
            fmt.name, layouts.kernel_fmt_of(scheme), target)
        if why is not None:  # the stack has this layout for MoE experts (or for linears) only
            plan.float_reasons[module] = why
            continue
        shape = weight_shape(ckpt, params)
        why = (shape_problem(line, layouts.kernel_fmt_of(scheme), expert=expert, k=shape[1])
               or scheme.shape_problem(shape))
        if why is not None:  # the consumer cannot load this shape: float, unless a recipe asked for it
            if choice.explicit:
                raise FormatError(f"{module}: {why}")
            plan.float_reasons[module] = f"{why}: kept float"
            continue
        fallback = group_fallback(fmt, module, scheme, shape, target)
        if fallback is not None:
            scheme = scheme_for(choice.scheme, fmt.name, 0, asym, fp4_format, cache)
            plan.group_fallbacks[module] = fallback
        fmt.check_shape(module, scheme, shape, target=target, expert=expert)
        plan.schemes[module] = scheme
        plan.experts[module] = expert
        plan.methods[module] = choice.method
        kernels = method_kernels(choice.method)
        if kernels is not None and layouts.kernel_fmt_of(scheme) not in kernels:  # a recipe's choice
            why = METHOD_TABLE[choice.method].why_not
            raise CvtError(f"{module}: --method {choice.method} does not support scheme {scheme.name}"
                           f"{f' ({why})' if why else ''} ({layouts.kernel_fmt_of(scheme)}; {choice.method} handles "
                           f"{', '.join(kernels)}): use rtn, or give this module another method or scheme in a recipe")
    if plan.group_fallbacks:  # one line for the run; each module is in the manifest's fallbacks
        names = sorted(plan.group_fallbacks)
        log.warning(f"cvt: {len(names)} linear(s) whose in_features the group size does not divide are quantized "
                    f"per channel (listed in cvt_manifest.json quant.fallbacks): {', '.join(names[:3])}"
                    + (f" and {len(names) - 3} more" if len(names) > 3 else ""))
    if not plan.schemes:
        raise CvtError(f"{ckpt.root}: nothing to quantize with scheme {scheme_name} (every linear is float by "
                       "default, ignored or not quantizable)")
    for module, scheme in plan.schemes.items():
        if getattr(scheme, "per_tensor_scale", False):
            group = tuple(m for m in (arch.fused_group(module) or ()) if plan.schemes.get(m) is scheme)
            if len(group) > 1:
                plan.shared[module] = group
    return plan


def check_fused_methods(arch, plan: Plan) -> None:
    """OptionError (before DST) for a linear that reads the same input as a `--method flatquant`
    linear (the table's `ArchTable.input_site`, on SRC's modules) with the same kernel format but
    another method (a recipe's): vLLM fuses them into one layer with one set of transforms, fitted
    for all or for none. Only the decoder layers' linears, which calibration runs (an MTP layer's
    are all RTN: `cvt.quant.methods.calib`); the first site in layer order is named."""
    if FLATQUANT not in plan.methods.values():
        return
    has = plan.modules.__contains__
    layers = {m: info.layer for m in plan.schemes
              if (info := arch.classify(m + ".weight")).layer is not None and not info.is_mtp}
    sites: dict[tuple[str, str], list[str]] = {}
    for m in sorted(layers, key=layers.__getitem__):
        sites.setdefault(arch.table.input_site(m, has, has), []).append(m)
    for members in sites.values():
        flat = [m for m in members if plan.methods[m] == FLATQUANT]
        other = [m for m in members if flat and plan.methods[m] != FLATQUANT
                 and plan.schemes[m].kernel_fmt() == plan.schemes[flat[0]].kernel_fmt()]
        if other:
            raise mixed_site(flat[0], other[0], plan.schemes[other[0]].name, plan.methods[other[0]])


def check_method(method: str, scheme) -> None:
    """OptionError when --method cannot quantize --scheme (the `scheme` instance the options
    build), before anything is read: the method table's kernel formats and reason, and the
    schemes it does apply to. (A recipe's per-module choices are checked in `make_plan`.)"""
    from cvt.qtensor import layouts

    kernels = method_kernels(method)
    if kernels is None or layouts.kernel_fmt_of(scheme) in kernels:
        return
    why = METHOD_TABLE[method].why_not.replace("this scheme", scheme.name)
    raise OptionError(f"--method {method} does not apply to --scheme {scheme.name}: {why or 'not one it quantizes'}; "
                      f"{method} applies to --scheme {', '.join(method_schemes(method))}")


def method_kernels(method: str) -> tuple[str, ...] | None:
    """The kernel formats `method` quantizes (None: every one; the method table,
    `cvt.quant.recipe.METHOD_TABLE`): gptq's error feedback is written for int4 / int8 per channel
    / fp4 / MX weights, smoothquant needs quantized activations; rtn and awq (a weight-error
    search, then RTN) take any scheme."""
    return METHOD_TABLE[method].kernels


def weight_shape(ckpt: Checkpoint, params: dict[str, str]) -> tuple[int, int]:
    if "weight_shape" in params:
        return tuple(int(x) for x in ckpt.read(params["weight_shape"]).tolist())
    if "weight" not in params and "weight_packed" in params:  # c-t mxfp4 / nvfp4: two E2M1 codes per byte
        n, half = ckpt.tensors[params["weight_packed"]].shape
        return (n, 2 * half)
    ref = ckpt.tensors[params["weight"]]
    shape = ref.shape
    if len(shape) != 2:
        raise TensorError(f"{params['weight']}: a linear weight must be 2-D, got {list(shape)}")
    if ref.dtype == "U8" and "weight_scale_2" in params:  # ModelOpt nvfp4: two E2M1 codes per byte
        return (shape[0], 2 * shape[1])
    if ref.dtype in FP4_DTYPES and "scale" in params and fp4_experts(ckpt.config):
        return (shape[0], 2 * shape[1])  # a DeepSeek-V4 FP4 expert: two E2M1 codes per byte
    return shape


def names_where(pred, kind: str) -> str:
    """The registered formats or schemes for which `pred(class)` holds, for messages."""
    from cvt.qtensor.formats import FORMATS
    from cvt.qtensor.schemes import SCHEMES

    reg = FORMATS if kind == "format" else SCHEMES
    return " or ".join(n for n in reg.names() if pred(reg.get(n)))


def check_kv_target(config, plan: Plan, fmt: str, target: str) -> None:
    """An int8 KV cache the target would load wrong is refused, saying why."""
    if not any(getattr(s, "kv_cache", None) == "int8" for s in plan.schemes.values()):
        return
    from cvt.qtensor.kv_tensors import kv_target_problem

    from cvt.qtensor import indexer_c8, layouts

    lm = text_config(config)
    if fmt == layouts.ASCEND and SPARSE_MLA in arch_for(config).table.attention.kinds and not indexer_c8.applies(lm, fmt):
        # vllm-ascend serves sparse MLA (a lightning indexer, no V4 compression) through its SFA
        # backend (`utils.model_uses_sfa_sparse`), whose C8 is the indexer's and which never reads
        # FAKQuant's fa_* scales: an MLA C8 would load and do nothing
        raise FormatError(f"{lm.get('model_type')}: vllm-ascend runs this model's attention through its SFA backend, "
                          "whose int8 cache is the lightning indexer's (sparse LI C8, which cvt writes for "
                          "DeepSeek-V3.2 only so far) and which never reads FAKQuant fa_* scales: --scheme w8a8c8 "
                          f"--format {layouts.ASCEND} is refused for it; use --scheme w8a8")
    why = indexer_c8.problem(lm) if indexer_c8.applies(lm, fmt) else kv_target_problem(lm, fmt, target)
    if why is not None:
        raise FormatError(why)


