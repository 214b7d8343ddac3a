"""`cvt quantize` of a compressed-tensors FP4 release (issue 40 item 2, the carried paths): an
``mxfp4-pack-quantized`` release (Kimi-K3's format, DeepSeek-V3-shaped here) into Ascend
W4A8_MXFP / W4A4_MXFP4 or compressed-tensors mxfp4, an ``nvfp4-pack-quantized`` one into
compressed-tensors nvfp4, with the codes and scale bytes carried over unchanged (method
"source"); requantized from the exact values with one note line where the grid differs.

The release is written by the compressed-tensors package itself (tests/convert/ct_release.py);
the "source's dequantized weight" is that package's own model-free decompression to float32
(e2m1 times a power of two, or times scale / global scale: exact in float32). Both sides' byte
layouts are written out here independently of cvt: c-t's ``nvfp4/helpers.py``
``pack_fp4_to_uint8`` (element 2j in the low nibble, ``sign << 3 | index``) and
``mx_utils.compress_mx_scale`` (uint8 ``exponent + 127``); vllm-ascend main's
``quantization/methods/w4a4_mxfp4.py`` / ``w4a8_mxfp4.py`` (``weight`` uint8 ``[n, k // 2]``,
``weight_scale`` uint8 ``[n, k // 32]``, read as ``float4_e2m1fn_x2`` / ``float8_e8m0fnu``).
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import run_cvt
from tests.convert.ct_release import ct_decompressed, write_ct_deepseek_release

pytest.importorskip("compressed_tensors")

# c-t's kE2M1ToFloat magnitudes (sign in bit 3)
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32)


def _load(d) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def mx_weight(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """An E2M1 pair / E8M0 weight as both c-t and vllm-ascend read it: low nibble first, sign
    bit 3, times ``2**(scale - 127)`` per 32 inputs (float32, exact)."""
    assert packed.dtype == torch.uint8 and scale.dtype == torch.uint8
    codes = torch.stack([packed & 0x0F, packed >> 4], -1).flatten(1).long()
    mag = E2M1[codes & 7]
    vals = torch.where(codes >= 8, -mag, mag)
    return vals * torch.exp2(scale.double() - 127).float().repeat_interleave(32, dim=1)


def nv_weight(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """A c-t nvfp4 weight's exact float32 values: the codes as `mx_weight`'s, times
    ``float32(scale) / global_scale`` per 16 inputs (c-t's ``dequantize`` order)."""
    codes = torch.stack([packed & 0x0F, packed >> 4], -1).flatten(1).long()
    mag = E2M1[codes & 7]
    vals = torch.where(codes >= 8, -mag, mag)
    return vals * (scale.float() / global_scale.float()).repeat_interleave(16, dim=1)


def _quantized(src: dict) -> list[str]:
    return sorted(n[: -len(".weight_packed")] for n in src if n.endswith(".weight_packed"))


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    src = write_ct_deepseek_release(tmp_path_factory.mktemp("ct-mxfp4") / "src", "MXFP4")
    return src, _load(src), ct_decompressed(src, torch.float32)


@pytest.fixture(scope="module")
def nvfp4(tmp_path_factory):
    src = write_ct_deepseek_release(tmp_path_factory.mktemp("ct-nvfp4") / "src", "NVFP4", shared_global=True)
    return src, _load(src), ct_decompressed(src, torch.float32)


def _runtime(dst) -> dict:
    from cvt.runtime.loader import load_model

    return dict(load_model(dst, dtype=torch.float32).model.named_modules())


@pytest.mark.slow
@pytest.mark.parametrize("scheme, tag", [("w4a8_mxfp", "W4A8_MXFP"), ("w4a4_mxfp4", "W4A4_MXFP4")])
def test_mxfp4_release_carried_into_ascend_mx(mxfp4, tmp_path, caplog, scheme, tag):
    src_dir, src, theirs = mxfp4
    dst = tmp_path / "q"
    with caplog.at_level(logging.WARNING, logger="cvt"):
        r = run_cvt("quantize", src_dir, dst, "--scheme", scheme, "--format", "ascend", "--quiet")
    assert r.rc == 0, r.err
    assert caplog.records == []  # nothing requantized, so no note
    out = _load(dst)
    desc = json.loads((dst / "quant_model_description.json").read_text())
    quant = json.loads((dst / "cvt_manifest.json").read_text())["quant"]["tensors"]
    model = _runtime(dst)
    carried = 0
    for m in _quantized(src):
        deq = theirs[f"{m}.weight"]  # the c-t package's decompression, float32
        if m not in quant:  # kept float (w4a8_mxfp: experts only; MLA's kv_b_proj): its BF16 dequant
            assert desc[f"{m}.weight"] == "FLOAT" and torch.equal(out[f"{m}.weight"], deq.bfloat16()), m
            continue
        carried += 1
        w, s = out[f"{m}.weight"], out[f"{m}.weight_scale"]
        # the codes and the scale bytes are the release's, unchanged
        assert torch.equal(w, src[f"{m}.weight_packed"]) and torch.equal(s, src[f"{m}.weight_scale"]), m
        assert desc[f"{m}.weight"] == desc[f"{m}.weight_scale"] == tag
        assert (quant[m]["method"], quant[m]["scheme"], quant[m]["sqnr_db"]) == ("source", scheme, "Infinity"), m
        # vllm-ascend's reading of the bytes and cvt's runtime weight are the package's values exactly
        assert torch.equal(mx_weight(w, s), deq), m
        assert torch.equal(model[m].dense_weight(), deq), m
    experts = [m for m in _quantized(src) if ".mlp.experts." in m]
    assert carried == (len(experts) if scheme == "w4a8_mxfp" else len(quant)) and carried >= len(experts) == 36
    assert not [n for n in out if n.endswith((".weight_packed", ".input_global_scale"))]


@pytest.mark.slow
@pytest.mark.parametrize("preset, fp4_format", [("MXFP4", "mxfp4"), ("NVFP4", "nvfp4")])
def test_fp4_release_carried_into_compressed_tensors(mxfp4, nvfp4, tmp_path, caplog, preset, fp4_format):
    """c-t mxfp4 -> fp4 mxfp4, c-t nvfp4 (fused groups sharing a global scale) -> fp4 nvfp4: every
    stored part the release's bytes, and the package decompresses the output to the same values."""
    src_dir, src, theirs = mxfp4 if preset == "MXFP4" else nvfp4
    dst = tmp_path / "q"
    with caplog.at_level(logging.WARNING, logger="cvt"):
        r = run_cvt("quantize", src_dir, dst, "--scheme", "fp4", "--fp4-format", fp4_format,
                    "--format", "compressed-tensors", "--quiet")
    assert r.rc == 0, r.err
    assert caplog.records == []
    out = _load(dst)
    quant = json.loads((dst / "cvt_manifest.json").read_text())["quant"]["tensors"]
    cfg = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert cfg["format"] == f"{fp4_format}-pack-quantized"
    parts = ("weight_packed", "weight_scale") + (("weight_global_scale",) if fp4_format == "nvfp4" else ())
    again = ct_decompressed(dst, torch.float32)  # the package's decompression of cvt's output
    model = _runtime(dst)
    carried = [m for m in _quantized(src) if m in quant]
    assert len(carried) >= 36
    for m in carried:
        for p in parts:
            a, b = out[f"{m}.{p}"], src[f"{m}.{p}"]
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (m, p)
        assert (quant[m]["method"], quant[m]["sqnr_db"]) == ("source", "Infinity"), m
        assert torch.equal(again[f"{m}.weight"], theirs[f"{m}.weight"]), m
        w = model[m].dense_weight()
        if fp4_format == "mxfp4":  # e2m1 times a power of two: the package's float32 is exact
            assert torch.equal(w, theirs[f"{m}.weight"]), m
        else:  # the package decompresses nvfp4 in bfloat16: cvt's exact float32, rounded once, is it
            assert torch.equal(w, nv_weight(*(src[f"{m}.{p}"] for p in parts))), m
            assert torch.equal(w.bfloat16(), theirs[f"{m}.weight"].bfloat16()), m


@pytest.mark.slow
def test_nvfp4_groups_with_their_own_global_scales_are_requantized_saying_so(tmp_path, caplog):
    """A release whose fused members (q_a + kv_a, gate + up) each have their own global scale:
    vLLM serves a fused group with one, so those are requantized with a shared one (from the
    exact values), the rest carried, and one line says so."""
    src_dir = write_ct_deepseek_release(tmp_path / "src", "NVFP4")
    src = _load(src_dir)
    with caplog.at_level(logging.WARNING, logger="cvt"):
        r = run_cvt("quantize", src_dir, tmp_path / "q", "--scheme", "fp4", "--format", "compressed-tensors", "--quiet")
    assert r.rc == 0, r.err
    out = _load(tmp_path / "q")
    quant = json.loads((tmp_path / "q" / "cvt_manifest.json").read_text())["quant"]["tensors"]
    partner = {"gate_proj": "up_proj", "up_proj": "gate_proj", "q_a_proj": "kv_a_proj_with_mqa",
               "kv_a_proj_with_mqa": "q_a_proj"}

    def own_scale(m: str) -> bool:  # a fused member whose partner's global scale is another number
        head, _, last = m.rpartition(".")
        return last in partner and not torch.equal(src[f"{m}.weight_global_scale"],
                                                   src[f"{head}.{partner[last]}.weight_global_scale"])

    requantized = [m for m in quant if own_scale(m)]
    assert len(requantized) >= 30 and len(quant) - len(requantized) >= 24
    assert {m for m in quant if quant[m]["method"] == "rtn"} == set(requantized)
    for m in set(quant) - set(requantized):
        assert quant[m]["method"] == "source" and torch.equal(out[f"{m}.weight_packed"], src[f"{m}.weight_packed"]), m
    gs = out["model.layers.1.mlp.experts.2.gate_proj.weight_global_scale"]
    assert torch.equal(gs, out["model.layers.1.mlp.experts.2.up_proj.weight_global_scale"])
    assert [rec.getMessage() for rec in caplog.records] == [
        f"cvt: {len(requantized)} compressed-tensors nvfp4 linear(s) of the release requantized to fp4 from their exact dequantized "
        "values (fp4 --fp4-format nvfp4 carries them over unchanged, a fused group only where its members share "
        "one global scale)"]


@pytest.mark.slow
def test_mxfp4_into_another_grid_is_requantized_saying_so(mxfp4, tmp_path, caplog):
    src_dir, src, _ = mxfp4
    with caplog.at_level(logging.WARNING, logger="cvt"):
        r = run_cvt("quantize", src_dir, tmp_path / "q", "--scheme", "w8a8", "--format", "ascend", "--quiet")
    assert r.rc == 0, r.err
    quant = json.loads((tmp_path / "q" / "cvt_manifest.json").read_text())["quant"]["tensors"]
    assert {v["method"] for v in quant.values()} == {"rtn"}
    assert [rec.getMessage() for rec in caplog.records] == [
        f"cvt: {len(quant)} compressed-tensors mxfp4 linear(s) of the release requantized to w8a8 from their exact "
        "dequantized values (w4a8_mxfp, w4a4_mxfp4 and fp4 --fp4-format mxfp4 carry them over unchanged)"]


@pytest.mark.parametrize("preset, word", [("MXFP4", "MXFP4"), ("NVFP4", "NVFP4"), ("W8A8", "INT8"), ("FP8", "FP8")])
def test_fp8_to_bf16_summary_names_the_source_precision(tmp_path, preset, word):
    from tests.convert.ct_release import write_ct_release

    src = write_ct_release(tmp_path / "src", preset)
    r = run_cvt("fp8-to-bf16", src, tmp_path / "bf16")
    assert r.rc == 0, r.err
    assert f"dequantized 21 {word} tensors, passed " in r.out, r.out
