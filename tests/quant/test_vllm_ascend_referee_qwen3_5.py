"""vllm-ascend main's own quantization package referees cvt's Qwen3.5 / Qwen3.5-MoE and Qwen3-Next
``--format ascend`` outputs (issue 41 item 3): W8A8, W4A8 (MoE: experts-only), W8A8_MXFP8 and W4A4_MXFP4,
dense, MoE and Qwen3-Next (fused in_proj_qkvz / in_proj_ba, a dense ``mlp_only_layers`` layer), through
tests/quant/vllm_ascend_referee_qwen3_5.py. Skipped unless ``CVT_VLLM_ASCEND_SRC`` names a vllm-ascend
source tree; a case is skipped where that tree has no packed-modules mapping for its model type (main
and v0.23.0 have all three).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from cvt.errors import CvtError
from cvt.quant.stage import quantize
from cvt.testing.checkpoints import write_bf16_checkpoint
from cvt.testing.checkpoints_qwen3_5 import tiny_qwen3_5_config, tiny_qwen3_next_config
from cvt.tests.quant.test_vllm_ascend_referee import _expect, _mutate
from cvt.tests.quant.vllm_ascend_referee_qwen3_5 import check_qwen3_5_output, inspect_qwen3_5_output

_ENV = os.environ.get("CVT_VLLM_ASCEND_SRC", "")
pytestmark = pytest.mark.skipif(not _ENV or not Path(_ENV).exists(),
                                reason="set CVT_VLLM_ASCEND_SRC to a local vllm-ascend source tree (the directory "
                                       "holding vllm_ascend/) to run vllm-ascend's own quantization package")

L = "language_model.model.layers"
# per source: its model type, the layers' vLLM and checkpoint prefixes, the lm_head's, a MoE and a dense
# layer, and how the fused Gated DeltaNet input projection's slot is filled (shard id, checkpoint name)
SRC = {
    "moe": dict(mt="qwen3_5_moe", L=L, ck="model.language_model.layers", head="language_model.lm_head.weight",
                moe=2, dense=None, qkvz=((0, 1, 2), "in_proj_qkv")),
    "dense": dict(mt="qwen3_5", L=L, ck="model.language_model.layers", head="language_model.lm_head.weight",
                  moe=None, dense=3, qkvz=((0, 1, 2), "in_proj_qkv")),
    "next": dict(mt="qwen3_next", L="model.layers", ck="model.layers", head="lm_head.weight", moe=2, dense=1,
                 qkvz=(None, "in_proj_qkvz")),
}
CASES = [
    pytest.param("moe", {"scheme": "w8a8"}, "AscendW8A8DynamicLinearMethod", "AscendW8A8DynamicFusedMoEMethod",
                 id="qwen3.5-moe-w8a8"),
    pytest.param("moe", {"scheme": "w4a8"}, "unquantized linear", "AscendW4A8DynamicFusedMoEMethod",
                 id="qwen3.5-moe-w4a8"),
    pytest.param("moe", {"scheme": "w4a8", "target_version": "main"}, "unquantized linear",
                 "AscendW4A8DynamicFusedMoEMethod", id="qwen3.5-moe-w4a8-main"),
    pytest.param("moe", {"scheme": "mxfp8"}, "AscendW8A8MXFP8DynamicLinearMethod",
                 "AscendW8A8MXFP8DynamicFusedMoEMethod", id="qwen3.5-moe-w8a8-mxfp8"),
    pytest.param("moe", {"scheme": "w4a4_mxfp4"}, "AscendW4A4MXFP4DynamicLinearMethod",
                 "AscendW4A4MXFP4DynamicFusedMoEMethod", id="qwen3.5-moe-w4a4-mxfp4"),
    pytest.param("dense", {"scheme": "w8a8"}, "AscendW8A8DynamicLinearMethod", None, id="qwen3.5-w8a8"),
    pytest.param("dense", {"scheme": "mxfp8"}, "AscendW8A8MXFP8DynamicLinearMethod", None, id="qwen3.5-w8a8-mxfp8"),
    pytest.param("dense", {"scheme": "w4a4_mxfp4"}, "AscendW4A4MXFP4DynamicLinearMethod", None,
                 id="qwen3.5-w4a4-mxfp4"),
    pytest.param("next", {"scheme": "w8a8"}, "AscendW8A8DynamicLinearMethod", "AscendW8A8DynamicFusedMoEMethod",
                 id="qwen3-next-w8a8"),
    pytest.param("next", {"scheme": "w4a8"}, "unquantized linear", "AscendW4A8DynamicFusedMoEMethod",
                 id="qwen3-next-w4a8"),
    pytest.param("next", {"scheme": "mxfp8"}, "AscendW8A8MXFP8DynamicLinearMethod",
                 "AscendW8A8MXFP8DynamicFusedMoEMethod", id="qwen3-next-w8a8-mxfp8"),
    pytest.param("next", {"scheme": "w4a4_mxfp4"}, "AscendW4A4MXFP4DynamicLinearMethod",
                 "AscendW4A4MXFP4DynamicFusedMoEMethod", id="qwen3-next-w4a4-mxfp4"),
]


@pytest.fixture(scope="module")
def va_src() -> Path:
    src = Path(_ENV)
    if not (src / "vllm_ascend").is_dir() and src.name == "vllm_ascend":
        src = src.parent
    cfg = src / "vllm_ascend" / "quantization" / "modelslim_config.py"
    if not cfg.is_file():
        pytest.fail(f"CVT_VLLM_ASCEND_SRC={_ENV}: no vllm_ascend/quantization/modelslim_config.py under it")
    return src


def _needs(va_src: Path, model_type: str) -> None:
    """Skip where this vllm-ascend tree has no packed-modules mapping for ``model_type``."""
    if f'"{model_type}"' not in (va_src / "vllm_ascend" / "quantization" / "modelslim_config.py").read_text():
        pytest.skip(f"{va_src}: this vllm-ascend has no {model_type} packed-modules mapping")


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Tiny Qwen3.5 releases (vision tower, an MTP layer) and a tiny Qwen3-Next (an MTP layer, layer 1
    dense) whose every in_features the MX schemes' group 32 and vllm-ascend's MX MoE scale pairs (64)
    divide."""
    root = tmp_path_factory.mktemp("va-qwen3.5")
    sizes = dict(hidden_size=64, linear_value_head_dim=16, moe_intermediate_size=64, shared_expert_intermediate_size=64)
    out = {"root": root}
    for kind in ("moe", "dense"):
        cfg = tiny_qwen3_5_config(moe=kind == "moe", mtp=1, **sizes, **({} if kind == "moe" else {"intermediate_size": 64}))
        cfg["vision_config"]["out_hidden_size"] = 64
        out[kind] = write_bf16_checkpoint(root / kind, cfg)
    out["next"] = write_bf16_checkpoint(root / "next", tiny_qwen3_next_config(mtp_num_hidden_layers=1, **sizes,
                                                                              intermediate_size=64))
    return out


def build(sources, src: str, opts: dict) -> Path:
    dst = sources["root"] / "out" / (src + "-" + "-".join(f"{k}={v}" for k, v in opts.items()))
    if not (dst / "cvt_manifest.json").exists():
        quantize(sources[src], dst, fmt="ascend", quiet=True, calib_tokens=64, **opts)
    return dst


@pytest.mark.parametrize("src, opts, linear, moe", CASES)
def test_vllm_ascend_loads_every_qwen3_5_output(sources, va_src, src, opts, linear, moe):
    """Zero problems, and vllm-ascend's own dispatch picks the scheme's methods for the fused Gated DeltaNet
    projections (in_proj_qkvz; in_proj_ba float), the gated full attention, the dense MLPs and the
    experts; the router, shared-expert gate and vision tower stay float."""
    n = SRC[src]
    _needs(va_src, n["mt"])
    r = inspect_qwen3_5_output(build(sources, src, opts), va_src)
    assert r.problems == [], f"{len(r.problems)} problems:\n" + "\n".join(r.problems[:60])
    lay, ck = n["L"], n["ck"]
    dense = (f"{n['dense']}.mlp.gate_up_proj", f"{n['dense']}.mlp.down_proj") if n["dense"] is not None else ()
    for m in ("0.linear_attn.in_proj_qkvz", "0.linear_attn.out_proj", "3.self_attn.qkv_proj", "3.self_attn.o_proj",
              *dense, *((f"{n['moe']}.mlp.shared_expert.gate_up_proj",) if moe else ())):
        assert r.schemes[f"{lay}.{m}"] == linear, m
    assert r.schemes[f"{lay}.0.linear_attn.in_proj_ba"] == "unquantized linear"
    if src != "next":
        assert r.schemes["visual.blocks.0.attn.qkv"] == r.schemes["visual.merger.linear_fc2"] == "unquantized linear"
    assert r.schemes[f"{lay}.3.self_attn.attn"] == "unquantized attention"
    if moe:
        e = f"{lay}.{n['moe']}.mlp"
        assert r.schemes[f"{e}.experts"] == moe
        assert r.schemes[f"{e}.gate"] == r.schemes[f"{e}.shared_expert_gate"] == "unquantized linear"
    # Qwen3.5: in_proj_qkv fills the first three shards of in_proj_qkvz, in_proj_z the fourth;
    # Qwen3-Next: the release's fused, key-head interleaved in_proj_qkvz fills it whole
    if opts["scheme"] != "w4a8":
        sid, ckpt = n["qkvz"]
        s = r.slots[(f"{lay}.0.linear_attn.in_proj_qkvz.weight", sid, None)]
        assert s.filled_by == [f"{ck}.0.linear_attn.{ckpt}.weight"]
        assert s.dtype in (torch.int8, torch.uint8, torch.float8_e4m3fn)
    assert r.slots[(f"{lay}.1.linear_attn.conv1d.weight", None, None)].filled_by == [f"{ck}.1.linear_attn.conv1d.weight"]
    assert r.slots[(n["head"], None, None)].filled_by == ["lm_head.weight"]


def test_dense_w4a8_is_refused(sources, tmp_path):
    """W4A8 is an experts-only scheme (msModelSlim's Qwen3.5 W4A8 recipe is the MoE's): a dense Qwen3.5
    has nothing it quantizes, and cvt says so rather than writing a float model."""
    with pytest.raises(CvtError, match="nothing to quantize with scheme w4a8"):
        quantize(sources["dense"], tmp_path / "out", scheme="w4a8", fmt="ascend", quiet=True)


def test_qwen3_5_referee_finds_what_vllm_ascend_would_not_load(sources, va_src, tmp_path):
    """Each defect in a W8A8 Qwen3.5-MoE output comes back as its own named problem."""
    _needs(va_src, "qwen3_5_moe")
    out = build(sources, "moe", {"scheme": "w8a8"})
    g, m = "model.language_model.layers.0.linear_attn.", "model.language_model.layers.0.mlp."

    def edit(t):
        t[g + "in_proj_a.weight"] = t[g + "in_proj_a.weight"].to(torch.int8)
        t[g + "conv1d.weight"] = t[g + "conv1d.weight"].squeeze(1)
        t["model.visual.blocks.0.attn.proj.weight"] = t["model.visual.blocks.0.attn.proj.weight"].to(torch.int8)

    def edit_desc(d):
        d[g + "in_proj_b.weight"] = "W8A8_DYNAMIC"  # b quantized, a float: vllm-ascend refuses the fused in_proj_ba
        del d["model.visual.blocks.0.mlp.linear_fc1.weight"]
        d["mtp.fc.weight"] = "W8A8_DYNAMIC"
        del d[m + "experts.0.up_proj.weight"]  # the experts ask for expert 0's tags

    _expect(check_qwen3_5_output(_mutate(out, tmp_path / "bad", edit, edit_desc), va_src), [
        f"{L}.0.linear_attn.in_proj_ba: ValueError in vllm-ascend",
        g + "conv1d.weight: shape [96, 4] but",
        "model.visual.blocks.0.attn.proj.weight: integer tensor (torch.int8) for float parameter",
        "visual.blocks.0.mlp.linear_fc1: KeyError in vllm-ascend",
        f"{L}.0.mlp.experts: KeyError in vllm-ascend",
        "[MTP draft] mtp.fc.weight: described 'W8A8_DYNAMIC', not FLOAT",
    ])


def test_the_description_keys_are_the_release_names(sources, va_src, tmp_path):
    """cvt's description keys are the release's (``model.language_model.…``), which vllm-ascend's
    apply_vllm_mapper turns into vLLM's ``language_model.model.…``: a description under a text-only
    model's names (``model.layers.…``) finds nothing."""
    _needs(va_src, "qwen3_5")
    out = build(sources, "dense", {"scheme": "w8a8"})
    desc = json.loads((out / "quant_model_description.json").read_text())
    assert desc["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"] == "W8A8_DYNAMIC"
    assert desc["model.language_model.layers.0.linear_attn.in_proj_b.weight"] == "FLOAT"
    assert desc["model.language_model.layers.0.linear_attn.conv1d.weight"] == "FLOAT"
    assert desc["lm_head.weight"] == desc["model.visual.blocks.0.attn.qkv.weight"] == "FLOAT"
    text_names = _mutate(out, tmp_path / "text-names", edit_desc=lambda d: [
        d.__setitem__(k.replace("model.language_model.", "model.", 1), d.pop(k))
        for k in list(d) if k.startswith("model.language_model.")])
    problems = check_qwen3_5_output(text_names, va_src)
    assert any(p.startswith(f"{L}.0.linear_attn.in_proj_qkvz: KeyError in vllm-ascend") for p in problems), problems


def test_qwen3_next_referee_finds_what_vllm_ascend_would_not_load(sources, va_src, tmp_path):
    """Each defect in a W8A8 Qwen3-Next output comes back as its own named problem: the fused projection
    written under Qwen3.5's split names, an in_proj_ba of the wrong rows, a description missing a dense
    layer's shard, a quantized MTP draft, a description under Qwen3.5's (multimodal) names."""
    _needs(va_src, "qwen3_next")
    out = build(sources, "next", {"scheme": "w8a8"})
    g0, g1 = "model.layers.0.linear_attn.", "model.layers.1.linear_attn."

    def edit(t):
        t[g0 + "in_proj_qkv.weight"] = t.pop(g0 + "in_proj_qkvz.weight")  # Qwen3.5's name: vLLM drops it
        t[g1 + "in_proj_ba.weight"] = t[g1 + "in_proj_ba.weight"][:4]

    def edit_desc(d):
        del d["model.layers.1.mlp.up_proj.weight"]  # the dense layer's gate_up_proj asks for both shards
        d["mtp.layers.0.self_attn.q_proj.weight"] = "W8A8_DYNAMIC"
        d["model.language_model.layers.2.linear_attn.out_proj.weight"] = d.pop(
            "model.layers.2.linear_attn.out_proj.weight")

    _expect(check_qwen3_5_output(_mutate(out, tmp_path / "bad", edit, edit_desc), va_src), [
        g0 + "in_proj_qkv.weight: checkpoint tensor dropped silently by vLLM's qwen3_next load_weights",
        "model.layers.0.linear_attn.in_proj_qkvz.weight: declared by AscendW8A8DynamicLinearMethod",
        g1 + "in_proj_ba.weight: shape [4, 64] but model.layers.1.linear_attn.in_proj_ba.weight",
        "model.layers.1.mlp.gate_up_proj: KeyError in vllm-ascend",
        "model.layers.2.linear_attn.out_proj: KeyError in vllm-ascend",
        "[MTP draft] mtp.layers.0.self_attn.q_proj.weight: described 'W8A8_DYNAMIC', not FLOAT",
    ])
