"""The quantize stage's per-module work: `Source` gives float (or already quantized) views of
SRC's modules whatever its format; `Quantizer` quantizes each module once, when the writer asks
for its first on-disk part (RTN through the fused kernels when they cover it, else the scheme's
reference path or the calibrated result), and records its manifest entry."""

from __future__ import annotations

import dataclasses
import math
import threading

from cvt.qtensor import kernel_formats as KF
from cvt.lazy import torch

from cvt.convert.config import SourceFormat, fp8_config, quantization_config
from cvt.convert.ct_source import ct_linears, dequantize_ct
from cvt.convert.sources import CT_STREAMED
from cvt.convert.fp8 import dequant_fp8_block, scale_to_f32_np
from cvt.convert.fp4 import FP4_DTYPES, dequant_fp4_experts
from cvt.convert.fp8_to_bf16 import dequantize_stored
from cvt.convert.mxfp4_source import dequantize_pair, mxfp4_pairs
from cvt.convert.reader import Checkpoint
from cvt.errors import TensorError
from cvt.quant import qkernel
from cvt.qtensor.formats.compressed_tensors import CompressedTensors
from cvt.qtensor.disk_specs import shell_q
from cvt.qtensor.layouts import kernel_fmt_of
from cvt.quant.recipe import RTN
from cvt.qtensor.schemes import get_scheme
from cvt.qtensor.schemes.base import QuantizedTensor, Scheme
from cvt.schemas.manifest import QuantTensorInfo

from cvt.quant.stage import fp4_source
from cvt.quant.stage.assignment import CT_PARTS, FP8_SCALE, Plan


# the release formats whose stored linears are on a carried FP4 grid (`fp4_source.GRIDS`)
_CARRY_GRIDS = {SourceFormat.CT_MXFP4: KF.MXFP4, SourceFormat.CT_NVFP4: KF.NVFP4, SourceFormat.MODELOPT_NVFP4: KF.NVFP4}


def sqnr_value(v: float | None, module: str = "", scheme: str = "") -> float | str | None:
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


class Source:
    """Float (or already-quantized) views of the source's modules, whatever its format."""

    def __init__(self, ckpt: Checkpoint, fmt: SourceFormat, scale_param: str = "weight" + FP8_SCALE):
        self.ckpt = ckpt
        self.fmt = fmt
        self.block = fp8_config(ckpt.config, str(ckpt.root)).block if fmt is SourceFormat.FP8_BLOCK else None
        self.ct = CompressedTensors() if fmt is SourceFormat.CT_INT4 else None
        # a compressed-tensors release read as float (`cvt.convert.ct_source`): module -> its linear
        self.ct_linears = ct_linears(ckpt.tensors, fmt, quantization_config(ckpt.config)) if fmt in CT_STREAMED else {}
        self.ct_parts = {n: lin for lin in self.ct_linears.values() for n in lin.parts.values()}
        # the release's block-scale parameter (`ArchTable.scale_param`): X.weight_scale_inv, or
        # DeepSeek-V4's X.scale, which also scales its FP4 experts (`fp4_source`)
        self.scale_param = scale_param
        self.fp4 = self.block is not None and fp4_source.fp4_experts(ckpt.config)
        # gpt-oss's MXFP4 release (`cvt.convert.mxfp4_source`): X_blocks -> its pair, kept float as
        # transformers' BF16 X [E, K, N] (the consumers' layout of float fused experts); X_scales read with it
        pairs = mxfp4_pairs(ckpt.tensors) if fmt is SourceFormat.GPT_OSS_MXFP4 else {}
        self.mxfp4 = {p.blocks: p for p in pairs.values()}
        self.mxfp4_scales = frozenset(p.scales for p in pairs.values())

    def scale_of(self, weight: str) -> str:
        """The name of an FP8 (or FP4) weight's scale."""
        return f"{weight.rpartition('.')[0]}.{self.scale_param}"

    def is_fp4(self, weight: str) -> bool:
        """Whether `weight` is one of a DeepSeek-V4 release's packed FP4 experts."""
        return (self.fp4 and self.ckpt.tensors[weight].dtype in FP4_DTYPES
                and self.scale_of(weight) in self.ckpt.tensors)

    def carry_grid(self, params: dict[str, str]) -> str | None:
        """The FP4 grid a linear's stored weight is on (`fp4_source.GRIDS`: mxfp4 for a DeepSeek-V4
        FP4 expert or a compressed-tensors mxfp4 linear, nvfp4 for a c-t or ModelOpt nvfp4 one),
        from the headers; None for any other weight."""
        if "weight" in params and self.is_fp4(params["weight"]):
            return KF.MXFP4
        lin = self.ct_linear(params)
        return None if lin is None else _CARRY_GRIDS.get(lin.fmt)

    def global_scale(self, params: dict[str, str]) -> bytes | None:
        """An nvfp4 linear's compressed-tensors global scale, as its float32 bytes (to compare a
        fused group's members): a c-t one's as stored, a ModelOpt one's converted from
        weight_scale_2 (`fp4_source.modelopt_global_scale`; None where that is not exact)."""
        lin = self.ct_linear(params)
        name = lin.parts[lin.layout.global_scale]
        try:
            gs = self.ckpt.read(name).to(torch.float32).reshape(-1)
            if lin.fmt is SourceFormat.MODELOPT_NVFP4:
                gs = fp4_source.modelopt_global_scale(gs)
            return None if gs is None else gs.numpy().tobytes()
        finally:
            self.ckpt.release(name)

    def carried(self, params: dict[str, str], scheme: Scheme) -> QuantizedTensor | None:
        """A stored FP4 weight's codes and scales as `scheme`'s tensor, unchanged (`fp4_source`;
        None: another grid, a V4 scale off the E8M0 grid, or a ModelOpt weight_scale_2 whose
        reciprocal is not exact)."""
        ck, lin = self.ckpt, self.ct_linear(params)
        names = ([params["weight"], self.scale_of(params["weight"])] if lin is None else
                 [lin.parts[p] for p in (lin.layout.codes, "weight_scale", lin.layout.global_scale) if p])
        try:
            if lin is not None and lin.fmt is SourceFormat.MODELOPT_NVFP4:  # weight_scale_2 -> 1 / it
                gs = fp4_source.modelopt_global_scale(ck.read(names[2]))
                return None if gs is None else fp4_source.carried_nvfp4(ck.read(names[0]), ck.read(names[1]), gs,
                                                                        scheme)
            if lin is not None and lin.fmt is SourceFormat.CT_NVFP4:
                return fp4_source.carried_nvfp4(*(ck.read(n) for n in names), scheme)
            return fp4_source.carried(ck.read(names[0]), ck.read(names[1]), scheme)
        finally:
            for n in names:
                ck.release(n)

    def _dequant_fp4(self, name: str) -> torch.Tensor:
        """bfloat16 [n, k], bit-exact with DeepSeek's official dequant (`cvt.convert.fp4`)."""
        ck = self.ckpt
        w = dequant_fp4_experts(ck.read(name), ck.read(self.scale_of(name)))
        ck.release(name)
        ck.release(self.scale_of(name))
        return w

    def ct_linear(self, params: dict[str, str]):
        """The compressed-tensors linear (`cvt.convert.ct_source.CtLinear`) of a module's params, or None."""
        name = params.get("weight_packed") or params.get("weight")
        return self.ct_parts.get(name) if name is not None else None

    def _dequant_ct(self, lin) -> torch.Tensor:
        """bfloat16 [n, k], as `cvt fp8-to-bf16` writes it."""
        return dequantize_ct(self.ckpt, lin).to(torch.bfloat16)

    def float_weight(self, params: dict[str, str]) -> torch.Tensor:
        """float32 [n, k] of a linear's weight: FP8 / FP4 / compressed-tensors FP4 / FP8 / INT8
        dequantized (to BF16 as `cvt fp8-to-bf16` writes it, then widened), CT INT4 unpacked, else cast."""
        ck = self.ckpt
        lin = self.ct_linear(params)
        if lin is not None:
            return self._dequant_ct(lin).float()
        if "weight" in params and ck.tensors[params["weight"]].dtype == "F8_E4M3":
            w = dequant_fp8_block(ck.read(params["weight"]), ck.read(self.scale_of(params["weight"])), self.block)
            ck.release(params["weight"])
            return w.float()
        if "weight" in params and self.is_fp4(params["weight"]):
            return self._dequant_fp4(params["weight"]).float()
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
        if ref is None or ref.dtype not in ("F8_E4M3", "BF16") or self.ct_linear(params) is not None:
            return None
        if qkernel.kernel_name() == "c":  # numpy over the mmap: this process never needs torch
            if ref.dtype == "BF16":
                return WeightSource.raw(self.ckpt.view(name), "BF16", ref.shape)
            s = self.ckpt.tensors[self.scale_of(name)]
            scale = scale_to_f32_np(self.ckpt.view(s.name), s.dtype, s.shape)
            return WeightSource.raw(self.ckpt.view(name), "F8_E4M3", ref.shape, scale, self.block)
        if ref.dtype == "F8_E4M3":
            return WeightSource.fp8(self.ckpt.read(name), self.ckpt.read(self.scale_of(name)), self.block)
        return WeightSource(self.ckpt.read(name))

    def source_quantized(self, params: dict[str, str]) -> QuantizedTensor:
        module = params["weight_packed"].rpartition(".")[0]
        disk = {n: self.ckpt.read(n).clone() for p, n in params.items() if p in CT_PARTS}
        return self.ct.read(module, disk, self.ckpt.config)

    def float_tensor(self, name: str):
        """A tensor kept float: FP8 ones dequantized to BF16 (with the C kernel: a numpy
        ``uint16`` array of the BF16 bits, no torch), FP4 experts and gpt-oss's MXFP4 experts
        (``X_blocks``: transformers' X, `cvt.convert.mxfp4_source`) to BF16, others as stored."""
        if name in self.ct_parts:
            return self._dequant_ct(self.ct_parts[name])
        if name in self.mxfp4:
            return dequantize_pair(self.ckpt, self.mxfp4[name])
        if self.ckpt.tensors[name].dtype == "F8_E4M3":
            return dequantize_stored(self.ckpt, name, self.scale_of(name), self.block)
        if self.is_fp4(name):
            return self._dequant_fp4(name)
        return self.ckpt.read(name)

    def float_name(self, name: str) -> str:
        """The output's name of a tensor kept float: gpt-oss's ``X_blocks`` is X, others their own."""
        p = self.mxfp4.get(name)
        return name if p is None else p.name

    def float_spec(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(dtype code, shape) of a tensor kept float in the output: FP8 / FP4 ones become BF16
        (an FP4 expert's packed ``[n, k/2]`` is ``[n, k]``)."""
        ref = self.ckpt.tensors[name]
        if name in self.ct_parts:
            return "BF16", self.ct_parts[name].shape
        if name in self.mxfp4:
            return "BF16", self.mxfp4[name].out_shape
        if ref.dtype == "F8_E4M3":
            return "BF16", tuple(ref.shape)
        if self.is_fp4(name):
            return "BF16", (ref.shape[0], 2 * ref.shape[1])
        return ref.dtype, tuple(ref.shape)


class Quantizer:
    """Quantizes each module once, when its first on-disk part is asked for, and hands out the
    parts; drops the result when all parts were taken. Thread-safe (files are written in parallel)."""

    def __init__(self, source: Source, plan: Plan, fmt, static_inputs: dict, precomputed: dict,
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
        self.carry = fp4_source.carried_modules(plan, source)  # FP4 weights copied as they are

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
            return self._take(module, name, n_parts)

    def _take(self, module: str, name: str, n_parts: int):
        if module not in self._ready:
            self._ready[module] = (self._quantize(module), n_parts)
        tensors, left = self._ready[module]
        if left == 1:
            del self._ready[module]
        else:
            self._ready[module] = (tensors, left - 1)
        return tensors[name]

    def pieces(self, module: str, name: str, n_parts: int):
        """Part `name`, the module's first on disk, for `OutTensor.pieces`: where the module is
        fused from a numpy source and `name` is its packed weight, made row block by row block
        (`qkernel.quantize_in_pieces`: never a whole fresh buffer to fault in and zero), the
        other parts kept for `part`; else the whole part, as one piece. The module's lock is held
        until the last piece is made (its other parts wait for it)."""
        with self._lock:
            lock = self._locks.setdefault(module, threading.Lock())
        with lock:
            made = None if module in self._ready else self._fused_pieces(module, name)
            if made is None:
                yield self._take(module, name, n_parts)
                return
            rest = yield from made
            if n_parts > 1:
                self._ready[module] = (rest, n_parts - 1)

    def _fused_pieces(self, module: str, name: str):
        """The generator of `pieces` for a module fused from a numpy source (RTN, not calibrated,
        not static), or None."""
        params = self.plan.modules[module]
        if (module in self.precomputed or module in self.static_inputs or qkernel.kernel_name() != "c"
                or "weight_packed" in params or self.source.is_fp4(params["weight"])):
            return None
        scheme, method = self.plan.schemes[module], self.plan.methods[module]
        src = self.source.weight_source(params)
        if src is None or not src.is_numpy:
            return None
        expert = self.plan.experts[module]
        layout = self.fmt.layout_for(module, shell_q(scheme, src.shape), target=self.target, expert=expert)
        if not qkernel.supports(layout, scheme, src) or name != f"{module}.{layout.tensors[0].suffix}":
            return None
        return self._stream(module, params, scheme, method, src, layout)

    def _stream(self, module, params, scheme, method, src, layout):
        group = self.plan.shared.get(module)
        made = qkernel.quantize_in_pieces(src, scheme, layout, name=module + ".weight",
                                          global_scale=self.shared_scale(group) if group else None)
        try:
            res = yield from made
        finally:
            self.source.ckpt.release(params["weight"])
        return self._fused_parts(module, params, scheme, method, layout, res)

    def _quantize(self, module: str) -> dict[str, torch.Tensor]:
        from cvt.qtensor.schemes.w8a8 import static_parts

        params = self.plan.modules[module]
        scheme = self.plan.schemes[module]
        method = self.plan.methods[module]
        q = self.loader(module) if module in self.precomputed else None  # calibrated (from the state folder)
        exact = False
        if "weight_packed" in params and self.source.ct is not None:  # INT4: read once, as its own quantized tensor
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
        elif self.source.carry_grid(params) is not None:  # V4's FP4 experts, c-t mxfp4 / nvfp4, ModelOpt nvfp4
            src_q = self.source.carried(params, scheme) if q is None and module in self.carry else None
            if src_q is not None:  # the scheme's grid is the release's: codes and scales copied, exact
                q, method, exact = src_q, "source", True
            else:
                w = self.source.float_weight(params)
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
            sqnr = sqnr_value(self.sqnr_known.get(module), module, scheme.name)
        elif exact:  # the source's own numbers: no float copy of the weight to compare with
            sqnr = sqnr_value(float("inf"))
        else:
            from cvt.runtime.metrics import sqnr_db

            w_hat = scheme.dequantize(q) if q.kernel_fmt != KF.W8A8_STATIC else static_dequant(q)
            sqnr = sqnr_value(sqnr_db(w, w_hat), module, scheme.name)
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
        return self._fused_parts(module, params, scheme, method, layout, res)

    def _fused_parts(self, module: str, params: dict[str, str], scheme: Scheme, method: str, layout, res):
        """The on-disk tensors of a fused result (and the module's manifest record)."""
        kf = kernel_fmt_of(scheme)
        bias = self.source.ckpt.read(params["bias"]).clone() if "bias" in params else None
        self.info[module] = QuantTensorInfo(
            scheme=scheme.name, kernel_fmt=kf, layout=layout.name, method=RTN if method == RTN else "rtn-fallback",
            group_size=scheme.group_size, symmetric=scheme.symmetric,
            sqnr_db=sqnr_value(res.sqnr_db, module, scheme.name))
        out = {f"{module}.{s}": t for s, t in res.tensors.items()}  # numpy (a raw source) or torch
        if bias is not None:
            out[f"{module}.bias"] = bias.contiguous()
        return out


def static_dequant(q: QuantizedTensor) -> torch.Tensor:
    return q.parts["weight"].float() * q.extra["weight_scale"]


