"""Quantized weight layouts as data: one entry per on-disk form of a kernel format.

A scheme (`cvt.quant.tensor.schemes`) produces a `QuantizedTensor` of canonical parts for a runtime
kernel format (``kernel_fmt``: w8a8_dynamic, w8a8_static, w4a16, w4a8_dynamic, nvfp4, mxfp4). A
`Layout` says how those parts sit on disk for one output format and the serving stacks that load it:
the tensors (suffix, dtype, and per dim which logical axis it follows and in what unit), the
Ascend type tag, which modules the stack accepts it for, and the encode / decode between
canonical parts and disk. The formats, the quantize stage, `cvt plan`, `cvt shard` and the
loader all read these entries; adding a layout is one entry here.

The entries, their tensors and the consumers' code each follows are tabled in docs/formats.md
("Quantized layouts"); `tests/quant/test_layouts.py` holds that table to the registry.

Dims: per on-disk dim, ``("n", u)`` / ``("k", u)`` -- that dim runs along the weight's output /
input features, one on-disk element per ``u`` logical elements (``u`` may be ``"G"``, the
group size, per channel k; or ``"K/16"``, a sixteenth of k: W4A8's row ``scale_bias``) -- or
a fixed size (an int). `cvt shard` splits a tensor along the dim that follows the module's TP
axis (a tensor without one is whole on every holder); `cvt plan` counts bytes and the units a
split must keep whole from the same data. A layout whose ``parallel`` is "column" / "row" holds
only the modules of that role (`scale_bias_role`, from the module name); `select` picks by it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from cvt.lazy import torch

from cvt.errors import FormatError, ShapeError
from cvt.quant.tensor import primitives as P
from cvt.quant.tensor import kernel_formats as KF
from cvt.quant.tensor.schemes import FP4, W4A8, W4A16, W8A8
from cvt.quant.tensor.schemes.base import SCHEMES, QuantizedTensor
from cvt.registry import Registry

# The output formats (implemented by `cvt.quant.tensor.formats`) and their serving targets are
# named here, once: the layout entries below are keyed by them. A format's first target is its default.
ASCEND, COMPRESSED_TENSORS = "ascend", "compressed-tensors"
VLLM_ASCEND, MINDIE = "vllm-ascend", "mindie"
ASCEND_TARGETS = (VLLM_ASCEND, MINDIE)
DEFAULT_TARGET = VLLM_ASCEND
CT_TARGET = "vllm"  # compressed-tensors: vLLM and transformers
FORMAT_TARGETS = {ASCEND: ASCEND_TARGETS, COMPRESSED_TENSORS: (CT_TARGET,)}
CONFIG_KEY_TARGETS = (MINDIE,)  # read their quantization keys from config.json (MindIE's atb_llm)
# target -> the serving stacks that load its outputs (the docs' support matrix, `cvt.support`)
STACKS = {VLLM_ASCEND: "vllm-ascend", MINDIE: "MindIE", CT_TARGET: "vLLM, transformers"}


@dataclass(frozen=True)
class DiskTensor:
    suffix: str
    dtype: str                # safetensors dtype code as written
    dims: tuple               # per dim: ("n" | "k", unit) or a fixed int; unit an int or "G"
    optional: bool = False    # written only for some tensors (asymmetric zero points, ...)

    def shape(self, n: int, k: int, g: int) -> tuple[int, ...]:
        out = []
        for d in self.dims:
            if isinstance(d, int):
                out.append(d)
                continue
            axis, unit = d
            u = _unit(unit, g, k)
            out.append(-(-(n if axis == "n" else k) // u))
        return tuple(out)

    def multiple(self, axis: str, g: int, k: int) -> tuple[int, str] | None:
        """(the multiple the logical `axis` size must be, the rule in words) for this tensor to be
        written, or None: a unit packs that many elements; ``K/16`` sums k in 16 runs, so k must be
        a multiple of 16 (not of k/16, the split unit `along` gives)."""
        for d in self.dims:
            if not isinstance(d, int) and d[0] == axis:
                if d[1] == K16:
                    return 16, f"sums {'out' if axis == 'n' else 'in'}_features in 16 runs"
                u = _unit(d[1], g, k)
                return u, f"packs {u} along {'out' if axis == 'n' else 'in'}_features"
        return None

    def along(self, axis: str, g: int, k: int) -> tuple[int, int] | None:
        """(on-disk dim, logical unit) of the dim that follows `axis` ("n" / "k"), or None."""
        for i, d in enumerate(self.dims):
            if not isinstance(d, int) and d[0] == axis:
                return i, _unit(d[1], g, k)
        return None


K16 = "K/16"  # a dim unit: one on-disk element per k/16 logical ones, i.e. 16 elements along k


def _unit(unit, g: int, k: int) -> int:
    if unit == "G":
        return g or k
    if unit == K16:
        return max(k // 16, 1)
    return unit


@dataclass(frozen=True)
class Layout:
    name: str
    kernel_fmt: str
    format: str
    targets: tuple[str, ...]
    tag: str | None
    tensors: tuple[DiskTensor, ...]
    encode: Callable[[QuantizedTensor], dict[str, torch.Tensor]] = field(repr=False)
    decode: Callable[[str, dict[str, torch.Tensor]], QuantizedTensor] = field(repr=False)
    experts_only: bool = False      # the stack loads this layout for routed experts only
    grouping: str = "any"           # "any" | "grouped" | "channel": which group sizes this entry holds
    groups: tuple[int, ...] = ()    # the group sizes the stack accepts (empty: any)
    parallel: str = "any"           # "any" | "column" | "row": the modules it holds (`scale_bias_role`)
    pack: str | None = None         # how the fused RTN kernel (`cvt.quant.qkernel`) packs it; None: not fused
    expert_k: int = 0               # routed experts' in_features must be a multiple of this (0: any; MX: 64)
    device: str = ""                # the only hardware whose kernels run it ("": every device of the target)

    def holds(self, group_size: int, k: int) -> bool:
        # a group of k is one group, not per channel: the stacks read one global group_size, and a
        # linear whose k equals it must be in the grouped layout (vllm-ascend methods/w4a16.py:
        # weight_scale [n, k // group_size] with group_size from the description)
        per_channel = group_size == 0
        if self.groups and not per_channel and group_size not in self.groups:
            return False
        return self.grouping == "any" or (self.grouping == "channel") == per_channel

    def shapes(self, n: int, k: int, group_size: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """{suffix: (shape, dtype code)} of a linear [n, k] (optional tensors left out)."""
        g = 0 if group_size in (0, k) else group_size
        return {t.suffix: (t.shape(n, k, g), t.dtype) for t in self.tensors if not t.optional}

    def split_units(self, axis: str, group_size: int, k: int, *, expert: bool = False) -> int:
        """The logical unit a TP split along `axis` must keep whole (lcm over the tensors; a routed
        expert's in_features also `expert_k`, which every rank's part must be a multiple of)."""
        g = 0 if group_size in (0, k) else group_size
        unit = self.expert_k if expert and axis == "k" and self.expert_k else 1
        for t in self.tensors:
            a = t.along(axis, g, k)
            if a is not None:
                unit = math.lcm(unit, a[1])
        return unit

    def tensor(self, suffix: str) -> DiskTensor | None:
        return next((t for t in self.tensors if t.suffix == suffix), None)

    def tags(self, module: str, suffixes) -> dict[str, str]:
        return {f"{module}.{s}": self.tag for s in suffixes}


LAYOUTS: Registry[Layout] = Registry("quantized layout", FormatError)


def register(layout: Layout) -> Layout:
    return LAYOUTS.add(layout.name, layout)


def _expect(name: str, t: torch.Tensor, dtypes, shape=None) -> torch.Tensor:
    """`t` after checking its dtype (one of `dtypes`: torch dtypes or their names) and shape."""
    names = [str(d).replace("torch.", "") for d in dtypes]
    have = str(t.dtype).replace("torch.", "")
    if have not in names or (shape is not None and tuple(t.shape) != tuple(shape)):
        want = " or ".join(names)
        raise FormatError(f"tensor {name!r} is {have} {list(t.shape)}: expected "
                          f"{want}" + (f" {list(shape)}" if shape is not None else ""))
    return t


def _take(module: str, disk: dict, suffixes) -> dict[str, torch.Tensor]:
    missing = [f"{module}.{s}" for s in suffixes if s not in disk]
    if missing:
        raise FormatError(f"module {module!r} lacks tensor(s) {missing}")
    return {s: disk[s] for s in suffixes}


FLOATS = ("float32", "bfloat16", "float16")  # names: torch is imported on first use (`cvt.lazy`)
N, K, G = ("n", 1), ("k", 1), ("k", "G")


# ---- W8A8 ------------------------------------------------------------------------------------------
def _enc_w8a8_dynamic(q):
    n = q.shape[0]
    return {"weight": q.parts["weight"], "weight_scale": q.parts["weight_scale"].float().reshape(n, 1),
            "weight_offset": q.parts["weight_offset"].float().reshape(n, 1)}


def _dec_w8a8_dynamic(module, d):
    t = _take(module, d, ("weight", "weight_scale", "weight_offset"))
    n, k = _expect(f"{module}.weight", t["weight"], (torch.int8,)).shape
    sc = _expect(f"{module}.weight_scale", t["weight_scale"], FLOATS).float().reshape(n, 1)
    off = _expect(f"{module}.weight_offset", t["weight_offset"], FLOATS).float().reshape(n, 1)
    return QuantizedTensor(W8A8.name, KF.W8A8_DYNAMIC, (n, k), {"weight": t["weight"], "weight_scale": sc,
                                                            "weight_offset": off})


def _enc_w8a8_static(q):
    p, n = q.parts, q.shape[0]
    ws = q.extra.get("weight_scale")
    if ws is None:
        raise FormatError("static W8A8 needs its weight scale to write weight_scale (vllm-ascend's MLA fused "
                          "paths read it): quantize through cvt.quant.tensor.schemes.static_parts")
    ws = ws.float().reshape(n, 1)
    return {"weight": p["weight"], "input_scale": p["input_scale"].float().reshape(1),
            "input_offset": p["input_offset"].float().reshape(1), "deq_scale": p["deq_scale"],
            "quant_bias": p["quant_bias"], "weight_scale": ws, "weight_offset": torch.zeros_like(ws)}


def _dec_w8a8_static(module, d):
    t = _take(module, d, ("weight", "input_scale", "input_offset", "deq_scale", "quant_bias"))
    n, k = _expect(f"{module}.weight", t["weight"], (torch.int8,)).shape
    _expect(f"{module}.deq_scale", t["deq_scale"], (torch.float32, torch.int64), (n,))
    _expect(f"{module}.quant_bias", t["quant_bias"], (torch.int32,), (n,))
    parts = {"weight": t["weight"], "input_scale": t["input_scale"].float().reshape(1),
             "input_offset": t["input_offset"].float().reshape(1), "deq_scale": t["deq_scale"],
             "quant_bias": t["quant_bias"]}
    extra = {"weight_scale": d["weight_scale"].float().reshape(n, 1)} if "weight_scale" in d else {}
    return QuantizedTensor(W8A8.name, KF.W8A8_STATIC, (n, k), parts, 0, True, extra)


register(Layout("ascend-w8a8-dynamic", KF.W8A8_DYNAMIC, ASCEND, ASCEND_TARGETS, "W8A8_DYNAMIC",
                (DiskTensor("weight", "I8", (N, K)), DiskTensor("weight_scale", "F32", (N, 1)),
                 DiskTensor("weight_offset", "F32", (N, 1))), _enc_w8a8_dynamic, _dec_w8a8_dynamic,
                pack="i8"))
register(Layout("ascend-w8a8-static", KF.W8A8_STATIC, ASCEND, ASCEND_TARGETS, "W8A8",
                (DiskTensor("weight", "I8", (N, K)), DiskTensor("input_scale", "F32", (1,)),
                 DiskTensor("input_offset", "F32", (1,)), DiskTensor("deq_scale", "F32", (N,)),
                 DiskTensor("quant_bias", "I32", (N,)),
                 # cvt writes these (vllm-ascend's MLA fused paths read weight_scale); msModelSlim 26.1's
                 # ascendv1_saver does not (static W8A8 linears: weight, input_scale, input_offset,
                 # deq_scale, quant_bias), and the static kernel needs neither: optional on reading
                 DiskTensor("weight_scale", "F32", (N, 1), optional=True),
                 DiskTensor("weight_offset", "F32", (N, 1), optional=True)), _enc_w8a8_static, _dec_w8a8_static))


def _enc_ct_int8(q):
    p, n = q.parts, q.shape[0]
    if bool((p["weight_offset"] != 0).any()):
        raise FormatError("int-quantized W8A8 is symmetric: non-zero weight offsets")
    return {"weight": p["weight"], "weight_scale": p["weight_scale"].float().reshape(n, 1)}


def _dec_ct_int8(module, d):
    t = _take(module, d, ("weight", "weight_scale"))
    n, k = _expect(f"{module}.weight", t["weight"], (torch.int8,)).shape
    sc = _expect(f"{module}.weight_scale", t["weight_scale"], FLOATS)
    if sc.numel() != n:
        raise FormatError(f"{module}.weight_scale {list(sc.shape)}: expected [{n}, 1] (channel)")
    if "weight_zero_point" in d:
        raise FormatError(f"{module} is asymmetric int8; cvt's W8A8 is symmetric")
    sc = sc.float().reshape(n, 1)
    return QuantizedTensor(W8A8.name, KF.W8A8_DYNAMIC, (n, k), {"weight": t["weight"], "weight_scale": sc,
                                                            "weight_offset": torch.zeros_like(sc)})


register(Layout("ct-int8", KF.W8A8_DYNAMIC, COMPRESSED_TENSORS, (CT_TARGET,), None,
                (DiskTensor("weight", "I8", (N, K)), DiskTensor("weight_scale", "F32", (N, 1))),
                _enc_ct_int8, _dec_ct_int8, pack="i8"))


# ---- W4A16 -----------------------------------------------------------------------------------------
def _w4a16(q_int4, sc, off, sym=None):
    n, k = q_int4.shape
    if sc.dim() != 2 or sc.shape[0] != n or k % sc.shape[1]:
        raise FormatError(f"weight_scale {list(sc.shape)} does not fit the weight [{n}, {k}] (expected [{n}, k/G])")
    g = 0 if sc.shape[1] == 1 else k // sc.shape[1]
    return QuantizedTensor(W4A16.name, KF.W4A16, (n, k), {"weight_int4": q_int4, "weight_scale": sc,
                                                      "weight_offset": off},
                           g, bool((off == 0).all()) if sym is None else sym)


def _ascend_int8_encoder(dim: int):
    def enc(q):
        if q.shape[dim] % 2:
            raise FormatError(f"cannot pack {list(q.shape)} along dim {dim} "
                              f"({'pairs of output channels' if dim == 0 else 'in_features'} must be even)")
        return {"weight": P.pack_int4_ascend(q.parts["weight_int4"], dim),
                "weight_scale": q.parts["weight_scale"].float(), "weight_offset": q.parts["weight_offset"].float()}
    return enc


def _dec_ascend_int8(module, d):
    t = _take(module, d, ("weight", "weight_scale", "weight_offset"))
    _expect(f"{module}.weight", t["weight"], (torch.int8,))
    sc = t["weight_scale"].float()
    if sc.dim() != 2:
        raise FormatError(f"{module}.weight_scale is {list(sc.shape)}: expected 2-D [n, k/G]")
    off = _expect(f"{module}.weight_offset", t["weight_offset"].float(), (torch.float32,), tuple(sc.shape))
    # the pack dim by rows: TP shards may hold one group per row
    return _w4a16(P.unpack_int4_ascend(t["weight"], P.ascend_pack_dim(sc, t["weight"])), sc, off)


register(Layout("ascend-w4a16-int8-grouped", KF.W4A16, ASCEND, (MINDIE,), "W4A16",
                (DiskTensor("weight", "I8", (("n", 2), K)), DiskTensor("weight_scale", "F32", (N, G)),
                 DiskTensor("weight_offset", "F32", (N, G))), _ascend_int8_encoder(0), _dec_ascend_int8,
                grouping="grouped", groups=(64, 128, 256), pack="nib_rows"))  # MindIE models/base/config.py: group_size check
register(Layout("ascend-w4a16-int8-channel", KF.W4A16, ASCEND, (MINDIE,), "W4A16",
                (DiskTensor("weight", "I8", (N, ("k", 2))), DiskTensor("weight_scale", "F32", (N, 1)),
                 DiskTensor("weight_offset", "F32", (N, 1))), _ascend_int8_encoder(1), _dec_ascend_int8,
                grouping="channel", pack="nib_k"))


def _check_bf16(sc: torch.Tensor) -> torch.Tensor:
    if not torch.equal(P.round_to_bf16(sc), sc):
        raise FormatError("weight_scale is not bfloat16-representable; the int32 pack-quantized layout stores "
                          "bf16 scales (quantize with cvt's w4a16 scheme)")
    return sc.to(torch.bfloat16)


def _enc_int32(q, zero_point: bool):
    p, (n, k) = q.parts, q.shape
    out = {"weight_packed": P.pack_int4_ct(p["weight_int4"], 1), "weight_scale": _check_bf16(p["weight_scale"].float()),
           "weight_shape": torch.tensor([n, k], dtype=torch.int32)}
    if not q.symmetric:
        if not zero_point:
            raise FormatError("vllm-ascend's W4A16 MoE method loads no zero points (weight_offset is zeros): "
                              "quantize symmetric (drop --asym)")
        out["weight_zero_point"] = P.pack_int4_ct(p["weight_offset"].to(torch.int8), 0)
    elif bool((p["weight_offset"] != 0).any()):
        raise FormatError("marked symmetric but has non-zero offsets")
    return out


def _dec_int32(module, d):
    t = _take(module, d, ("weight_packed", "weight_scale", "weight_shape"))
    shape = t["weight_shape"].reshape(-1).tolist()
    if len(shape) != 2:
        raise FormatError(f"{module}.weight_shape is {shape}: expected [n, k]")
    n, k = (int(v) for v in shape)
    _expect(f"{module}.weight_packed", t["weight_packed"], (torch.int32,), (n, math.ceil(k / 8)))
    sc = t["weight_scale"].float()
    sym = "weight_zero_point" not in d
    off = torch.zeros_like(sc) if sym else P.unpack_int4_ct(d["weight_zero_point"], n, 0).float()
    if tuple(off.shape) != tuple(sc.shape):
        raise FormatError(f"{module}.weight_zero_point unpacks to {list(off.shape)}, expected {list(sc.shape)}")
    return _w4a16(P.unpack_int4_ct(t["weight_packed"], k, 1), sc, off, sym)


_INT32 = (DiskTensor("weight_packed", "I32", (N, ("k", 8))), DiskTensor("weight_scale", "BF16", (N, G)),
          DiskTensor("weight_shape", "I32", (2,)))
register(Layout("ascend-w4a16-int32", KF.W4A16, ASCEND, (VLLM_ASCEND,), "W4A16", _INT32,
                lambda q: _enc_int32(q, zero_point=False), _dec_int32, experts_only=True, grouping="grouped",
                pack="ct32"))
register(Layout("ct-int4", KF.W4A16, COMPRESSED_TENSORS, (CT_TARGET,), None,
                _INT32 + (DiskTensor("weight_zero_point", "I32", (("n", 8), G), optional=True),),
                lambda q: _enc_int32(q, zero_point=True), _dec_int32, pack="ct32"))


# ---- FP4 ---------------------------------------------------------------------------------------------
def _enc_fp4(packed_name: str):
    def enc(q):
        out = {packed_name: P.pack_fp4(q.parts["weight_fp4"])}
        if q.kernel_fmt == KF.NVFP4:
            out["weight_scale"] = q.parts["weight_scale"]
            out["weight_global_scale"] = q.parts["weight_global_scale"].float().reshape(1)
        else:
            out["weight_scale"] = q.parts["weight_scale"].view(torch.uint8)
        return out
    return enc


def _dec_fp4(packed_name: str):
    def dec(module, d):
        packed = _expect(f"{module}.{packed_name}", _take(module, d, (packed_name,))[packed_name], (torch.uint8,))
        codes = P.unpack_fp4(packed)
        n, k = codes.shape
        if "weight_global_scale" in d:
            t = _take(module, d, ("weight_scale", "weight_global_scale"))
            sc = _expect(f"{module}.weight_scale", t["weight_scale"], (torch.float8_e4m3fn,), (n, k // 16))
            parts = {"weight_fp4": codes, "weight_scale": sc,
                     "weight_global_scale": t["weight_global_scale"].float().reshape(1)}
            return QuantizedTensor(FP4.name, KF.NVFP4, (n, k), parts, 16, True, {"fp4_format": KF.NVFP4})
        sc = _expect(f"{module}.weight_scale", _take(module, d, ("weight_scale",))["weight_scale"],
                     (torch.uint8, torch.float8_e8m0fnu), (n, k // 32))
        return QuantizedTensor(FP4.name, KF.MXFP4, (n, k), {"weight_fp4": codes, "weight_scale": sc.view(torch.uint8)},
                               32, True, {"fp4_format": KF.MXFP4})
    return dec


register(Layout("ct-nvfp4", KF.NVFP4, COMPRESSED_TENSORS, (CT_TARGET,), None,
                (DiskTensor("weight_packed", "U8", (N, ("k", 2))), DiskTensor("weight_scale", "F8_E4M3", (N, ("k", 16))),
                 DiskTensor("weight_global_scale", "F32", (1,))), _enc_fp4("weight_packed"), _dec_fp4("weight_packed"),
                pack="e2m1"))
register(Layout("ct-mxfp4", KF.MXFP4, COMPRESSED_TENSORS, (CT_TARGET,), None,
                (DiskTensor("weight_packed", "U8", (N, ("k", 2))), DiskTensor("weight_scale", "U8", (N, ("k", 32)))),
                _enc_fp4("weight_packed"), _dec_fp4("weight_packed"), pack="e2m1"))
register(Layout("ascend-mxfp4", KF.MXFP4, ASCEND, (VLLM_ASCEND,), "W4A16_MXFP4",
                (DiskTensor("weight", "U8", (N, ("k", 2))), DiskTensor("weight_scale", "U8", (N, ("k", 32)))),
                _enc_fp4("weight"), _dec_fp4("weight"), experts_only=True, pack="e2m1"))


# ---- W4A8_DYNAMIC ------------------------------------------------------------------------------------
# msModelSlim 26.1 save/utils/pack.py process_scale: which modules' scale_bias is summed whole along k
# ([n, 1]) and which in 16 runs of k/16 ([n, 16], so that each of up to 16 TP ranks splitting k gets
# the sum over its own slice). vllm-ascend agrees: w13 (gate / up) [E, 2I, 1], w2 (down) [E, H, 16 //
# tp] (methods/w4a8.py get_dynamic_quant_param_modelslim); linears: RowParallelLinear -> 16.
SCALE_BIAS_COLUMN = ("up_proj", "gate_proj", "q_proj", "k_proj", "v_proj", "w1", "w3")
SCALE_BIAS_ROW = ("down_proj", "o_proj", "w2")
SCALE_BIAS_RUNS = 16


def scale_bias_role(module: str) -> str:
    """"column" ([n, 1] scale_bias) or "row" ([n, 16]) for a W4A8_DYNAMIC module, by msModelSlim's
    name rule (`SCALE_BIAS_COLUMN` first, then `SCALE_BIAS_ROW`, on the module's own name); FormatError
    for a name in neither list (msModelSlim would write the unsummed [n, k] product there)."""
    own = module.rsplit(".", 1)[-1]
    if any(s in own for s in SCALE_BIAS_COLUMN):
        return "column"
    if any(s in own for s in SCALE_BIAS_ROW):
        return "row"
    raise FormatError(f"{module}: W4A8_DYNAMIC's scale_bias is [n, 1] for {', '.join(SCALE_BIAS_COLUMN)} and "
                      f"[n, {SCALE_BIAS_RUNS}] for {', '.join(SCALE_BIAS_ROW)} (msModelSlim's process_scale, by the "
                      f"module name); {own!r} is neither, so its scale_bias shape is unknown")


def _w4a8_encoder(runs: int):
    def enc(q):
        p, (n, k) = q.parts, q.shape
        if n % 8:
            raise ShapeError(f"W4A8_DYNAMIC packs two int4 per byte along out_features and vllm-ascend views the "
                              f"[k, n/2] bytes as int32 (methods/w4a8.py pack_to_int32): out_features must be a "
                              f"multiple of 8, got {n}")
        if k % runs:
            raise ShapeError(f"W4A8_DYNAMIC row-parallel scale_bias sums in_features in {runs} runs: in_features "
                              f"must be a multiple of {runs}, got {k}")
        qi, sc = p["weight_int4"], p["weight_scale"].to(torch.float32).reshape(n, 1)
        # ascendv1.py on_w4a8_dynamic: deq_weight = weight.float().T * weight_scale; process_scale(name,
        # deq_weight.T, 16) -- summed, then times 8 (the order and views are msModelSlim's)
        deq = (qi.to(torch.float32).T * sc.reshape(n)).T
        if runs == 1:
            sb = 8 * deq.sum(dim=1, keepdim=True)
        else:
            sb = (8 * deq.reshape(-1, k // runs).sum(dim=1, keepdim=True)).reshape(n, -1)
        return {"weight": P.pack_int4_ascend(qi, 0), "weight_scale": sc, "weight_offset": torch.zeros_like(sc),
                "scale_bias": sb.to(torch.float32)}
    return enc


def _dec_w4a8(module, d):
    if "weight_scale_second" in d or "weight_offset_second" in d:
        raise FormatError(f"{module}: per-group W4A8_DYNAMIC (weight_scale_second / weight_offset_second, "
                          "msModelSlim's older two-level form) is not supported; cvt reads the per-channel form")
    t = _take(module, d, ("weight", "weight_scale", "weight_offset", "scale_bias"))
    packed = _expect(f"{module}.weight", t["weight"], (torch.int8,))
    if packed.dim() != 2:
        raise FormatError(f"{module}.weight is {list(packed.shape)}: expected 2-D [n/2, k]")
    n, k = 2 * packed.shape[0], packed.shape[1]
    sc = _expect(f"{module}.weight_scale", t["weight_scale"], FLOATS)
    if sc.numel() != n or sc.dim() > 2:
        raise FormatError(f"{module}.weight_scale is {list(sc.shape)}: expected [{n}, 1] (per channel; the weight "
                          f"[{n // 2}, {k}] packs two output channels per byte)")
    off = _expect(f"{module}.weight_offset", t["weight_offset"], FLOATS)
    if off.numel() != n or bool((off != 0).any()):
        raise FormatError(f"{module}.weight_offset must be {n} zeros (W4A8_DYNAMIC is symmetric)")
    sb = _expect(f"{module}.scale_bias", t["scale_bias"], (torch.float32,))
    if sb.dim() != 2 or sb.shape[0] != n or SCALE_BIAS_RUNS % sb.shape[1]:
        raise FormatError(f"{module}.scale_bias is {list(sb.shape)}: expected [{n}, 1] or [{n}, "
                          f"{SCALE_BIAS_RUNS} / tp]")
    parts = {"weight_int4": P.unpack_int4_ascend(packed, 0), "weight_scale": sc.to(torch.float32).reshape(n, 1)}
    return QuantizedTensor(W4A8.name, KF.W4A8_DYNAMIC, (n, k), parts)


def _w4a8_tensors(scale_bias: tuple) -> tuple[DiskTensor, ...]:
    return (DiskTensor("weight", "I8", (("n", 2), K)), DiskTensor("weight_scale", "F32", (N, 1)),
            DiskTensor("weight_offset", "F32", (N, 1)), DiskTensor("scale_bias", "F32", scale_bias))


# vllm-ascend's linear method for W4A8_DYNAMIC divides by the description's group_size (0 here:
# ZeroDivisionError) and runs it as weight-only W4A16 anyway: loaded for MoE experts only
register(Layout("ascend-w4a8-dynamic", KF.W4A8_DYNAMIC, ASCEND, (VLLM_ASCEND,), "W4A8_DYNAMIC",
                _w4a8_tensors((N, 1)), _w4a8_encoder(1), _dec_w4a8, experts_only=True, grouping="channel",
                parallel="column"))
register(Layout("ascend-w4a8-dynamic-row", KF.W4A8_DYNAMIC, ASCEND, (VLLM_ASCEND,), "W4A8_DYNAMIC",
                _w4a8_tensors((N, ("k", K16))), _w4a8_encoder(SCALE_BIAS_RUNS), _dec_w4a8, experts_only=True,
                grouping="channel", parallel="row"))


# ---- selection -------------------------------------------------------------------------------------
def kernel_fmt_of(scheme, static: bool = False) -> str:
    """The kernel format a scheme (instance, or a registered name) quantizes to (static: W8A8
    static activations); each scheme says (`Scheme.kernel_fmt`)."""
    return _instance(scheme).kernel_fmt(static)


def _instance(scheme):
    return SCHEMES.get(scheme)() if isinstance(scheme, str) else scheme


def fuses(layout: Layout, scheme, shape: tuple[int, int]) -> bool:
    """Whether the fused RTN kernels (`cvt.quant.qkernel`) write `layout` for a ``[n, k]`` weight
    of `scheme`, whatever its source dtype: the cases where the reference's encoder raises (and
    the stage then reports that) are not fused."""
    n, k = shape
    if layout.pack is None or n == 0 or k == 0 or layout.kernel_fmt != kernel_fmt_of(scheme):
        return False
    if not scheme.symmetric and not any(t.suffix in ("weight_offset", "weight_zero_point") for t in layout.tensors):
        return False  # no tensor holds zero points (vllm-ascend's int32 W4A16): the reference raises
    return not ((layout.pack == "nib_rows" and n % 2) or (layout.pack in ("nib_k", "e2m1") and k % 2))


def kernel_formats(scheme) -> set[str]:
    """Every kernel format a scheme can produce: a registered name's all, an instance's own
    (`Scheme.kernel_formats`: fp4 is one of nvfp4 / mxfp4 once built)."""
    return set(SCHEMES.get(scheme).kernel_formats) if isinstance(scheme, str) else set(scheme.produces())


def targets_for(fmt: str) -> tuple[str, ...]:
    if fmt not in FORMAT_TARGETS:
        raise FormatError(f"unknown output format {fmt!r} (known: {', '.join(sorted(FORMAT_TARGETS))})")
    return FORMAT_TARGETS[fmt]


def check_target(fmt: str, target: str | None) -> str:
    """The serving target of an output (default: vllm-ascend for ascend, vllm for c-t)."""
    valid = targets_for(fmt)
    if target is None:
        return valid[0]
    if target not in valid:
        raise FormatError(f"--target {target!r} does not apply to the {fmt} format (valid: {', '.join(valid)})")
    return target


def candidates(fmt: str, kernel_fmt: str, target: str) -> list[Layout]:
    return [lo for lo in LAYOUTS.values() if lo.format == fmt and lo.kernel_fmt == kernel_fmt and target in lo.targets]


def select(fmt: str, kernel_fmt: str, target: str, *, expert: bool, group_size: int, k: int,
           module: str = "") -> Layout:
    """The layout `target` loads for a linear of `kernel_fmt` (routed expert or not); FormatError
    saying why there is none (with what the stack does accept)."""
    where = f"{module}: " if module else ""
    found = candidates(fmt, kernel_fmt, target)
    if not found:
        other = sorted({t for lo in LAYOUTS.values() if lo.format == fmt and lo.kernel_fmt == kernel_fmt
                        for t in lo.targets})
        raise FormatError(f"{where}{fmt} for {target} has no layout for kernel format {kernel_fmt!r}"
                          + (f" (--target {' / '.join(other)} has one)" if other else ""))
    fit = [lo for lo in found if lo.holds(group_size, k)]
    if not fit:
        sizes = sorted({g for lo in found for g in lo.groups})
        raise FormatError(f"{where}{target} loads {kernel_fmt} only with "
                          + " or ".join(sorted({lo.grouping for lo in found})) + " scales"
                          + (f" (group sizes {', '.join(map(str, sizes))})" if sizes else "") + ", not "
                          + ("per channel" if group_size == 0 else f"group size {group_size}")
                          + (" (vllm-ascend divides by the description's group_size: 0 fails); use --group-size "
                             "32, 64 or 128" if target == VLLM_ASCEND else ""))
    lo = fit[0]
    if lo.experts_only and not expert:
        raise FormatError(f"{where}{target} loads {lo.tag or kernel_fmt} ({lo.name}) for MoE experts only (no "
                          "linear method loads it); keep this module float or give it another scheme in a recipe")
    if any(x.parallel != "any" for x in fit):  # e.g. W4A8_DYNAMIC: scale_bias by the module's role
        role = scale_bias_role(module)
        lo = next((x for x in fit if x.parallel in ("any", role)), None)
        if lo is None:
            raise FormatError(f"{where}{target} has no {kernel_fmt} layout for {role}-parallel modules")
    return lo


def experts_only_reason(fmt: str, kernel_fmt: str, target: str) -> str | None:
    """Why a non-expert linear stays float by default under this target (None: it need not):
    every layout the target has for `kernel_fmt` is loaded for MoE experts only."""
    found = candidates(fmt, kernel_fmt, target)
    if found and all(lo.experts_only for lo in found):
        return (f"{target} loads {found[0].tag} ({kernel_fmt}) for MoE experts only (no linear method loads "
                "it): kept float; a recipe can give it another scheme")
    return None


def read_layout(module: str, kernel_candidates, disk: dict[str, torch.Tensor]) -> Layout:
    """Among `kernel_candidates` (layouts of one tag), the one whose required tensors `disk`
    (suffix -> tensor) holds, preferring the most specific; int8 W4A16 by its scale shape."""
    fits = [lo for lo in kernel_candidates if all(t.suffix in disk for t in lo.tensors if not t.optional)]
    if not fits:
        need = sorted({t.suffix for lo in kernel_candidates for t in lo.tensors if not t.optional} - set(disk))
        raise FormatError(f"{module}: none of the layouts {[lo.name for lo in kernel_candidates]} matches its "
                          f"tensors {sorted(disk)} (missing {', '.join(need)})")
    return max(fits, key=lambda lo: len(lo.tensors))


from cvt.quant.tensor import layouts_mx  # noqa: E402,F401  (registers the Ascend 950 MX entries)

__all__ = ["ASCEND", "COMPRESSED_TENSORS", "ASCEND_TARGETS", "CONFIG_KEY_TARGETS", "DEFAULT_TARGET", "CT_TARGET", "FORMAT_TARGETS", "MINDIE", "STACKS", "VLLM_ASCEND", "DiskTensor", "Layout", "LAYOUTS", "register",
           "select", "candidates", "check_target", "targets_for", "read_layout", "kernel_fmt_of", "kernel_formats", "experts_only_reason",
           "scale_bias_role", "K16"]
