"""Formats: exact disk layouts (FORMATS.md 2.2 / 2.3), read(disk_tensors(q)) == q, and the referee:
the compressed-tensors package's own decompression reproduces cvt's dequantized weights."""

from __future__ import annotations

import json

import pytest
import torch

import cvt.runtime.kernels as K
from cvt.errors import FormatError
from cvt.qtensor.formats import format_names, get_format
from cvt.qtensor.formats.compressed_tensors import kv_cache_int8
from cvt.qtensor.schemes import QuantizedTensor, get_scheme, static_parts

N, KF = 24, 256
I8, I32, U8, F32, BF16, E4M3, I64 = torch.int8, torch.int32, torch.uint8, torch.float32, torch.bfloat16, \
    torch.float8_e4m3fn, torch.int64
W4 = [(g, sym) for g in (32, 64, 128, 0) for sym in (True, False)]


def weight(n=N, k=KF, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 0.1


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point and a.element_size() == 1:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


def assert_same_qt(a: QuantizedTensor, b: QuantizedTensor) -> None:
    assert (a.scheme, a.kernel_fmt, tuple(a.shape), a.group_size, a.symmetric) == \
        (b.scheme, b.kernel_fmt, tuple(b.shape), b.group_size, b.symmetric)
    assert sorted(a.parts) == sorted(b.parts) and sorted(a.extra) == sorted(b.extra)
    for k in a.parts:
        assert same_tensor(a.parts[k], b.parts[k]), k
    for k, v in a.extra.items():
        assert same_tensor(v, b.extra[k]) if isinstance(v, torch.Tensor) else v == b.extra[k], k


def layout(out: dict) -> dict:
    return {k: (v.dtype, tuple(v.shape)) for k, v in out.items()}


def static_qt(fp16_model=False) -> QuantizedTensor:
    q = get_scheme("w8a8", static_activations=True).quantize(weight())
    return static_parts(q, 0.02, -3.0, torch.randn(N, generator=torch.Generator().manual_seed(5)), fp16_model)


# ---- registry and refusals ------------------------------------------------------------------------

def test_registry_and_refusals():
    assert format_names() == ["ascend", "compressed-tensors"]
    with pytest.raises(FormatError, match=r"unknown output format 'gguf' \(known: ascend, compressed-tensors\)"):
        get_format("gguf")
    asc, ct = get_format("ascend"), get_format("compressed-tensors")
    assert (asc.weights_prefix, ct.weights_prefix) == ("quant_model_weights", "model")
    with pytest.raises(FormatError, match=r"for vllm-ascend has no layout for scheme 'fp4' \(nvfp4\).*MXFP4 for MoE"):
        asc.supports(get_scheme("fp4"))
    with pytest.raises(FormatError, match=r"for mindie has no layout for scheme 'fp4' \(mxfp4\)"):
        asc.supports(get_scheme("fp4", fp4_format="mxfp4"), "mindie")
    with pytest.raises(FormatError, match=r"--target 'vllm' does not apply to the ascend format"):
        asc.supports(get_scheme("w8a8"), "vllm")
    asc.supports(get_scheme("fp4", fp4_format="mxfp4"))
    with pytest.raises(FormatError, match="static activations is Ascend-only"):
        ct.supports(get_scheme("w8a8", static_activations=True))
    with pytest.raises(FormatError, match="no layout for static W8A8"):
        ct.disk_tensors("m", static_qt())
    for name in ("w8a8", "w8a8c8", "w4a16", "fp4"):
        ct.supports(get_scheme(name))


def test_ascend_w4a16_shape_checks_name_the_module():
    asc = get_format("ascend")
    mi = {"target": "mindie"}
    with pytest.raises(FormatError, match=r"model.layers.0.mlp.down_proj.weight \[7, 128\]: weight packs 2 along "
                                          r"out_features, which must be a multiple of 2"):
        asc.check_shape("model.layers.0.mlp.down_proj", get_scheme("w4a16", group_size=64), (7, 128), **mi)
    with pytest.raises(FormatError, match=r"\[8, 33\]: weight packs 2 along in_features"):
        asc.check_shape("m", get_scheme("w4a16", group_size=0), (8, 33), **mi)
    asc.check_shape("m", get_scheme("w4a16", group_size=0), (7, 64), **mi)
    # MindIE's group sizes (atb_llm models/base/config.py: group_size in [0, 64, 128, 256])
    with pytest.raises(FormatError, match=r"mindie loads w4a16 only with .*group sizes 64, 128, 256.*not group size 32"):
        asc.check_shape("m", get_scheme("w4a16", group_size=32), (8, 64), **mi)
    # vllm-ascend: W4A16 registered for ("W4A16", "moe") only; its group size is divided by
    with pytest.raises(FormatError, match=r"m: vllm-ascend loads W4A16 \(ascend-w4a16-int32\) for MoE experts only"):
        asc.check_shape("m", get_scheme("w4a16", group_size=32), (8, 64))
    with pytest.raises(FormatError, match=r"vllm-ascend loads w4a16 only with grouped scales, not per channel.*0 fails"):
        asc.check_shape("m", get_scheme("w4a16", group_size=0), (8, 64), expert=True)
    asc.check_shape("m", get_scheme("w4a16", group_size=32), (8, 64), expert=True)


# ---- Ascend layouts -------------------------------------------------------------------------------

def test_ascend_w8a8_dynamic_layout_tags_and_read():
    asc = get_format("ascend")
    for name in ("w8a8", "w8a8c8"):
        q = get_scheme(name).quantize(weight())
        out = asc.disk_tensors("x", q, bias=torch.ones(N, dtype=BF16))
        assert layout(out) == {"x.weight": (I8, (N, KF)), "x.weight_scale": (F32, (N, 1)),
                               "x.weight_offset": (F32, (N, 1)), "x.bias": (BF16, (N,))}
        assert not bool(out["x.weight_offset"].any())
        tags = asc.tags("x", q, bias=True)
        assert tags == {"x.weight": "W8A8_DYNAMIC", "x.weight_scale": "W8A8_DYNAMIC",
                        "x.weight_offset": "W8A8_DYNAMIC", "x.bias": "FLOAT"}
        desc = asc.description(tags, kv_cache="C8" if get_scheme(name).kv_cache else None)
        assert_same_qt(asc.read("x", out, desc), q)


@pytest.mark.parametrize("fp16_model", [False, True])
def test_ascend_w8a8_static_layout_and_read(fp16_model):
    asc = get_format("ascend")
    q = static_qt(fp16_model)
    out = asc.disk_tensors("x", q)
    assert layout(out) == {"x.weight": (I8, (N, KF)), "x.input_scale": (F32, (1,)), "x.input_offset": (F32, (1,)),
                           "x.deq_scale": (I64 if fp16_model else F32, (N,)), "x.quant_bias": (I32, (N,)),
                           "x.weight_scale": (F32, (N, 1)), "x.weight_offset": (F32, (N, 1))}
    assert set(asc.tags("x", q).values()) == {"W8A8"} and set(asc.tags("x", q)) == set(out)
    assert_same_qt(asc.read("x", out, "W8A8"), q)
    mod = K.get("w8a8_static").from_parts(asc.read("x", out, "W8A8").parts)
    assert torch.equal(mod.dense_weight(), get_scheme("w8a8").dequantize(q))


W4_MINDIE = [(g, sym) for g in (64, 128, 0) for sym in (True, False)]


@pytest.mark.parametrize("g,sym", W4_MINDIE, ids=[f"g{g}-{'sym' if s else 'asym'}" for g, s in W4_MINDIE])
def test_ascend_w4a16_mindie_layout_and_read(g, sym):
    """MindIE's W4A16 (atb_llm utils/quantize/w4a16.py W4A16LinearStatic; msModelSlim llm_ptq
    complex_quantifier._w4a16_pack_int4): int8, two int4 per byte, even element low nibble; per
    group packed along n ([n/2, k]), per channel along k ([n, k/2]); f32 scale / offset [n, k/G]."""
    asc = get_format("ascend")
    s = get_scheme("w4a16", group_size=g, symmetric=sym)
    q = s.quantize(weight())
    out = asc.disk_tensors("x", q, target="mindie")
    ng = KF // g if g else 1
    packed = (N // 2, KF) if g else (N, KF // 2)  # per group: pairs of output channels; per channel: along k
    assert layout(out) == {"x.weight": (I8, packed), "x.weight_scale": (F32, (N, ng)), "x.weight_offset": (F32, (N, ng))}
    # the pair-of-output-channels rule, checked by hand on one byte
    q4 = q.parts["weight_int4"]
    lo, hi = (q4[0, 0], q4[1, 0]) if g else (q4[0, 0], q4[0, 1])
    assert int(out["x.weight"][0, 0]) & 0xFF == ((int(lo) & 0xF) | ((int(hi) & 0xF) << 4))
    got = asc.read("x", out, {"x.weight": "W4A16"})
    assert_same_qt(got, q)
    assert torch.equal(K.W4A16Linear.from_parts(got.parts).dense_weight(), s.dequantize(q))


@pytest.mark.parametrize("g", [32, 64, 128])
def test_ascend_w4a16_vllm_ascend_layout_and_read(g):
    """vllm-ascend's ("W4A16", "moe") method (quantization/methods/w4a16.py): per expert
    weight_packed int32 [n, k/8] (unpack_from_int32: element i at bits 4i, value + 8),
    weight_scale [n, k/G], weight_shape int32 [2]; no zero points."""
    asc = get_format("ascend")
    s = get_scheme("w4a16", group_size=g)
    q = s.quantize(weight())
    out = asc.disk_tensors("x", q, expert=True)
    assert layout(out) == {"x.weight_packed": (I32, (N, KF // 8)), "x.weight_scale": (BF16, (N, KF // g)),
                           "x.weight_shape": (I32, (2,))}
    w = int(out["x.weight_packed"][0, 0]) & 0xFFFFFFFF
    assert [((w >> (4 * i)) & 0xF) - 8 for i in range(8)] == q.parts["weight_int4"][0, :8].tolist()
    assert set(asc.tags("x", q, expert=True).values()) == {"W4A16"}
    got = asc.read("x", out, {"x.weight_packed": "W4A16"})
    assert_same_qt(got, q)
    with pytest.raises(FormatError, match="loads no zero points"):
        asc.disk_tensors("x", get_scheme("w4a16", group_size=g, symmetric=False).quantize(weight()), expert=True)


def test_ascend_mxfp4_vllm_ascend_layout_and_read():
    """vllm-ascend's ("W4A16_MXFP4", "moe") (quantization/methods/w4a16_mxfp4.py): weight uint8
    [n, k/2] (unpack_uint8_to_fp4: low nibble first), weight_scale uint8 E8M0 [n, k/32]."""
    asc = get_format("ascend")
    s = get_scheme("fp4", fp4_format="mxfp4")
    q = s.quantize(weight())
    out = asc.disk_tensors("x", q, expert=True)
    assert layout(out) == {"x.weight": (U8, (N, KF // 2)), "x.weight_scale": (U8, (N, KF // 32))}
    c = q.parts["weight_fp4"]
    assert int(out["x.weight"][0, 0]) == int(c[0, 0]) | (int(c[0, 1]) << 4)
    assert set(asc.tags("x", q, expert=True).values()) == {"W4A16_MXFP4"}
    assert_same_qt(asc.read("x", out, {"x.weight": "W4A16_MXFP4"}), q)
    with pytest.raises(FormatError, match="for MoE experts only"):
        asc.disk_tensors("x", q)


def test_ascend_w4a16_row_parallel_shard_with_one_group_per_row_reads_back():
    """A TP shard (half of k) of a grouped weight whose k holds two groups: the rank's scale is
    [n, 1], like a per-channel one, but its weight is still packed in row pairs [n/2, k/2]."""
    asc = get_format("ascend")
    g = KF // 2
    s = get_scheme("w4a16", group_size=g, symmetric=False)
    q = s.quantize(weight())
    out = asc.disk_tensors("x", q, target="mindie")
    half = {k: v[:, v.shape[1] // 2:].contiguous() for k, v in out.items()}  # the second run of dim 1
    assert half["x.weight_scale"].shape == (N, 1) and half["x.weight"].shape == (N // 2, KF // 2)
    got = asc.read("x", half, {"x.weight": "W4A16"})
    assert torch.equal(got.parts["weight_int4"], q.parts["weight_int4"][:, KF // 2:])
    dense = s.dequantize(q)[:, KF // 2:]
    assert torch.equal(K.W4A16Linear.from_parts(got.parts).dense_weight(), dense)


def test_ascend_description():
    asc = get_format("ascend")
    tags = {}
    for i in range(3):
        tags.update(asc.tags(f"model.layers.{i}.mlp.down_proj", get_scheme("w8a8").quantize(weight(8, 64))))
    tags.update(asc.tags("model.layers.0.self_attn.o_proj", static_qt()))
    tags.update({"model.embed_tokens.weight": "FLOAT", "lm_head.weight": "FLOAT", "model.norm.weight": "FLOAT"})
    d = asc.description(tags, kv_cache="C8")
    # msModelSlim 26.1 save/ascendv1.py update_quant_type: static W8A8 outranks W8A8_DYNAMIC
    assert d["model_quant_type"] == "W8A8" and d["version"] == "1.0.0" and d["group_size"] == 0
    assert d["kv_cache_type"] == d["kv_quant_type"] == "C8" and d["lm_head.weight"] == "FLOAT"
    assert asc.description(tags, kv_cache="FAKQuant")["fa_quant_type"] == "FAKQuant"
    assert d["model.layers.0.self_attn.o_proj.deq_scale"] == "W8A8"
    json.dumps(d)
    w4 = asc.tags("e", get_scheme("w4a16", group_size=64).quantize(weight()), target="mindie")
    d4 = asc.description({**w4, "lm_head.weight": "FLOAT"}, group_size=64)
    assert (d4["model_quant_type"], d4["group_size"], "kv_cache_type" in d4) == ("W4A16", 64, False)
    assert asc.description({"a.weight": "FLOAT"})["model_quant_type"] == "FLOAT"
    with pytest.raises(FormatError, match="no type tag for m.weight"):
        asc.read("m", asc.disk_tensors("m", get_scheme("w8a8").quantize(weight())), {})


# ---- compressed-tensors layouts -------------------------------------------------------------------

CT_CASES = [("w8a8", {}), ("w8a8c8", {})] + [("w4a16", {"group_size": g, "symmetric": s}) for g, s in W4] + \
    [("fp4", {"fp4_format": "nvfp4"}), ("fp4", {"fp4_format": "mxfp4"})]
CT_IDS = [f"{n}-" + "-".join(f"{k}={v}" for k, v in o.items()) for n, o in CT_CASES]


def ct_layout(name, opts, n=N, k=KF):
    if name.startswith("w8a8"):
        return {"x.weight": (I8, (n, k)), "x.weight_scale": (F32, (n, 1))}
    if name == "w4a16":
        g = opts["group_size"]
        lay = {"x.weight_packed": (I32, (n, -(-k // 8))), "x.weight_scale": (BF16, (n, k // g if g else 1)),
               "x.weight_shape": (I32, (2,))}
        if not opts["symmetric"]:
            lay["x.weight_zero_point"] = (I32, (-(-n // 8), k // g if g else 1))
        return lay
    if opts["fp4_format"] == "nvfp4":
        return {"x.weight_packed": (U8, (n, k // 2)), "x.weight_scale": (E4M3, (n, k // 16)),
                "x.weight_global_scale": (F32, (1,))}
    return {"x.weight_packed": (U8, (n, k // 2)), "x.weight_scale": (U8, (n, k // 32))}


@pytest.mark.parametrize("name,opts", CT_CASES, ids=CT_IDS)
@pytest.mark.parametrize("shape", [(N, KF), (20, 384)], ids=["24x256", "20x384"])
def test_ct_layout_and_read(name, opts, shape):
    ct = get_format("compressed-tensors")
    s = get_scheme(name, **opts)
    q = s.quantize(weight(*shape))
    out = ct.disk_tensors("x", q, bias=torch.zeros(shape[0]))
    assert layout(out) == {**ct_layout(name, opts, *shape), "x.bias": (F32, (shape[0],))}
    if name == "w4a16":
        assert out["x.weight_shape"].tolist() == list(shape)
    cfg = ct.quantization_config([s], ["lm_head"], kv_cache_int8() if s.kv_cache else None)
    assert_same_qt(ct.read("x", out, cfg), q)
    # the runtime kernel built from what the layout reads
    cls = K.get(q.kernel_fmt)
    mod = cls.from_parts(ct.read("x", out, cfg).parts)
    assert torch.equal(mod.dense_weight(), s.dequantize(q))


def test_ct_quantization_config():
    ct = get_format("compressed-tensors")
    cfg = ct.quantization_config([get_scheme("w4a16", group_size=32)], ["lm_head", "re:.*mlp.gate$", "lm_head"])
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == "pack-quantized"
    assert cfg["quantization_status"] == "compressed" and cfg["kv_cache_scheme"] is None
    assert cfg["ignore"] == ["lm_head", "re:.*mlp.gate$"]
    assert cfg["config_groups"]["group_0"]["targets"] == ["Linear"]
    assert cfg["config_groups"]["group_0"]["weights"] == {"num_bits": 4, "type": "int", "symmetric": True,
                                                          "group_size": 32, "strategy": "group", "dynamic": False}
    assert cfg["config_groups"]["group_0"]["input_activations"] is None
    with pytest.raises(FormatError, match="each needs explicit targets"):
        ct.quantization_config([get_scheme("w4a16"), get_scheme("w8a8")])
    mixed = ct.quantization_config([(get_scheme("w4a16"), ["re:.*experts.*"]), (get_scheme("w8a8"), ["re:.*self_attn.*"])])
    assert mixed["format"] == "mixed-precision" and mixed["config_groups"]["group_1"]["format"] == "int-quantized"
    with pytest.raises(FormatError, match="needs kv_cache_scheme"):
        ct.quantization_config([get_scheme("w8a8c8")])
    with pytest.raises(FormatError, match="does not compile"):
        ct.quantization_config([get_scheme("w8a8")], ["re:(("])
    with pytest.raises(FormatError, match="'lm_head' is in the ignore list"):
        ct.read("lm_head", {}, cfg)
    qc = pytest.importorskip("compressed_tensors.quantization")
    for c in (cfg, mixed, ct.quantization_config([get_scheme("w8a8c8")], [], kv_cache_int8("attn_head")),
              ct.quantization_config([get_scheme("fp4")]), ct.quantization_config([get_scheme("fp4", fp4_format="mxfp4")])):
        qc.QuantizationConfig.model_validate(c)  # the package accepts what we write


# ---- the referee: compressed-tensors' own decompression -------------------------------------------

def _dequantize_with_compressed_tensors(tmp_path, scheme, weights: dict[str, torch.Tensor]):
    """Write a tiny checkpoint (config.json + model.safetensors), run the package's model-free
    dequantizer (convert_checkpoint + CompressedTensorsDequantizer) to float32, read it back."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.entrypoints.convert import convert_checkpoint
    from compressed_tensors.entrypoints.convert.converters import CompressedTensorsDequantizer
    from safetensors.torch import load_file, save_file

    ct = get_format("compressed-tensors")
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    tensors = {"model.embed_tokens.weight": torch.randn(10, KF).bfloat16(), "model.norm.weight": torch.ones(KF).bfloat16(),
               "lm_head.weight": torch.randn(10, KF).bfloat16()}
    qts = {}
    for mod, w in weights.items():
        qts[mod] = scheme.quantize(w)
        tensors.update(ct.disk_tensors(mod, qts[mod]))
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    cfg = ct.quantization_config([scheme], ["lm_head"], kv_cache_int8() if scheme.kv_cache else None)
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": cfg}))
    deq = CompressedTensorsDequantizer(src, ignore=["model.embed_tokens", "lm_head", "re:.*norm$"], dtype=torch.float32)
    convert_checkpoint(src, dst, deq, device="cpu", max_workers=1)
    got = {}
    for f in dst.glob("*.safetensors"):
        got.update(load_file(str(f)))
    assert torch.equal(got["lm_head.weight"], tensors["lm_head.weight"])  # ignored modules pass through
    return {m: (scheme.dequantize(q), got[f"{m}.weight"]) for m, q in qts.items()}


REFEREE = [("w8a8", {})] + [("w4a16", {"group_size": g, "symmetric": s}) for g, s in W4] + \
    [("fp4", {"fp4_format": "nvfp4"}), ("fp4", {"fp4_format": "mxfp4"})]


@pytest.mark.parametrize("name,opts", REFEREE, ids=[f"{n}-" + "-".join(f"{k}={v}" for k, v in o.items())
                                                    for n, o in REFEREE])
def test_referee_compressed_tensors_dequantizer(tmp_path, name, opts):
    """int-quantized and mxfp4 come back bit-exact in float32. pack-quantized and nvfp4 are
    computed by the package in bfloat16 (pack-quantized multiplies in the bf16 scale's dtype;
    nvfp4 unpacks to bf16 and casts its float32 product to bf16), so they are compared with
    cvt's float32 dequant rounded to bf16: exactly equal. `test_referee_float32_building_blocks`
    checks those two in float32 through the package's own unpack + dequantize functions."""
    w = {"model.layers.0.mlp.down_proj": weight(N, KF, 1), "model.layers.0.mlp.experts.3.up_proj": weight(40, KF, 2)}
    for mod, (ours, theirs) in _dequantize_with_compressed_tensors(tmp_path, get_scheme(name, **opts), w).items():
        assert theirs.dtype == torch.float32 and theirs.shape == ours.shape, mod
        exact_f32 = name == "w8a8" or opts.get("fp4_format") == "mxfp4"
        assert torch.equal(theirs, ours if exact_f32 else ours.bfloat16().float()), mod


@pytest.mark.parametrize("name,opts", REFEREE[1:], ids=[f"{n}-" + "-".join(f"{k}={v}" for k, v in o.items())
                                                        for n, o in REFEREE[1:]])
def test_referee_float32_building_blocks(name, opts):
    """The package's unpackers + `dequantize` (QuantizationArgs from our config) in float32: exact."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.mx_utils import decompress_mx_scale
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    ct = get_format("compressed-tensors")
    s = get_scheme(name, **opts)
    q = s.quantize(weight(N, KF, 3))
    d = {k[2:]: v for k, v in ct.disk_tensors("x", q).items()}
    args = QuantizationConfig.model_validate(ct.quantization_config([s])).config_groups["group_0"].weights
    if name == "w4a16":
        shape = torch.Size(d["weight_shape"].tolist())
        zp = None if s.symmetric else unpack_from_int32(d["weight_zero_point"], 4, (N, d["weight_scale"].shape[1]), 0)
        got = dequantize(unpack_from_int32(d["weight_packed"], 4, shape), d["weight_scale"].float(), zp, args)
    else:
        vals = unpack_fp4_from_uint8(d["weight_packed"], N, KF, dtype=torch.float32)
        if opts["fp4_format"] == "nvfp4":
            got = dequantize(vals, d["weight_scale"].float(), None, args, global_scale=d["weight_global_scale"])
        else:
            got = dequantize(vals, decompress_mx_scale(d["weight_scale"]).float(), None, args)
    assert got.dtype == torch.float32 and torch.equal(got, s.dequantize(q))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_our_fp4_quantizer_matches_compressed_tensors(fmt):
    """Not only decompression: c-t's own observer math + quantize + pack give our exact bytes."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.mx_utils import compress_mx_scale
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    w = weight(N, KF, 4)
    w[0, :32] = 0.0
    w[2, 40] = 7.0 * float(w[2].abs().max())
    ct = get_format("compressed-tensors")
    d = ct.disk_tensors("x", get_scheme("fp4", fp4_format=fmt).quantize(w))
    g = 16 if fmt == "nvfp4" else 32
    grp = w.reshape(N, -1, g)
    if fmt == "nvfp4":
        args = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True,
                                dynamic=False, scale_dtype=torch.float8_e4m3fn)
        gs = generate_gparam(w.amin(), w.amax())
        sc, _ = calculate_qparams(grp.amin(-1), grp.amax(-1), args, global_scale=gs)
        vals = quantize(w, sc, None, args, global_scale=gs)
        assert torch.equal(d["x.weight_global_scale"], gs)
        assert torch.equal(d["x.weight_scale"].view(torch.uint8), sc.to(torch.float8_e4m3fn).view(torch.uint8))
    else:
        args = QuantizationArgs(num_bits=4, type="float", strategy="group", group_size=32, symmetric=True,
                                dynamic=False, scale_dtype=torch.uint8)
        sc, _ = calculate_qparams(grp.amin(-1), grp.amax(-1), args)
        vals = quantize(w, sc, None, args)
        assert torch.equal(d["x.weight_scale"], compress_mx_scale(sc, torch.uint8))
    assert torch.equal(d["x.weight_packed"], pack_fp4_to_uint8(vals))


@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
def test_our_int4_quantizer_matches_compressed_tensors(sym):
    """c-t's calculate_qparams gives our scales once rounded to bf16 (we store bf16 scales), the same
    zero points, and its quantize() with our scales gives our int4 values."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    w = weight(N, KF, 6)
    q = get_scheme("w4a16", group_size=32, symmetric=sym).quantize(w)
    args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=32, symmetric=sym)
    grp = w.reshape(N, -1, 32)
    sc, zp = calculate_qparams(grp.amin(-1), grp.amax(-1), args)
    assert torch.equal(sc.bfloat16().float(), q.parts["weight_scale"])
    assert torch.equal(zp.float(), q.parts["weight_offset"])
    got = quantize(w, q.parts["weight_scale"], None if sym else q.parts["weight_offset"].to(torch.int8), args,
                   dtype=torch.int8)
    assert torch.equal(got, q.parts["weight_int4"])
