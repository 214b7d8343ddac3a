"""ONNX graph building blocks: a small graph builder and one emitter per runtime linear format.

The graphs are written with `onnx.helper` straight from the runtime model's modules, so every
op is chosen here (no tracing): float32 arithmetic throughout; float weights stored in the
export dtype (fp32 / fp16 / bf16) and cast to float32 where used.

Weights stream to an external data file as they are added (`Graph.weight`), so the graph
proto never holds them; `save_graph` inlines them again when the total is under the
threshold (protobuf's 2 GB limit), else keeps ``<graph>.onnx.data`` next to the graph.

Linear formats (``x [..., k] -> y [..., n]``; ``W`` is the runtime weight ``[n, k]``):

==============  ================  ===================================================================
runtime format  option            ONNX
==============  ================  ===================================================================
dense           -                 MatMul(x, Cast(W^T))  (+ bias)
w4a16           matmulnbits       com.microsoft.MatMulNBits(bits=4, block_size=B, accuracy_level):
                                  B = q + 8 packed two per byte along k (even element low nibble),
                                  scales [n, k/B]; zero point = offset + 8: absent when the offsets
                                  are 0 (the default 8), packed uint8 when integers, else float.
                                  B = the group size when it is a power of two 16..256, else the
                                  largest such divisor of it (per-channel: of k), scales repeated.
w4a16           qdq (opset 21)    MatMul(x, DequantizeLinear(int4 W^T [k, n], scale [k/G, n],
                                  int4 zero point = offset, axis=0, block_size=G))
w8a8_dynamic    integer           per-token symmetric int8: s = max|x| / 127, q = Cast<int8>(
                                  Clip(Round(x * (127 / max|x|)))) (the runtime's and the serving
                                  kernels' rounding); Cast<float>(MatMulInteger(q, W^T)) * w_scale * s
w8a8_dynamic    qdq               Quantize/DequantizeLinear per row with scale s (QuantizeLinear
                                  divides: one int8 step off the integer path at a tie), times
                                  DequantizeLinear(W^T, w_scale, axis=1)
w4a8_dynamic    integer / qdq     as w8a8_dynamic, the int4 weight values (-8..7) stored as int8:
                                  the runtime's per-token int8 activation step, exact
w8a8_static     integer           q = Cast<int8>(Clip(Round(x / s_in + off))); (MatMulInteger(q, W^T)
                                  + quant_bias) * deq_scale
w8a8_static     qdq               DequantizeLinear(q, s_in, off) @ DQ(W^T, deq / s_in) + (quant_bias +
                                  off * sum_k W) * deq_scale, with the integer path's q (see below)
fp8 / fp4       -                 dequantized (exact values, float32 storage) and exported dense
==============  ================  ===================================================================

Rounding is half to even on both sides (ONNX Round, torch.round), so the integer paths are the
runtime's integers exactly; only float32 summation order differs.

The static activation quantizer is the runtime's arithmetic, written out, in both paths:
``round(x / s_in + off)``. QuantizeLinear would compute ``round(x / s_in) + off``, which differs
on .5 ties when the offset is odd; and onnxruntime fuses a QuantizeLinear with constant scale
into DQ -> MatMul as a uint8 x int8 MatMulIntegerToFloat, whose AVX2 kernel (x86 without VNNI)
saturates its int16 pair sums: seen 20% off. The dynamic Q/DQ path keeps QuantizeLinear: zero
point 0 (no tie issue), and its per-row scale is computed in the graph, which onnxruntime does
not fuse.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from cvt.qtensor import kernel_formats as KF
from cvt.errors import CvtError

MS_DOMAIN = "com.microsoft"
MIN_OPSET = 13
QDQ_INT4_OPSET = 21
EXTERNAL_THRESHOLD = 2 * 1024**3 - 128 * 1024**2  # protobuf caps a serialized model at 2 GiB
_INLINE_MAX = 1024  # tensors smaller than this stay in the graph even when weights are external

ONNX_DTYPES = {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
F = TensorProto.FLOAT


def _raw(t: torch.Tensor) -> tuple[int, bytes]:
    """(onnx element type, little-endian raw bytes) of a CPU tensor."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return TensorProto.BFLOAT16, t.view(torch.int16).numpy().tobytes()
    kinds = {torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16, torch.int64: TensorProto.INT64,
             torch.int32: TensorProto.INT32, torch.int8: TensorProto.INT8, torch.uint8: TensorProto.UINT8,
             torch.bool: TensorProto.BOOL}
    if t.dtype not in kinds:
        raise CvtError(f"cannot store a {t.dtype} tensor in ONNX")
    return kinds[t.dtype], t.numpy().tobytes()


def pack_int4(q: torch.Tensor) -> bytes:
    """int4 values (int8 tensor, -8..7 or 0..15) -> ONNX int4/uint4 raw bytes: element 2j in the
    low nibble of byte j, 2j+1 in the high nibble (row-major, an odd count pads with 0)."""
    v = (q.reshape(-1).to(torch.int16) & 0xF).to(torch.uint8)
    if v.numel() % 2:
        v = torch.cat([v, v.new_zeros(1)])
    return (v[0::2] | (v[1::2] << 4)).numpy().tobytes()


@dataclass
class Graph:
    """Nodes, initializers and I/O of one ONNX graph under construction.

    `data_path`: weights of at least `_INLINE_MAX` bytes are appended to this file as they are
    added (their TensorProto only records the offset), so memory holds one weight at a time.
    """

    opset: int
    weight_dtype: str = "fp32"
    data_path: Path | None = None
    nodes: list = field(default_factory=list)
    inits: list = field(default_factory=list)
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    weight_bytes: int = 0
    _used: dict = field(default_factory=dict)
    _consts: dict = field(default_factory=dict)
    _data: object = None
    _root: "Graph | None" = None  # a subgraph (If branch): names, constants and the data file are the root's
    _domains: set = field(default_factory=set)
    progress: object = None  # a tqdm bar (bytes of weights written), or None

    # -- names, nodes, constants ---------------------------------------------------------
    def name(self, hint: str) -> str:
        if self._root is not None:
            return self._root.name(hint)
        n = self._used.get(hint, 0)
        self._used[hint] = n + 1
        return hint if n == 0 else f"{hint}_{n}"

    def op(self, op_type: str, inputs, hint: str | None = None, n_out: int = 1, domain: str = "", **attrs):
        outs = [self.name(f"{hint or op_type}" + (f"_o{i}" if n_out > 1 else "")) for i in range(n_out)]
        if domain:
            (self._root or self)._domains.add(domain)
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=self.name("n_" + (hint or op_type)),
                                           domain=domain or None, **attrs))
        return outs[0] if n_out == 1 else outs

    def tensor(self, name: str, kind: int, dims, raw: bytes) -> str:
        """An initializer of this graph (a subgraph's own: onnxruntime's Q/DQ fusions look for
        weights in the graph of the node); its bytes go to the root's data file."""
        self.inits.append((self._root or self)._proto(name, kind, dims, raw))
        return name

    def _proto(self, name: str, kind: int, dims, raw: bytes) -> TensorProto:
        t = TensorProto()
        t.name, t.data_type = name, kind
        t.dims.extend(int(d) for d in dims)
        if self.data_path is not None and len(raw) >= _INLINE_MAX:
            if self._data is None:
                self._data = open(self.data_path, "wb")
            f = self._data
            offset = f.tell()
            pad = (-offset) % 64  # aligned for mmap
            f.write(b"\0" * pad)
            f.write(raw)
            t.data_location = TensorProto.EXTERNAL
            for k, v in (("location", self.data_path.name), ("offset", str(offset + pad)), ("length", str(len(raw)))):
                e = t.external_data.add()
                e.key, e.value = k, v
        else:
            t.raw_data = raw
        self.weight_bytes += len(raw)
        if self.progress is not None:
            self.progress.update(len(raw))
        return t

    def weight(self, t: torch.Tensor, hint: str, dtype: str | None = None, cast: bool = True) -> str:
        """An initializer from a torch tensor; floats are stored as `dtype` (default the graph's
        weight dtype) and returned as float32 (a Cast when stored narrower, unless `cast` is
        False: then the stored tensor itself)."""
        if t.is_floating_point():
            bad = int((~torch.isfinite(t)).sum())  # a NaN / Inf weight is never written (`cvt.convert.finite`)
            if bad:
                from cvt.convert.finite import nonfinite_error

                raise nonfinite_error(hint, bad, t.numel(), "export onnx")
            store = TORCH_DTYPES[dtype or self.weight_dtype]
            if store == torch.float16 and t.numel() and float(t.abs().max()) > 65504:
                raise CvtError(f"{hint}: holds {float(t.abs().max()):.4g}, beyond float16's range (65504); "
                               "export with --dtype bf16 or fp32")
            kind, raw = _raw(t.to(store))
            name = self.tensor(self.name(hint), kind, t.shape, raw)
            return name if kind == F or not cast else self.op("Cast", [name], hint + ".f32", to=F)
        kind, raw = _raw(t)
        return self.tensor(self.name(hint), kind, t.shape, raw)

    def const(self, value, dtype=np.int64) -> str:
        """A small constant (shapes, axes, scalars), shared by value."""
        if self._root is not None:
            return self._root.const(value, dtype)
        a = np.asarray(value, dtype=dtype)
        key = (a.dtype.str, a.shape, a.tobytes())
        if key not in self._consts:
            t = onnx.numpy_helper.from_array(a, self.name("c"))
            self.inits.append(t)
            self._consts[key] = t.name
        return self._consts[key]

    def fconst(self, value) -> str:
        return self.const(value, np.float32)

    def branch(self) -> "Graph":
        """A builder for a subgraph (an If branch): its own nodes and weights (initializers); names,
        shared constants and the external data file are the root graph's (subgraphs see the outer
        scope)."""
        return Graph(opset=self.opset, weight_dtype=self.weight_dtype, _root=self._root or self)

    def if_(self, cond: str, then: "Graph", then_out: str, other: "Graph", other_out: str, hint: str) -> str:
        """If(cond) -> then_out of `then` else other_out of `other` (float32 outputs)."""
        branches = {}
        for key, sub, out in (("then_branch", then, then_out), ("else_branch", other, other_out)):
            branches[key] = helper.make_graph(sub.nodes, self.name(f"{hint}.{key}"), [],
                                              [helper.make_tensor_value_info(out, F, None)], sub.inits)
        return self.op("If", [cond], hint=hint, **branches)

    # -- I/O ---------------------------------------------------------------------------
    def add_input(self, name: str, kind: int, shape) -> str:
        self._used[name] = self._used.get(name, 0) + 1
        self.inputs.append(helper.make_tensor_value_info(name, kind, shape))
        return name

    def add_output(self, value: str, name: str, kind: int, shape) -> None:
        self._used[name] = self._used.get(name, 0) + 1
        self.nodes.append(helper.make_node("Identity", [value], [name], name=self.name("n_out_" + name)))
        self.outputs.append(helper.make_tensor_value_info(name, kind, shape))

    # -- opset-aware helpers -----------------------------------------------------------
    def reduce(self, op: str, x: str, axes, keepdims: int = 1) -> str:
        axes = list(axes)
        if op == "ReduceSum" or self.opset >= 18:
            return self.op(op, [x, self.const(axes)], keepdims=keepdims)
        return self.op(op, [x], axes=axes, keepdims=keepdims)

    def unsqueeze(self, x: str, axes) -> str:
        return self.op("Unsqueeze", [x, self.const(list(axes))])

    def squeeze(self, x: str, axes) -> str:
        return self.op("Squeeze", [x, self.const(list(axes))])

    def reshape(self, x: str, shape) -> str:
        return self.op("Reshape", [x, shape if isinstance(shape, str) else self.const(list(shape))])

    def slice(self, x: str, start: int, end: int, axis: int) -> str:
        return self.op("Slice", [x, self.const([start]), self.const([end]), self.const([axis])])

    def transpose(self, x: str, perm) -> str:
        return self.op("Transpose", [x], perm=list(perm))

    def dim(self, x: str, axis: int) -> str:
        """Dimension `axis` of x as an int64 [1] tensor."""
        return self.op("Gather", [self.op("Shape", [x]), self.const([axis])], axis=0)

    def mm(self, a: str, b: str) -> str:
        return self.op("MatMul", [a, b])

    def add(self, a, b):
        return self.op("Add", [a, b])

    def mul(self, a, b):
        return self.op("Mul", [a, b])

    def silu(self, x: str) -> str:
        return self.mul(x, self.op("Sigmoid", [x]))

    def rms_norm(self, x: str, norm, hint: str) -> str:
        """RMSNorm over the last axis: x / sqrt(mean(x^2) + eps) * weight (float32)."""
        ms = self.reduce("ReduceMean", self.mul(x, x), [-1])
        inv = self.op("Reciprocal", [self.op("Sqrt", [self.add(ms, self.fconst(norm.eps))])])
        return self.mul(self.weight(norm.weight, hint + ".weight"), self.mul(x, inv))

    # -- output --------------------------------------------------------------------------
    def close_data(self) -> None:
        if self._data is not None:
            self._data.flush()
            os.fsync(self._data.fileno())
            self._data.close()
            self._data = None

    def model(self, name: str) -> onnx.ModelProto:
        g = helper.make_graph(self.nodes, name, self.inputs, self.outputs, self.inits)
        opsets = [helper.make_opsetid("", self.opset)] + [helper.make_opsetid(d, 1) for d in sorted(self._domains)]
        m = helper.make_model(g, opset_imports=opsets, producer_name="cvt",
                              ir_version=helper.find_min_ir_version_for(opsets, ignore_unknown=True))
        return m


def save_graph(g: Graph, model: onnx.ModelProto, path: Path, threshold: int) -> Path | None:
    """Write `model` to `path`; weights inline when they total at most `threshold` bytes, else
    in the external data file already written. Returns the external data path or None."""
    g.close_data()
    data = g.data_path
    if data is not None and data.exists() and g.weight_bytes <= threshold:
        onnx.external_data_helper.load_external_data_for_model(model, str(path.parent))
        data.unlink()
        data = None
    elif data is not None and not data.exists():
        data = None
    with open(path, "wb") as f:
        f.write(model.SerializeToString())
        f.flush()
        os.fsync(f.fileno())
    return data


# ------------------------------------------------------------------------------- linears
@dataclass
class LinearOptions:
    int4_op: str = "matmulnbits"      # matmulnbits | qdq
    w8a8_op: str = "integer"          # integer | qdq
    accuracy_level: int = 0           # MatMulNBits accuracy_level (0: as exact as float32)
    moe: str = "gated"                # gated: an If per expert; dense: every expert, no control flow
    counts: dict = field(default_factory=dict)


def linear(g: Graph, mod, x: str, hint: str, opts: LinearOptions) -> str:
    """Emit `mod` (a runtime `Linear` of any format) applied to x [..., k] -> [..., n]."""
    fmt = getattr(mod, "fmt", "dense")
    if fmt == KF.W4A16:
        y = _w4a16_matmulnbits(g, mod, x, hint, opts) if opts.int4_op == "matmulnbits" else _w4a16_qdq(g, mod, x, hint)
        key = f"w4a16:{opts.int4_op}"
    elif fmt == KF.W8A8_DYNAMIC:
        y = _w8a8_dynamic(g, mod, x, hint, opts.w8a8_op)
        key = f"w8a8_dynamic:{opts.w8a8_op}"
    elif fmt == KF.W4A8_DYNAMIC:  # W8A8_DYNAMIC's math with int4 values held as int8 (exact, twice the bytes)
        as_int8 = SimpleNamespace(weight=mod.weight_int4, weight_scale=mod.weight_scale,
                                  in_features=mod.in_features, out_features=mod.out_features)
        y = _w8a8_dynamic(g, as_int8, x, hint, opts.w8a8_op)
        key = f"w4a8_dynamic:{opts.w8a8_op}"
    elif fmt == KF.W8A8_STATIC:
        y = _w8a8_static(g, mod, x, hint, opts.w8a8_op)
        key = f"w8a8_static:{opts.w8a8_op}"
    elif fmt == "dense":
        y = g.mm(x, g.weight(mod.weight.t(), hint + ".weight_t"))
        key = "dense"
    else:  # fp8_block, nvfp4, mxfp4: exact values, float32 storage
        y = g.mm(x, g.weight(mod.dense_weight().t(), hint + ".weight_t", dtype="fp32"))
        key = f"{fmt}:dequantized"
    opts.counts[key] = opts.counts.get(key, 0) + 1
    if mod.bias is not None:
        y = g.add(y, g.weight(mod.bias, hint + ".bias"))
    return y


def _int4_block(group: int, k: int, hint: str) -> int:
    """MatMulNBits block size for a group (power of two, 16..256, dividing the group)."""
    if group & (group - 1) == 0 and 16 <= group <= 256:
        return group
    for b in (256, 128, 64, 32, 16):
        if group % b == 0:
            return b
    raise CvtError(f"{hint}: int4 group size {group} (k={k}) has no power-of-two divisor of at least 16, which "
                   "MatMulNBits needs as its block_size; use --int4-op qdq")


def _w4a16_matmulnbits(g: Graph, mod, x: str, hint: str, opts: LinearOptions) -> str:
    q, sc, off = mod.weight_int4, mod.weight_scale.float(), mod.weight_offset.float()
    n, k = q.shape
    group = k // sc.shape[1]
    block = _int4_block(group, k, hint)
    rep = group // block
    nb = k // block
    u = (q.to(torch.int16) + 8).to(torch.uint8).reshape(n, nb, block)
    packed = (u[..., 0::2] | (u[..., 1::2] << 4)).contiguous()          # [n, nb, block/2]
    scales = sc.repeat_interleave(rep, dim=1)                            # [n, nb]
    inputs = [x, g.tensor(g.name(hint + ".qweight"), TensorProto.UINT8, packed.shape, packed.numpy().tobytes()),
              g.weight(scales, hint + ".scales", dtype="fp32")]
    if bool((off != 0).any()):
        zp = off.repeat_interleave(rep, dim=1) + 8
        if bool((zp == zp.round()).all()) and float(zp.min()) >= 0 and float(zp.max()) <= 15:
            z = zp.to(torch.uint8)
            if nb % 2:
                z = torch.cat([z, z.new_zeros(n, 1)], dim=1)
            zpk = (z[:, 0::2] | (z[:, 1::2] << 4)).contiguous()          # [n, ceil(nb/2)]
            inputs.append(g.tensor(g.name(hint + ".zero_points"), TensorProto.UINT8, zpk.shape, zpk.numpy().tobytes()))
        else:
            inputs.append(g.weight(zp, hint + ".zero_points", dtype="fp32"))
    return g.op("MatMulNBits", inputs, hint=hint, domain=MS_DOMAIN, K=k, N=n, bits=4, block_size=block,
                accuracy_level=opts.accuracy_level)


def _w4a16_qdq(g: Graph, mod, x: str, hint: str) -> str:
    q, sc, off = mod.weight_int4, mod.weight_scale.float(), mod.weight_offset.float()
    n, k = q.shape
    group = k // sc.shape[1]
    inputs = [g.tensor(g.name(hint + ".qweight"), TensorProto.INT4, (k, n), pack_int4(q.t().contiguous())),
              g.weight(sc.t().contiguous(), hint + ".scales", dtype="fp32")]
    if bool((off != 0).any()):
        if not bool((off == off.round()).all()) or float(off.min()) < -8 or float(off.max()) > 7:
            raise CvtError(f"{hint}: w4a16 offsets are not integers in -8..7, so they cannot be int4 zero points of "
                           "DequantizeLinear; use --int4-op matmulnbits (float zero points)")
        inputs.append(g.tensor(g.name(hint + ".zero_points"), TensorProto.INT4, (k // group, n),
                               pack_int4(off.t().contiguous().to(torch.int8))))
    w = g.op("DequantizeLinear", inputs, hint=hint + ".dq", axis=0, block_size=group)
    return g.mm(x, w)


def _per_token_quant(g: Graph, x: str) -> tuple[str, str]:
    """Symmetric per-row int8 of x [..., k]: (q float (integers in -128..127), scale [..., 1]);
    q = round(x * (127 / amax)), as the runtime (`cvt.qtensor.primitives.per_token_quant`)
    and the serving kernels compute it (0 for an all-zero row)."""
    amax = g.reduce("ReduceMax", g.op("Abs", [x]), [-1])
    s = g.op("Div", [amax, g.fconst(127.0)])
    pos = g.op("Greater", [amax, g.fconst(0.0)])
    factor = g.op("Where", [pos, g.op("Div", [g.fconst(127.0), g.op("Where", [pos, amax, g.fconst(1.0)])]),
                            g.fconst(0.0)])
    p = g.op("Mul", [x, factor])
    p = g.op("Where", [g.op("IsNaN", [p]), g.fconst(0.0), p])  # 0 * inf (amax < 127 / FLT_MAX): 0, as the runtime
    q = g.op("Clip", [g.op("Round", [p]), g.fconst(-128.0), g.fconst(127.0)])
    return q, s


def _w8a8_dynamic(g: Graph, mod, x: str, hint: str, op: str) -> str:
    wq, ws = mod.weight, mod.weight_scale.float().reshape(-1)
    if op == "integer":
        q, s = _per_token_quant(g, x)
        acc = g.op("MatMulInteger", [g.op("Cast", [q], to=TensorProto.INT8),
                                     g.weight(wq.t().contiguous(), hint + ".weight_t")], hint=hint)
        return g.mul(g.mul(g.op("Cast", [acc], to=F), g.weight(ws, hint + ".weight_scale", dtype="fp32")), s)
    # qdq: rows of x [m, k] quantized per row (axis 0), weights per output channel (axis 1)
    shape = g.op("Shape", [x])
    x2 = g.reshape(x, [-1, int(mod.in_features)])
    s = g.op("Div", [g.reduce("ReduceMax", g.op("Abs", [x2]), [-1], keepdims=0), g.fconst(127.0)])
    s1 = g.op("Where", [g.op("Greater", [s, g.fconst(0.0)]), s, g.fconst(1.0)])          # [m]
    zp = g.op("ConstantOfShape", [g.op("Shape", [s1])], value=helper.make_tensor("z", TensorProto.INT8, [1], [0]))
    xq = g.op("QuantizeLinear", [x2, s1, zp], axis=0)
    xd = g.op("DequantizeLinear", [xq, s1, zp], axis=0)
    wd = g.op("DequantizeLinear", [g.weight(wq.t().contiguous(), hint + ".weight_t"),
                                   g.weight(ws, hint + ".weight_scale", dtype="fp32")], axis=1)
    y = g.mm(xd, wd)
    out_shape = g.op("Concat", [g.slice(shape, 0, -1, 0), g.const([int(mod.out_features)])], axis=0)
    return g.reshape(y, out_shape)


def _w8a8_static(g: Graph, mod, x: str, hint: str, op: str) -> str:
    from cvt.qtensor.primitives import deq_scale_f32

    wq = mod.weight
    s_in = float(mod.input_scale.float().reshape(()))
    off = float(mod.input_offset.float().reshape(()))
    deq = deq_scale_f32(mod.deq_scale).float()
    if op == "qdq" and (off != round(off) or not -128 <= off <= 127):
        raise CvtError(f"{hint}: w8a8 input_offset {off} is not an int8 integer; use --w8a8-op integer")
    # the runtime's static_quant: clamp(round(x / s_in + off)) (not QuantizeLinear: module doc)
    xq = g.op("Clip", [g.op("Round", [g.add(g.op("Div", [x, g.fconst(s_in)]), g.fconst(off))]),
                       g.fconst(-128.0), g.fconst(127.0)])
    xq = g.op("Cast", [xq], to=TensorProto.INT8)
    if op == "integer":
        acc = g.op("MatMulInteger", [xq, g.weight(wq.t().contiguous(), hint + ".weight_t")], hint=hint)
        acc = g.add(acc, g.weight(mod.quant_bias, hint + ".quant_bias"))
        return g.mul(g.op("Cast", [acc], to=F), g.weight(deq, hint + ".deq_scale", dtype="fp32"))
    xd = g.op("DequantizeLinear", [xq, g.fconst(s_in), g.const(int(off), np.int8)])
    wd = g.op("DequantizeLinear", [g.weight(wq.t().contiguous(), hint + ".weight_t"),
                                   g.weight(deq / s_in, hint + ".weight_scale", dtype="fp32")], axis=1)
    corr = (mod.quant_bias.double() + off * wq.double().sum(dim=1)) * deq.double()
    return g.add(g.mm(xd, wd), g.weight(corr.float(), hint + ".offset_bias", dtype="fp32"))
