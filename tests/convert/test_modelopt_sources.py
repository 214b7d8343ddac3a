"""NVIDIA ModelOpt releases as sources (issue 40 item 1): NVFP4, FP8 and MXFP8, recognised from
hf_quant_config.json or config.json, dequantized by `cvt fp8-to-bf16` bit-exact with the
dequantization written out from the stored bytes (`modelopt_release.reference_dequant`, after
ModelOpt's own ``dequantize`` and vLLM's), quantized from on the fly exactly as from that BF16
output, corrupt parts refused with one line before DST is touched."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from cvt.convert.config import SourceFormat, fold_hf_quant_config, source_format
from cvt.convert.sources import SOURCES, readable
from tests.conftest import run_cvt
from tests.convert.ct_release import assert_corrupt_refused
from tests.convert.modelopt_release import (ALGOS, WRITERS, dequantized, hf_quant_config, load_all,
                                             reference_dequant, write_modelopt_release)

FORMATS = {"NVFP4": SourceFormat.MODELOPT_NVFP4, "FP8": SourceFormat.MODELOPT_FP8,
           "MXFP8": SourceFormat.MODELOPT_MXFP8}


@pytest.mark.parametrize("side_only", [True, False], ids=["hf_quant_config", "config.json"])
@pytest.mark.parametrize("algo", ALGOS)
def test_dequantized_bit_exact(tmp_path, algo, side_only):
    """Every quantized linear's BF16 weight is the reference float32 rounded once; the float
    tensors are copied; input / KV scales and hf_quant_config.json are dropped; inspect names it."""
    src, ours, stored, linears = dequantized(tmp_path, algo, side_only)
    for n in linears:
        module = n[: -len(".weight")]
        parts = {k.rpartition(".")[2]: v for k, v in stored.items() if k.rpartition(".")[0] == module}
        want = reference_dequant(parts, algo)
        assert ours[n].dtype == torch.bfloat16 and torch.equal(ours[n], want.bfloat16()), n
    assert {n.rpartition(".")[2] for n in ours} == {"weight"}  # no scale of any kind left
    for n in set(ours) - set(linears):
        assert torch.equal(ours[n], stored[n]), n
    assert json.loads((tmp_path / "bf16" / "cvt_manifest.json").read_text())["source"]["format"] == FORMATS[algo].value
    assert "quantization_config" not in json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert not (tmp_path / "bf16" / "hf_quant_config.json").exists()  # vLLM would read BF16 as quantized
    shown = run_cvt("inspect", str(src))
    assert shown.rc == 0 and f"format          {FORMATS[algo].value}:" in shown.out, shown.out
    assert f"quant_algo '{algo}'" in shown.out
    assert f"precision       {SOURCES.get(FORMATS[algo].value).summary}" in shown.out


def test_nvfp4_nibble_order_and_global_scale_by_hand(tmp_path):
    """One byte worked by hand: 0x2B holds element 0 in the low nibble (0xB = -1.5) and element 1
    in the high one (0x2 = 1.0); block scale e4m3 0x40 = 2.0, weight_scale_2 0.25 multiplies."""
    src = write_modelopt_release(tmp_path / "src", "NVFP4")
    name = "model.layers.0.self_attn.o_proj"
    index = json.loads((src / "model.safetensors.index.json").read_text())
    f = src / index["weight_map"][f"{name}.weight"]
    t = load_file(str(f))
    t[f"{name}.weight"][0, 0] = 0x2B
    t[f"{name}.weight_scale"].view(torch.uint8)[0, 0] = 0x40
    t[f"{name}.weight_scale_2"] = torch.tensor(0.25, dtype=torch.float32)
    save_file(t, str(f), metadata={"format": "pt"})
    assert run_cvt("fp8-to-bf16", str(src), str(tmp_path / "bf16"), "--quiet").rc == 0
    w = load_all(tmp_path / "bf16")[f"{name}.weight"]
    assert w[0, :2].tolist() == [-1.5 * 2.0 * 0.25, 1.0 * 2.0 * 0.25]


def test_quantize_dequantizes_on_the_fly(tmp_path):
    """`cvt quantize` of each ModelOpt release writes the very bytes it writes from the release's
    `fp8-to-bf16` output (the source read as that BF16, never stored), but for the NVFP4 linears
    `fp4` carries over as stored (method "source": tests/quant/test_modelopt_fp4_carry.py)."""
    from cvt.convert.fp8_to_bf16 import fp8_to_bf16
    from cvt.quant.stage.run import quantize

    for algo in ALGOS:
        src = write_modelopt_release(tmp_path / algo, algo, side_only=algo != "FP8")
        fp8_to_bf16(src, tmp_path / f"{algo}-bf16", quiet=True)
        for scheme, fmt in (("w8a8", "ascend"), ("fp4", "compressed-tensors")):
            a, b = tmp_path / f"{algo}-{scheme}-direct", tmp_path / f"{algo}-{scheme}-via-bf16"
            ra = quantize(src, a, scheme=scheme, fmt=fmt, quiet=True)
            quantize(tmp_path / f"{algo}-bf16", b, scheme=scheme, fmt=fmt, quiet=True)
            A, B = load_all(a), load_all(b)
            assert set(A) == set(B) and len(ra.manifest.quant.tensors) == 39
            carried = {m for m, t in ra.manifest.quant.tensors.items() if t.method == "source"}
            assert len(carried) < 39 and (not carried or (algo, scheme) == ("NVFP4", "fp4"))
            # each linear has its own weight_scale_2 here: no fused group (q/k/v, gate/up) is carried
            assert not [m for m in carried if m.endswith(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))]
            for n in A:
                if n.rpartition(".")[0] in carried:
                    continue
                assert A[n].dtype == B[n].dtype and torch.equal(A[n].view(-1).view(torch.uint8),
                                                                B[n].view(-1).view(torch.uint8)), n
            assert ra.manifest.source.format == FORMATS[algo].value
            assert not (a / "hf_quant_config.json").exists()


X = "model.layers.1.self_attn.o_proj"
BAD = [
    ("NVFP4", f"{X}.weight_scale", lambda t: t.view(torch.uint8).index_fill(1, torch.tensor([2]), 0x7F).view(t.dtype),
     "non-finite"),  # an e4m3 NaN code
    ("NVFP4", f"{X}.weight_scale_2", lambda t: torch.full_like(t, float("inf")), "non-finite"),
    ("NVFP4", f"{X}.weight_scale_2", lambda t: torch.full_like(t, float("nan")), "non-finite"),
    ("NVFP4", f"{X}.weight_scale_2", lambda t: torch.zeros_like(t), "expected > 0"),
    ("NVFP4", f"{X}.weight_scale_2", lambda t: torch.full_like(t, 1e38), "overflows bfloat16"),
    ("NVFP4", f"{X}.weight_scale", lambda t: t[:, :1].contiguous(), "expected F8_E4M3"),
    ("NVFP4", f"{X}.weight_scale_2", lambda t: None, "weight_scale_2 is missing"),
    ("FP8", f"{X}.weight_scale", lambda t: torch.full_like(t, float("inf")), "non-finite"),
    ("FP8", f"{X}.weight_scale", lambda t: torch.ones(5), "expected F32"),
    ("MXFP8", f"{X}.weight_scale", lambda t: t.index_fill(1, torch.tensor([0]), 0xFF), "non-finite"),  # E8M0 NaN
    ("MXFP8", f"{X}.weight_scale", lambda t: t[:, :1].contiguous(), "expected U8 / F8_E8M0"),
]


@pytest.mark.parametrize("algo,name,fn,why", BAD, ids=[f"{a}-{n.rpartition('.')[2]}-{w}" for a, n, _, w in BAD])
@pytest.mark.parametrize("verb", ["fp8-to-bf16", "quantize"])
def test_corrupt_scale_refused(tmp_path, algo, name, fn, why, verb):
    assert_corrupt_refused(write_modelopt_release(tmp_path / "src", algo), tmp_path / "dst", verb, name, fn, why)


def test_registry_and_config_forms():
    """Both config forms name the same entry; an other-producer export is not read as ModelOpt's
    (MIXED_PRECISION and FP8_PB_WO: test_modelopt_pbwo_mixed.py); the entries are read by both stages."""
    for algo, fmt in FORMATS.items():
        assert fmt.value in readable("fp8-to-bf16") and fmt.value in readable("quantize")
        folded = fold_hf_quant_config({"model_type": "qwen3"}, hf_quant_config(algo))
        assert source_format(folded) is fmt
        assert source_format({"quantization_config": {"quant_method": "modelopt", "quant_algo": algo.lower()}}) is fmt
    assert source_format({"quantization_config": {"quant_method": "modelopt", "quantization": {
        "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"}}}) is SourceFormat.MODELOPT_FP8
    w4a8 = fold_hf_quant_config({}, {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "W4A8_AWQ"}})
    assert source_format(w4a8) is SourceFormat.OTHER_QUANT
    other = {"producer": {"name": "someone"}, "quantization": {"quant_algo": "NVFP4"}}
    assert fold_hf_quant_config({}, other) == {}
    own = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    assert fold_hf_quant_config(own, hf_quant_config("NVFP4")) is own  # config.json's own wins


@pytest.mark.parametrize("algo", ALGOS)
def test_fixture_is_modelopts_own_bytes(algo):
    """Where the ModelOpt package imports (not in CI: its dependencies do not install here), the
    fixture's codes and scales are its quantize's, and its own dequantize gives the reference."""
    qt = pytest.importorskip("modelopt.torch.quantization.qtensor")
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(3)).bfloat16().float()
    w[0, :16] = 0  # an all-zero block: scale 1.0
    ours = WRITERS[algo](w)
    if algo == "NVFP4":
        q, s, s2 = qt.NVFP4QTensor.quantize(w, 16)
        theirs = {"weight": q._quantized_data, "weight_scale": s, "weight_scale_2": s2}
        deq = q.dequantize(torch.float32, scale=s, double_scale=s2, block_sizes={-1: 16})
    elif algo == "FP8":
        q, s = qt.FP8QTensor.quantize(w)
        theirs, deq = {"weight": q._quantized_data, "weight_scale": s}, q.dequantize(torch.float32, scale=s)
    else:
        q, s = qt.MXFP8QTensor.quantize(w)
        theirs, deq = {"weight": q._quantized_data, "weight_scale": s}, q.dequantize(torch.float32, scale=s)
    for k, v in ours.items():
        assert torch.equal(v.reshape(-1).view(torch.uint8), theirs[k].reshape(-1).view(torch.uint8)), k
    assert torch.equal(reference_dequant(ours, algo), deq)
