"""`cvt quantize` of a DeepSeek-V4 release itself: FP8 linears dequantized on the fly, the FP4
routed experts carried over into W4A8_MXFP (and the other E2M1 / E8M0-32 layouts) without
requantizing, requantized from their exact dequant for every other scheme.

Both sides, written out here by hand (independently of cvt):

* the release: DeepSeek's V4 ``inference/convert.py`` (``FP4_TABLE``: code 8 is +0.0;
  ``cast_e2m1fn_to_e4m3fn``: element 2i in the low nibble of the int8 byte, times the
  float8_e8m0fnu scale of its 32 inputs) and ``inference/model.py`` ``Linear`` (FP4 weight int8
  ``[n, k/2]``, scale float8_e8m0fnu ``[n, k/32]``);
* the Ascend side: msModelSlim's saver ``save/ascendv1.py`` on_w4a8_mx_dynamic_per_block
  (``pack_fp4_to_uint8``: element 2j in the low nibble, code ``signbit << 3 | index`` into
  {0, .5, 1, 1.5, 2, 3, 4, 6}; ``weight_scale = (exponent + 127).to(uint8)``) and vllm-ascend
  main's ``quantization/methods/w4a8_mxfp4.py`` AscendW4A8MXFPDynamicFusedMoEMethod (uint8
  ``[E, n, k // 2]`` weights, uint8 ``[E, n, k // 32]`` scales).
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors import safe_open

from cvt.testing.checkpoints_v4 import write_v4_release
from cvt.tests.conftest import run_cvt

# DeepSeek's V4 inference/convert.py FP4_TABLE (code 8 is +0.0)
DEEPSEEK_FP4_TABLE = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                                   0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32)
# msModelSlim's pack_fp4_to_uint8 kE2M1 magnitudes (sign in bit 3)
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32)


def deepseek_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The release's expert as DeepSeek dequantizes it: low nibble first, FP4_TABLE, times the
    float32 E8M0 scale (exact in float32)."""
    u = packed.view(torch.uint8)
    x = torch.stack([DEEPSEEK_FP4_TABLE[(u & 0x0F).long()], DEEPSEEK_FP4_TABLE[(u >> 4).long()]], -1).flatten(1)
    return x * scale.float().repeat_interleave(32, dim=1)


def ascend_w4a8_mxfp(weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """An Ascend W4A8_MXFP expert as msModelSlim writes it: uint8 pairs (element 2j low), sign bit
    3, E8M0 scale with bias 127."""
    assert weight.dtype == torch.uint8 and weight_scale.dtype == torch.uint8
    codes = torch.stack([weight & 0x0F, weight >> 4], -1).flatten(1).long()
    mag = E2M1[codes & 7]
    vals = torch.where(codes >= 8, -mag, mag)
    return vals * torch.exp2(weight_scale.double() - 127).float().repeat_interleave(32, dim=1)


def _load(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return write_v4_release(tmp_path_factory.mktemp("v4") / "src")


@pytest.mark.slow
def test_w4a8_mxfp_carries_the_fp4_experts_byte_for_byte(release, tmp_path, caplog):
    from cvt.runtime.loader import load_model

    dst = tmp_path / "q"
    # one expert kept float: written BF16, the official dequant rounded once
    with caplog.at_level(logging.WARNING, logger="cvt"):
        r = run_cvt("quantize", release, dst, "--scheme", "w4a8_mxfp", "--format", "ascend", "--quiet",
                    "--ignore", r"^layers\.3\.ffn\.experts\.0\.")
    assert r.rc == 0, r.err
    assert caplog.records == []  # nothing requantized, so no note
    src, out = _load(release), _load(dst)
    desc = json.loads((dst / "quant_model_description.json").read_text())
    quant = json.loads((dst / "cvt_manifest.json").read_text())["quant"]
    experts = sorted(n[:-len(".weight")] for n in src if ".ffn.experts." in n and n.endswith(".weight"))
    assert len(experts) == 5 * 4 * 3  # 4 layers + 1 MTP layer, 4 experts, w1 / w2 / w3
    model = dict(load_model(dst, dtype=torch.float32).model.named_modules())
    carried = 0
    for m in experts:
        official = deepseek_fp4(src[f"{m}.weight"], src[f"{m}.scale"])
        if m.startswith("layers.3.ffn.experts.0."):
            assert desc[f"{m}.weight"] == "FLOAT" and out[f"{m}.weight"].dtype == torch.bfloat16
            assert torch.equal(out[f"{m}.weight"], official.bfloat16()), m
            continue
        carried += 1
        w, s = out[f"{m}.weight"], out[f"{m}.weight_scale"]
        # the integer codes and the scale bytes are the release's, unchanged
        assert torch.equal(w, src[f"{m}.weight"].view(torch.uint8)), m
        assert torch.equal(s, src[f"{m}.scale"].view(torch.uint8)), m
        assert desc[f"{m}.weight"] == desc[f"{m}.weight_scale"] == "W4A8_MXFP"
        info = quant["tensors"][m]
        assert (info["method"], info["scheme"], info["sqnr_db"]) == ("source", "w4a8_mxfp", "Infinity"), m
        # both sides read the same numbers, and cvt's runtime computes with exactly them
        assert torch.equal(ascend_w4a8_mxfp(w, s), official), m
        assert torch.equal(model[m].dense_weight(), official), m  # the MTP layer's too
    assert carried == 57
    # the rest of the release: FP8 linears (W4A8_MXFP is for experts only) and the shared experts
    # dequantized on the fly to BF16, as DeepSeek's convert.py wo_a branch (float32 product per
    # 128x128 block, one bf16 rounding); scales dropped
    assert not [n for n in out if n.endswith(".scale")]
    for n in ("layers.0.attn.wq_a.weight", "layers.2.ffn.shared_experts.w2.weight", "mtp.0.e_proj.weight"):
        w, s = src[n], src[n[:-len("weight")] + "scale"]
        rows, cols = w.shape
        ref = (w.float() * s.float().repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]).bfloat16()
        assert desc[n] == "FLOAT" and torch.equal(out[n], ref), n
    for n in ("layers.0.ffn.gate.tid2eid", "layers.1.hc_attn_fn", "layers.1.attn.compressor.ape", "embed.weight"):
        assert torch.equal(out[n], src[n]), n  # everything else byte for byte
    cfg = json.loads((dst / "config.json").read_text())
    assert "expert_dtype" not in cfg and "quantization_config" not in cfg


@pytest.mark.slow
def test_w8a8_requantizes_the_experts_as_from_the_bf16_output_saying_so(release, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="cvt"):
        r = run_cvt("quantize", release, tmp_path / "direct", "--scheme", "w8a8", "--format", "ascend", "--quiet")
    assert r.rc == 0, r.err
    assert [rec.getMessage() for rec in caplog.records] == [
        "cvt: 60 FP4 routed expert(s) of the release requantized to w8a8 from their exact dequantized values "
        "(w4a8_mxfp, w4a4_mxfp4 and fp4 --fp4-format mxfp4 carry them over unchanged)"]
    assert run_cvt("fp8-to-bf16", release, tmp_path / "bf16", "--quiet").rc == 0
    assert run_cvt("quantize", tmp_path / "bf16", tmp_path / "two", "--scheme", "w8a8", "--format", "ascend",
                   "--quiet").rc == 0
    # reading the release directly gives the same bytes as going through fp8-to-bf16 first
    direct, two = _load(tmp_path / "direct"), _load(tmp_path / "two")
    assert direct.keys() == two.keys()
    assert [n for n in direct if not torch.equal(direct[n], two[n])] == []
    assert direct["layers.1.ffn.experts.2.w1.weight"].dtype == torch.int8
    m = json.loads((tmp_path / "direct" / "cvt_manifest.json").read_text())
    assert m["quant"]["tensors"]["layers.1.ffn.experts.2.w1"]["method"] == "rtn"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_power_of_two_float_scales_carry_others_do_not(dtype):
    from cvt.quant.stage.fp4_source import carried, e8m0_bytes
    from cvt.qtensor.schemes import W4A8MXFP, W8A8, get_scheme

    s = torch.tensor([[2.0 ** -127, 0.125, 1.0, 2.0 ** 127]], dtype=dtype)
    assert e8m0_bytes(s).tolist() == [[0, 124, 127, 254]]
    assert e8m0_bytes(torch.tensor([[0.75]], dtype=dtype)) is None
    assert e8m0_bytes(torch.tensor([[0.0]], dtype=dtype)) is None
    packed = torch.tensor([[0x21, 0xF9] * 16], dtype=torch.uint8).view(torch.int8)  # 64 codes
    q = carried(packed, torch.tensor([[1.0, 4.0]], dtype=dtype), get_scheme(W4A8MXFP.name))
    assert q.parts["weight_scale"].tolist() == [[127, 129]]
    assert q.parts["weight_fp4"][0, :4].tolist() == [1, 2, 9, 15]  # element 2j the low nibble
    assert carried(packed, torch.tensor([[1.0, 4.0]], dtype=dtype), get_scheme(W8A8.name)) is None


@pytest.mark.parametrize("bad, words", [
    ("shape", "does not fit FP4 weight"),       # a [n, k/64] scale for a [n, k/2] packed weight
    ("nan", "non-finite"),                      # E8M0 code 255 is NaN
], ids=["scale-shape", "nan-scale"])
def test_a_bad_fp4_expert_scale_is_one_line_before_anything_is_written(tmp_path, bad, words):
    from cvt.testing.checkpoints import write_release
    from cvt.testing.checkpoints_v4 import tiny_deepseek_v4_config, v4_release_tensors

    cfg = tiny_deepseek_v4_config()
    tensors = v4_release_tensors(cfg)
    name = "layers.2.ffn.experts.1.w3.scale"
    if bad == "shape":
        tensors[name] = tensors[name][:, :2].contiguous()
    else:
        u = tensors[name].view(torch.uint8).clone()
        u[3, 1] = 255
        tensors[name] = u.view(torch.float8_e8m0fnu)
    src = write_release(tmp_path / "src", cfg, tensors, 2, move_scale=False)
    r = run_cvt("quantize", src, tmp_path / "q", "--scheme", "w4a8_mxfp", "--format", "ascend")
    assert r.rc != 0 and r.err.startswith("cvt: error: ") and name in r.err and words in r.err, r.err
    assert len(r.err.strip().splitlines()) == 1 and not (tmp_path / "q").exists()


@pytest.mark.parametrize("args, weight, tag", [
    (("--scheme", "w4a4_mxfp4", "--format", "ascend"), "weight", "W4A4_MXFP4"),
    # (compressed-tensors is refused for V4: tests/quant/test_v4_mtp_copies.py)
], ids=["w4a4_mxfp4"])
def test_the_other_e2m1_e8m0_grids_carry_the_experts_too(release, tmp_path, args, weight, tag):
    # wq_b's in_features (q_lora_rank 200) is no multiple of 32: kept float for these every-linear schemes
    r = run_cvt("quantize", release, tmp_path / "q", *args, "--ignore", r"attn\.wq_b", "--quiet")
    assert r.rc == 0, r.err
    src, out = _load(release), _load(tmp_path / "q")
    quant = json.loads((tmp_path / "q" / "cvt_manifest.json").read_text())["quant"]
    experts = sorted(n[:-len(".weight")] for n in src if ".ffn.experts." in n and n.endswith(".weight"))
    for m in experts:
        assert torch.equal(out[f"{m}.{weight}"], src[f"{m}.weight"].view(torch.uint8)), m
        assert torch.equal(out[f"{m}.weight_scale"], src[f"{m}.scale"].view(torch.uint8)), m
        assert (quant["tensors"][m]["method"], quant["tensors"][m]["sqnr_db"]) == ("source", "Infinity"), m
    if tag is not None:
        desc = json.loads((tmp_path / "q" / "quant_model_description.json").read_text())
        assert {desc[f"{m}.weight"] for m in experts} == {tag}
    # the shared experts (FP8 in the release) are quantized from their dequantized weight
    assert quant["tensors"]["layers.1.ffn.shared_experts.w1"]["method"] == "rtn"
