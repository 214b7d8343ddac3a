"""vllm-ascend's own quantization package referees cvt's ``--format ascend`` outputs.

Optional: skipped unless ``CVT_VLLM_ASCEND_SRC`` names a local vllm-ascend source tree (the
directory holding the ``vllm_ascend`` package, e.g. the unpacked 0.23.0.post1 sdist). Nothing is
downloaded; vllm and torch_npu are stubbed (tests/quant/vllm_ascend_referee.py), vllm-ascend's
``AscendModelSlimConfig``, scheme registry and ``create_weights`` are its own code, and every
output must come back with zero problems. A case that shows problems is marked
``xfail(strict=True)`` with the problems as its reason (none does at the time of writing).
"""

from __future__ import annotations

import builtins
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from cvt.testing.checkpoints import (kimi_int4_tensors, release_tensors, tiny_glm_moe_dsa_config,
                                     tiny_kimi_k25_config, tiny_qwen3_config, write_bf16_checkpoint,
                                     write_release)
from cvt.testing.checkpoints_v4 import tiny_deepseek_v4_config, write_v4_release
from cvt.quant.stage import quantize
from cvt.tests.convert.ct_release import write_ct_deepseek_release
from cvt.tests.quant.vllm_ascend_referee import check_output, inspect_output, read_headers
from cvt.tests.quant.vllm_ascend_referee_flatquant import run_flatquant
from cvt.tests.quant.vllm_ascend_referee_v4 import check_v4_output, inspect_v4_output, process_after_loading

_ENV = os.environ.get("CVT_VLLM_ASCEND_SRC", "")
pytestmark = pytest.mark.skipif(not _ENV or not Path(_ENV).exists(),
                                reason="set CVT_VLLM_ASCEND_SRC to a local vllm-ascend source tree (the directory "
                                       "holding vllm_ascend/) to run vllm-ascend's own quantization package")

FITTED = {"scheme": "w4a4_flatquant", "method": "flatquant"}  # --method flatquant (issue 39 item 2)
MX_FITTED = {"scheme": "w4a4_mxfp4_flatquant", "method": "flatquant"}
CASES = [
    pytest.param("ds", {"scheme": "w8a8"}, id="deepseek-w8a8"),
    pytest.param("ds", {"scheme": "w8a8", "static_attention": True}, id="deepseek-w8a8-static-attention"),
    pytest.param("ds", {"scheme": "w8a8c8"}, id="deepseek-w8a8c8-fakquant"),
    pytest.param("ds", {"scheme": "w4a16", "group_size": 32}, id="deepseek-w4a16-g32"),
    pytest.param("ds", {"scheme": "fp4", "fp4_format": "mxfp4"}, id="deepseek-mxfp4"),
    pytest.param("qmoe", {"scheme": "w8a8"}, id="qwen3-moe-w8a8"),
    pytest.param("qmoe", {"scheme": "w4a16", "group_size": 32}, id="qwen3-moe-w4a16-g32"),
    pytest.param("qdense", {"scheme": "w8a8"}, id="qwen3-w8a8"),
    pytest.param("qdense", {"scheme": "w8a8c8"}, id="qwen3-w8a8c8"),
    # Ascend 950 (issue 28): registered from v0.23.0 on, so a 0.23 tree and a main checkout both referee them
    pytest.param("ds", {"scheme": "mxfp8"}, id="deepseek-w8a8-mxfp8"),
    pytest.param("ds", {"scheme": "w4a4_mxfp4"}, id="deepseek-w4a4-mxfp4"),
    pytest.param("ds", {"scheme": "w4a8_mxfp"}, id="deepseek-w4a8-mxfp"),
    pytest.param("qmoe", {"scheme": "mxfp8"}, id="qwen3-moe-w8a8-mxfp8"),
    pytest.param("ds", {"scheme": "w8a8c8", "kv_dtype": "fp8"}, id="deepseek-w8a8c8-fakquant-fp8"),
    pytest.param("ds", {"scheme": "w4a8", "target_version": "main"}, id="deepseek-w4a8-main"),
    # GLM-5 (issue 27): GlmMoeDsaForCausalLM is vLLM's DeepseekV2ForCausalLM with the V3.2 Indexer; the
    # indexer stays float (FLOAT in the description), layer 1 a "shared" layer without one
    pytest.param("glm", {"scheme": "w8a8"}, id="glm5-w8a8"),
    pytest.param("glm", {"scheme": "w4a8"}, id="glm5-w4a8"),
    # Kimi-K2.5 (issue 27): the INT4 release's experts to Ascend W4A16 (int32) and W4A8_DYNAMIC, under
    # KimiK25ForConditionalGeneration's language_model. prefix; vision tower / projector carried float
    pytest.param("k25", {"scheme": "w4a16", "group_size": 32}, id="kimi-k2.5-w4a16-g32"),
    pytest.param("k25", {"scheme": "w4a8"}, id="kimi-k2.5-w4a8"),
    # --rotate (issue 39): the rotation is folded into the weights, the norms ones; nothing online
    pytest.param("ds", {"scheme": "w4a8", "rotate": "hadamard:1"}, id="deepseek-w4a8-rotated"),
    pytest.param("ds", {"scheme": "w4a4_mxfp4", "rotate": "hadamard:1"}, id="deepseek-w4a4-mxfp4-rotated"),
    pytest.param("glm", {"scheme": "w8a8", "rotate": "hadamard:1"}, id="glm5-w8a8-rotated"),
    pytest.param("qmoe", {"scheme": "w8a8", "rotate": "hadamard:1"}, id="qwen3-moe-w8a8-rotated"),
    # a compressed-tensors mxfp4-pack-quantized release (Kimi-K3's format, DeepSeek-V3-shaped) whose
    # E2M1 codes and E8M0 scales are carried over byte for byte (issue 40; tests/quant/test_ct_fp4_carry.py)
    pytest.param("ctmx", {"scheme": "w4a4_mxfp4"}, id="ct-mxfp4-w4a4-mxfp4-carried"),
    pytest.param("ctmx", {"scheme": "w4a8_mxfp"}, id="ct-mxfp4-w4a8-mxfp-carried"),
    # online rotation (issue 39 item 2): W4A4_FLATQUANT_DYNAMIC linears (routed experts float or W4A8_DYNAMIC)
    pytest.param("qmoe", {"scheme": "w4a4_flatquant"}, id="qwen3-moe-w4a4-flatquant"),
    pytest.param("ds", {"scheme": "w4a4_flatquant"}, id="deepseek-w4a4-flatquant"),
    # ... with the transforms and clip fitted on calibration rows (--method flatquant)
    pytest.param("qmoe", FITTED, id="qwen3-moe-w4a4-flatquant-fitted"),
    pytest.param("ds", FITTED, id="deepseek-w4a4-flatquant-fitted"),
    # ... its Ascend 950 MX twin: row-parallel linears with vllm-ascend's row-sized transforms
    pytest.param("qmoe", {"scheme": "w4a4_mxfp4_flatquant"}, id="qwen3-moe-w4a4-mxfp4-flatquant"),
    pytest.param("qdense", {"scheme": "w4a4_mxfp4_flatquant"}, id="qwen3-w4a4-mxfp4-flatquant"),
    pytest.param("ds", {"scheme": "w4a4_mxfp4_flatquant"}, id="deepseek-w4a4-mxfp4-flatquant"),
    pytest.param("ds", MX_FITTED, id="deepseek-w4a4-mxfp4-flatquant-fitted"),
]

# sources written on first use (the compressed-tensors package writes them: skipped without it)
LAZY_SOURCES = {"ctmx": lambda root: write_ct_deepseek_release(root / "ct-mxfp4", "MXFP4")}

MX_METHODS = {"mxfp8": ("AscendW8A8MXFP8DynamicLinearMethod", "AscendW8A8MXFP8DynamicFusedMoEMethod"),
              "w4a4_mxfp4": ("AscendW4A4MXFP4DynamicLinearMethod", "AscendW4A4MXFP4DynamicFusedMoEMethod"),
              "w4a8_mxfp": ("unquantized linear", "AscendW4A8MXFPDynamicFusedMoEMethod")}


@pytest.fixture(scope="module")
def va_src() -> Path:
    src = Path(_ENV)
    if not (src / "vllm_ascend").is_dir() and src.name == "vllm_ascend":
        src = src.parent  # the package directory itself was given
    if not (src / "vllm_ascend" / "quantization" / "modelslim_config.py").is_file():
        pytest.fail(f"CVT_VLLM_ASCEND_SRC={_ENV}: no vllm_ascend/quantization/modelslim_config.py under it")
    return src


@pytest.fixture(scope="module")
def sources(fp8_release_session, tmp_path_factory):
    root = tmp_path_factory.mktemp("va-referee")
    # Qwen3-MoE sizes every vllm-ascend W4A16 assert divides (I % 8, H % 8, I and H % group)
    qmoe = write_bf16_checkpoint(root / "qwen3-moe", tiny_qwen3_config(moe=True, hidden_size=128, head_dim=32,
                                                                       intermediate_size=256, moe_intermediate_size=64))
    qdense = write_bf16_checkpoint(root / "qwen3", tiny_qwen3_config(moe=False))
    # GLM-5's FP8 release; the shared layer stated both ways vllm-ascend reads it (indexer_types and
    # index_topk_pattern: patch_deepseek_v2._should_skip_indexer_init needs both)
    glm_cfg = tiny_glm_moe_dsa_config(indexer_types=["full", "shared", "full"], index_topk_pattern="FSF")
    glm = write_release(root / "glm5", glm_cfg, release_tensors(glm_cfg, 1, "F32"), n_shards=2)
    k25_cfg = tiny_kimi_k25_config()
    k25 = write_release(root / "k25", k25_cfg, kimi_int4_tensors(k25_cfg, seed=2), n_shards=2, move_scale=False)
    # DeepSeek-V4's release (FP8 linears, FP4 experts): every attention type and an MTP layer without
    # compression, as V4-Flash's compress_ratios end; q_lora_rank 192 so the MX schemes' group 32 divides
    v4_cfg = tiny_deepseek_v4_config(q_lora_rank=192, compress_ratios=[0, 4, 128, 0, 0])
    v4 = write_v4_release(root / "v4", v4_cfg)
    return {"ds": fp8_release_session, "qmoe": qmoe, "qdense": qdense, "glm": glm, "k25": k25, "v4": v4, "root": root}


def build(sources, src: str, opts: dict) -> Path:
    name = src + "-" + "-".join(f"{k}={v}" for k, v in opts.items())
    dst = sources["root"] / "out" / name
    if src not in sources:
        sources[src] = LAZY_SOURCES[src](sources["root"])
    if not (dst / "cvt_manifest.json").exists():
        quantize(sources[src], dst, fmt="ascend", quiet=True, calib_tokens=64, **opts)
    return dst


@pytest.mark.parametrize("src, opts", CASES)
def test_vllm_ascend_loads_every_output(sources, va_src, src, opts):
    dst = build(sources, src, opts)
    quant = json.loads((dst / "cvt_manifest.json").read_text())["quant"]
    assert quant["target"] == "vllm-ascend"
    if src in LAZY_SOURCES:  # the release's FP4 weights are what the referee loads, as they are
        assert {t["method"] for t in quant["tensors"].values()} == {"source"}
    problems = check_output(dst, va_src)
    assert problems == [], f"{len(problems)} problems:\n" + "\n".join(problems[:60])


def test_referee_sees_the_schemes_and_leaves_no_stubs(sources, va_src):
    """The referee really ran vllm-ascend's dispatch (schemes per module, FA params on the MLA layer,
    the MTP draft's parameters) and left sys.modules, builtins.__import__, torch.empty and the
    default dtype as it found them."""
    def ours():
        return {k for k in sys.modules if k.split(".")[0] in ("vllm", "vllm_ascend", "torch_npu")}

    before, imp, empty, dtype = ours(), builtins.__import__, torch.empty, torch.get_default_dtype()
    r = inspect_output(build(sources, "ds", {"scheme": "w8a8", "static_attention": True}), va_src)
    assert ours() == before and builtins.__import__ is imp
    assert torch.empty is empty and torch.get_default_dtype() == dtype
    assert r.schemes["model.layers.1.self_attn.fused_qkv_a_proj"] == "AscendW8A8LinearMethod"
    assert r.schemes["model.layers.0.mlp.gate_up_proj"] == "AscendW8A8DynamicLinearMethod"  # dense layer
    assert r.schemes["model.layers.1.mlp.experts"] == "AscendW8A8DynamicFusedMoEMethod"
    assert r.schemes["model.layers.1.self_attn.kv_b_proj"] == "unquantized linear"
    ds = r.slots[("model.layers.1.self_attn.fused_qkv_a_proj.deq_scale", 1, None)]
    assert ds.dtype == torch.float32 and ds.filled_by == ["model.layers.1.self_attn.kv_a_proj_with_mqa.deq_scale"]
    # the MTP layer (index num_hidden_layers = 3) is the DeepSeekMTP draft's, under .mtp_block.
    assert any("MTP layers [3] checked" in n for n in r.notes)
    w = r.mtp_slots[("model.layers.3.mtp_block.mlp.experts.w13_weight", "w3", 2)]
    assert w.dtype == torch.int8 and w.filled_by == ["model.layers.3.mlp.experts.2.up_proj.weight"]
    assert r.mtp_slots[("model.embed_tokens.weight", None, None)].filled_by == ["model.layers.3.embed_tokens.weight"]
    assert all(s.filled_by for s in r.mtp_slots.values() if s.required)

    c8 = inspect_output(build(sources, "ds", {"scheme": "w8a8c8"}), va_src)
    assert c8.schemes["model.layers.1.self_attn.attn"] == "AscendFAQuantAttentionMethod"
    fa = c8.slots[("model.layers.1.self_attn.mla_attn.mla_attn.fa_k.scale", None, None)]
    assert fa.shape == (1, 1) and fa.filled_by == ["model.layers.1.self_attn.fa_k.scale"]
    gqa = inspect_output(build(sources, "qdense", {"scheme": "w8a8c8"}), va_src)
    assert gqa.schemes["model.layers.1.self_attn.attn"] == "AscendC8KVCacheAttentionMethod"
    assert gqa.slots[("model.layers.1.self_attn.attn.v_cache_offset", None, None)].filled_by == [
        "model.layers.1.self_attn.v_proj.kv_cache_offset"]
    w4 = inspect_output(build(sources, "qmoe", {"scheme": "w4a16", "group_size": 32}), va_src)
    assert w4.schemes["model.layers.1.mlp.experts"] == "AscendW4A16FusedMoEMethod"
    assert w4.schemes["model.layers.1.mlp.gate"] == "unquantized linear"  # the router is built with quant_config
    mx = inspect_output(build(sources, "ds", {"scheme": "fp4", "fp4_format": "mxfp4"}), va_src)
    assert mx.schemes["model.layers.1.mlp.experts"] == "AscendW4A16MXFP4FusedMoEMethod"


# ---- the referee finds what is wrong ------------------------------------------------------------

def _mutate(src: Path, dst: Path, edit=None, edit_desc=None) -> Path:
    """A copy of ``src`` with its tensors (all shards merged into one dict) and description edited."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if edit is not None:
        files = sorted(dst.glob("*.safetensors"))
        tensors = {}
        for f in files:
            tensors.update(load_file(f))
            f.unlink()
        edit(tensors)
        save_file(tensors, dst / "quant_model_weights-00001-of-00001.safetensors", metadata={"format": "pt"})
    if edit_desc is not None:
        desc = json.loads((dst / "quant_model_description.json").read_text())
        edit_desc(desc)
        (dst / "quant_model_description.json").write_text(json.dumps(desc))
    return dst


def _expect(problems: list[str], want: list[str]) -> None:
    for w in want:
        assert any(p.startswith(w) for p in problems), (w, problems)
    assert len(problems) == len(want), problems


def test_referee_reports_specific_problems(sources, va_src, tmp_path):
    """A broken W8A8 output: each defect comes back as its own named problem."""
    def edit(t):
        t["model.layers.1.self_attn.kv_a_layernorm.kv_cache_scale"] = torch.ones(1)  # the old MLA C8 name
        del t["model.layers.1.self_attn.q_a_proj.weight_scale"]
        t["model.layers.0.mlp.gate_proj.weight"] = t["model.layers.0.mlp.gate_proj.weight"].to(torch.int32)
        t["model.layers.0.mlp.down_proj.weight_scale"] = t["model.layers.0.mlp.down_proj.weight_scale"].flatten()

    bad = _mutate(build(sources, "ds", {"scheme": "w8a8"}), tmp_path / "bad", edit,
                  lambda d: d.pop("model.layers.2.self_attn.o_proj.weight"))
    _expect(check_output(bad, va_src), [
        ("model.layers.1.self_attn.kv_a_layernorm.kv_cache_scale: checkpoint tensor with no parameter in vLLM "
         "(KeyError in load_weights"),
        "model.layers.1.self_attn.fused_qkv_a_proj.weight_scale: declared by AscendW8A8DynamicLinearMethod",
        "model.layers.0.mlp.gate_proj.weight: integer payload is torch.int32",
        "model.layers.0.mlp.down_proj.weight_scale: shape [256] but",
        "model.layers.2.self_attn.o_proj: KeyError in vllm-ascend",
    ])


def test_referee_reports_static_attention_problems(sources, va_src, tmp_path):
    """Static W8A8: the fused q_a / kv_a shards must agree on the shared per-tensor input_scale, shapes
    are [1], deq_scale is float32 for a bf16 model and quant_bias int32."""
    a = "model.layers.1.self_attn."

    def edit(t):
        t[a + "kv_a_proj_with_mqa.input_scale"] = t[a + "kv_a_proj_with_mqa.input_scale"] * 2
        t[a + "q_a_proj.input_offset"] = t[a + "q_a_proj.input_offset"].reshape([])
        t[a + "o_proj.deq_scale"] = t[a + "o_proj.deq_scale"].to(torch.bfloat16)
        t[a + "o_proj.quant_bias"] = t[a + "o_proj.quant_bias"].float()

    bad = _mutate(build(sources, "ds", {"scheme": "w8a8", "static_attention": True}), tmp_path / "bad", edit)
    _expect(check_output(bad, va_src), [
        a + "fused_qkv_a_proj.input_scale: the fused shards carry different per-tensor values",
        a + "q_a_proj.input_offset: shape [] but",
        a + "o_proj.deq_scale: deq_scale is torch.bfloat16 but AscendW8A8LinearMethod",
        a + "o_proj.quant_bias: float tensor (torch.float32) for integer parameter",
    ])


def test_referee_reports_moe_kv_and_mtp_problems(sources, va_src, tmp_path):
    """W4A16 / MXFP4 experts, FAKQuant and GQA C8 scales, the MTP draft and the group size."""
    e = "model.layers.1.mlp.experts.1."

    def w4(t):
        t[e + "gate_proj.weight_packed"] = t[e + "gate_proj.weight_packed"].view(torch.float32)
        del t[e + "down_proj.weight_shape"]
        t[e + "up_proj.weight_offset"] = torch.zeros_like(t[e + "up_proj.weight_scale"])  # loads: zero offsets

    bad = _mutate(build(sources, "qmoe", {"scheme": "w4a16", "group_size": 32}), tmp_path / "w4", w4,
                  lambda d: d.update(group_size=64))  # every group scale now has the wrong width
    problems = check_output(bad, va_src)
    assert any(p.startswith(e + "gate_proj.weight_packed: float tensor (torch.float32)") for p in problems)
    assert any(p.startswith("model.layers.1.mlp.experts.w2_weight_shape: declared by AscendW4A16FusedMoEMethod")
               and "model.layers.1.mlp.experts.1.down_proj.weight_shape" in p for p in problems)
    assert any(p.startswith("model.layers.1.mlp.experts.0.down_proj.weight_scale: shape [128, 2] but") for p in problems)
    # W4A16 declares (zero) offsets, so a checkpoint offset loads; here only its group width is wrong
    assert [p.split(" but")[0] for p in problems if e + "up_proj.weight_offset" in p] == [
        e + "up_proj.weight_offset: shape [64, 4]"]

    def mx(t):
        t[e + "down_proj.weight_scale"] = t[e + "down_proj.weight_scale"].float()
        t["model.layers.3.eh_proj.weight"] = t["model.layers.3.eh_proj.weight"].to(torch.int8)
        t["model.layers.3.mlp.experts.9.up_proj.weight"] = t["model.layers.3.mlp.experts.0.up_proj.weight"].clone()

    _expect(check_output(_mutate(build(sources, "ds", {"scheme": "fp4", "fp4_format": "mxfp4"}), tmp_path / "mx",
                                 mx), va_src), [
        e + "down_proj.weight_scale: float tensor (torch.float32) for integer parameter",
        "[MTP draft] model.layers.3.eh_proj.weight: integer tensor (torch.int8) for float parameter",
        "[MTP draft] model.layers.3.mlp.experts.9.up_proj.weight: checkpoint tensor with no parameter in vLLM",
    ])

    a = "model.layers.2.self_attn."
    _expect(check_output(_mutate(build(sources, "ds", {"scheme": "w8a8c8"}), tmp_path / "fa",
                                 lambda t: t.update({a + "fa_q.scale": t[a + "fa_q.scale"][:1]}),
                                 lambda d: d.pop("model.layers.1.self_attn.fa_k.scale")), va_src), [
        a + "fa_q.scale: shape [1, 1] but model.layers.2.self_attn.mla_attn.mla_attn.fa_q.scale",
        # layer 1 is no longer an FA layer (its fa_k.scale tag is gone): its six tensors have no parameter
        *[f"model.layers.1.self_attn.fa_{x}.{y}: checkpoint tensor with no parameter" for x in "kqv"
          for y in ("offset", "scale")],
    ])

    g = "model.layers.1.self_attn."
    _expect(check_output(_mutate(build(sources, "qdense", {"scheme": "w8a8c8"}), tmp_path / "c8",
                                 lambda t: (t.pop(g + "v_proj.kv_cache_scale"),
                                            t.update({g + "k_proj.kv_cache_scale": t[g + "k_proj.kv_cache_scale"][:5]}))),
                         va_src), [
        g + "k_proj.kv_cache_scale: shape [5]: the C8 scale must squeeze",
        g + "attn.v_cache_scale: declared by AscendC8KVCacheAttentionMethod",
    ])


@pytest.mark.parametrize("scheme", sorted(MX_METHODS))
def test_mx_outputs_get_vllm_ascends_mx_methods(sources, va_src, scheme):
    """vllm-ascend's own dispatch picks its MX methods (methods/w8a8_mxfp8.py, w4a4_mxfp4.py,
    w4a8_mxfp4.py) for the MX outputs, and their create_weights' parameters take cvt's tensors."""
    r = inspect_output(build(sources, "ds", {"scheme": scheme}), va_src)
    linear, moe = MX_METHODS[scheme]
    assert r.problems == []
    assert r.schemes["model.layers.1.self_attn.o_proj"] == linear
    assert r.schemes["model.layers.1.mlp.experts"] == moe
    s = r.slots[("model.layers.1.mlp.experts.w13_weight_scale", "w1", 0)]
    assert s.dtype == torch.uint8 and s.filled_by == ["model.layers.1.mlp.experts.0.gate_proj.weight_scale"]


def test_glm5_indexer_is_vllms_float_indexer(sources, va_src, tmp_path):
    """GLM-5: vLLM's Indexer (deepseek_v2.py) in every "full" layer and the MTP layer, none in the shared
    layer 1 (vllm-ascend patch_deepseek_v2._should_skip_indexer_init); wq_b asks the description
    (FLOAT: unquantized), wk + weights_proj load into the fused float wk_weights_proj."""
    out = build(sources, "glm", {"scheme": "w8a8"})
    r = inspect_output(out, va_src)
    assert r.problems == []
    ix = "model.layers.{}.self_attn.indexer."
    assert r.schemes[ix.format(0) + "wq_b"] == "unquantized linear"
    assert r.schemes[ix.format(2) + "wk_weights_proj"] == "unquantized linear"
    assert r.schemes["model.layers.2.mlp.experts"] == "AscendW8A8DynamicFusedMoEMethod"
    assert not any(k.startswith(ix.format(1)) for k in r.schemes)
    assert r.slots[(ix.format(2) + "wk_weights_proj.weight", 1, None)].filled_by == [ix.format(2) + "weights_proj.weight"]
    assert r.slots[(ix.format(0) + "k_norm.bias", None, None)].filled_by == [ix.format(0) + "k_norm.bias"]
    w = r.mtp_slots[(ix.format(3).replace("layers.3.", "layers.3.mtp_block.") + "wk_weights_proj.weight", 0, None)]
    assert w.filled_by == [ix.format(3) + "wk.weight"]
    # without index_topk_pattern vllm-ascend computes top-k in layer 1 (index_topk_freq 1) and builds its
    # indexer, which the checkpoint (transformers' reading of indexer_types) does not have
    cfg = json.loads((out / "config.json").read_text())
    del cfg["index_topk_pattern"]
    bad = shutil.copytree(out, tmp_path / "no-pattern")
    (bad / "config.json").write_text(json.dumps(cfg))
    problems = check_output(bad, va_src)
    assert problems and all(p.startswith(ix.format(1)) for p in problems), problems
    assert any(p.startswith(ix.format(1) + "wq_b: KeyError in vllm-ascend") for p in problems), problems


@pytest.mark.parametrize("scheme, moe", [("w4a16", "AscendW4A16FusedMoEMethod"), ("w4a8", "AscendW4A8DynamicFusedMoEMethod")])
def test_kimi_k25_loads_under_vllms_language_model_prefix(sources, va_src, tmp_path, scheme, moe):
    """Kimi-K2.5: vLLM models/kimi_k25.py builds DeepseekV2Model(prefix="language_model") with no
    packed_modules_mapping, so vllm-ascend's AscendModelSlimConfig.get_quant_method looks up
    ``language_model.layers.{i}.…`` and the fused names (modelslim_config.py get_linear_quant_type);
    cvt's description carries them (cvt.qtensor.kimi_k25_keys). Without them every text module
    is a KeyError; the vision tower must stay float."""
    out = build(sources, "k25", {"scheme": scheme, **({"group_size": 32} if scheme == "w4a16" else {})})
    r = inspect_output(out, va_src)
    assert r.problems == []
    assert r.schemes["language_model.layers.1.mlp.experts"] == moe
    assert r.schemes["language_model.layers.1.self_attn.fused_qkv_a_proj"] == "unquantized linear"
    assert r.schemes["language_model.layers.0.mlp.gate_up_proj"] == "unquantized linear"
    local = "weight_packed" if scheme == "w4a16" else "weight"
    s = r.slots[(f"language_model.layers.1.mlp.experts.w13_{local}", "w3", 2)]
    assert s.filled_by == [f"language_model.model.layers.1.mlp.experts.2.up_proj.{local}"]
    assert r.slots[("lm_head.weight", None, None)].filled_by == ["language_model.lm_head.weight"]

    desc = json.loads((out / "quant_model_description.json").read_text())
    old = _mutate(out, tmp_path / "old", edit_desc=lambda d: [d.pop(k) for k in list(d)
                                                                if k.startswith("language_model.layers.")])
    problems = check_output(old, va_src)
    assert "language_model.layers.1.mlp.experts: KeyError in vllm-ascend" in "\n".join(problems)
    assert all(": KeyError in vllm-ascend" in p for p in problems), problems
    tag = desc[f"language_model.layers.1.mlp.experts.{local}"]
    assert tag == desc[f"language_model.model.layers.1.mlp.experts.0.gate_proj.{local}"] == scheme.upper() + (
        "_DYNAMIC" if scheme == "w4a8" else "")

    v = "vision_tower.encoder.blocks.0.wo.weight"
    bad = _mutate(out, tmp_path / "int8-vision", lambda t: t.update({v: t[v].to(torch.int8)}))
    _expect(check_output(bad, va_src), [f"{v}: I8 tensor in the vision tower / projector"])


# ---- DeepSeek-V4 (issue 26): vllm-ascend's models/deepseek_v4 (tests/quant/vllm_ascend_referee_v4.py) ----

V4_CASES = [
    pytest.param({"scheme": "w8a8"}, "AscendW8A8DynamicLinearMethod", "AscendW8A8DynamicFusedMoEMethod", id="w8a8"),
    pytest.param({"scheme": "w4a8"}, "unquantized linear", "AscendW4A8DynamicFusedMoEMethod", id="w4a8"),
    pytest.param({"scheme": "w4a8", "target_version": "main"}, "unquantized linear", "AscendW4A8DynamicFusedMoEMethod",
                 id="w4a8-main"),
    # Ascend 950: the FP4 experts carried over (w4a8_mxfp, w4a4_mxfp4) or requantized (mxfp8)
    pytest.param({"scheme": "w4a8_mxfp"}, "unquantized linear", "AscendW4A8MXFPDynamicFusedMoEMethod", id="w4a8-mxfp"),
    pytest.param({"scheme": "mxfp8"}, "AscendW8A8MXFP8DynamicLinearMethod", "AscendW8A8MXFP8DynamicFusedMoEMethod",
                 id="w8a8-mxfp8"),
    pytest.param({"scheme": "w4a4_mxfp4"}, "AscendW4A4MXFP4DynamicLinearMethod", "AscendW4A4MXFP4DynamicFusedMoEMethod",
                 id="w4a4-mxfp4"),
    # experts-only schemes vllm-ascend's generic MoE registry takes for V4 too
    pytest.param({"scheme": "w4a16", "group_size": 32}, "unquantized linear", "AscendW4A16FusedMoEMethod", id="w4a16-g32"),
    pytest.param({"scheme": "fp4", "fp4_format": "mxfp4"}, "unquantized linear", "AscendW4A16MXFP4FusedMoEMethod",
                 id="mxfp4"),
]
V4_FLOAT = ("self_attn.wo_a", "self_attn.wo_b", "self_attn.compressor.wkv", "self_attn.compressor.wgate",
            "self_attn.indexer.wq_b", "self_attn.indexer.weights_proj", "self_attn.indexer.compressor.wkv",
            "self_attn.indexer.compressor.wgate", "mlp.gate")


@pytest.mark.parametrize("opts, linear, moe", V4_CASES)
def test_vllm_ascend_loads_every_v4_output(sources, va_src, opts, linear, moe):
    """Every module vllm-ascend's AscendDeepseekV4ForCausalLM and DeepSeekV4MTP build gets the method cvt's
    description asks for (vllm-ascend's own dispatch after its hc_head_fn key normalisation and the
    deepseek_v4 prefix / substr / packed maps), and every parameter its create_weights declares is filled
    by one cvt tensor of the exact shape and dtype: zero problems."""
    if not (va_src / "vllm_ascend" / "models" / "deepseek_v4").is_dir() and not (
            va_src / "vllm_ascend" / "models" / "deepseek_v4.py").is_file():
        pytest.skip(f"{va_src}: this vllm-ascend has no DeepSeek-V4 model")
    dst = build(sources, "v4", opts)
    desc = json.loads((dst / "quant_model_description.json").read_text())
    assert "hc_head_fn" in desc  # what makes _apply_extra_quant_adaptations normalise the release's names
    r = inspect_v4_output(dst, va_src)
    assert r.problems == [], f"{len(r.problems)} problems:\n" + "\n".join(r.problems[:60])
    for layer in ("model.layers.1.", "model.layers.2.", "mtp.0."):  # CSA, HCA, the MTP draft's block
        assert r.schemes[layer + "mlp.experts"] == moe
        for m in ("self_attn.wq_a", "self_attn.wq_b", "self_attn.wkv", "mlp.shared_experts.gate_up_proj"):
            assert r.schemes[layer + m] == linear, (layer, m)
        for m in V4_FLOAT:
            if layer + m in r.schemes:
                assert r.schemes[layer + m] == "unquantized linear", (layer, m)
    assert r.schemes["model.layers.1.self_attn.indexer.wq_b"] == "unquantized linear"
    assert r.schemes["mtp.0.e_proj"] == r.schemes["mtp.0.h_proj"] == "unquantized linear"
    # w1 / w3 land in gate_up_proj's shards and the experts' w13 after the SUBSTR mapping (.w1. -> .gate_proj.)
    w = "weight_packed" if opts["scheme"] == "w4a16" else "weight"
    s = r.slots[("model.layers.1.mlp.shared_experts.gate_up_proj.weight", 1, None)]
    assert s.filled_by == ["layers.1.ffn.shared_experts.w3.weight"]
    s = r.slots[(f"model.layers.2.mlp.experts.w13_{w}", "w3", 3)]
    assert s.filled_by == [f"layers.2.ffn.experts.3.w3.{w}"]
    assert r.slots[("model.layers.0.mlp.gate.tid2eid", None, None)].filled_by == ["layers.0.ffn.gate.tid2eid"]
    assert r.slots[("lm_head.weight", None, None)].filled_by == ["head.weight"]
    # the draft's own embedding and head, which vllm-ascend reads only as mtp.0.* (`ArchTable.ascend_copies`)
    assert r.mtp_slots[("model.embed_tokens.weight", None, None)].filled_by == ["mtp.0.emb.tok_emb.weight"]
    assert r.mtp_slots[("model.layers.0.shared_head.head.weight", None, None)].filled_by == ["mtp.0.head.weight"]
    assert r.mtp_slots[("model.layers.0.mtp_block.mlp.gate.e_score_correction_bias", None, None)].filled_by == [
        "mtp.0.ffn.gate.bias"]


def test_v4_referee_finds_what_vllm_ascend_would_not_load(sources, va_src, tmp_path):
    """Without the MTP copies (cvt's V4 outputs before issue 26's referee) vllm-ascend's draft asks the
    description for mtp.0.head (KeyError) and leaves its embedding empty; without hc_head_fn no key is
    normalised and every quantized module is a KeyError; an int8 wo_a loads into a float parameter."""
    if not (va_src / "vllm_ascend" / "models" / "deepseek_v4").is_dir() and not (
            va_src / "vllm_ascend" / "models" / "deepseek_v4.py").is_file():
        pytest.skip(f"{va_src}: this vllm-ascend has no DeepSeek-V4 model")
    out = build(sources, "v4", {"scheme": "w8a8"})
    old = _mutate(out, tmp_path / "old", lambda t: [t.pop(k) for k in ("mtp.0.emb.tok_emb.weight", "mtp.0.head.weight")],
                  lambda d: [d.pop(k) for k in ("mtp.0.emb.tok_emb.weight", "mtp.0.head.weight")])
    problems = check_v4_output(old, va_src)
    assert any(p.startswith("[MTP draft] model.embed_tokens.weight: declared by") for p in problems), problems
    assert all(p.startswith("[MTP draft] ") for p in problems) and len(problems) == 2, problems
    problems = check_v4_output(_mutate(out, tmp_path / "no-hc", edit_desc=lambda d: d.pop("hc_head_fn")), va_src)
    assert any(p.startswith("model.layers.1.self_attn.wq_a: KeyError in vllm-ascend") for p in problems), problems
    assert any(p.startswith("model.layers.1.mlp.experts: KeyError in vllm-ascend") for p in problems), problems
    a = "layers.1.attn.wo_a.weight"
    _expect(check_v4_output(_mutate(out, tmp_path / "int8", lambda t: t.update({a: t[a].to(torch.int8)})), va_src),
            [f"{a}: integer tensor (torch.int8) for float parameter model.layers.1.self_attn.wo_a.weight"])


@pytest.mark.parametrize("scheme", ["w8a8", "w4a8_mxfp", "mxfp8", "w4a4_mxfp4"])
def test_v4_weights_go_through_vllm_ascends_process_weights_after_loading(sources, va_src, scheme):
    """cvt's values in the parameters vllm-ascend creates, then its own process_weights_after_loading (NZ
    casts as the identity off-device): every quantized linear and MoE layer of a CSA and an HCA layer
    processes. (W4A8_DYNAMIC's experts call .npu() and W4A16's NPU packing: not runnable here.)"""
    if not (va_src / "vllm_ascend" / "models" / "deepseek_v4").is_dir() and not (
            va_src / "vllm_ascend" / "models" / "deepseek_v4.py").is_file():
        pytest.skip(f"{va_src}: this vllm-ascend has no DeepSeek-V4 model")
    mods = [f"model.layers.{i}.{m}" for i in (1, 2) for m in ("self_attn.wq_a", "self_attn.wq_b", "self_attn.wkv",
                                                             "self_attn.wo_a", "mlp.shared_experts.gate_up_proj",
                                                             "mlp.shared_experts.down_proj", "mlp.experts")]
    r = process_after_loading(build(sources, "v4", {"scheme": scheme}), va_src, mods)
    # every parameter vllm-ascend's method creates is filled from cvt's output, then processed;
    # wo_a is float (msModelSlim's V4 recipes); W4A8_MXFP is for the routed experts only
    quantized = {m for m in mods if not m.endswith("wo_a") and (scheme != "w4a8_mxfp" or m.endswith("mlp.experts"))}
    assert r == {m: "ok" if m in quantized else "unquantized" for m in mods}, r


def test_the_v4_routing_copies_vllm_ascends_renames(va_src):
    """The referee's copy of vllm-ascend's V4 load_weights renames (tests/quant/vllm_ascend_referee_v4.py
    MODEL_RENAMES / MTP_RENAMES) is the tree's own, pair for pair and in order."""
    from cvt.tests.quant.vllm_ascend_referee_v4 import MODEL_RENAMES, MTP_RENAMES, name_renames

    models = va_src / "vllm_ascend" / "models"
    model, mtp = ((models / "deepseek_v4" / "model.py", models / "deepseek_v4" / "mtp.py")
                  if (models / "deepseek_v4").is_dir() else (models / "deepseek_v4.py", models / "deepseek_v4_mtp.py"))
    if not model.is_file():
        pytest.skip(f"{va_src}: this vllm-ascend has no DeepSeek-V4 model")
    assert name_renames(model) == MODEL_RENAMES
    assert name_renames(mtp) == MTP_RENAMES


# ---- W4A4_FLATQUANT_DYNAMIC (issue 39 item 2) ---------------------------------------------------------

@pytest.mark.parametrize("opts", [{"scheme": "w4a4_flatquant"}, FITTED], ids=["hadamard", "fitted"])
def test_flatquant_output_gets_vllm_ascends_flatquant_method(sources, va_src, opts):
    """vllm-ascend's dispatch picks AscendW4A4FlatQuantDynamicLinearMethod for every linear cvt wrote
    (the fused qkv / gate_up shards share one left_trans), and its FusedMoE stays unquantized."""
    r = inspect_output(build(sources, "qmoe", opts), va_src)
    assert r.problems == []
    for m in ("self_attn.qkv_proj", "self_attn.o_proj"):
        assert r.schemes[f"model.layers.1.{m}"] == "AscendW4A4FlatQuantDynamicLinearMethod"
    assert r.schemes["model.layers.1.mlp.experts"] == "unquantized FusedMoE"
    s = r.slots[("model.layers.1.self_attn.qkv_proj.left_trans", "k", None)]
    assert s.shape == (8, 8) and s.filled_by == ["model.layers.1.self_attn.k_proj.left_trans"]


def _disk(dst: Path, module: str) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    tensors, _ = read_headers(dst)
    out = {}
    for name, (_, _, path) in tensors.items():
        if name.startswith(module + "."):
            with safe_open(path, "pt") as f:
                out[name[len(module) + 1:]] = f.get_tensor(name)
    return out


@pytest.mark.parametrize("opts", [{"scheme": "w4a4_flatquant"}, FITTED], ids=["hadamard", "fitted"])
def test_flatquant_runtime_is_vllm_ascends_apply(sources, va_src, opts):
    """vllm-ascend's own process_weights_after_loading + apply (its NPU ops as documented, in torch:
    vllm_ascend_referee_flatquant) on cvt's tensors give cvt's runtime kernel's output bit for bit,
    with a clip below 1 too; a left_trans written the other way round would not. Fitted: the
    transforms are not Hadamard's (nor orthogonal) and the clip is below 1 as written."""
    from cvt.qtensor import layouts as L
    from cvt.qtensor.schemes.flatquant import init_transforms
    from cvt.runtime import kernels

    dst = build(sources, "qmoe", opts)
    disk = _disk(dst, "model.layers.1.self_attn.o_proj")
    if opts is FITTED:
        assert not torch.equal(disk["left_trans"], init_transforms(disk["weight"].shape[1])[0])
        assert 0 < float(disk["clip_ratio"]) < 1
    lo = L.LAYOUTS.get("ascend-w4a4-flatquant")
    x = torch.randn(2, 3, disk["weight"].shape[1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    outs = {}
    for clip in (1.0, 0.8):
        d = dict(disk, clip_ratio=torch.tensor([clip]))
        q = lo.decode("o_proj", d)
        outs[clip] = kernels.get(q.kernel_fmt).from_parts(q.parts)(x)
        assert torch.equal(run_flatquant(va_src, d, x), outs[clip])
    assert not torch.equal(outs[1.0], outs[0.8])
    flipped = run_flatquant(va_src, dict(disk, left_trans=disk["left_trans"].T.contiguous()), x)
    assert float((flipped.float() - outs[1.0].float()).abs().max()) > 0.1 * float(outs[1.0].float().abs().max())


# ---- W4A4_MXFP4_FLATQUANT: row-parallel linears sized as vllm-ascend declares them -------------------

@pytest.mark.parametrize("src, opts", [("qmoe", {"scheme": "w4a4_mxfp4_flatquant"}), ("ds", MX_FITTED)],
                         ids=["qwen3-moe-hadamard", "deepseek-fitted"])
def test_mxflatquant_row_layers_are_quantized_with_row_sizes(sources, va_src, src, opts):
    """Every RowParallelLinear (o_proj, down_proj) is W4A4_MXFP4_FLATQUANT, none kept float, and its
    transforms are the ones vllm-ascend declares for a row layer (layer_type "row", max_supported_tp
    4), which differ from a column layer's of the same k; vllm-ascend's apply on them is cvt's kernel."""
    from cvt.qtensor import layouts as L
    from cvt.qtensor.schemes.flatquant_mx import get_decompose_dim
    from cvt.runtime import kernels
    from cvt.tests.quant.vllm_ascend_referee_mxflatquant import run_mxflatquant

    dst = build(sources, src, opts)
    r = inspect_output(dst, va_src)
    assert r.problems == []
    quant = json.loads((dst / "cvt_manifest.json").read_text())["quant"]
    rows = [m for m, s in r.schemes.items() if m.endswith(("o_proj", "down_proj")) and "experts" not in m]
    assert rows and all(r.schemes[m] == "AscendW4A4MXFP4FlatQuantDynamicLinearMethod" for m in rows)
    floats = quant["float_modules"]  # module -> reason
    assert not [f for f in floats if f.endswith(("o_proj", "down_proj")) and "experts" not in f], floats
    m = "model.layers.1.self_attn.o_proj"
    s = r.slots[(m + ".left_trans", None, None)]
    k = 2 * _disk(dst, m)["weight"].shape[1]
    assert s.shape[0] * r.slots[(m + ".right_trans", None, None)].shape[0] == k
    assert s.shape[0] != get_decompose_dim(k, 1)[0]  # not the non-row size: the row rule is in play
    disk = _disk(dst, m)
    assert disk["left_trans"].shape == s.shape
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    q = L.LAYOUTS.get("ascend-w4a4-mxfp4-flatquant-row").decode(m, disk)
    mine = kernels.get(q.kernel_fmt).from_parts(q.parts)(x)
    assert torch.equal(run_mxflatquant(va_src, disk, x, row=True), mine)
