"""The `cvt quantize` stage: a BF16, FP8 or compressed-tensors INT4 checkpoint -> quantized
weights in the Ascend (msModelSlim AscendV1) or compressed-tensors format.

Streaming like every stage: tensors are read one at a time (FP8 weights dequantized on the
fly, so no BF16 copy is ever written), each quantized linear is quantized once when its first
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
fallback to RTN is recorded in the manifest.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cvt.quant.tensor import kernel_formats as KF
from cvt.lazy import torch

from cvt.version import __version__
from cvt.convert.arch import Role, arch_for, text_config
from cvt.convert.config import SourceFormat, bf16_config, fp8_config, source_format
from cvt.convert.fp8 import dequant_fp8_block, scale_to_f32_np
from cvt.convert.fp8_to_bf16 import check_scales_finite, dequantize_stored, pair_fp8_weights
from cvt.convert.validate import check_weights
from cvt.convert.reader import Checkpoint, check_manifest_files, open_checkpoint
from cvt.dtypes import dtype_code
from cvt.convert.safetensors_io import TensorSpec
from cvt.convert.writer import DEFAULT_MAX_SHARD, OutTensor, WriteResult, default_workers, write_checkpoint
from cvt.errors import CvtError, FormatError, OptionError, TensorError
from cvt.quant import qkernel
from cvt.quant.tensor.formats import DEFAULT_FORMAT, default_group, get_format, group_fallback
from cvt.quant.tensor.formats.compressed_tensors import CompressedTensors
from cvt.quant.tensor.disk_layouts import DiskLayouts, shell_q
from cvt.quant.tensor.layouts import check_target, kernel_fmt_of
from cvt.quant.recipe import GPTQ, RTN, SMOOTHQUANT, Policy, Recipe
from cvt.quant.tensor.schemes import get_scheme, scheme_from_options
from cvt.quant.tensor.schemes.base import QuantizedTensor, Scheme
from cvt.schemas.manifest import Fallback, QuantInfo, QuantTensorInfo, StageInfo
from cvt.units import article

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


def _sqnr_value(v: float | None, module: str = "", scheme: str = "") -> float | str | None:
    """The manifest's sqnr_db: "Infinity" for an exact quantization; TensorError naming the weight
    when it is NaN or -inf (the finite weight's dequantized form holds Inf: a value past what the
    scheme represents, e.g. mxfp4 rounding |w| near the bfloat16 maximum up to 2**128), which a
    manifest cannot record and `cvt run` would refuse."""
    if v is None:
        return None
    if v == float("inf"):
        return "Infinity"
    if math.isnan(v) or v == -math.inf:
        raise TensorError(f"{module}.weight: its {scheme} quantization is not finite (the dequantized weight "
                          "holds Inf: a value past what the scheme represents); quantize refused")
    return v


class _Source:
    """Float (or already-quantized) views of the source's modules, whatever its format."""

    def __init__(self, ckpt: Checkpoint, fmt: SourceFormat):
        self.ckpt = ckpt
        self.block = fp8_config(ckpt.config, str(ckpt.root)).block if fmt is SourceFormat.FP8_BLOCK else None
        self.ct = CompressedTensors() if fmt is SourceFormat.CT_INT4 else None

    def float_weight(self, params: dict[str, str]) -> torch.Tensor:
        """float32 [n, k] of a linear's weight: FP8 dequantized, CT INT4 unpacked, else cast."""
        ck = self.ckpt
        if "weight" in params and ck.tensors[params["weight"]].dtype == "F8_E4M3":
            w = dequant_fp8_block(ck.read(params["weight"]), ck.read(params["weight"] + FP8_SCALE), self.block)
            ck.release(params["weight"])
            return w.float()
        if "weight_packed" in params:
            q = self.source_quantized(params)
            return get_scheme(q.scheme, group_size=q.group_size, symmetric=q.symmetric).dequantize(q)
        t = ck.read(params["weight"]).float()
        ck.release(params["weight"])
        return t

    def weight_source(self, params: dict[str, str]):
        """A linear's weight as stored, for the fused kernels (`cvt.quant.qkernel.WeightSource`:
        BF16, or FP8 with its scale, over the mmap); None for other dtypes and packed sources."""
        from cvt.quant.qkernel import WeightSource

        name = params.get("weight")
        ref = self.ckpt.tensors[name] if name is not None else None
        if ref is None or ref.dtype not in ("F8_E4M3", "BF16"):
            return None
        if qkernel.kernel_name() == "c":  # numpy over the mmap: this process never needs torch
            if ref.dtype == "BF16":
                return WeightSource.raw(self.ckpt.view(name), "BF16", ref.shape)
            s = self.ckpt.tensors[name + FP8_SCALE]
            scale = scale_to_f32_np(self.ckpt.view(s.name), s.dtype, s.shape)
            return WeightSource.raw(self.ckpt.view(name), "F8_E4M3", ref.shape, scale, self.block)
        if ref.dtype == "F8_E4M3":
            return WeightSource.fp8(self.ckpt.read(name), self.ckpt.read(name + FP8_SCALE), self.block)
        return WeightSource(self.ckpt.read(name))

    def source_quantized(self, params: dict[str, str]) -> QuantizedTensor:
        module = params["weight_packed"].rpartition(".")[0]
        disk = {n: self.ckpt.read(n).clone() for p, n in params.items() if p in CT_PARTS}
        return self.ct.read(module, disk, self.ckpt.config)

    def float_tensor(self, name: str):
        """A tensor kept float: FP8 ones dequantized to BF16 (with the C kernel: a numpy
        ``uint16`` array of the BF16 bits, no torch), others as stored."""
        if self.ckpt.tensors[name].dtype == "F8_E4M3":
            return dequantize_stored(self.ckpt, name, name + FP8_SCALE, self.block)
        return self.ckpt.read(name)


def _scheme_for(name: str, fmt_name: str, group_size: int | None, asym: bool, fp4_format: str,
                cache: dict) -> Scheme:
    """One instance per distinct request (a recipe's modules share it: the plan groups by identity)."""
    gs = group_size if group_size is not None else default_group(fmt_name, name)
    key = (name, gs, asym, fp4_format)
    if key not in cache:
        cache[key] = scheme_from_options(name, group_size=gs, symmetric=not asym, fp4_format=fp4_format)
    return cache[key]


def make_plan(ckpt: Checkpoint, policy: Policy, fmt, scheme_name: str, group_size: int | None, asym: bool,
              fp4_format: str, target: str | None = None) -> Plan:
    from cvt.quant.tensor import layouts

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
        scheme = _scheme_for(choice.scheme, fmt.name, choice.group_size, asym, fp4_format, cache)
        fmt.supports(scheme, target)
        expert = arch.classify(module + ".weight").role is Role.EXPERT
        why = None if expert or choice.explicit else layouts.experts_only_reason(
            fmt.name, layouts.kernel_fmt_of(scheme), target)
        if why is not None:  # the stack has this layout for MoE experts only
            plan.float_reasons[module] = why
            continue
        shape = _weight_shape(ckpt, params)
        fallback = group_fallback(fmt, module, scheme, shape, target)
        if fallback is not None:
            scheme = _scheme_for(choice.scheme, fmt.name, 0, asym, fp4_format, cache)
            plan.group_fallbacks[module] = fallback
        fmt.check_shape(module, scheme, shape, target=target, expert=expert)
        plan.schemes[module] = scheme
        plan.experts[module] = expert
        plan.methods[module] = choice.method
        kernels = method_kernels(choice.method)
        if kernels is not None and layouts.kernel_fmt_of(scheme) not in kernels:
            why = (" (it smooths activations for their int8 quantization; this scheme keeps them float)"
                   if choice.method == SMOOTHQUANT else "")
            raise CvtError(f"{module}: --method {choice.method} does not support scheme {scheme.name}{why} "
                           f"({layouts.kernel_fmt_of(scheme)}; {choice.method} handles {', '.join(kernels)}): use "
                           "rtn, or give this module another method or scheme in a recipe")
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


def method_kernels(method: str) -> tuple[str, ...] | None:
    """The kernel formats `method` quantizes (None: every one): gptq's error feedback is written
    for int4 / int8 per channel / fp4 weights, smoothquant needs quantized activations; rtn and
    awq (a weight-error search, then RTN) take any scheme."""
    if method == GPTQ:
        from cvt.quant.methods.gptq import SUPPORTED  # the methods import torch eagerly: only when asked

        return SUPPORTED
    if method == SMOOTHQUANT:
        from cvt.quant.methods.smoothquant import SUPPORTED

        return SUPPORTED
    return None


def _weight_shape(ckpt: Checkpoint, params: dict[str, str]) -> tuple[int, int]:
    if "weight_shape" in params:
        return tuple(int(x) for x in ckpt.read(params["weight_shape"]).tolist())
    shape = ckpt.tensors[params["weight"]].shape
    if len(shape) != 2:
        raise TensorError(f"{params['weight']}: a linear weight must be 2-D, got {list(shape)}")
    return shape


class _Quantizer:
    """Quantizes each module once, when its first on-disk part is asked for, and hands out the
    parts; drops the result when all parts were taken. Thread-safe (files are written in parallel)."""

    def __init__(self, source: _Source, plan: Plan, fmt, static_inputs: dict, precomputed: dict,
                 methods_applied: dict | None = None, sqnr_known: dict | None = None, target: str | None = None,
                 loader=None):
        self.source, self.plan, self.fmt, self.target = source, plan, fmt, target
        self.loader = loader or precomputed.get
        self.static_inputs, self.precomputed = static_inputs, precomputed
        self.methods_applied, self.sqnr_known = methods_applied or {}, sqnr_known or {}
        self._lock = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}
        self._ready: dict[str, tuple[dict[str, torch.Tensor], int]] = {}
        self._shared: dict[tuple[str, ...], torch.Tensor] = {}
        self.info: dict[str, QuantTensorInfo] = {}

    def shared_scale(self, group: tuple[str, ...]):
        """The per-tensor scale of a fused group: from every member's weight (each read once more
        here; only amax is kept), computed once per group. A float when the fused kernels took
        each member's amax, else a float32 ``[1]`` tensor."""
        with self._lock:
            lock = self._locks.setdefault("|".join(group), threading.Lock())
        with lock:
            if group not in self._shared:
                scheme = self.plan.schemes[group[0]]
                amax = None if qkernel.kernel_name() == "reference" else [self._absmax(m) for m in group]
                if amax is not None and None not in amax:  # the same number from max |w| alone, no float32 copies
                    self._shared[group] = scheme.shared_scale_of(amax)  # a float: no torch on the fused path
                else:
                    self._shared[group] = scheme.shared_scale(
                        [self.source.float_weight(self.plan.modules[m]) for m in group])
            return self._shared[group]

    def _absmax(self, module: str) -> float | None:
        """max |w| of a module's float32 weight by the fused kernels (None: not readable so, or NaN/Inf)."""
        params = self.plan.modules[module]
        src = self.source.weight_source(params)
        if src is None:
            return None
        try:
            return qkernel.absmax(src)
        finally:
            self.source.ckpt.release(params["weight"])

    def part(self, module: str, name: str, n_parts: int) -> torch.Tensor:
        with self._lock:
            lock = self._locks.setdefault(module, threading.Lock())
        with lock:
            if module not in self._ready:
                self._ready[module] = (self._quantize(module), n_parts)
            tensors, left = self._ready[module]
            if left == 1:
                del self._ready[module]
            else:
                self._ready[module] = (tensors, left - 1)
            return tensors[name]

    def _quantize(self, module: str) -> dict[str, torch.Tensor]:
        from cvt.quant.tensor.schemes.w8a8 import static_parts

        params = self.plan.modules[module]
        scheme = self.plan.schemes[module]
        method = self.plan.methods[module]
        q = self.loader(module) if module in self.precomputed else None  # calibrated (from the state folder)
        if "weight_packed" in params:  # an INT4 source: read it once, as its own quantized tensor
            src_q = self.source.source_quantized(params)
            w = get_scheme(src_q.scheme, group_size=src_q.group_size, symmetric=src_q.symmetric).dequantize(src_q)
            k = src_q.shape[1]
            same_group = (0 if src_q.group_size in (0, k) else src_q.group_size) == (
                0 if scheme.group_size in (0, k) else scheme.group_size)  # a group of k: the same scales
            if q is None and same_group and (src_q.kernel_fmt, src_q.symmetric) == (
                    kernel_fmt_of(scheme), scheme.symmetric):
                # same int4 grid: re-emitted as is, without loss, recorded with the scheme's group
                # size (a [n, 1] scale reads back as 0; a group of k is written in the grouped layout)
                q, method = dataclasses.replace(src_q, group_size=scheme.group_size), "source"
        else:
            if q is None and module not in self.static_inputs and qkernel.kernel_name() != "reference":
                fused = self._quantize_fused(module, params, scheme, method)
                if fused is not None:
                    return fused
            w = self.source.float_weight(params)
        if q is None:
            if method != RTN:
                method = "rtn-fallback"
            group = self.plan.shared.get(module)
            gs = self.shared_scale(group) if group else None
            if isinstance(gs, float):
                gs = torch.tensor([gs], dtype=torch.float32)
            q = (scheme.quantize(w, name=module + ".weight", global_scale=gs) if group
                 else scheme.quantize(w, name=module + ".weight"))
        bias = self.source.ckpt.read(params["bias"]).clone() if "bias" in params else None
        if module in self.static_inputs:
            q = static_parts(q, *self.static_inputs[module], bias=bias)
            bias = None  # folded into quant_bias
        if module in self.precomputed:  # calibrated: its method and SQNR (vs the smoothed weight) come with it
            method = self.methods_applied.get(module, method)
            sqnr = _sqnr_value(self.sqnr_known.get(module), module, scheme.name)
        else:
            from cvt.runtime.metrics import sqnr_db

            w_hat = scheme.dequantize(q) if q.kernel_fmt != KF.W8A8_STATIC else _static_dequant(q)
            sqnr = _sqnr_value(sqnr_db(w, w_hat), module, scheme.name)
        expert = self.plan.experts[module]
        layout = self.fmt.layout_for(module, q, target=self.target, expert=expert).name
        self.info[module] = QuantTensorInfo(scheme=scheme.name, kernel_fmt=q.kernel_fmt, layout=layout, method=method,
                                            group_size=scheme.group_size, symmetric=scheme.symmetric, sqnr_db=sqnr)
        return self.fmt.disk_tensors(module, q, bias, target=self.target, expert=expert)

    def _quantize_fused(self, module: str, params: dict[str, str], scheme: Scheme, method: str):
        """RTN straight from the stored weight to the on-disk tensors (`cvt.quant.qkernel`): the
        same tensors as the path below, without float32 copies of the weight. None when the
        layout or the source dtype is not fused (the caller then takes that path)."""
        src = self.source.weight_source(params)
        if src is None:
            return None
        kf = kernel_fmt_of(scheme)
        expert = self.plan.experts[module]
        layout = self.fmt.layout_for(module, shell_q(scheme, src.shape), target=self.target, expert=expert)
        if not qkernel.supports(layout, scheme, src):
            return None
        group = self.plan.shared.get(module)
        try:
            res = qkernel.quantize_to_layout(src, scheme, layout, name=module + ".weight",
                                             global_scale=self.shared_scale(group) if group else None)
        finally:
            self.source.ckpt.release(params["weight"])
        bias = self.source.ckpt.read(params["bias"]).clone() if "bias" in params else None
        self.info[module] = QuantTensorInfo(
            scheme=scheme.name, kernel_fmt=kf, layout=layout.name, method=RTN if method == RTN else "rtn-fallback",
            group_size=scheme.group_size, symmetric=scheme.symmetric,
            sqnr_db=_sqnr_value(res.sqnr_db, module, scheme.name))
        out = {f"{module}.{s}": t for s, t in res.tensors.items()}  # numpy (a raw source) or torch
        if bias is not None:
            out[f"{module}.bias"] = bias.contiguous()
        return out


def _static_dequant(q: QuantizedTensor) -> torch.Tensor:
    return q.parts["weight"].float() * q.extra["weight_scale"]


def quantize(src, dst, *, scheme: str, fmt: str | None = None, method: str | None = None,
             group_size: int | None = None, asym: bool = False, fp4_format: str | None = None, calib: Path | None = None,
             calib_tokens: int = 32768, ignore: tuple[str, ...] = (), recipe: Recipe | None = None,
             static_attention: bool = False, revision: str | None = None, workers: int | None = None,
             max_shard_size: int = DEFAULT_MAX_SHARD, resume: bool = True, overwrite: bool = False,
             quiet: bool = False, target: str | None = None, device: str = "cpu",
             expert_memory: int | None = None) -> WriteResult:
    """Quantize SRC into DST (see the module docstring) for the serving `target` (ascend:
    vllm-ascend, the default, or mindie; `cvt.quant.tensor.layouts`). Returns the writer's result,
    with counts in `.extra`. `expert_memory`: bytes of a MoE layer's routed experts calibration
    reads at once, as float32 (None: `cvt.quant.methods.stream.MAX_EXPERT_BYTES`)."""
    fmt, method = fmt or DEFAULT_FORMAT, method or RTN
    form = get_format(fmt)
    target = check_target(fmt, target)
    sch = scheme_from_options(scheme, fp4_format=fp4_format)  # unknown names fail here
    if static_attention and not (form.static_attention and getattr(sch, "static_attention", False)):
        raise FormatError("--static-attention (static W8A8 attention with input_scale / deq_scale / quant_bias) "
                          f"exists only in the {_names(lambda f: f.static_attention, 'format')} format with --scheme "
                          f"{_names(lambda s: getattr(s, 'static_attention', False), 'scheme')}")
    req = _Request(scheme, fmt, target, method, group_size, asym, getattr(sch, "fp4_format", None),
                   static_attention, workers, max_shard_size, resume, overwrite, quiet)
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
        policy = Policy(arch, scheme, method, group_size, ignore, recipe)
        plan = make_plan(ckpt, policy, form, scheme, group_size, asym, fp4_format, target)
        _check_kv_target(ckpt.config, plan, fmt, target)
        source = _Source(ckpt, src_fmt)
        if source.block is not None:  # an FP8 release: every scale present, well shaped and finite
            check_scales_finite(ckpt, pair_fp8_weights(ckpt, source.block))
        check_weights(ckpt, arch, "quantize", source.block or (128, 128))

        needs_model = (any(m != RTN for m in plan.methods.values()) or static_attention
                       or any(getattr(s, "kv_cache", None) == "int8" for s in plan.schemes.values()))
        if calib is not None and needs_model:  # before DST is touched
            from cvt.quant.methods.data import check_calib

            check_calib(calib)
        if calib is not None and not needs_model:
            raise OptionError(f"--calib {calib}: nothing in this run calibrates (RTN needs no data); give --method "
                              "gptq / awq / smoothquant, --static-attention or an int8 KV cache, or drop --calib")
        if not needs_model:
            return _write(ckpt, dst, plan, form, source, src_fmt, _Calib(), req)
        from cvt.convert.outdir import calibration_dir

        with calibration_dir(ckpt.source.confine_root, Path(dst), overwrite, resume) as state:
            # the KV cache in the form the format's stacks load (`Format.kv_codec`)
            cal = _calibrate(ckpt, plan, calib, calib_tokens, static_attention, form.kv_codec, state, device, quiet,
                             expert_memory)
            return _write(ckpt, dst, plan, form, source, src_fmt, cal, req)
    finally:
        ckpt.close()


def _names(pred, kind: str) -> str:
    """The registered formats or schemes for which `pred(class)` holds, for messages."""
    from cvt.quant.tensor.formats import FORMATS
    from cvt.quant.tensor.schemes import SCHEMES

    reg = FORMATS if kind == "format" else SCHEMES
    return " or ".join(n for n in reg.names() if pred(reg.get(n)))


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


def _check_kv_target(config, plan: Plan, fmt: str, target: str) -> None:
    """An int8 KV cache the target would load wrong is refused, saying why."""
    if not any(getattr(s, "kv_cache", None) == "int8" for s in plan.schemes.values()):
        return
    from cvt.quant.tensor.kv_layout import kv_target_problem

    why = kv_target_problem(text_config(config), fmt, target)
    if why is not None:
        raise FormatError(why)


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
               kv_codec: str, state_dir: Path, device, quiet: bool, expert_memory: int | None = None) -> _Calib:
    """Calibration text through the model, one decoder layer from disk at a time
    (`cvt.quant.methods.stream`): the calibrated methods, static activation scales of the
    attention projections (--static-attention: amax / 127 of what they see, after smoothing and
    with the earlier layers quantized) and KV-cache scales (w8a8c8). Resumable per layer."""
    import hashlib

    from cvt.quant.methods.data import calib_tokens as calib_tokens_of
    from cvt.quant.methods.stream import calibrate_streaming, kv_scales
    from cvt.runtime.models import family
    from cvt.runtime.tokenizer import load_tokenizer
    from cvt.schemas.manifest import Fallback as ManifestFallback

    mod, cfg = family(ckpt.config)
    tokens = calib_tokens_of(load_tokenizer(ckpt.root, ckpt.config), calib, seq_len=256,
                             max_sequences=max(1, calib_tokens // 256),
                             max_len=mod.Args.from_config(cfg).max_position_embeddings)
    c8 = any(getattr(s, "kv_cache", None) == "int8" for s in plan.schemes.values())
    res = calibrate_streaming(ckpt, plan, tokens, state_dir, device=device, observe_kv=c8, quiet=quiet,
                              collect_stats=static_attention,
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
        out.kv_scales = kv_scales(res, ckpt.config, kv_codec)
    out.summary = {"tokens": int(tokens.numel()), "layers": len(res.seconds_per_layer), "device": str(device),
                   "seconds_per_layer": [round(x, 3) for x in res.seconds_per_layer],
                   "peak_rss_bytes": res.peak_rss, "resumed_layers": res.resumed_layers}
    return out


LINEAR_ROLES = ("linear", "expert", "shared_expert", "mtp_proj", "head", "router")


def _write(ckpt, dst, plan: Plan, form, source: _Source, src_fmt: SourceFormat, cal: _Calib,
           req: _Request) -> WriteResult:
    import hashlib

    target = req.target
    arch = arch_for(ckpt.config)
    quantizer = _Quantizer(source, plan, form, cal.static_inputs, cal.quantized, cal.methods_applied, cal.sqnr,
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
        module = info.module
        if module in plan.schemes:
            if module in emitted:
                continue
            emitted.add(module)
            sch = plan.schemes[module]
            shape = _weight_shape(ckpt, plan.modules[module])
            static = module in cal.static_inputs
            has_bias = "bias" in plan.modules[module] and not static
            b = ckpt.tensors[plan.modules[module]["bias"]] if has_bias else None
            specs, module_tags = layouts.get(module, sch, shape, static, None if b is None else b.shape,
                                             None if b is None else getattr(torch, _torch_name(b.dtype)),
                                             plan.experts[module])
            tags.update(module_tags)
            for j, (disk_name, (shape_, dt)) in enumerate(specs.items()):
                outs.append(OutTensor(
                    spec=TensorSpec(disk_name, dt, shape_),
                    produce=lambda m=module, n=disk_name, c=len(specs): quantizer.part(m, n, c),
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
            shape = _weight_shape(ckpt, params)
            outs.append(OutTensor(TensorSpec(wname, "BF16", shape),
                                  produce=lambda p=params: source.float_weight(p).to(torch.bfloat16)))
            tags[wname] = "FLOAT"
            float_linears.append(module)
            continue
        dt = "BF16" if ref.dtype == "F8_E4M3" else ref.dtype
        if name in cal.float_overrides:
            read = cal.float_loader or cal.float_overrides.get
            produce = (lambda n=name, d=dt, read=read: read(n).to(getattr(torch, _torch_name(d))).contiguous())
        elif ref.dtype == "F8_E4M3":
            produce = (lambda n=name: source.float_tensor(n))
        else:
            produce = (lambda n=name: ckpt.view(n))
        outs.append(OutTensor(TensorSpec(name, dt, ref.shape), produce=produce,
                              release=(lambda n=name: ckpt.release(n)), read_bytes=ref.nbytes))
        tags[name] = "FLOAT"
        if info.param == "weight" and len(ref.shape) == 2 and info.role.value in LINEAR_ROLES and module not in float_linears:
            float_linears.append(module)

    c8 = any(getattr(s, "kv_cache", None) == "int8" for s in plan.schemes.values())
    kv_meta = None
    mla = "kv_lora_rank" in arch.config
    if c8:
        from cvt.quant.tensor.kv_layout import kv_tag

        kv_meta = form.kv_manifest(cal.kv_scales)  # Ascend int8 names, or compressed-tensors fp8 k_scale / v_scale
        for n, t in cal.kv_scales.items():
            outs.append(OutTensor(TensorSpec(n, dtype_code(t.dtype), tuple(t.shape)), produce=lambda t=t: t.contiguous()))
            tags[n] = kv_tag(mla)
    config = bf16_config(ckpt.config)
    extra_files = form.write_metadata(config, tags, plan.schemes, float_linears=float_linears, kv_cache=c8, mla=mla,
                                      target=target)

    calibrated = {f.module for f in cal.fallbacks}
    fallbacks = sorted(list(cal.fallbacks) + [Fallback(module=m, method=plan.methods[m], reason=why)
                                              for m, why in plan.group_fallbacks.items()],
                       key=lambda f: f.module)  # one order whichever way the layers were calibrated
    quant = QuantInfo(scheme=req.scheme, format=req.fmt, target=target, method=req.method, group_size=req.group_size,
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
    params = {"scheme": req.scheme, "format": req.fmt, "target": target, "method": req.method,
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
                        fallbacks=len(quant.fallbacks), min_sqnr_db=f"{min(sqnrs):.1f} dB" if sqnrs else "exact")
    return result


def _counts(names) -> dict[str, int]:
    """{name: how many}, most frequent first (a mixed recipe's summary counts each scheme / method)."""
    from collections import Counter

    return dict(sorted(Counter(names).items(), key=lambda kv: (-kv[1], kv[0])))


def _torch_name(code: str) -> str:
    from cvt.dtypes import DTYPES

    return DTYPES[code][0]
