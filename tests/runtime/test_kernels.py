"""Linear kernels: each format against an independent RTN quantizer and dequantizer written here,
hand-worked bit layouts for every packing, bad parts, and the registry."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from cvt.qtensor import primitives
from cvt.errors import CvtError, TensorError
from cvt.runtime import kernels as K
from cvt.runtime.kernels import fp4, int4, int8
from cvt.runtime.kernels._common import int8_matmul
from cvt.qtensor.layouts import LAYOUTS

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randw(n, k, seed=0):
    return torch.randn(n, k, generator=gen(seed)) * 0.05


def randx(*shape, seed=1, dtype=torch.float32):
    return torch.randn(*shape, generator=gen(seed)).to(dtype)


# ---- independent quantizers / dequantizers ------------------------------------------------------

def rtn_fp8_block(w, b=128):
    n, k = w.shape
    gn, gk = math.ceil(n / b), math.ceil(k / b)
    s = torch.zeros(gn, gk)
    for i in range(gn):
        for j in range(gk):
            s[i, j] = w[i * b:(i + 1) * b, j * b:(j + 1) * b].abs().max() / 448.0
    full = s.repeat_interleave(b, 0).repeat_interleave(b, 1)[:n, :k]
    q = (w / full).to(torch.float8_e4m3fn)
    return q, s, (q.float() * full).bfloat16().float()


def rtn_int8_channel(w):
    s = w.abs().amax(dim=1, keepdim=True) / 127.0
    return torch.round(w / s).clamp(-128, 127).to(torch.int8), s


def rtn_int4(w, g, sym):
    n, k = w.shape
    wg = w.reshape(n, k // g, g)
    if sym:
        s = (wg.abs().amax(-1) / 7.0).bfloat16().float()  # bf16-representable scales, as c-t stores them
        off = torch.zeros_like(s)
    else:
        lo, hi = wg.amin(-1), wg.amax(-1)
        s = ((hi - lo) / 15.0).bfloat16().float()
        off = torch.round(-lo / s) - 8.0
    q = torch.round(wg / s[..., None] + off[..., None]).clamp(-8, 7)
    deq = ((q - off[..., None]) * s[..., None]).reshape(n, k)
    return q.reshape(n, k).to(torch.int8), s, off, deq


def e2m1_codes(v):
    mags = torch.tensor(E2M1)
    idx = (v.abs().unsqueeze(-1) - mags).abs().argmin(-1)
    return (idx + 8 * (v < 0).long()).to(torch.uint8)


def e2m1_values(codes):
    c = codes.long()
    v = torch.tensor(E2M1)[c & 7]
    return torch.where(c >= 8, -v, v)


def rtn_nvfp4(w):
    n, k = w.shape
    gs = torch.tensor([448.0 * 6.0]) / w.abs().max()
    amax = w.reshape(n, k // 16, 16).abs().amax(-1)
    scale = (amax / 6.0 * gs).to(torch.float8_e4m3fn)
    eff = scale.float() / gs
    codes = e2m1_codes((w.reshape(n, k // 16, 16) / eff[..., None]).clamp(-6, 6)).reshape(n, k)
    deq = (e2m1_values(codes).reshape(n, k // 16, 16) * eff[..., None]).reshape(n, k)
    return codes, scale, gs, deq


def rtn_mxfp4(w):
    n, k = w.shape
    amax = w.reshape(n, k // 32, 32).abs().amax(-1)
    e = (127 + torch.ceil(torch.log2(amax / 6.0))).clamp(0, 254)
    sc = torch.exp2(e - 127)
    codes = e2m1_codes((w.reshape(n, k // 32, 32) / sc[..., None]).clamp(-6, 6)).reshape(n, k)
    deq = (e2m1_values(codes).reshape(n, k // 32, 32) * sc[..., None]).reshape(n, k)
    return codes, e.to(torch.uint8), deq


# ---- fp8_block ----------------------------------------------------------------------------------

@pytest.mark.parametrize("bias", [False, True])
def test_fp8_block(bias):
    w = randw(200, 300)  # partial edge blocks in both dimensions
    q, s, deq = rtn_fp8_block(w)
    b = randx(200, seed=5) if bias else None
    mod = K.get("fp8_block").from_parts({"weight": q, "weight_scale_inv": s}, b)
    assert isinstance(mod, K.Fp8BlockLinear) and mod.block_size == (128, 128)
    assert torch.equal(mod.dense_weight(), deq)
    x = randx(2, 3, 300, dtype=torch.bfloat16)
    y = mod(x)
    assert y.shape == (2, 3, 200) and y.dtype == torch.bfloat16
    assert torch.equal(y, F.linear(x, deq.bfloat16(), None if b is None else b.bfloat16()))
    xf = randx(4, 300)
    ref = xf.double() @ deq.double().t() + (0 if b is None else b.double())
    torch.testing.assert_close(mod(xf).double(), ref, rtol=1e-5, atol=1e-6)
    # bf16 scales and a non-default block size
    q2, s2, deq2 = rtn_fp8_block(w, 64)
    mod2 = K.Fp8BlockLinear.from_parts({"weight": q2, "weight_scale_inv": s2}, block_size=(64, 64))
    assert torch.equal(mod2.dense_weight(), deq2)


@pytest.mark.parametrize("sdtype", [torch.float32, torch.bfloat16, torch.float8_e8m0fnu])
def test_fp8_device_expression_matches_cpu_kernel(sdtype):
    """The torch expression used off-CPU (e.g. on an NPU) gives the CPU kernel's bits."""
    from cvt.convert.fp8 import dequant_fp8_block
    from cvt.runtime.kernels.fp8_block import dequant_expr

    w = (torch.randn(150, 260, generator=gen(2)) * 20).to(torch.float8_e4m3fn)
    s = (torch.rand(2, 3, generator=gen(3)) * 4).to(sdtype)
    assert torch.equal(dequant_expr(w, s, (128, 128)).view(torch.int16),
                       dequant_fp8_block(w, s, (128, 128)).view(torch.int16))


# ---- w8a8 ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("m,k,n", [(1, 24, 16), (5, 200, 80), (33, 64, 48)])
def test_int8_matmul_exact(m, k, n):
    a = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=gen(m))
    b = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen(n))
    assert torch.equal(int8_matmul(a, b).long(), a.long() @ b.long().t())
    assert torch.equal(int8_matmul(a, b.t().contiguous().t()).long(), a.long() @ b.long().t())


def test_int8_matmul_huge_k_is_exact():
    k = 131080  # past int32 accumulation: float64 path, int64 result
    a = torch.full((1, k), -128, dtype=torch.int8)
    b = torch.stack([torch.full((k,), -128, dtype=torch.int8), torch.full((k,), 127, dtype=torch.int8)])
    assert int8_matmul(a, b).tolist() == [[16384 * k, -16256 * k]]


@pytest.mark.parametrize("bias", [False, True])
def test_w8a8_dynamic(bias):
    n, k = 80, 200
    w = randw(n, k)
    q, s = rtn_int8_channel(w)
    b = randx(n, seed=7) if bias else None
    mod = K.get("w8a8_dynamic").from_parts({"weight": q, "weight_scale": s, "weight_offset": torch.zeros(n, 1)}, b)
    assert torch.equal(mod.dense_weight(), q.float() * s)
    x = randx(2, 3, k)
    x[0, 1] = 0.0  # an all-zero token
    xs = x.reshape(-1, k).abs().amax(-1, keepdim=True) / 127.0
    xq = torch.where(xs > 0, torch.round(x.reshape(-1, k) / torch.where(xs > 0, xs, 1)), 0).clamp(-128, 127)
    got_q, got_s = primitives.per_token_quant(x.reshape(-1, k))
    assert torch.equal(got_q.float(), xq) and torch.equal(got_s, xs.squeeze(1))
    ref = (xq.double() @ q.double().t()) * s.double().t() * xs.double()  # = dequant(x_q) @ dense^T
    ref = ref.reshape(2, 3, n) + (0 if b is None else b.double())
    y = mod(x)
    assert y.shape == (2, 3, n) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-6)
    assert mod(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("deq_int64", [False, True])
def test_w8a8_static(bias, deq_int64):
    n, k = 48, 96
    w = randw(n, k)
    q, ws = rtn_int8_channel(w)
    x = randx(6, k, seed=3)
    in_scale = torch.tensor([float(x.abs().max()) / 120.0])
    in_off = torch.tensor([3.0])
    deq = (in_scale * ws.squeeze(1)).float()
    b = randx(n, seed=9) * 0.1 if bias else None
    qb = primitives.quant_bias_from(b, q, in_off, deq)
    indep = torch.round((torch.zeros(n, dtype=torch.float64) if b is None else b.double() / deq.double())
                        - q.double().sum(1) * 3.0)
    assert qb.dtype == torch.int32 and torch.equal(qb.double(), indep)
    parts = {"weight": q, "input_scale": in_scale, "input_offset": in_off, "quant_bias": qb,
             "deq_scale": primitives.deq_scale_int64(deq) if deq_int64 else deq}
    mod = K.get("w8a8_static").from_parts(parts)
    xq = torch.round(x / in_scale + in_off).clamp(-128, 127)
    ref = ((xq.double() @ q.double().t() + qb.double()) * deq.double())
    torch.testing.assert_close(mod(x).double(), ref, rtol=1e-6, atol=1e-6)
    # the folded bias comes back: (x_q - offset) * s @ (w_q * ws)^T + bias
    approx = ((xq - in_off) * in_scale).double() @ mod.dense_weight().double().t() + (0 if b is None else b.double())
    torch.testing.assert_close(ref, approx, rtol=0, atol=float(deq.max()) * 1.01)
    torch.testing.assert_close(mod.dense_weight(), q.float() * ws, rtol=1e-6, atol=0)


def test_deq_scale_int64_worked_example():
    # 0.5f = 0x3F000000; -2.0f = 0xC0000000 (int32 -1073741824, sign-extended when widened)
    d = torch.tensor([0.5, -2.0])
    assert primitives.deq_scale_int64(d).tolist() == [0x3F000000, -1073741824]
    assert torch.equal(primitives.deq_scale_f32(torch.tensor([0x3F000000, 0xC0000000, -1073741824])),
                       torch.tensor([0.5, -2.0, -2.0]))


# ---- w4a16 --------------------------------------------------------------------------------------

@pytest.mark.parametrize("g,sym", [(32, False), (32, True), (128, True), (128, False)])
def test_w4a16(g, sym):
    n, k = 24, 128
    q, s, off, deq = rtn_int4(randw(n, k), g, sym)
    b = randx(n, seed=11)
    mod = K.get("w4a16").from_parts({"weight_int4": q, "weight_scale": s, "weight_offset": off}, b)
    assert mod.group_size == g
    assert torch.equal(mod.dense_weight(), deq)
    x = randx(2, 5, k, dtype=torch.bfloat16)
    assert torch.equal(mod(x), F.linear(x, deq.bfloat16(), b.bfloat16()))
    xf = randx(3, k)
    torch.testing.assert_close(mod(xf).double(), xf.double() @ deq.double().t() + b.double(), rtol=1e-5, atol=1e-6)
    # the on-disk layouts give the same module
    dim = int4.ascend_pack_dim(s)
    assert dim == (1 if g == k else 0)
    asc = LAYOUTS.get("ascend-w4a16-int8-grouped").decode("m", {"weight": int4.pack_int4_ascend(q, dim),
                                                                "weight_scale": s, "weight_offset": off})
    assert torch.equal(K.W4A16Linear.from_parts(asc.parts).dense_weight(), deq)
    ct = {"weight_packed": int4.pack_int4_ct(q), "weight_scale": s.bfloat16(), "weight_shape": torch.tensor([n, k])}
    if not sym:
        ct["weight_zero_point"] = int4.pack_int4_ct(off.to(torch.int8), dim=0)
    assert torch.equal(K.W4A16Linear.from_parts(LAYOUTS.get("ct-int4").decode("m", ct).parts).dense_weight(), deq)


def test_int4_ascend_worked_example():
    q = torch.tensor([[1, -2], [3, -4]], dtype=torch.int8)
    # per group: pairs of output channels; column 0: rows (1, 3) -> 0x31; column 1: (-2, -4) -> 0xCE
    assert int4.pack_int4_ascend(q, 0).tolist() == [[0x31, 0xCE - 256]]
    # per channel: along k; row 0: (1, -2) -> 0xE1; row 1: (3, -4) -> 0xC3
    assert int4.pack_int4_ascend(q, 1).tolist() == [[0xE1 - 256], [0xC3 - 256]]
    assert int4.ascend_pack_dim(torch.ones(4, 1)) == 1 and int4.ascend_pack_dim(torch.ones(4, 2)) == 0


def test_int4_ct_worked_example():
    q = torch.tensor([[1, -2, 3, -4, 5, -6, 7, -8, 2, 0]], dtype=torch.int8)
    # +8 -> 9 6 11 4 13 2 15 0 | 10 8 (padded with 0): element i at bits 4i
    assert int4.pack_int4_ct(q).tolist() == [[0x0F2D4B69, 0x8A]]
    assert torch.equal(int4.unpack_int4_ct(int4.pack_int4_ct(q), 10), q)


@pytest.mark.parametrize("shape", [(6, 10), (8, 64), (3, 7)])
def test_int4_round_trips(shape):
    q = torch.randint(-8, 8, shape, dtype=torch.int8, generator=gen(shape[0]))
    for dim in (0, 1):
        assert torch.equal(int4.unpack_int4_ct(int4.pack_int4_ct(q, dim), shape[dim], dim), q)
        if shape[dim] % 2 == 0:
            assert torch.equal(int4.unpack_int4_ascend(int4.pack_int4_ascend(q, dim), dim), q)


# ---- fp4 ----------------------------------------------------------------------------------------

def test_nvfp4():
    n, k = 24, 64
    codes, scale, gs, deq = rtn_nvfp4(randw(n, k))
    mod = K.get("nvfp4").from_parts({"weight_fp4": codes, "weight_scale": scale, "weight_global_scale": gs})
    assert torch.equal(mod.dense_weight(), deq)
    x = randx(3, k, dtype=torch.bfloat16)
    assert torch.equal(mod(x), F.linear(x, deq.bfloat16()))
    ct = LAYOUTS.get("ct-nvfp4").decode("m", {"weight_packed": fp4.pack_fp4(codes), "weight_scale": scale,
                                              "weight_global_scale": gs})
    assert torch.equal(K.NvFp4Linear.from_parts(ct.parts).dense_weight(), deq)


def test_mxfp4():
    n, k = 16, 96
    codes, e, deq = rtn_mxfp4(randw(n, k))
    mod = K.get("mxfp4").from_parts({"weight_fp4": codes, "weight_scale": e})
    assert torch.equal(mod.dense_weight(), deq)
    mod2 = K.MxFp4Linear.from_parts({"weight_fp4": codes, "weight_scale": e.view(torch.float8_e8m0fnu)})
    assert torch.equal(mod2.dense_weight(), deq)
    xf = randx(2, k)
    torch.testing.assert_close(mod(xf).double(), xf.double() @ deq.double().t(), rtol=1e-5, atol=1e-6)
    # E8M0 extremes: 0 -> 2**-127, 254 -> 2**127
    tiny = K.MxFp4Linear.from_parts({"weight_fp4": torch.full((1, 32), 2, dtype=torch.uint8),
                                     "weight_scale": torch.tensor([[0]], dtype=torch.uint8)})
    assert tiny.dense_weight()[0, 0].item() == 2.0 ** -127
    huge = K.MxFp4Linear.from_parts({"weight_fp4": torch.full((1, 32), 10, dtype=torch.uint8),
                                     "weight_scale": torch.tensor([[254]], dtype=torch.uint8)})
    assert huge.dense_weight()[0, 0].item() == -(2.0 ** 127)


def test_fp4_worked_example_and_round_trip():
    codes = torch.tensor([[1, 2, 9, 15]], dtype=torch.uint8)  # 0.5, 1.0, -0.5, -6.0
    assert fp4.pack_fp4(codes).tolist() == [[0x21, 0xF9]]
    assert fp4.decode_e2m1(codes).tolist() == [[0.5, 1.0, -0.5, -6.0]]
    c = torch.randint(0, 16, (5, 34), dtype=torch.uint8, generator=gen(4))
    assert torch.equal(fp4.unpack_fp4(fp4.pack_fp4(c)), c)
    assert torch.equal(fp4.decode_e2m1(c), e2m1_values(c))


# ---- bad parts ----------------------------------------------------------------------------------

def _good_parts():
    q8, s8 = rtn_int8_channel(randw(16, 32))
    qf8, sf8, _ = rtn_fp8_block(randw(16, 32))
    q4, s4, o4, _ = rtn_int4(randw(16, 32), 16, False)
    cn, sn, gn, _ = rtn_nvfp4(randw(16, 32))
    cm, em, _ = rtn_mxfp4(randw(16, 32))
    return {
        "fp8_block": {"weight": qf8, "weight_scale_inv": sf8},
        "w8a8_dynamic": {"weight": q8, "weight_scale": s8, "weight_offset": torch.zeros(16, 1)},
        "w8a8_static": {"weight": q8, "input_scale": torch.tensor([0.1]), "input_offset": torch.tensor([0.0]),
                        "deq_scale": s8.squeeze(1) * 0.1, "quant_bias": torch.zeros(16, dtype=torch.int32)},
        "w4a16": {"weight_int4": q4, "weight_scale": s4, "weight_offset": o4},
        "nvfp4": {"weight_fp4": cn, "weight_scale": sn, "weight_global_scale": gn},
        "mxfp4": {"weight_fp4": cm, "weight_scale": em},
    }


BAD = [
    ("fp8_block", "weight_scale_inv", lambda p: p["weight_scale_inv"][:, :0], "weight_scale_inv"),
    ("fp8_block", "weight", lambda p: p["weight"].float(), "float8_e4m3fn"),
    ("fp8_block", "weight_scale_inv", lambda p: p["weight_scale_inv"] * float("nan"), "non-finite"),
    ("w8a8_dynamic", "weight_offset", lambda p: p["weight_offset"] + 1, "not all zeros"),
    ("w8a8_dynamic", "weight_scale", lambda p: p["weight_scale"][:8], "[16, 1]"),
    ("w8a8_dynamic", "weight", lambda p: p["weight"].to(torch.int32), "int8"),
    ("w8a8_static", "deq_scale", lambda p: p["deq_scale"].double(), "int64"),
    ("w8a8_static", "quant_bias", lambda p: p["quant_bias"][:3], "[16]"),
    ("w8a8_static", "input_scale", lambda p: torch.tensor([0.1, 0.2]), "[1]"),
    ("w8a8_static", "input_scale", lambda p: torch.tensor([0.0]), "non-positive"),
    ("w4a16", "weight_int4", lambda p: p["weight_int4"] * 3, "-8..7"),
    ("w4a16", "weight_scale", lambda p: p["weight_scale"][:, :1].repeat(1, 3), "k/G"),
    ("w4a16", "weight_offset", lambda p: p["weight_offset"][:, :1], "same shape"),
    ("nvfp4", "weight_scale", lambda p: p["weight_scale"].float(), "float8_e4m3fn"),
    ("nvfp4", "weight_global_scale", lambda p: torch.tensor([1.0, 2.0]), "[1]"),
    ("nvfp4", "weight_fp4", lambda p: p["weight_fp4"] + 16, "above 15"),
    ("mxfp4", "weight_scale", lambda p: torch.full_like(p["weight_scale"], 255), "NaN"),
    ("mxfp4", "weight_fp4", lambda p: p["weight_fp4"][:, :20], "multiple"),
]


@pytest.mark.parametrize("fmt,part,bad,expect", BAD, ids=[f"{b[0]}-{b[1]}-{b[3]}" for b in BAD])
def test_bad_parts_raise(fmt, part, bad, expect):
    parts = _good_parts()[fmt]
    K.get(fmt).from_parts(dict(parts))  # the good ones load
    parts[part] = bad(parts)
    with pytest.raises(TensorError) as e:
        K.get(fmt).from_parts(parts)
    assert part in str(e.value) and expect in str(e.value) and fmt in str(e.value)


@pytest.mark.parametrize("fmt", ["fp8_block", "w8a8_dynamic", "w8a8_static", "w4a16", "nvfp4", "mxfp4"])
def test_missing_unknown_parts_and_bias(fmt):
    parts = _good_parts()[fmt]
    cls = K.get(fmt)
    name = cls.parts[-1]
    with pytest.raises(TensorError, match=f"missing part.*{name}"):
        cls.from_parts({p: t for p, t in parts.items() if p != name})
    with pytest.raises(TensorError, match="unknown part.*extra"):
        cls.from_parts({**parts, "extra": torch.zeros(1)})
    with pytest.raises(TensorError, match=r"bias .*\[16\]"):
        cls.from_parts(parts, torch.zeros(15))


# ---- registry -----------------------------------------------------------------------------------

def test_registry():
    assert set(K.FORMATS) >= {"dense", "fp8_block", "w8a8_dynamic", "w8a8_static", "w4a16", "nvfp4", "mxfp4"}
    for fmt, parts in _good_parts().items():
        assert K.for_parts(set(parts)) is K.get(fmt)
        assert K.for_parts(set(parts) | {"bias"}) is K.get(fmt)
    assert K.for_parts({"weight"}) is K.Linear
    with pytest.raises(CvtError, match="no linear format stores exactly"):
        K.for_parts({"weight", "weight_scale"})
    with pytest.raises(CvtError, match="unknown linear format 'int3'.*w4a16"):
        K.get("int3")
    before = {n: K.FORMATS[n] for n in K.FORMATS}

    class Dup(K.Linear):
        fmt = "w4a16"

    with pytest.raises(CvtError, match="registered twice"):
        K.register(Dup)
    assert {n: K.FORMATS[n] for n in K.FORMATS} == before
