"""NVIDIA ModelOpt FP8_PB_WO and MIXED_PRECISION releases as sources (issue 40 item 1), as vLLM
reads them (vllm/model_executor/layers/quantization/modelopt.py, commit 00155cdecca7:
``ModelOptFp8PbWoLinearMethod``, ``ModelOptMixedPrecisionConfig``): recognised from the
release's own config, shown by `cvt inspect`, dequantized by `cvt fp8-to-bf16` byte for byte as
the hand decoder (`modelopt_release.reference_dequant`), quantized from on the fly as from that
BF16, corrupt scales and quantized_layers that do not match the tensors refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from cvt.convert.config import SourceFormat, fold_hf_quant_config, source_format
from cvt.convert.sources import SOURCES, readable
from tests.conftest import run_cvt
from tests.convert.ct_release import assert_corrupt_refused
from tests.convert.modelopt_release import (MIXED, dequantized, hf_quant_config, load_all, mixed_algo,
                                             reference_dequant, write_modelopt_release)

PB = "FP8_PB_WO"
FORMATS = {PB: SourceFormat.MODELOPT_FP8_PB_WO, MIXED: SourceFormat.MODELOPT_MIXED}


def _parts(stored, module):
    return {k.rpartition(".")[2]: v for k, v in stored.items() if k.rpartition(".")[0] == module}


@pytest.mark.parametrize("algo,side_only", [(PB, True), (MIXED, False)], ids=["fp8_pb_wo", "mixed-config.json"])
def test_dequantized_byte_for_byte(tmp_path, algo, side_only):
    """Each quantized linear's BF16 is the hand decoder's float32 rounded once (per layer, its
    quantized_layers algorithm); a layer MIXED_PRECISION does not list is copied as stored;
    inspect names the entry."""
    src, ours, stored, linears = dequantized(tmp_path, algo, side_only)
    seen = set()
    for n in linears:
        module = n[: -len(".weight")]
        layer_algo = mixed_algo(module) if algo == MIXED else algo
        seen.add(layer_algo)
        want = stored[n] if layer_algo is None else reference_dequant(_parts(stored, module), layer_algo).bfloat16()
        assert ours[n].dtype == torch.bfloat16 and torch.equal(ours[n].view(torch.int16), want.view(torch.int16)), n
    assert seen == ({PB} if algo == PB else {None, "FP8", "NVFP4", "W4A16_NVFP4"})
    assert {n.rpartition(".")[2] for n in ours} == {"weight"}
    for n in set(ours) - set(linears):
        assert torch.equal(ours[n], stored[n]), n
    assert json.loads((tmp_path / "bf16" / "cvt_manifest.json").read_text())["source"]["format"] == FORMATS[algo].value
    assert not (tmp_path / "bf16" / "hf_quant_config.json").exists()
    shown = run_cvt("inspect", str(src))
    assert shown.rc == 0 and f"format          {FORMATS[algo].value}:" in shown.out, shown.out
    assert f"precision       {SOURCES.get(FORMATS[algo].value).summary}" in shown.out
    if algo == PB:  # no quantized_layers: the one algorithm named
        assert "format          modelopt-fp8-pb-wo: quantization_config.quant_method 'modelopt' (quant_algo " \
               "'FP8_PB_WO')\n" in shown.out, shown.out
    if algo == MIXED:  # FP8: 11 attention linears and layer 0's down_proj; NVFP4 experts of layers 1 / 2
        assert "quant_algo 'MIXED_PRECISION', quantized_layers 12 FP8, 12 NVFP4, 12 W4A16_NVFP4" in shown.out, shown.out


def test_pb_wo_block_grid_by_hand(tmp_path):
    """The scale [a, 1, b, 1] indexed by (i // 128, j // 128), worked by hand: e4m3 0x38 = 1.0
    and 0x40 = 2.0 in the second row block of gate_proj [160, 96] (scale[1, 0, 0, 0] = 0.5) and
    the second column block of down_proj [96, 160] (scale[0, 0, 1, 0] = 0.25)."""
    src = write_modelopt_release(tmp_path / "src", PB)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    cases = {"model.layers.0.mlp.gate_proj": ((130, 5), (1, 0, 0, 0), 0.5),
             "model.layers.0.mlp.down_proj": ((3, 140), (0, 0, 1, 0), 0.25)}
    for module, ((i, j), at, scale) in cases.items():
        f = src / index["weight_map"][f"{module}.weight"]
        t = load_file(str(f))
        assert tuple(t[f"{module}.weight_scale"].shape) == {"gate_proj": (2, 1, 1, 1), "down_proj": (1, 1, 2, 1)}[
            module.rpartition(".")[2]]
        t[f"{module}.weight"].view(torch.uint8)[i, j : j + 2] = torch.tensor([0x38, 0x40], dtype=torch.uint8)
        t[f"{module}.weight_scale"][at] = scale
        save_file(t, str(f), metadata={"format": "pt"})
    assert run_cvt("fp8-to-bf16", str(src), str(tmp_path / "bf16"), "--quiet").rc == 0
    out = load_all(tmp_path / "bf16")
    for module, ((i, j), _, scale) in cases.items():
        assert out[f"{module}.weight"][i, j : j + 2].tolist() == [1.0 * scale, 2.0 * scale]


@pytest.mark.parametrize("algo", [PB, MIXED])
def test_quantize_dequantizes_on_the_fly(tmp_path, algo):
    """`cvt quantize --scheme w8a8` of the release writes the bytes it writes from the release's
    `fp8-to-bf16` output (the BF16 never stored)."""
    from cvt.convert.fp8_to_bf16 import fp8_to_bf16
    from cvt.quant.stage.run import quantize

    src = write_modelopt_release(tmp_path / "src", algo)
    fp8_to_bf16(src, tmp_path / "bf16", quiet=True)
    ra = quantize(src, tmp_path / "direct", scheme="w8a8", fmt="ascend", quiet=True)
    quantize(tmp_path / "bf16", tmp_path / "via", scheme="w8a8", fmt="ascend", quiet=True)
    A, B = load_all(tmp_path / "direct"), load_all(tmp_path / "via")
    assert set(A) == set(B) and len(ra.manifest.quant.tensors) == 39
    for n in A:
        assert A[n].dtype == B[n].dtype and torch.equal(A[n].view(-1).view(torch.uint8), B[n].view(-1).view(torch.uint8)), n
    assert ra.manifest.source.format == FORMATS[algo].value


X = "model.layers.1.self_attn.o_proj"
E = "model.layers.1.mlp.experts.0.down_proj"
BAD = [
    (PB, f"{X}.weight_scale", lambda t: torch.full_like(t, float("inf")), "non-finite"),
    (PB, f"{X}.weight_scale", lambda t: t.reshape(-1).contiguous(), "expected F32 [1, 1, 1, 1]"),
    (PB, f"{X}.weight_scale", lambda t: torch.full_like(t, 1e37), "overflows bfloat16"),
    (MIXED, f"{X}.weight_scale", lambda t: torch.full_like(t, float("nan")), "non-finite"),  # an FP8 layer
    (MIXED, f"{E}.weight_scale_2", lambda t: torch.zeros_like(t), "expected > 0"),  # an NVFP4 layer
    (MIXED, f"{E}.weight_scale", lambda t: t[:, :1].contiguous(), "expected F8_E4M3"),
]


@pytest.mark.parametrize("algo,name,fn,why", BAD, ids=[f"{a}-{n.rpartition('.')[2]}-{w}" for a, n, _, w in BAD])
def test_corrupt_scale_refused(tmp_path, algo, name, fn, why):
    assert_corrupt_refused(write_modelopt_release(tmp_path / "src", algo), tmp_path / "dst", "fp8-to-bf16", name, fn, why)


def _edit_layers(src, edit) -> None:
    side = json.loads((src / "hf_quant_config.json").read_text())
    edit(side["quantization"]["quantized_layers"])
    (src / "hf_quant_config.json").write_text(json.dumps(side))


@pytest.mark.parametrize("edit,names,why", [
    (lambda q: q.pop(X), f"{X}.weight", "quantized_layers does not list"),
    (lambda q: q.update({"model.layers.9.self_attn.q_proj": {"quant_algo": "FP8"}}), "model.layers.9.self_attn.q_proj",
     "has no quantized"),
    (lambda q: q.update({X: {"quant_algo": "W4A8_AWQ", "group_size": 128}}), X, "'W4A8_AWQ' is not read"),
    (lambda q: q.update({E: {"quant_algo": "NVFP4", "group_size": 32}}), E, "group_size 32, expected 16"),
], ids=["unlisted-quantized", "listed-absent", "other-algo", "nvfp4-group"])
def test_quantized_layers_mismatch_refused(tmp_path, edit, names, why):
    """quantized_layers that disagree with the tensors: one line naming the layer, no DST."""
    src = write_modelopt_release(tmp_path / "src", MIXED)
    _edit_layers(src, edit)
    for verb in ("fp8-to-bf16", "quantize"):
        r = run_cvt(verb, str(src), str(tmp_path / verb), *(("--scheme", "w8a8") if verb == "quantize" else ()),
                    "--quiet")
        lines = r.err.strip().splitlines()
        assert r.rc == 1 and len(lines) == 1 and names in lines[0] and why in lines[0], r.err
        assert not (tmp_path / verb).exists()


def test_registry_and_config_forms():
    """Both config forms name the entries (quant_algo case-blind, as vLLM upper-cases it); both
    stages read them."""
    for algo, fmt in FORMATS.items():
        assert fmt.value in readable("fp8-to-bf16") and fmt.value in readable("quantize")
        assert source_format(fold_hf_quant_config({}, hf_quant_config(algo, ["m.q_proj"]))) is fmt
        assert source_format({"quantization_config": {"quant_method": "modelopt", "quant_algo": algo.lower()}}) is fmt
