"""`cvt quantize --scheme fp4 --fp4-format nvfp4 --format compressed-tensors` of an NVIDIA ModelOpt
NVFP4 release (issue 40 item 2, the carried paths): the E2M1 codes and E4M3 block scales carried
byte for byte, ``weight_scale_2`` (which multiplies) written as ``weight_global_scale = 1 /
weight_scale_2`` (which compressed-tensors divides by) where that gives every reader ModelOpt's
values exactly, requantized with one note line where it does not.

The release is written from ModelOpt's published code (tests/convert/modelopt_release.py), its
fused linears sharing one weight_scale_2 as ModelOpt's export makes them; "the source's dequantized
weight" is `reference_dequant`, decoded from the stored bytes. The consumers' readings are written
out here, independently of cvt:

* vLLM (compressed_tensors_w4a16_nvfp4.py / compressed_tensors_w4a4_nvfp4.py
  ``process_weights_after_loading``: ``1.0 / weight_global_scale`` in float32, then
  nvfp4_emulation_utils.py ``dequantize_to_dtype``: ``e2m1 * (float32(scale) * that)``);
* compressed-tensors' own model-free decompression (installed; it divides, in float32, then
  rounds to BF16), and its own ModelOpt converter (``ModelOptNvfp4Converter``), whose bytes the
  carried linears must be.
"""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from safetensors.torch import load_file

from cvt.quant.stage.fp4_source import MODELOPT_CARRIED_BY
from tests.conftest import run_cvt
from tests.convert.ct_release import corrupt_tensor, ct_decompressed
from tests.convert.modelopt_release import E2M1, _e4m3, reference_dequant, write_modelopt_release

pytest.importorskip("compressed_tensors")

PARTS = ("weight", "weight_scale", "weight_scale_2")


def _load(d) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _carried(tmp_path, caplog, algo: str):
    """A ModelOpt `algo` release quantized to compressed-tensors nvfp4 (warnings captured):
    (SRC, DST, SRC's tensors, DST's tensors, DST's manifest quant.tensors)."""
    src_dir = write_modelopt_release(tmp_path / "src", algo, scale_2=scale_2)
    dst = tmp_path / "q"
    with caplog.at_level(logging.WARNING, logger="cvt"):
        r = run_cvt("quantize", src_dir, dst, "--scheme", "fp4", "--fp4-format", "nvfp4", "--format",
                    "compressed-tensors", "--quiet")
    assert r.rc == 0, r.err
    quant = json.loads((dst / "cvt_manifest.json").read_text())["quant"]["tensors"]
    return src_dir, dst, _load(src_dir), _load(dst), quant


def _round_trips(s2: torch.Tensor) -> bool:
    """Whether float32 ``1 / (1 / s2)`` is `s2` again (vLLM's reading of c-t's global scale)."""
    one = torch.tensor(1.0, dtype=torch.float32)
    return bool(one / (one / s2) == s2)


def _pow2(s2: torch.Tensor) -> torch.Tensor:
    """The power of two at or above s2 (1 / it is exact in float32)."""
    return torch.tensor(2.0 ** math.ceil(math.log2(float(s2))), dtype=torch.float32)


def _no_round_trip(s2: torch.Tensor) -> torch.Tensor:
    """A float32 at or above s2 whose reciprocal does not round-trip: 1.7000001669 (float32
    0x3FD9999B, whose does not; below about sqrt(2) every mantissa's does) times the power of two
    at or above s2."""
    return torch.tensor(1.7000001668930054, dtype=torch.float32) * _pow2(s2)


def scale_2(module: str, s2: torch.Tensor) -> torch.Tensor:
    """Layers 0 and 2: a power-of-two weight_scale_2 (carried); layer 1: one whose reciprocal does
    not survive float32 (requantized)."""
    return _no_round_trip(s2) if ".layers.1." in module else _pow2(s2)


def vllm_dequant(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """vLLM's float32 weight of a c-t nvfp4 linear (module docstring), from the bytes."""
    n, half = packed.shape
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(n, 2 * half).long()
    inv = 1.0 / global_scale.to(torch.float32).reshape(())
    block = _e4m3(scale.view(torch.uint8)) * inv
    return (E2M1[codes].reshape(n, -1, 16) * block.unsqueeze(-1)).reshape(n, 2 * half)


def _ct_converted(src, dst) -> dict[str, torch.Tensor]:
    """compressed-tensors' own ModelOpt NVFP4 -> c-t nvfp4 conversion of `src`."""
    from compressed_tensors.entrypoints.convert import convert_checkpoint
    from compressed_tensors.entrypoints.convert.converters import ModelOptNvfp4Converter

    conv = ModelOptNvfp4Converter(ignore=["lm_head", "re:.*mlp\\.gate$"], targets=["re:.*_proj$"])
    convert_checkpoint(src, dst, conv, device="cpu", max_workers=1)
    return _load(dst)


@pytest.mark.slow
def test_modelopt_nvfp4_carried_into_compressed_tensors(tmp_path, caplog):
    src_dir, dst, src, out, quant = _carried(tmp_path, caplog, "NVFP4")
    cfg = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert cfg["format"] == "nvfp4-pack-quantized"
    theirs = _ct_converted(src_dir, tmp_path / "ct-converted")
    again = ct_decompressed(dst, torch.float32)  # the package's decompression of cvt's output
    from cvt.runtime.loader import load_model

    model = dict(load_model(dst, dtype=torch.float32).model.named_modules())
    modules = sorted(n[: -len(".weight_scale_2")] for n in src if n.endswith(".weight_scale_2"))
    carried = [m for m in modules if ".layers.1." not in m]
    requantized = [m for m in modules if ".layers.1." in m]
    assert len(carried) >= 20 and len(requantized) >= 10 and set(quant) == set(modules)
    for m in carried:
        ref = reference_dequant({p: src[f"{m}.{p}"] for p in PARTS}, "NVFP4")  # ModelOpt's float32 weight
        packed, scale, gs = (out[f"{m}.{p}"] for p in ("weight_packed", "weight_scale", "weight_global_scale"))
        assert (quant[m]["method"], quant[m]["sqnr_db"]) == ("source", "Infinity"), m
        # codes and block-scale bytes the release's; the global scale 1 / weight_scale_2, as the
        # package's own converter writes all three
        assert torch.equal(packed, src[f"{m}.weight"]) and scale.dtype == torch.float8_e4m3fn, m
        assert torch.equal(scale.view(torch.uint8), src[f"{m}.weight_scale"].view(torch.uint8)), m
        for p in ("weight_packed", "weight_scale", "weight_global_scale"):
            assert torch.equal(out[f"{m}.{p}"].reshape(-1).view(torch.uint8),
                               theirs[f"{m}.{p}"].reshape(-1).view(torch.uint8)), (m, p)
        assert gs.dtype == torch.float32 and float(gs) * float(src[f"{m}.weight_scale_2"]) == 1.0, m
        # every reader gets ModelOpt's values: vLLM, cvt's runtime, the package's decompression
        assert torch.equal(vllm_dequant(packed, scale, gs), ref), m
        assert torch.equal(model[m].dense_weight(), ref), m
        assert torch.equal(again[f"{m}.weight"].bfloat16(), ref.bfloat16()), m
    for m in requantized:  # vLLM would read 1 / (1 / weight_scale_2) as another number
        assert not _round_trips(src[f"{m}.weight_scale_2"]), m
        assert quant[m]["method"] == "rtn", m
    head = "model.layers.1.mlp.experts.2."
    assert torch.equal(out[head + "gate_proj.weight_global_scale"], out[head + "up_proj.weight_global_scale"])
    # the output is weight-only nvfp4 (vLLM's CompressedTensorsW4A16Fp4): no activation scale
    assert not [n for n in out if n.endswith(("input_scale", "input_global_scale", "weight_scale_2"))]
    assert [rec.getMessage() for rec in caplog.records] == [
        f"cvt: {len(requantized)} ModelOpt nvfp4 linear(s) of the release requantized to fp4 from their exact "
        "dequantized values (fp4 --fp4-format nvfp4 carries them over unchanged where 1 / weight_scale_2 gives "
        "every element the same value in float32, a fused group only where its members share one global scale)"]


def _products_equal(s2: torch.Tensor, gs: torch.Tensor) -> bool:
    """Every (code, e4m3 scale) product, 16 x 254, the same ModelOpt's way (times s2) and
    compressed-tensors' (divided by gs), in float32."""
    e4m3 = _e4m3(torch.arange(256, dtype=torch.int32).to(torch.uint8))
    e4m3 = e4m3[~torch.isnan(e4m3)]
    ours, theirs = E2M1[:, None] * (e4m3 * s2)[None], E2M1[:, None] * (e4m3 / gs)[None]
    return torch.equal(ours, theirs)


def test_global_scale_carried_only_when_exact():
    """`modelopt_global_scale`: a power of two converts; a weight_scale_2 whose reciprocal does not
    round-trip is refused; so is one that round-trips but whose divided products differ from the
    multiplied ones somewhere among the 16 x 254 (code, e4m3) pairs; one where all agree converts."""
    from cvt.quant.stage.fp4_source import modelopt_global_scale

    f = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    assert torch.equal(modelopt_global_scale(f(2.0 ** -9)), f([512.0]))
    assert modelopt_global_scale(_no_round_trip(f(1e-4))) is None
    kinds: dict[bool, torch.Tensor] = {}
    s2 = f(3e-4)
    for _ in range(1000):  # the next round-tripping values, until both kinds were seen
        s2 = torch.nextafter(s2, f(1.0))
        if _round_trips(s2):
            kinds.setdefault(_products_equal(s2, f(1.0) / s2), s2)
    assert modelopt_global_scale(kinds[False]) is None
    assert torch.equal(modelopt_global_scale(kinds[True]), (f(1.0) / kinds[True]).reshape(1))


@pytest.mark.parametrize("part, fn, why", [
    ("weight_scale", lambda t: t.view(torch.uint8).index_fill(1, torch.tensor([1]), 0x7F).view(t.dtype),
     "non-finite"),
    ("weight_scale_2", lambda t: torch.full_like(t, float("inf")), "non-finite"),
    ("weight_scale", lambda t: t[:, :2].contiguous(), "expected F8_E4M3")], ids=["nan-e4m3", "inf-scale-2", "shape"])
def test_corrupt_scale_refused_before_the_carry(tmp_path, part, fn, why):
    """A corrupt scale of a linear the run would carry: exit 1, one line naming it, no DST."""
    src = write_modelopt_release(tmp_path / "src", "NVFP4", scale_2=scale_2)
    name = f"model.layers.0.self_attn.o_proj.{part}"
    corrupt_tensor(src, name, fn)
    dst = tmp_path / "q"
    r = run_cvt("quantize", src, dst, "--scheme", "fp4", "--format", "compressed-tensors", "--quiet")
    lines = r.err.strip().splitlines()
    assert r.rc == 1 and len(lines) == 1 and lines[0].startswith("cvt: error: "), r.err
    assert name in lines[0] and why in lines[0], r.err
    assert not dst.exists()


def test_another_grid_is_requantized_saying_so(tmp_path, caplog):
    """Into w8a8 every NVFP4 linear is requantized from its exact values (method rtn), one line."""
    src = write_modelopt_release(tmp_path / "src", "NVFP4", scale_2=scale_2)
    with caplog.at_level(logging.WARNING, logger="cvt"):
        r = run_cvt("quantize", src, tmp_path / "q", "--scheme", "w8a8", "--format", "ascend", "--quiet")
    assert r.rc == 0, r.err
    quant = json.loads((tmp_path / "q" / "cvt_manifest.json").read_text())["quant"]["tensors"]
    assert len(quant) == 39 and {v["method"] for v in quant.values()} == {"rtn"}
    assert [rec.getMessage() for rec in caplog.records] == [
        "cvt: 39 ModelOpt nvfp4 linear(s) of the release requantized to w8a8 from their exact dequantized values "
        f"({MODELOPT_CARRIED_BY})"]


@pytest.mark.slow
def test_mixed_precision_carries_its_nvfp4_layers(tmp_path, caplog):
    """A MIXED_PRECISION release into c-t nvfp4: layer 2's W4A16_NVFP4 experts (power-of-two
    weight_scale_2) carried, codes and block-scale bytes the release's and the global scale 1 /
    weight_scale_2; layer 1's NVFP4 experts (a weight_scale_2 whose reciprocal does not survive
    float32) requantized under the one note line; the FP8 and float linears requantized without
    one (dequantizing FP8 is the ordinary path)."""
    from tests.convert.modelopt_release import MIXED, mixed_algo

    _, _, src, out, quant = _carried(tmp_path, caplog, MIXED)
    algo = {m: mixed_algo(m) for m in quant}
    carried = sorted(m for m, a in algo.items() if a == "W4A16_NVFP4")
    assert len(quant) == 39 and len(carried) == 12 and sum(a == "NVFP4" for a in algo.values()) == 12
    assert sum(a == "FP8" for a in algo.values()) == 12 and sum(a is None for a in algo.values()) == 3
    assert sorted(m for m, v in quant.items() if v["method"] == "source") == carried
    assert {v["method"] for m, v in quant.items() if m not in carried} == {"rtn"}
    for m in carried:
        assert quant[m]["sqnr_db"] == "Infinity", m
        assert torch.equal(out[f"{m}.weight_packed"], src[f"{m}.weight"]), m
        assert torch.equal(out[f"{m}.weight_scale"].view(torch.uint8), src[f"{m}.weight_scale"].view(torch.uint8)), m
        assert float(out[f"{m}.weight_global_scale"]) * float(src[f"{m}.weight_scale_2"]) == 1.0, m
    assert [rec.getMessage() for rec in caplog.records] == [
        f"cvt: 12 ModelOpt nvfp4 linear(s) of the release requantized to fp4 from their exact dequantized values "
        f"({MODELOPT_CARRIED_BY})"]
