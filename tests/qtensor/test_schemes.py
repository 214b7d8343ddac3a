"""Schemes: quantize -> dequantize against independent references, param_info, errors, runtime parity."""

from __future__ import annotations

import math
import re
import struct

import pytest
import torch

import cvt.runtime.kernels as K
from cvt.errors import CvtError, TensorError
from cvt.qtensor.schemes import get_scheme, scheme_names, static_parts
from cvt.qtensor.schemes.base import Scheme, SchemeBase

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

CASES = [("w8a8", {}), ("w8a8c8", {}), ("w4a16", {"group_size": 32}), ("w4a16", {"group_size": 64}),
         ("w4a16", {"group_size": 128}), ("w4a16", {"group_size": 0}), ("w4a16", {"group_size": 32, "symmetric": False}),
         ("w4a16", {"group_size": 0, "symmetric": False}), ("fp4", {"fp4_format": "nvfp4"}),
         ("fp4", {"fp4_format": "mxfp4"})]
IDS = [f"{n}-" + "-".join(f"{k}={v}" for k, v in o.items()) for n, o in CASES]


def weight(n=24, k=256, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 0.1
    w[1] = 0.0                    # an all-zero row (zero scales)
    w[2, :32] = 0.0               # an all-zero group
    w[3, 5] = 1.0                 # an outlier
    return w


def bf16(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).to(torch.bfloat16).item()


def f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


# ---- independent references (plain Python over rows / groups) -------------------------------------

def ref_int(w, group, qdiv, qmin, qmax, sym, bf16_scale=True):
    """Per group: scale (bf16 of amax/qdiv, or min/max), offset, q (round half even), dequant."""
    n, k = w.shape
    g = group or k
    out = torch.empty(n, k)
    for r in range(n):
        for j in range(0, k, g):
            v = [float(x) for x in w[r, j:j + g]]
            if sym:
                s, off = bf16(f32(max(abs(x) for x in v) / f32(qdiv))), 0.0
            else:
                lo, hi = min(min(v), 0.0), max(max(v), 0.0)
                s = f32(f32(f32(hi) - f32(lo)) / f32(qmax - qmin)) or 1.0
                off = float(max(qmin, min(qmax, round(f32(qmin - f32(lo / s))))))  # from the unrounded scale
                s = bf16(s)
            s = s or 1.0
            for i, x in enumerate(v):
                q = max(qmin, min(qmax, round(f32(f32(x / s) + off))))
                out[r, j + i] = (q - off) * s
    return out


def ref_e2m1(x: float) -> float:
    a = min(abs(x), 6.0)
    d = [abs(a - v) for v in E2M1]
    idx = [i for i, v in enumerate(d) if v == min(d)]
    i = idx[0] if len(idx) == 1 else next(j for j in idx if j % 2 == 0)
    return math.copysign(E2M1[i], x)


def ref_fp4(w, fmt):
    n, k = w.shape
    g = 16 if fmt == "nvfp4" else 32
    out = torch.empty(n, k)
    amax_all = float(w.abs().max())
    gs = f32(2688.0 / amax_all) if amax_all else 1.0
    for r in range(n):
        for j in range(0, k, g):
            v = [float(x) for x in w[r, j:j + g]]
            amax = max(abs(x) for x in v)
            if fmt == "nvfp4":
                s = torch.tensor(f32(f32(amax / 6.0) * gs)).to(torch.float8_e4m3fn).float().item() or 0.125
                mult = f32(s / gs)
            else:
                m, e = math.frexp(amax)
                mult = 2.0 ** (max(0, min(254, 127 + (e if 2 * m - 1 >= 0.75 else e - 1) - 2)) - 127) if amax else 2.0 ** -127
            for i, x in enumerate(v):
                out[r, j + i] = f32(ref_e2m1(f32(x / mult)) * mult)
    return out


def reference(name, opts, w):
    if name in ("w8a8", "w8a8c8"):
        return ref_int(w, 0, 127.0, -128, 127, True)
    if name == "w4a16":
        return ref_int(w, opts.get("group_size", 128), 7.5, -8, 7, opts.get("symmetric", True))
    return ref_fp4(w, opts["fp4_format"])


# ---- the protocol ---------------------------------------------------------------------------------

def test_registry():
    assert scheme_names() == ["fp4", "mxfp8", "w4a16", "w4a4_flatquant", "w4a4_mxfp4", "w4a4_mxfp4_flatquant", "w4a8", "w4a8_mxfp", "w8a8",
                              "w8a8c8"]
    with pytest.raises(CvtError, match=r"unknown scheme 'w3'.*known: fp4, mxfp8, w4a16, w4a4_flatquant, w4a4_mxfp4, "
                                       r"w4a4_mxfp4_flatquant, "
                                       r"w4a8, w4a8_mxfp, "
                                       r"w8a8, w8a8c8"):
        get_scheme("w3")
    for name, opts in CASES:
        assert isinstance(get_scheme(name, **opts), Scheme)


@pytest.mark.parametrize("name", scheme_names())
def test_every_scheme_checks_its_weight_through_the_base(name):
    """Each registered scheme takes its shape check, finiteness check and fake_quant from
    `SchemeBase`: a 3-D weight is refused naming the tensor and the scheme."""
    s = get_scheme(name)
    assert isinstance(s, SchemeBase)
    label = "fp4 (nvfp4)" if name == "fp4" else name
    with pytest.raises(CvtError, match=rf"^{re.escape(label)}: tensor 'x.weight' has shape \[2, 3, 4\]: expected "
                                       r"a non-empty 2-D \[out_features, in_features\] weight$"):
        s.quantize(torch.ones(2, 3, 4), name="x.weight")
    w = weight()
    assert torch.equal(s.fake_quant(w), s.dequantize(s.quantize(w)))


@pytest.mark.parametrize("name,opts", CASES, ids=IDS)
def test_quantize_dequantize_equals_independent_reference(name, opts):
    s = get_scheme(name, **opts)
    w = weight()
    q = s.quantize(w)
    d = s.dequantize(q)
    assert d.dtype == torch.float32 and d.shape == w.shape
    assert torch.equal(d, reference(name, opts, w))
    assert torch.equal(s.fake_quant(w), d)
    assert torch.equal(d[1], torch.zeros(w.shape[1]))  # the zero row stays exactly zero
    sqnr = 20 * math.log10(w.norm() / (w - d).norm())
    assert sqnr > {"w8a8": 38, "w8a8c8": 38, "w4a16": 14, "fp4": 14}[name]


@pytest.mark.parametrize("name,opts", CASES, ids=IDS)
def test_param_info_matches_parts_and_the_runtime_kernel_agrees(name, opts):
    s = get_scheme(name, **opts)
    for shape in [(24, 256), (8, 128)]:
        q = s.quantize(weight(*shape))
        assert {k: (tuple(v.shape), v.dtype) for k, v in q.parts.items()} == s.param_info(shape)
        assert q.shape == shape
        mod = K.get(q.kernel_fmt).from_parts(q.parts)  # the canonical parts are exactly the kernel's
        assert torch.equal(mod.dense_weight(), s.dequantize(q))


def test_quantized_tensor_fields():
    q = get_scheme("w4a16", group_size=32, symmetric=False).quantize(weight())
    assert (q.scheme, q.kernel_fmt, q.group_size, q.symmetric) == ("w4a16", "w4a16", 32, False)
    assert q.parts["weight_scale"].shape == (24, 8)
    assert bool((q.parts["weight_offset"] != 0).any())
    assert torch.equal(q.parts["weight_offset"], q.parts["weight_offset"].round())
    # G == k: one group of k, the per-channel numbers, recorded as G (the Ascend stacks read one
    # global group_size and need such a linear in the grouped layout: tests/quant/test_group_fallback.py)
    whole = get_scheme("w4a16", group_size=256).quantize(weight())
    assert whole.group_size == 256 and whole.parts["weight_scale"].shape == (24, 1)
    channel = get_scheme("w4a16", group_size=0).quantize(weight())
    assert all(torch.equal(whole.parts[p], channel.parts[p]) for p in channel.parts)
    f = get_scheme("fp4", fp4_format="mxfp4").quantize(weight())
    assert (f.kernel_fmt, f.group_size, f.extra) == ("mxfp4", 32, {"fp4_format": "mxfp4"})
    assert get_scheme("w8a8c8").kv_cache == "int8" and get_scheme("w8a8").kv_cache is None
    assert get_scheme("w8a8", static_activations=True).static_activations


def test_scales_are_bf16_representable():
    for name, opts in CASES[:8]:
        sc = get_scheme(name, **opts).quantize(weight()).parts["weight_scale"]
        assert torch.equal(sc.bfloat16().float(), sc)


@pytest.mark.parametrize("name,opts", [c for c in CASES if c[0] in ("w4a16", "fp4")], ids=IDS[2:])
def test_group_size_not_dividing_k_names_the_tensor(name, opts):
    s = get_scheme(name, **opts)
    g = s.group_size or 0
    if g == 0:
        return
    with pytest.raises(CvtError, match=rf"'model.layers.3.mlp.experts.7.down_proj.weight'.*group size {g} does not "
                                       rf"divide in_features=40"):
        s.check("model.layers.3.mlp.experts.7.down_proj.weight", (16, 40))
    with pytest.raises(CvtError, match=r"'x.weight'"):
        s.quantize(torch.ones(16, 40), name="x.weight")


@pytest.mark.parametrize("name,opts", CASES, ids=IDS)
def test_non_finite_weights_are_refused(name, opts):
    s = get_scheme(name, **opts)
    w = weight()
    w[4, 7] = float("nan")
    with pytest.raises(TensorError, match="non-finite"):
        s.quantize(w)
    w[4, 7] = float("inf")
    with pytest.raises(TensorError, match=r"weight 'a.weight' .* non-finite"):
        s.quantize(w, name="a.weight")


@pytest.mark.parametrize("name,opts,msg", [
    ("w8a8", {"group_size": 64}, "per output channel only"),
    ("w8a8", {"symmetric": False}, "symmetric only"),
    ("w4a16", {"fp4_format": "nvfp4"}, "no fp4_format"),
    ("w4a16", {"group_size": -1}, "group_size must be"),
    ("fp4", {"fp4_format": "fp4e3"}, r"unknown fp4_format 'fp4e3' \(known: nvfp4, mxfp4\)"),
    ("fp4", {"fp4_format": "nvfp4", "group_size": 32}, "fixed group size of 16"),
    ("fp4", {"symmetric": False}, "symmetric only"),
])
def test_bad_options(name, opts, msg):
    with pytest.raises(CvtError, match=msg):
        get_scheme(name, **opts)


# ---- static W8A8 ----------------------------------------------------------------------------------

@pytest.mark.parametrize("fp16_model", [False, True])
def test_static_parts(fp16_model):
    s = get_scheme("w8a8", static_activations=True)
    w = weight(16, 64)
    q = s.quantize(w)
    bias = torch.randn(16, generator=torch.Generator().manual_seed(3))
    st = static_parts(q, 0.0123, 2.6, bias, fp16_model=fp16_model)
    assert st.kernel_fmt == "w8a8_static" and st.scheme == "w8a8"
    assert st.parts["input_scale"].tolist() == [bf16(0.0123)] and st.parts["input_offset"].tolist() == [3.0]
    ws = q.parts["weight_scale"].reshape(16)
    deq = torch.tensor([f32(bf16(0.0123) * float(v)) for v in ws])
    got = st.parts["deq_scale"]
    if fp16_model:
        assert got.dtype == torch.int64
        got = torch.tensor([struct.unpack("<f", struct.pack("<I", v & 0xFFFFFFFF))[0] for v in got.tolist()])
    assert torch.equal(got, deq)
    wsum = q.parts["weight"].to(torch.int64).sum(dim=1)
    qb = [round(float(b) / float(d) - int(sv) * 3.0) for b, d, sv in zip(bias.double(), deq.double(), wsum)]
    assert st.parts["quant_bias"].tolist() == qb and st.parts["quant_bias"].dtype == torch.int32
    assert torch.equal(st.extra["weight_scale"], q.parts["weight_scale"])
    assert torch.equal(s.dequantize(st), s.dequantize(q))
    mod = K.get("w8a8_static").from_parts(st.parts)  # bias folded into quant_bias
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    ref = (x / bf16(0.0123) + 3).round().clamp(-128, 127) - 3
    ref = (ref.double() @ q.parts["weight"].double().t()) * deq.double() + bias.double()
    torch.testing.assert_close(mod(x).double(), ref, rtol=0, atol=float(deq.max()))


def test_static_parts_refuses_bad_inputs():
    q = get_scheme("w8a8").quantize(weight(16, 64))
    with pytest.raises(TensorError, match="input_scale > 0"):
        static_parts(q, 0.0, 0)
    with pytest.raises(TensorError, match=r"bias has shape \[3\]: expected \[16\]"):
        static_parts(q, 0.1, 0, torch.ones(3))
    with pytest.raises(CvtError, match="needs a w8a8_dynamic tensor"):
        static_parts(static_parts(q, 0.1, 0), 0.1, 0)
