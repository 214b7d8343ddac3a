"""The Ascend 950 MX schemes and layouts (mxfp8 / w4a4_mxfp4 / w4a8_mxfp -> W8A8_MXFP8 / W4A4_MXFP4 /
W4A8_MXFP), pinned to the producer's and the consumer's code, written out here by hand:

* msModelSlim (MindStudio-ModelSlim, commit 1e4a534): ``msmodelslim/ir/api/impl/mx_quantization.py``
  calculate_mx_qparam, mxfp_per_block_quantize, _quant, _clamp_out, calculate_mxfp4_qparam,
  mxfp4_quantize, mxfp_per_block_dequantize; ``ir/qal/qbase.py`` _get_format_params (mxfp8_e4m3:
  ebits 4, mbits 5, emax 8, max_norm 448; mxfp4: ebits 2, mbits 3, emax 2); the observer
  ``core/observer/minmax.py`` MsMinMaxBlockObserver.update (max |x| per block, in x's dtype);
  the saver ``core/quant_service/modelslim_v1/save/ascendv1.py`` on_w8a8_mx_dynamic_per_block /
  on_w4a4_mx_dynamic_per_block / on_w4a8_mx_dynamic_per_block (weight ``.to(float8_e4m3fn)`` or
  ``pack_fp4_to_uint8``; ``weight_scale = (scale + 127).to(uint8)``; ``group_size = 32``) and
  ``save/utils/pack.py`` pack_fp4_to_uint8.
* vllm-ascend main (182b75e): ``vllm_ascend/quantization/methods/w8a8_mxfp8.py``
  AscendW8A8MXFP8DynamicLinearMethod.get_weight / get_pergroup_param (weight float8_e4m3fn
  [out, in], weight_scale uint8 [out, cdiv(in, group_size)]) and AscendW8A8MXFP8DynamicFusedMoEMethod
  get_weight / get_dynamic_quant_param (w13 / w2 float8_e4m3fn [E, n, k], scales uint8 [E, n, k //
  group_size]); ``w4a4_mxfp4.py`` (the same with uint8 [.., in // 2] weights) and ``w4a8_mxfp4.py``
  AscendW4A8MXFPDynamicFusedMoEMethod (uint8 [E, n, k // 2], scales uint8 [E, n, k // group_size]);
  every method reads ``quant_description.get("group_size", 32)``.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

import cvt.runtime.kernels as K
from cvt.errors import CvtError
from cvt.qtensor import kernel_formats as KF
from cvt.qtensor import layouts as L
from cvt.qtensor import mx as MX
from cvt.qtensor.formats import get_format
from cvt.qtensor.schemes import MXFP8, W4A4MXFP4, W4A8MXFP, get_scheme

SCHEMES = (MXFP8, W4A4MXFP4, W4A8MXFP)
TAG = {MXFP8.name: "W8A8_MXFP8", W4A4MXFP4.name: "W4A4_MXFP4", W4A8MXFP.name: "W4A8_MXFP"}
EXPERT = "model.layers.1.mlp.experts.0.gate_proj"


# ---- msModelSlim, by hand (literal copies of the functions named in the module docstring) -----------

FP32_EXPONENT_BIAS = 127
FP32_MIN_NORMAL = 2 ** (-FP32_EXPONENT_BIAS + 1)
MXFP8_FINFO = dict(ebits=4, mbits=5, emax=8, max_norm=2 ** 8 * 1.75, scale_bits=8)
MXFP4_FINFO = dict(ebits=2, mbits=3, emax=2, scale_bits=8)


def ms_calculate_mx_qparam(max_val):
    shared_exp = torch.floor(torch.log2(max_val + FP32_MIN_NORMAL * (max_val == 0).to(max_val.dtype)))
    shared_exp = shared_exp - MXFP8_FINFO["emax"]
    scale_emax = 2 ** (MXFP8_FINFO["scale_bits"] - 1) - 1
    shared_exp[shared_exp > scale_emax] = float("NaN")
    shared_exp[shared_exp < -scale_emax] = -scale_emax
    return shared_exp


def ms_quant(a, bits, exp, exp_bits):
    min_exp = - (2 ** (exp_bits - 1)) + 2
    exp = exp.clip(min=min_exp)
    bits_ = bits - 2
    a = a / (2 ** exp) * (2 ** bits_)
    a = torch.sign(a) * torch.floor(torch.abs(a) + 0.5)
    a = a / (2 ** bits_) * (2 ** exp)
    return a


def ms_clamp_out(out, a, max_norm):
    out = torch.clamp(out, min=-max_norm, max=max_norm)
    out[a == float("Inf")] = float("Inf")
    out[a == -float("Inf")] = -float("Inf")
    out[a == float("NaN")] = float("NaN")
    return out


def ms_mxfp_per_block_quantize(inp, shared_exp):
    dtype = inp.dtype
    inp = inp.to(torch.float32)
    inp = inp / (2 ** shared_exp)
    private_exp = torch.floor(torch.log2(torch.abs(inp) + (inp == 0).to(inp.dtype)))
    inp_ = inp.clone()
    inp = ms_quant(inp, MXFP8_FINFO["mbits"], private_exp, MXFP8_FINFO["ebits"])
    inp = ms_clamp_out(inp, inp_, MXFP8_FINFO["max_norm"])
    return inp.to(dtype)


def ms_calculate_mxfp4_qparam(max_val):
    man_shift_bit = MXFP4_FINFO["mbits"] - 2
    shared_exp = torch.floor(torch.log2(max_val / (1 - 0.5 ** (man_shift_bit + 2)) + 9.6e-7))
    shared_exp = shared_exp - MXFP4_FINFO["emax"]
    scale_emax = 2 ** (MXFP4_FINFO["scale_bits"] - 1) - 1
    return torch.clip(shared_exp, -scale_emax - MXFP4_FINFO["emax"], scale_emax - MXFP4_FINFO["emax"])


def ms_mxfp4_quantize(inp, shared_exp):
    dtype = inp.dtype
    inp = inp.to(torch.float32)
    x_unsigned = torch.abs(inp)
    sign = torch.sign(inp)
    x_biased = x_unsigned / torch.exp2(shared_exp)
    private_exp_with_bias = torch.floor(torch.log2(x_biased + 9.6e-7))
    min_exp = - (2 ** (MXFP4_FINFO["ebits"] - 1)) + 2
    private_exp = torch.clip(private_exp_with_bias, min_exp, MXFP4_FINFO["emax"])
    man_shift_bit = MXFP4_FINFO["mbits"] - 2
    mant_lshifted = x_biased / (2 ** private_exp) * (2 ** man_shift_bit)
    mant_trunc = torch.floor(mant_lshifted + 0.5)
    fp_value = mant_trunc / (2 ** man_shift_bit) * (2 ** private_exp)
    fp_val_max = 2 ** MXFP4_FINFO["emax"] * float(2 ** (man_shift_bit + 1) - 1) / 2 ** man_shift_bit
    fp_value = torch.clip(fp_value, -fp_val_max, fp_val_max)
    ind_nan = shared_exp < -127
    fp_value[torch.broadcast_to(ind_nan, fp_value.shape)] = 0
    return (sign * fp_value).to(dtype)


def ms_pack_fp4_to_uint8(x):
    m, n = x.shape
    kE2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=x.dtype)
    abs_indices = torch.argmin(torch.abs(torch.abs(x).unsqueeze(-1) - kE2M1), dim=-1)
    indices = (abs_indices + (torch.signbit(x).to(torch.long) << 3)).reshape(-1).reshape(-1, 2)
    return (indices[:, 0] | (indices[:, 1] << 4)).to(torch.uint8).reshape(m, n // 2)


def ms_weight(w: torch.Tensor, elem: str):
    """(on-disk weight, on-disk weight_scale, dequantized float32) as MXWeightPerBlockMinmax +
    the saver produce them for a weight `w` (in its own dtype, bf16 for the releases)."""
    n, k = w.shape
    blocks = w.reshape(n, k // 32, 32)
    max_val, _ = torch.max(torch.abs(blocks), dim=2, keepdim=True)  # the observer, clip 1.0
    if elem == MX.FP8:
        se = ms_calculate_mx_qparam(max_val)
        q = ms_mxfp_per_block_quantize(blocks, se)
        disk = q.reshape(n, k).cpu().to(torch.float8_e4m3fn)
    else:
        se = ms_calculate_mxfp4_qparam(max_val)
        q = ms_mxfp4_quantize(blocks, se)
        disk = ms_pack_fp4_to_uint8(q.reshape(n, k))
    deq = (q * (2 ** se)).reshape(n, k).float()  # mxfp_per_block_dequantize
    return disk, (se.squeeze(-1) + 127).to(torch.uint8), deq


def bf16_weight(n=16, k=256, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g).add(0.05) * 2.0 ** torch.randint(-12, 8, (n, 1), generator=g)
    w[0, :32] = 0                                                    # an all-zero block
    w[1, :32] = torch.linspace(-1, 1, 32) * 255.0                    # block max 255: log2 rounds to 8 in bf16
    w[2, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)  # E2M1 ties (max 6: scale 1)
    w[2, 32:64] = -w[2, :32]
    w[3, 64:96] = torch.tensor([448.0, 464.0, 480.0, 500.0] * 8) * 2.0 ** -9  # FP8 near and past 448
    w[4, :32] = -1e-3                                                # small negatives
    w[5, 96:128] = 2.0 ** -130                                       # subnormal-sized block
    return w.to(torch.bfloat16)


# ---- the scheme == msModelSlim's quantizer + saver, bit for bit -----------------------------------

@pytest.mark.parametrize("cls", SCHEMES, ids=lambda c: c.name)
def test_quantize_is_msmodelslims_bit_for_bit(cls):
    w = bf16_weight()
    disk, scale, deq = ms_weight(w, cls.elem)
    s = cls()
    q = s.quantize(w.float())
    lo = get_format("ascend").layout_for(EXPERT, q, expert=True)
    enc = lo.encode(q)
    assert torch.equal(enc["weight_scale"], scale)
    assert enc["weight"].dtype == disk.dtype and torch.equal(enc["weight"].view(torch.uint8), disk.view(torch.uint8))
    assert torch.equal(s.dequantize(q), deq)
    # the bf16 rounding of log2 matters: block max 255 takes exponent 0 (8 - 8), not -1 as in float32
    if cls.elem == MX.FP8:
        assert int(scale[1, 0]) == 127 and int(scale[0, 0]) == 0


def test_mx_elements_are_on_the_grid_and_round_half_away():
    v = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.25, -5.0])
    assert MX.quantize_elements(v, MX.FP4).tolist() == [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 6.0, -0.5, -6.0]
    # E4M3: 17 lies halfway between 16 and 18 -> 18; 500 saturates to 448; 2**-10 halfway to 2**-9 -> 2**-9
    assert MX.quantize_elements(torch.tensor([17.0, 500.0, 2.0 ** -10, -17.0]), MX.FP8).tolist() == \
        [18.0, 448.0, 2.0 ** -9, -18.0]


# ---- the layouts == vllm-ascend main's parameters --------------------------------------------------

VLLM_ASCEND_MAIN = {  # (tag, linear weight dtype, weight [n, k] -> shape): the methods' get_weight
    "mxfp8": ("W8A8_MXFP8", "F8_E4M3", lambda n, k: (n, k)),
    "w4a4_mxfp4": ("W4A4_MXFP4", "U8", lambda n, k: (n, k // 2)),
    "w4a8_mxfp": ("W4A8_MXFP", "U8", lambda n, k: (n, k // 2)),
}


@pytest.mark.parametrize("cls", SCHEMES, ids=lambda c: c.name)
def test_layout_names_dtypes_shapes_are_vllm_ascend_mains(cls):
    tag, wdt, wshape = VLLM_ASCEND_MAIN[cls.name]
    lo = L.select(L.ASCEND, cls.kernel_formats[0], L.VLLM_ASCEND, expert=True, group_size=32, k=256, module=EXPERT)
    assert lo.tag == tag and lo.targets == (L.VLLM_ASCEND,)
    n, k = 48, 256
    assert lo.shapes(n, k, 32) == {"weight": (wshape(n, k), wdt), "weight_scale": ((n, k // 32), "U8")}
    assert lo.split_units("k", 32, k) == 32 and lo.split_units("n", 32, k) == 1
    q = cls().quantize(torch.randn(n, k))
    enc = lo.encode(q)
    assert {s: (tuple(t.shape), t.dtype) for s, t in enc.items()} == {
        "weight": (wshape(n, k), torch.float8_e4m3fn if wdt == "F8_E4M3" else torch.uint8),
        "weight_scale": ((n, k // 32), torch.uint8)}
    back = lo.decode(EXPERT, enc)  # pack -> unpack exact
    assert back.kernel_fmt == q.kernel_fmt and back.group_size == 32
    assert all(torch.equal(back.parts[p].view(torch.uint8), q.parts[p].view(torch.uint8)) for p in q.parts)
    # the linear methods load W8A8_MXFP8 and W4A4_MXFP4; W4A8_MXFP is written for experts only
    linear = dict(expert=False, group_size=32, k=k, module="model.layers.0.self_attn.o_proj")
    if cls is W4A8MXFP:
        with pytest.raises(CvtError, match="for MoE experts only"):
            L.select(L.ASCEND, cls.kernel_formats[0], L.VLLM_ASCEND, **linear)
    else:
        assert L.select(L.ASCEND, cls.kernel_formats[0], L.VLLM_ASCEND, **linear) is lo


def test_shape_rules_and_options_are_refused_with_the_reason():
    fmt = get_format("ascend")
    with pytest.raises(CvtError, match=r"w4a4_mxfp4.*group size 32 does not divide in_features=48"):
        fmt.check_shape("m.o_proj", W4A4MXFP4(), (16, 48))
    # vllm-ascend's MoE methods view each scale row [k/32] as [k/64, 2] (process_weights_after_loading)
    with pytest.raises(CvtError, match="multiple of 64, got 96"):
        fmt.check_shape(EXPERT, MXFP8(), (16, 96), expert=True)
    fmt.check_shape("model.layers.0.self_attn.o_proj", MXFP8(), (16, 96))  # a linear pads: fine
    with pytest.raises(CvtError, match="fixed block of 32"):
        get_scheme("mxfp8", group_size=64)
    with pytest.raises(CvtError, match="symmetric only"):
        get_scheme("w4a8_mxfp", symmetric=False)
    with pytest.raises(CvtError, match="for mindie has no layout"):
        fmt.supports(MXFP8(), "mindie")


# ---- runtime kernels: dequant == the scheme's, forward == msModelSlim's fake-quant linear --------

@pytest.mark.parametrize("cls", SCHEMES, ids=lambda c: c.name)
def test_runtime_kernel_dequant_and_forward(cls):
    w = bf16_weight(n=24, k=128, seed=3)
    s = cls()
    q = s.quantize(w.float())
    lin = K.get(q.kernel_fmt).from_parts(q.parts, torch.randn(24))
    assert torch.equal(lin.dense_weight(), s.dequantize(q))
    x = (torch.randn(5, 128, generator=torch.Generator().manual_seed(1)) * 3).to(torch.bfloat16)
    # msModelSlim's W8A8MX / W4A4MX / W4A8MX DynamicPerBlockFakeQuantLinear.forward: x fake-quantized
    # per block of 32 with the activation element kind (MXFP8, or MXFP4 for W4A4), in x's dtype
    xb = x.reshape(5, 4, 32)
    mx_ = torch.max(torch.abs(xb), dim=2, keepdim=True)[0]
    if cls.act == MX.FP8:
        se = ms_calculate_mx_qparam(mx_)
        xq = ms_mxfp_per_block_quantize(xb, se) * (2 ** se)
    else:
        se = ms_calculate_mxfp4_qparam(mx_)
        xq = ms_mxfp4_quantize(xb, se) * (2 ** se)
    xq = xq.reshape(5, 128).float()
    assert torch.equal(MX.mx_fake_quant(x.float(), cls.act), xq)
    want = F.linear(xq, s.dequantize(q), lin.bias.float())
    torch.testing.assert_close(lin(x.float()), want, rtol=1e-6, atol=1e-6)
    assert lin(x).dtype == torch.bfloat16


@pytest.mark.parametrize("act_order", [False, True], ids=["natural", "act_order"])
@pytest.mark.parametrize("cls", SCHEMES, ids=lambda c: c.name)
def test_gptq_on_the_mx_grid(cls, act_order):
    """GPTQ (`cvt.quant.methods.gptq`) with the MX schemes: block scales from the scheme's RTN,
    each column's elements on msModelSlim's grid (`mx.quantize_elements`); beats RTN on a
    correlated layer and the stored tensor dequantizes (scheme and runtime kernel) to exactly
    GPTQ's columns."""
    from cvt.quant.methods import HessianAccumulator, gptq_quantize
    from cvt.tests.quant.test_methods import correlated_linear, out_err

    s = cls()
    x, w = correlated_linear()
    acc = HessianAccumulator(w.shape[1])
    for chunk in x.split(500):
        acc.add(chunk)
    r = gptq_quantize(w, acc.H, s, act_order=act_order)
    assert out_err(x, w, r.weight) < 0.8 * out_err(x, w, s.fake_quant(w))
    assert r.exact and torch.equal(s.dequantize(r.qtensor), r.weight)
    assert torch.equal(K.get(r.qtensor.kernel_fmt).from_parts(r.qtensor.parts).dense_weight(), r.weight)
    assert r.qtensor.parts["weight_scale"].dtype == torch.uint8


def test_for_parts_still_finds_weight_only_mxfp4():
    # the W4A4 / W4A8 MX kernels store the same parts as mxfp4: the loader picks by the manifest's kernel_fmt
    assert K.for_parts({"weight_fp4", "weight_scale"}) is K.get(KF.MXFP4)
    assert K.for_parts({"weight_fp8", "weight_scale"}) is K.get(KF.MXFP8)


# ---- end to end on the tiny release: written, described, loaded, sharded --------------------------

@pytest.fixture(scope="module")
def outputs(fp8_release_session, tmp_path_factory):
    from cvt.quant.stage import quantize

    root = tmp_path_factory.mktemp("mx")
    out = {}
    for cls in SCHEMES:
        quantize(fp8_release_session, root / cls.name, fmt="ascend", scheme=cls.name, quiet=True)
        out[cls.name] = root / cls.name
    return out


def _headers(folder):
    out = {}
    for f in sorted(folder.glob("quant_model_weights-*.safetensors")):
        with safe_open(f, framework="pt") as h:
            for k in h.keys():
                sl = h.get_slice(k)
                out[k] = (sl.get_dtype(), tuple(sl.get_shape()))
    return out


@pytest.mark.parametrize("cls", SCHEMES, ids=lambda c: c.name)
def test_output_tensors_tags_and_description(outputs, cls):
    d = outputs[cls.name]
    desc = json.loads((d / "quant_model_description.json").read_text())
    tag, wdt, wshape = VLLM_ASCEND_MAIN[cls.name]
    # msModelSlim's saver sets group_size 32; vllm-ascend divides by it (0 would fail)
    assert desc["model_quant_type"] == tag and desc["group_size"] == 32
    man = json.loads((d / "cvt_manifest.json").read_text())["quant"]["tensors"]
    assert man
    got = _headers(d)
    experts = 0
    for m, t in man.items():
        n, k = got[f"{m}.weight_scale"][1][0], got[f"{m}.weight_scale"][1][1] * 32
        assert got[f"{m}.weight"] == (wdt, wshape(n, k)) and got[f"{m}.weight_scale"] == ("U8", (n, k // 32))
        assert desc[f"{m}.weight"] == desc[f"{m}.weight_scale"] == tag
        assert t["kernel_fmt"] == cls.kernel_formats[0]
        experts += ".experts." in m
    assert experts and (cls is not W4A8MXFP or experts == len(man))
    assert cls is W4A8MXFP or any(".self_attn." in m for m in man)


@pytest.mark.parametrize("cls", SCHEMES, ids=lambda c: c.name)
def test_output_loads_and_runs_with_the_mx_kernels(outputs, cls):
    from cvt.runtime.loader import load_model

    loaded = load_model(outputs[cls.name], dtype=torch.float32)
    fmts = {type(m).fmt for m in loaded.model.modules() if hasattr(m, "fmt")}
    assert cls.kernel_formats[0] in fmts
    logits = loaded.model(torch.tensor([[1, 2, 3, 4]]))
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("cls", SCHEMES, ids=lambda c: c.name)
def test_fp8_in_one_pass_is_byte_identical_to_going_through_bf16(outputs, fp8_release_session, tmp_path_factory, cls):
    """Issue 40 item 4: `cvt quantize --scheme <mx>` straight from the FP8 block release (each FP8
    weight dequantized to BF16 on the fly, never stored, then quantized by the fused kernel) writes
    the very files `cvt fp8-to-bf16` then `cvt quantize` of that BF16 writes: every tensor's bytes,
    the description and the config."""
    from cvt.convert.fp8_to_bf16 import fp8_to_bf16
    from cvt.quant.stage import quantize

    root = tmp_path_factory.mktemp("mx-via-bf16")
    bf16 = fp8_to_bf16(fp8_release_session, root / "bf16", quiet=True).dst
    via = quantize(bf16, root / cls.name, fmt="ascend", scheme=cls.name, quiet=True).dst
    direct = outputs[cls.name]
    for name in ("quant_model_description.json", "config.json"):
        assert (direct / name).read_bytes() == (via / name).read_bytes(), name
    a, b = _tensors(direct), _tensors(via)
    assert set(a) == set(b) and len(a) > 50
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), k


def _tensors(folder) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_shard_reassembles_byte_exact(outputs, tmp_path):
    """TP 2 over the experts: gate / up split rows, down splits k in whole 32-blocks (weight bytes
    and scale columns together); every piece concatenates back to the unsharded bytes."""
    from safetensors.torch import load_file

    from cvt.convert.placement import make_layout
    from cvt.convert.shard import shard

    d = outputs[W4A4MXFP4.name]
    out = shard(d, tmp_path / "tp", make_layout(4, tp=4, ep=2, moe_tp=2, dense_tp=2, embed_tp=1), quiet=True).dst
    whole = {k: v for f in d.glob("*.safetensors") for k, v in load_file(f).items()}
    e = "model.layers.1.mlp.experts.0."
    held: dict[str, list] = {}
    for f in sorted(out.glob("rank-*/*.safetensors")):
        for k, v in load_file(f).items():
            if k.startswith(e):
                held.setdefault(k, []).append(v)
    for p in ("weight", "weight_scale"):
        assert len(held[e + "down_proj." + p]) == 2
        assert torch.equal(torch.cat(held[e + "down_proj." + p], 1), whole[e + "down_proj." + p]), p
        assert torch.equal(torch.cat(held[e + "gate_proj." + p], 0), whole[e + "gate_proj." + p]), p


def test_shard_keeps_each_ranks_expert_in_features_a_multiple_of_64(outputs, tmp_path):
    """moe_tp 4 would give each rank 32 of down_proj's 128 in_features: vllm-ascend's MX MoE
    method views each expert's scale row in pairs (Layout.expert_k, 64), so that layout is refused
    before any rank file is written, naming the unit and the valid moe_tp; moe_tp 2 (64) is not."""
    from cvt.convert.placement import make_layout
    from cvt.convert.shard import shard

    d = outputs[W4A8MXFP.name]
    dst = tmp_path / "tp4"
    with pytest.raises(CvtError) as err:
        shard(d, dst, make_layout(4, tp=4, ep=1, moe_tp=4, dense_tp=1, embed_tp=1), quiet=True)
    msg = str(err.value)
    assert "down_proj" in msg and "expert in_features unit of 64" in msg and "moe_tp" in msg, msg
    assert not any(dst.glob("rank-*/*.safetensors"))


# ---- quality on the trained fixture (docs/quantize.md's table) ----------------------------------------

@pytest.mark.slow
def test_mx_quality_rows_on_the_trained_fixture(trained_fixture, tmp_path):
    """`cvt quantize FIXTURE S --scheme S --format ascend` + `cvt verify` as the quantize page's table runs
    them (RTN; the fp8 FAKQuant cache calibrated on 2048 tokens); the page's numbers are these.
    W4A4 (activations in E2M1 too) loses the most, W4A8_MXFP (experts only) the least."""
    from cvt.quant.stage import quantize
    from cvt.tests.quant.test_methods_e2e import assert_readme_row, kl_and_ppl

    rows = {"mxfp8 (W8A8_MXFP8), rtn": dict(scheme="mxfp8"),
            "w4a4_mxfp4 (W4A4_MXFP4), rtn (the 96-wide q_b_proj float: 0.23)": dict(scheme="w4a4_mxfp4"),
            "w4a8_mxfp (W4A8_MXFP, experts), rtn": dict(scheme="w4a8_mxfp"),
            "w8a8c8 with the fp8 FAKQuant cache (--kv-dtype fp8), rtn": dict(scheme="w8a8c8", kv_dtype="fp8",
                                                                              calib_tokens=2048)}
    got = {}
    for i, (label, kw) in enumerate(rows.items()):
        dst = tmp_path / f"q{i}"
        quantize(trained_fixture, dst, fmt="ascend", quiet=True, **kw)
        got[label] = kl_and_ppl(dst, trained_fixture, tmp_path)
        assert_readme_row(label, got[label])
    kls = [v[0] for v in got.values()]
    assert kls[1] > kls[0] > kls[2]
