"""Per-linear quantized releases read as float, one linear at a time: compressed-tensors (what
llm-compressor writes: ``mxfp4-pack-quantized``, ``nvfp4-pack-quantized``, ``float-quantized``
(FP8), ``int-quantized`` (INT8)) and NVIDIA ModelOpt's exports (NVFP4, FP8, MXFP8), the
`cvt.convert.sources` entries in `CT_STREAMED`. The two producers differ in part names and in
how nvfp4's global scale applies, which `LAYOUTS` holds as data; the reading is one code path.

Per linear X (w [n, k]):

==============  ==========================================================================
format          tensors, and the float32 weight (BF16: that product rounded once, RNE)
==============  ==========================================================================
c-t mxfp4       X.weight_packed u8 [n, k/2] (element 2j in the low nibble), X.weight_scale
                u8 / E8M0 [n, k/32]:  e2m1(code) * 2**(s - 127)
c-t nvfp4       X.weight_packed u8 [n, k/2], X.weight_scale e4m3 [n, k/16],
                X.weight_global_scale f32 [1]:  e2m1(code) * (float32(s) / global_scale)
c-t fp8         X.weight e4m3 [n, k], X.weight_scale f32/bf16/f16 [1] (tensor), [n, 1]
                (channel), [n, k/G] (group) or [ceil(n/bn), ceil(k/bk)] (block, the config
                group's block_structure):  float32(w) * float32(s)
c-t int8        X.weight i8 [n, k], X.weight_scale as fp8's, X.weight_zero_point (asymmetric,
                the scale's shape):  float32(w - zero_point) * float32(s)
modelopt nvfp4  X.weight u8 [n, k/2] (element 2j in the low nibble), X.weight_scale e4m3
                [n, k/16], X.weight_scale_2 f32 []:  e2m1(code) * (float32(s) * weight_scale_2)
modelopt fp8    X.weight e4m3 [n, k], X.weight_scale f32 [] (FP8) or [n] / [n, 1]
                (FP8_PER_CHANNEL_PER_TOKEN):  float32(w) * s
modelopt mxfp8  X.weight e4m3 [n, k], X.weight_scale u8 / E8M0 [n, k/32]:
                float32(w) * 2**(s - 127)
modelopt        X.weight e4m3 [n, k], X.weight_scale f32 [ceil(n/128), 1, ceil(k/128), 1]
fp8-pb-wo       (or that grid 2-D):  float32(w) * s[i // 128, 0, j // 128, 0]
modelopt mixed  per linear, the layout of its ``quantized_layers`` entry's quant_algo (FP8:
                modelopt fp8, NVFP4 / W4A16_NVFP4: modelopt nvfp4); a linear not listed is float
==============  ==========================================================================

compressed-tensors: the package's own decompression (compressed-tensors 0.20 ``dequantize``: the
code in the scale's dtype times the scale, nvfp4's scale divided by the global scale first), which
the tests run against. ModelOpt: its own ``NVFP4QTensor.dequantize`` (TensorRT-Model-Optimizer
modelopt/torch/quantization/qtensor/nvfp4_tensor.py: packed ``q[1::2] << 4 | q[0::2]``, so the
low nibble first; per-block scale ``float32(s) * weight_scale_2``, then the E2M1 value times it,
in float32) and vLLM's emulation (vllm/model_executor/layers/quantization/utils/
nvfp4_emulation_utils.py ``dequantize_to_dtype``: the same two float32 products, weight_scale_2
passed as the global scale unreciprocated, as modelopt.py's ModelOptNvFp4W4A16LinearMethod says);
FP8 and MXFP8 as vLLM's ModelOptFp8LinearMethod / ModelOptMxFp8LinearMethod apply the float32
scale to the e4m3 value (``FP8QTensor.dequantize`` in float32, rounded to BF16 once).

FP8_PB_WO and MIXED_PRECISION as vLLM reads them (vllm/model_executor/layers/quantization/
modelopt.py at commit 00155cdecca722d98e34234c3d172725b7720b7d): ``ModelOptFp8PbWoLinearMethod``
takes a fixed 128x128 block, the float32 ``weight_scale`` as ModelOpt exports it, [out_blk, 1,
in_blk, 1] (squeezed to [out_blk, in_blk]; a 2-D one is taken as is), multiplying the e4m3 value
(the exporter's ``to_quantized_weight`` divides the weight by it per block: modelopt/torch/export/
quant_utils.py). ``ModelOptMixedPrecisionConfig`` reads ``quantized_layers`` (under
``quantization`` in hf_quant_config.json, at the top of config.json's quantization_config):
layer -> {"quant_algo": FP8 | NVFP4 | W4A16_NVFP4, "group_size"}; FP8 is the per-tensor method,
both NVFP4 kinds store the same parts; a linear it does not list is loaded unquantized (what
quant_utils.py ``process_layer_quant_config`` writes: every quantized layer listed, the rest
float). cvt reads vLLM's fixed 128 block with partial edge blocks allowed (vLLM itself
asks n and k per rank to be multiples of 128), and refuses a quantized weight the list does not
name, a listed layer that stores no quantized weight, and any other per-layer algorithm.

Activation parameters (``input_scale``, ``input_global_scale``, ``input_zero_point``) and the KV
cache's ``k_scale`` / ``v_scale`` describe the serving of a quantized model and are dropped from a
float output. Before anything is written every part is checked from the headers (present, dtype,
shape) and every scale read (NaN, Inf, E8M0 0xFF, a global scale not > 0, a scale whose largest
code overflows bfloat16): TensorError naming it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from cvt.convert.sources import SourceFormat
from cvt.errors import FormatError, TensorError

BF16_MAX = 3.3895313892515355e38
DROPPED = ("input_scale", "input_global_scale", "input_zero_point", "k_scale", "v_scale")
_FLOAT_SCALES = ("F32", "BF16", "F16")
_E8M0 = ("U8", "F8_E8M0")
_ZERO_POINT = "weight_zero_point"


@dataclass(frozen=True)
class Layout:
    """How one producer stores one format's linear: part names, dtypes and the scale's grid."""

    codes: str                  # the stored codes, in whose place the float weight X.weight is written
    dtype: str                  # the codes' safetensors dtype
    scale_dtypes: tuple[str, ...]
    top: float                  # the largest |code| (int8 asymmetric: |w - zero_point| up to 2x)
    group: int | None = None    # one scale per `group` inputs; None: tensor / channel / group / block scales
    global_scale: str | None = None  # nvfp4's second-level scale
    divides: bool = True        # c-t divides the block scale by the global scale, ModelOpt multiplies
    channel_1d: bool = False    # a channel scale may be stored [n] (ModelOpt's FP8_PER_CHANNEL_PER_TOKEN)
    block: tuple[int, int] | None = None  # a fixed block grid (ModelOpt's FP8_PB_WO), scales [bn, 1, bk, 1]

    @property
    def packed(self) -> bool:
        """Two E2M1 codes per byte."""
        return self.dtype == "U8"


_CT_FP4 = dict(codes="weight_packed", dtype="U8", top=6.0)
LAYOUTS: dict[SourceFormat, Layout] = {
    SourceFormat.CT_MXFP4: Layout(**_CT_FP4, scale_dtypes=_E8M0, group=32),
    SourceFormat.CT_NVFP4: Layout(**_CT_FP4, scale_dtypes=("F8_E4M3",), group=16, global_scale="weight_global_scale"),
    SourceFormat.CT_FP8: Layout("weight", "F8_E4M3", _FLOAT_SCALES, 448.0),
    SourceFormat.CT_INT8: Layout("weight", "I8", _FLOAT_SCALES, 128.0),
    SourceFormat.MODELOPT_NVFP4: Layout("weight", "U8", ("F8_E4M3",), 6.0, 16, "weight_scale_2", divides=False),
    SourceFormat.MODELOPT_FP8: Layout("weight", "F8_E4M3", ("F32",), 448.0, channel_1d=True),
    SourceFormat.MODELOPT_MXFP8: Layout("weight", "F8_E4M3", _E8M0, 448.0, 32),
    SourceFormat.MODELOPT_FP8_PB_WO: Layout("weight", "F8_E4M3", ("F32",), 448.0, block=(128, 128)),
}
# MIXED_PRECISION: a quantized_layers entry's quant_algo -> the layout its linear is stored in
# (the algorithms vLLM's ModelOptMixedPrecisionConfig.get_quant_method loads)
MIXED_ALGOS: dict[str, SourceFormat] = {"FP8": SourceFormat.MODELOPT_FP8, "NVFP4": SourceFormat.MODELOPT_NVFP4,
                                        "W4A16_NVFP4": SourceFormat.MODELOPT_NVFP4}


@dataclass(frozen=True)
class CtLinear:
    """One quantized linear of a compressed-tensors / ModelOpt source: its parts (param -> tensor name)."""

    module: str
    fmt: SourceFormat
    parts: dict[str, str]
    shape: tuple[int, int]
    block: tuple[int, int] | None = None  # float-quantized / int-quantized block strategy

    @property
    def layout(self) -> Layout:
        return LAYOUTS[self.fmt]

    @property
    def anchor(self) -> str:
        """The stored tensor whose place the float weight ``X.weight`` takes in an output."""
        return self.parts[self.layout.codes]


def block_structure(qc: Mapping[str, Any] | None) -> tuple[int, int] | None:
    """The [bn, bk] of a block-strategy config group (None: no group is block-scaled)."""
    for g in ((qc or {}).get("config_groups") or {}).values():
        w = (g or {}).get("weights") or {}
        b = w.get("block_structure")
        if w.get("strategy") == "block" and isinstance(b, list) and len(b) == 2:
            return int(b[0]), int(b[1])
    return None


def ct_linears(tensors: Mapping[str, Any], fmt: SourceFormat, qc: Mapping[str, Any] | None = None) -> dict[str, CtLinear]:
    """module -> its quantized linear, from the headers alone (`tensors`: name -> TensorRef);
    TensorError naming the first part that is missing or of the wrong dtype / shape."""
    if fmt is SourceFormat.MODELOPT_MIXED:
        return _mixed_linears(tensors, qc)
    lay = LAYOUTS[fmt]
    anchor = lay.codes
    block = lay.block or block_structure(qc)
    out: dict[str, CtLinear] = {}
    for name, ref in tensors.items():
        module, _, param = name.rpartition(".")
        if param == "weight_scale" and f"{module}.{anchor}" not in tensors:
            raise TensorError(f"scale {ref.describe()}: its weight {module}.{anchor} is missing")
        if param != anchor:
            continue
        if anchor == "weight" and f"{module}.weight_scale" not in tensors and not (lay.packed and ref.dtype == "U8"):
            continue  # a float weight (ignored by the config, e.g. lm_head): no scale comes with it
        parts = {p: f"{module}.{p}" for p in ("weight_packed", "weight", "weight_scale", lay.global_scale or "",
                                              _ZERO_POINT) if p and f"{module}.{p}" in tensors}
        lin = CtLinear(module, fmt, parts, _shape(ref, fmt), block)
        _check_parts(tensors, lin)
        out[module] = lin
    return out


def mixed_layers(qc: Mapping[str, Any] | None) -> dict[str, SourceFormat]:
    """A MIXED_PRECISION export's quantized_layers as layer -> the format its linear is stored in;
    FormatError, one line, for an empty list, an algorithm cvt does not read or an NVFP4 group
    size other than 16."""
    layers = (qc or {}).get("quantized_layers")
    if not isinstance(layers, Mapping) or not layers:
        raise FormatError("quantization_config: quant_algo MIXED_PRECISION needs a non-empty quantized_layers "
                          f"object (layer -> {{\"quant_algo\": ...}}), got {str(layers)[:40]!r}")
    out: dict[str, SourceFormat] = {}
    for layer, info in layers.items():
        algo = str((info or {}).get("quant_algo", "") if isinstance(info, Mapping) else "").upper()
        if algo not in MIXED_ALGOS:
            raise FormatError(f"quantization_config.quantized_layers[{layer!r}]: quant_algo {algo or None!r} is not read "
                              f"(MIXED_PRECISION layers cvt and vLLM read: {', '.join(MIXED_ALGOS)})")
        group = info.get("group_size")
        if MIXED_ALGOS[algo] is SourceFormat.MODELOPT_NVFP4 and group not in (None, 16):
            raise FormatError(f"quantization_config.quantized_layers[{layer!r}]: {algo} group_size {group!r}, "
                              "expected 16")
        out[str(layer)] = MIXED_ALGOS[algo]
    return out


def _mixed_linears(tensors: Mapping[str, Any], qc: Mapping[str, Any] | None) -> dict[str, CtLinear]:
    """Each listed layer read in its own format's layout; a stored quantized weight (codes not
    float, or a weight_scale) of a layer the list leaves out, or a listed layer with none, is a
    TensorError naming it (vLLM would load the one as float, fail on the other)."""
    layers = mixed_layers(qc)
    for name, ref in tensors.items():
        module, _, param = name.rpartition(".")
        if module in layers:
            continue
        if param == "weight_scale" or (param == "weight" and ref.dtype not in _FLOAT_SCALES):
            raise TensorError(f"{ref.describe()}: quantized, but quantization_config.quantized_layers does not list "
                              f"{module} (MIXED_PRECISION reads a layer not listed as float)")
    out: dict[str, CtLinear] = {}
    for fmt in dict.fromkeys(layers.values()):
        mine = {n: r for n, r in tensors.items() if layers.get(n.rpartition(".")[0]) is fmt}
        out.update(ct_linears(mine, fmt))
    for layer, fmt in layers.items():
        if layer not in out:
            raise TensorError(f"quantization_config.quantized_layers lists {layer} as {fmt.value}, but the checkpoint "
                              f"has no quantized {layer}.weight with its {layer}.weight_scale")
    return out


def _shape(ref, fmt: SourceFormat) -> tuple[int, int]:
    lay = LAYOUTS[fmt]
    if ref.dtype != lay.dtype or len(ref.shape) != 2:
        raise TensorError(f"{ref.describe()}: a {fmt.value} weight is 2-D {lay.dtype}"
                          + (" (two E2M1 codes per byte)" if lay.packed else ""))
    n, k = ref.shape
    return (n, 2 * k) if lay.packed else (n, k)


def _check_parts(tensors, lin: CtLinear) -> None:
    n, k = lin.shape
    x, lay = lin.module, lin.layout
    for p in ("weight_scale", lay.global_scale):
        if p is not None and p not in lin.parts:
            raise TensorError(f"{tensors[lin.anchor].describe()}: its {x}.{p} is missing ({lin.fmt.value})")
    s = tensors[lin.parts["weight_scale"]]
    if lay.group is not None:
        g, dts = lay.group, lay.scale_dtypes
        if k % g or s.dtype not in dts or tuple(s.shape) != (n, k // g):
            raise TensorError(f"scale {s.describe()}: expected {' / '.join(dts)} {[n, k // g]} for weight "
                              f"[{n}, {k}] (one scale per {g} inputs)")
        if _ZERO_POINT in lin.parts:
            raise TensorError(f"{tensors[lin.parts[_ZERO_POINT]].describe()}: an asymmetric {lin.fmt.value} "
                              "weight is not read")
        if lay.global_scale is not None:
            gs = tensors[lin.parts[lay.global_scale]]
            if gs.dtype not in _FLOAT_SCALES or math.prod(gs.shape) != 1:
                raise TensorError(f"global scale {gs.describe()}: expected one float32 value")
        return
    if lay.block is not None and (s.dtype not in lay.scale_dtypes or scale_granularity(lin, tuple(s.shape)) is None):
        a, b = -(-n // lay.block[0]), -(-k // lay.block[1])
        raise TensorError(f"scale {s.describe()}: expected {' / '.join(lay.scale_dtypes)} [{a}, 1, {b}, 1] (one per "
                          f"{lay.block[0]}x{lay.block[1]} block, as ModelOpt exports it) or [{a}, {b}] for weight [{n}, {k}]")
    if s.dtype not in lay.scale_dtypes or scale_granularity(lin, tuple(s.shape)) is None:
        raise TensorError(f"scale {s.describe()}: expected {' / '.join(lay.scale_dtypes)} [1] (tensor), [{n}, 1] "
                          f"(channel), [{n}, k/G] (group) or block scales for weight [{n}, {k}]")
    zp = lin.parts.get(_ZERO_POINT)
    if zp is not None and (lin.fmt is not SourceFormat.CT_INT8 or tuple(tensors[zp].shape) != tuple(s.shape)
                           or tensors[zp].dtype not in ("I8", "I32")):
        raise TensorError(f"zero point {tensors[zp].describe()}: expected int8 of its scale's shape {list(s.shape)}")


def scale_granularity(lin: CtLinear, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """(rows, cols) of the weight one scale covers, or None when `shape` fits no strategy."""
    n, k = lin.shape
    if lin.layout.block is not None:  # a fixed block grid, 4-D as ModelOpt exports it or 2-D
        a, b = -(-n // lin.block[0]), -(-k // lin.block[1])
        return lin.block if shape in ((a, 1, b, 1), (a, b)) else None
    if math.prod(shape) == 1:
        return n, k
    if lin.layout.channel_1d and shape == (n,):
        return 1, k
    if len(shape) != 2:
        return None
    if lin.block is not None and shape == (-(-n // lin.block[0]), -(-k // lin.block[1])):
        return lin.block
    if shape[0] == n and k % shape[1] == 0:
        return 1, k // shape[1]
    return None


def _float_scale(t):
    """float32 of a scale tensor (E8M0 exponents as 2**(e - 127), exactly)."""
    from cvt.lazy import torch
    from cvt.qtensor.primitives import e8m0_to_f32

    return e8m0_to_f32(t) if t.dtype in (torch.uint8, torch.float8_e8m0fnu) else t.to(torch.float32)


def check_ct_scales(ckpt, linears: dict[str, CtLinear]) -> None:
    """Read every scale (the weights stay unread): TensorError naming the first that is NaN or
    Inf (E8M0 0xFF, an e4m3 NaN code), a global scale not > 0, or one whose largest code times it
    overflows bfloat16 (the weight would dequantize to Inf)."""
    from cvt.lazy import torch

    for lin in linears.values():
        lay = lin.layout
        names = [lin.parts["weight_scale"]] + ([lin.parts[lay.global_scale]] if lay.global_scale else [])
        s = [_float_scale(ckpt.read(nm)).reshape(-1) for nm in names]
        for nm, v in zip(names, s):
            bad = ~torch.isfinite(v)
            if bool(bad.any()):
                i = int(bad.nonzero()[0, 0])
                raise TensorError(f"scale {ckpt.tensors[nm].describe()}: {int(bad.sum())} non-finite value(s), "
                                  f"first {float(v[i])} at flat index {i}")
        if lay.global_scale and not float(s[1][0]) > 0:
            raise TensorError(f"global scale {ckpt.tensors[names[1]].describe()}: {float(s[1][0])}, expected > 0")
        top = lay.top * (2 if _ZERO_POINT in lin.parts else 1)
        big = float(s[0].abs().max())
        if len(s) > 1:
            big = big / float(s[1][0]) if lay.divides else big * float(s[1][0])
        if top * big > BF16_MAX:
            by = f" {'/' if lay.divides else '*'} global scale {names[1]} ({float(s[1][0]):g})" if len(s) > 1 else ""
            raise TensorError(f"scale {ckpt.tensors[names[0]].describe()}{by}: {big:g} times {top:g} (the largest code) "
                              f"overflows bfloat16 (max {BF16_MAX:.4g}): the weight would dequantize to Inf")
        for nm in names:
            ckpt.release(nm)


def dequantize_ct(ckpt, lin: CtLinear):
    """float32 [n, k] of one linear (module docstring); its pages released after."""
    from cvt.lazy import torch

    n, k = lin.shape
    lay = lin.layout
    try:
        s = _float_scale(ckpt.read(lin.parts["weight_scale"]))
        if lay.packed:
            from cvt.qtensor.primitives import decode_e2m1, unpack_fp4

            if lay.global_scale:  # nvfp4: the block scale in float32 first, as both producers' own code
                gs = ckpt.read(lin.parts[lay.global_scale]).to(torch.float32).reshape(1)
                s = s / gs if lay.divides else s * gs
            v = decode_e2m1(unpack_fp4(ckpt.read(lin.anchor)))
            return (v.reshape(n, s.shape[1], -1) * s[:, :, None]).reshape(n, k)
        w = ckpt.read(lin.anchor).to(torch.float32)
        if _ZERO_POINT in lin.parts:
            zp = ckpt.read(lin.parts[_ZERO_POINT]).to(torch.float32).reshape(s.shape)
            w = w - _expand_scale(lin, zp)
        return w * _expand_scale(lin, s)
    finally:
        for nm in lin.parts.values():
            ckpt.release(nm)


def _expand_scale(lin: CtLinear, s):
    """The scale broadcast to the weight's [n, k] (tensor and channel scales by broadcasting)."""
    n, k = lin.shape
    rows, cols = scale_granularity(lin, tuple(s.shape))
    if math.prod(s.shape) == 1:
        return s.reshape(1, 1)
    if s.dim() == 1:  # a channel scale stored [n]
        return s.reshape(n, 1)
    if s.dim() == 4:  # FP8_PB_WO's [out_blk, 1, in_blk, 1], squeezed as vLLM does
        s = s.reshape(s.shape[0], s.shape[2])
    return s.repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]
