"""compressed-tensors releases as sources (issue 40 item 1): recognised through the source
registry, dequantized bit-exact with the compressed-tensors package's own decompression by
`cvt fp8-to-bf16`, quantized from on the fly exactly as from that BF16 output, corrupt parts
refused with one line before DST is touched."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from cvt.convert.config import SourceFormat, source_format
from cvt.convert.sources import SOURCES, readable
from tests.conftest import run_cvt
from tests.convert.ct_release import assert_corrupt_refused, ct_decompressed, write_ct_release

pytest.importorskip("compressed_tensors")

# in the order the brief ranks them; W8A8 and FP8 cover c-t's int-quantized / float-quantized
CASES = {"MXFP4": SourceFormat.CT_MXFP4, "NVFP4": SourceFormat.CT_NVFP4, "FP8": SourceFormat.CT_FP8,
         "FP8_DYNAMIC": SourceFormat.CT_FP8, "W8A8": SourceFormat.CT_INT8}


def _load(d) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("preset", list(CASES))
def test_dequantized_bit_exact_with_compressed_tensors(tmp_path, preset):
    """Every quantized linear's BF16 weight equals the package's model-free dequantizer's (to
    bfloat16, and its float32 rounded once); the float tensors are copied; inspect names it."""
    src = write_ct_release(tmp_path / "src", preset)
    assert source_format(json.loads((src / "config.json").read_text())) is CASES[preset]
    r = run_cvt("fp8-to-bf16", str(src), str(tmp_path / "bf16"), "--quiet")
    assert r.rc == 0, r.err
    ours = _load(tmp_path / "bf16")
    theirs, theirs32 = ct_decompressed(src, torch.bfloat16), ct_decompressed(src, torch.float32)
    linears = [n for n in theirs if n.endswith("_proj.weight")]
    assert len(linears) == 21 and set(ours) == set(theirs)
    for n in linears:
        assert ours[n].dtype == torch.bfloat16 and torch.equal(ours[n], theirs[n]), n
        assert torch.equal(ours[n], theirs32[n].bfloat16()), n
    stored = _load(src)
    for n in set(ours) - set(linears):
        assert torch.equal(ours[n], stored[n]), n
    m = json.loads((tmp_path / "bf16" / "cvt_manifest.json").read_text())
    assert m["source"]["format"] == CASES[preset].value
    assert "quantization_config" not in json.loads((tmp_path / "bf16" / "config.json").read_text())
    shown = run_cvt("inspect", str(src))
    assert shown.rc == 0 and f"format          {CASES[preset].value}:" in shown.out
    assert f"precision       {SOURCES.get(CASES[preset].value).summary}" in shown.out


@pytest.mark.parametrize("preset", ["MXFP4", "NVFP4", "FP8", "W8A8"])
def test_quantize_dequantizes_on_the_fly(tmp_path, preset):
    """`cvt quantize` of the c-t release writes the very bytes it writes from the release's
    `fp8-to-bf16` output (the source read as that BF16, never stored); except the NVFP4
    release's linears fp4 (nvfp4) carries over as they are (o_proj, down_proj: each fused
    member here has its own global scale, so those are requantized; tests/quant/test_ct_fp4_carry.py)."""
    from cvt.convert.fp8_to_bf16 import fp8_to_bf16
    from cvt.quant.stage.run import quantize

    src = write_ct_release(tmp_path / "src", preset)
    fp8_to_bf16(src, tmp_path / "bf16", quiet=True)
    for scheme, fmt in (("w8a8", "ascend"), ("fp4", "compressed-tensors")):
        a, b = tmp_path / f"{scheme}-direct", tmp_path / f"{scheme}-via-bf16"
        ra = quantize(src, a, scheme=scheme, fmt=fmt, quiet=True)
        quantize(tmp_path / "bf16", b, scheme=scheme, fmt=fmt, quiet=True)
        A, B = _load(a), _load(b)
        assert set(A) == set(B) and len(ra.manifest.quant.tensors) == 21
        carried = {m for m, t in ra.manifest.quant.tensors.items() if t.method == "source"}
        assert len(carried) == (6 if (preset, scheme) == ("NVFP4", "fp4") else 0)
        stored = _load(src)
        for n in A:
            if n.rpartition(".")[0] in carried:  # the release's bytes
                assert torch.equal(A[n].view(-1).view(torch.uint8), stored[n].view(-1).view(torch.uint8)), n
                continue
            assert A[n].dtype == B[n].dtype and torch.equal(A[n].view(-1).view(torch.uint8),
                                                            B[n].view(-1).view(torch.uint8)), n
        assert ra.manifest.source.format == CASES[preset].value


SCALE = "model.layers.1.self_attn.o_proj.weight_scale"
BAD = [
    ("MXFP4", SCALE, lambda t: t.index_fill(1, torch.tensor([0]), 0xFF), "non-finite"),  # E8M0 NaN
    ("MXFP4", SCALE, lambda t: t.index_fill(1, torch.tensor([0]), 0xFE), "overflows bfloat16"),
    ("MXFP4", SCALE, lambda t: t[:, :1].contiguous(), "expected U8 / F8_E8M0"),
    ("NVFP4", SCALE, lambda t: t.view(torch.uint8).index_fill(1, torch.tensor([2]), 0x7F).view(t.dtype), "non-finite"),
    ("NVFP4", "model.layers.1.self_attn.o_proj.weight_global_scale", lambda t: torch.zeros_like(t), "expected > 0"),
    ("FP8", SCALE, lambda t: torch.full_like(t, float("inf")), "non-finite"),
    ("W8A8", SCALE, lambda t: t.index_fill(0, torch.tensor([3]), float("nan")), "non-finite"),
    ("W8A8", SCALE, lambda t: t[:5].contiguous(), "expected F32 / BF16 / F16"),
]


@pytest.mark.parametrize("preset,name,fn,why", BAD, ids=[f"{p}-{w}" for p, _, _, w in BAD])
@pytest.mark.parametrize("verb", ["fp8-to-bf16", "quantize"])
def test_corrupt_scale_refused(tmp_path, preset, name, fn, why, verb):
    assert_corrupt_refused(write_ct_release(tmp_path / "src", preset), tmp_path / "dst", verb, name, fn, why)


def test_registry_is_what_the_stages_read():
    """The help / docs lists come from the registry: every compressed-tensors entry that is read
    is read by both stages, and an unread c-t format (mixed precision) stays refused."""
    for fmt in CASES.values():
        assert fmt.value in readable("fp8-to-bf16") and fmt.value in readable("quantize")
    assert source_format({"quantization_config": {"quant_method": "compressed-tensors",
                                                  "format": "mixed-precision"}}) is SourceFormat.CT_OTHER
    assert source_format({"quantization_config": {"quant_method": "awq"}}) is SourceFormat.OTHER_QUANT
