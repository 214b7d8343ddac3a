"""Ascend outputs per scheme x serving target, pinned to the consumers' code.

Every tensor's name, dtype and shape, and the description / config.json keys, are compared
with what the stacks declare and read -- written out here by hand from their code, not from
cvt's layout table:

* vllm-ascend 0.23.0.post1 ``vllm_ascend/quantization/``:
  - ``methods/w8a8_dynamic.py`` AscendW8A8DynamicLinearMethod.get_weight / get_perchannel_param:
    weight int8 [n, k], weight_scale / weight_offset [n, 1];
  - ``methods/w8a8_static.py`` AscendW8A8LinearMethod: input_scale [1], input_offset [1],
    quant_bias int32 [n], deq_scale float32 [n] (bf16 models), weight_scale / weight_offset [n, 1];
  - ``methods/w4a16.py`` AscendW4A16FusedMoEMethod (registered ("W4A16", "moe") only):
    weight_packed int32 [n, k/8], weight_scale [n, k/G], weight_shape int32 [2];
  - ``methods/w4a16_mxfp4.py`` ("W4A16_MXFP4", "moe"): weight uint8 [n, k/2], weight_scale
    uint8 [n, k/32];
  - ``methods/kv_c8.py`` AscendFAQuantAttentionMethod: fa_q.scale [num_heads, 1], fa_k / fa_v
    .scale [num_kv_heads=1, 1], offsets int8; ``modelslim_config.py`` get_cache_scale (GQA:
    k_proj / v_proj .kv_cache_scale / .kv_cache_offset), _add_kvcache_quant_metadata
    (``fa_quant_type``, ``kv_cache_type``), is_layer_skipped_ascend (every linear's
    ``<prefix>.weight`` has a tag, FLOAT included);
  - ``patch/worker/patch_gqa_c8.py``: C8 scales loaded for Qwen3 dense, not Qwen3-MoE.
* msModelSlim 26.1 ``core/quant_service/modelslim_v1/save/ascendv1.py``: ``version`` 1.0.0,
  ``model_quant_type`` by QUANT_TYPE_PRIORITY, ``group_size``, ``kv_cache_type`` +
  ``kv_quant_type`` "C8", ``fa_quant_type`` "FAKQuant", tags ``FAQuant`` / ``C8`` / ``FLOAT``.
* MindIE atb_llm ``utils/quantize/w4a16.py`` W4A16LinearStatic (int8 two per byte, per group
  [n/2, k]; scale / offset [n, k/G]), ``models/base/config.py`` QuantizationConfig (group_size
  in 0/64/128/256, kv_quant_type, fa_quant_type read from config.json ``quantization_config``),
  ``models/deepseekv2/flash_causal_deepseekv2.py`` (``mla_quantize`` for the attention).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from cvt.convert.arch import Role, arch_for
from cvt.testing.checkpoints import tiny_qwen3_config, write_bf16_checkpoint
from cvt.errors import CvtError
from cvt.quant.stage import quantize
from cvt.runtime.loader import load_model
from cvt.runtime.verify import verify

I8, I32, U8, F32, BF16 = torch.int8, torch.int32, torch.uint8, torch.float32, torch.bfloat16


def headers(folder) -> dict[str, tuple[torch.dtype, tuple]]:
    out = {}
    for f in sorted(folder.glob("quant_model_weights-*.safetensors")):
        with safe_open(f, framework="pt") as h:
            for k in h.keys():
                sl = h.get_slice(k)
                out[k] = (getattr(torch, {"I8": "int8", "I32": "int32", "U8": "uint8", "F32": "float32",
                                          "BF16": "bfloat16", "F16": "float16", "I64": "int64"}[sl.get_dtype()]),
                          tuple(sl.get_shape()))
    return out


def linears(config) -> dict[str, tuple[tuple[int, int], bool, bool]]:
    """module -> ((n, k), quantizable by default, routed expert) for the decoder's linears."""
    arch = arch_for(config)
    out = {}
    for name, shape in arch.shapes().items():
        if not name.endswith(".weight") or len(shape) != 2:
            continue
        info = arch.classify(name)
        if info.role not in (Role.LINEAR, Role.EXPERT, Role.SHARED_EXPERT):  # MTP layers alike
            continue
        out[info.module] = (shape, info.rule.quantizable and not info.rule.float_default, info.role is Role.EXPERT)
    return out


def expected(config, kind: str, g: int = 0, static_attn: bool = False) -> dict[str, tuple[torch.dtype, tuple]]:
    """The tensors of every quantized linear, as the consumer declares them (module docstring)."""
    out = {}
    layers = config["num_hidden_layers"]
    for m, ((n, k), quant, expert) in linears(config).items():
        if not quant:
            continue
        if kind == "w8a8":
            # static attention is calibrated on the decoder layers (the MTP layer's stays dynamic)
            if static_attn and ".self_attn." in m and int(m.split(".")[2]) < layers:
                out.update({f"{m}.weight": (I8, (n, k)), f"{m}.input_scale": (F32, (1,)),
                            f"{m}.input_offset": (F32, (1,)), f"{m}.deq_scale": (F32, (n,)),
                            f"{m}.quant_bias": (I32, (n,)), f"{m}.weight_scale": (F32, (n, 1)),
                            f"{m}.weight_offset": (F32, (n, 1))})
            else:
                out.update({f"{m}.weight": (I8, (n, k)), f"{m}.weight_scale": (F32, (n, 1)),
                            f"{m}.weight_offset": (F32, (n, 1))})
        elif kind == "w4a16-vllm-ascend" and expert:
            out.update({f"{m}.weight_packed": (I32, (n, k // 8)), f"{m}.weight_scale": (BF16, (n, k // g)),
                        f"{m}.weight_shape": (I32, (2,))})
        elif kind == "mxfp4-vllm-ascend" and expert:
            out.update({f"{m}.weight": (U8, (n, k // 2)), f"{m}.weight_scale": (U8, (n, k // 32))})
        elif kind == "w4a16-mindie":
            out.update({f"{m}.weight": (I8, (n // 2, k)), f"{m}.weight_scale": (F32, (n, k // g)),
                        f"{m}.weight_offset": (F32, (n, k // g))})
    return out


def kv_expected(config) -> dict[str, tuple[torch.dtype, tuple]]:
    cfg = config
    out = {}
    for i in range(cfg["num_hidden_layers"]):
        a = f"model.layers.{i}.self_attn."
        if "kv_lora_rank" in cfg:
            h = cfg["num_attention_heads"]
            for r, rows in (("q", h), ("k", 1), ("v", 1)):
                out[f"{a}fa_{r}.scale"], out[f"{a}fa_{r}.offset"] = (F32, (rows, 1)), (I8, (rows, 1))
        else:
            ch = cfg["num_key_value_heads"] * cfg["head_dim"]
            for p in ("k_proj", "v_proj"):
                out[f"{a}{p}.kv_cache_scale"], out[f"{a}{p}.kv_cache_offset"] = (F32, (ch,)), (F32, (ch,))
    return out


def check(folder, config, want: dict, tags: dict[str, str], desc_keys: dict) -> dict:
    got = headers(folder)
    desc = json.loads((folder / "quant_model_description.json").read_text())
    for name, spec in want.items():
        assert got.get(name) == spec, (name, got.get(name), spec)
    # every tensor is tagged; quantized ones with their tag, the rest FLOAT
    assert set(got) <= set(desc)
    static = {n.rsplit(".", 1)[0] for n in want if n.endswith(".input_scale")}
    for name in got:
        want_tag = next((t for pat, t in tags.items() if pat in name and name in want
                         and (t != "W8A8" or name.rsplit(".", 1)[0] in static)), "FLOAT")
        assert desc[name] == want_tag, (name, desc[name], want_tag)
    # the float tensors are the source's, no quantized part left out or invented
    quantized_modules = {n.rsplit(".", 1)[0] for n in want}
    extra = [n for n in got if n.rsplit(".", 1)[0] in quantized_modules and n not in want]
    assert not extra, extra
    for m, (shape, _, _) in linears(config).items():  # every linear answers vllm-ascend's <prefix>.weight lookup
        assert f"{m}.weight" in desc or f"{m}.weight_packed" in desc, m
    for k, v in desc_keys.items():
        assert desc.get(k) == v, (k, desc.get(k), v)
    for k in ("kv_cache_type", "kv_quant_type", "fa_quant_type"):
        if k not in desc_keys:
            assert k not in desc, k
    return desc


@pytest.fixture(scope="module")
def sources(fp8_release_session, tmp_path_factory):
    root = tmp_path_factory.mktemp("targets")
    qmoe = write_bf16_checkpoint(root / "qwen3-moe", tiny_qwen3_config(moe=True, hidden_size=128, head_dim=32,
                                                                       intermediate_size=256, moe_intermediate_size=64))
    qdense = write_bf16_checkpoint(root / "qwen3", tiny_qwen3_config(moe=False))
    return {"ds": fp8_release_session, "qmoe": qmoe, "qdense": qdense, "root": root}


def cfg(src) -> dict:
    return json.loads((src / "config.json").read_text())


def run(sources, name, src, **kw):
    dst = sources["root"] / name
    if not (dst / "cvt_manifest.json").exists():  # built once per session (a failed attempt is redone)
        quantize(sources[src], dst, fmt="ascend", quiet=True, calib_tokens=64, **kw)
    return dst


# ---- vllm-ascend (the default target) ------------------------------------------------------------

@pytest.mark.slow
def test_vllm_ascend_w8a8_dynamic_and_static(sources):
    c = cfg(sources["ds"])
    d = run(sources, "ds-w8a8", "ds", scheme="w8a8")
    check(d, c, expected(c, "w8a8"), {".": "W8A8_DYNAMIC"},
          {"model_quant_type": "W8A8_DYNAMIC", "version": "1.0.0", "group_size": 0})
    s = run(sources, "ds-w8a8-static", "ds", scheme="w8a8", static_attention=True)
    want = expected(c, "w8a8", static_attn=True)
    check(s, c, want, {".self_attn.": "W8A8", ".": "W8A8_DYNAMIC"},
          {"model_quant_type": "W8A8", "version": "1.0.0", "group_size": 0})  # static outranks dynamic
    assert "quantization_config" not in cfg(s) and "quantize" not in cfg(s)  # vllm-ascend: description only


@pytest.mark.slow
def test_vllm_ascend_w8a8c8_mla_is_fakquant(sources):
    c = cfg(sources["ds"])
    d = run(sources, "ds-w8a8c8", "ds", scheme="w8a8c8")
    desc = check(d, c, {**expected(c, "w8a8"), **kv_expected(c)}, {".fa_": "FAQuant", ".": "W8A8_DYNAMIC"},
                 {"model_quant_type": "W8A8_DYNAMIC", "fa_quant_type": "FAKQuant"})
    assert not any("kv_cache_" in k for k in desc)  # the old kv_a_layernorm names raised KeyError in vLLM
    # the latent's scale is what the runtime's int8 cache uses; fa_v equals it (one latent tensor)
    m = load_model(d, dtype=torch.float32).model
    from cvt.runtime.kv_cache import get_kv_cache_scales

    got = get_kv_cache_scales(m)
    for i in range(c["num_hidden_layers"]):
        a = f"model.layers.{i}.self_attn."
        assert m.model.layers[i].self_attn.kv_scales[1] is None  # the rope key stays float
        assert torch.equal(got[a + "fa_v.scale"], got[a + "fa_k.scale"])


def test_vllm_ascend_w4a16_experts_int32_others_float(sources):
    c = cfg(sources["ds"])
    d = run(sources, "ds-w4a16", "ds", scheme="w4a16", group_size=32)
    want = expected(c, "w4a16-vllm-ascend", g=32)
    assert want and all(".experts." in n for n in want)
    desc = check(d, c, want, {".experts.": "W4A16"}, {"model_quant_type": "W4A16", "group_size": 32})
    assert desc["model.layers.1.self_attn.q_b_proj.weight"] == "FLOAT"
    m = json.loads((d / "cvt_manifest.json").read_text())["quant"]
    assert m["target"] == "vllm-ascend"
    assert "MoE experts only" in m["float_modules"]["model.layers.0.mlp.down_proj"]
    assert {t["layout"] for t in m["tensors"].values()} == {"ascend-w4a16-int32"}
    with pytest.raises(CvtError, match="group size > 0|not per channel"):
        quantize(sources["ds"], sources["root"] / "g0", fmt="ascend", scheme="w4a16", group_size=0, quiet=True)


def test_vllm_ascend_mxfp4_experts(sources):
    c = cfg(sources["ds"])
    d = run(sources, "ds-mxfp4", "ds", scheme="fp4", fp4_format="mxfp4")
    check(d, c, expected(c, "mxfp4-vllm-ascend"), {".experts.": "W4A16_MXFP4"},
          {"model_quant_type": "W4A16_MXFP4", "group_size": 32})
    with pytest.raises(CvtError, match=r"fp4 on Ascend is MXFP4"):
        quantize(sources["ds"], sources["root"] / "nv", fmt="ascend", scheme="fp4", quiet=True)


def test_vllm_ascend_gqa_c8_dense_and_qwen3_moe_refused(sources):
    c = cfg(sources["qdense"])
    d = run(sources, "qd-w8a8c8", "qdense", scheme="w8a8c8")
    check(d, c, {**expected(c, "w8a8"), **kv_expected(c)}, {".kv_cache_": "C8", ".": "W8A8_DYNAMIC"},
          {"model_quant_type": "W8A8_DYNAMIC", "kv_cache_type": "C8", "kv_quant_type": "C8"})
    with pytest.raises(CvtError, match="qwen3_moe on vllm-ascend.*drops them"):
        quantize(sources["qmoe"], sources["root"] / "qm-c8", fmt="ascend", scheme="w8a8c8", quiet=True)


# ---- MindIE -----------------------------------------------------------------------------------------

def test_mindie_w4a16_int8_every_linear_and_config_keys(sources):
    c = cfg(sources["ds"])
    d = run(sources, "ds-w4a16-mindie", "ds", scheme="w4a16", target="mindie")  # default group 64
    check(d, c, expected(c, "w4a16-mindie", g=64), {".": "W4A16"}, {"model_quant_type": "W4A16", "group_size": 64})
    out = cfg(d)
    assert out["quantize"] == "w4a16" and out["quantization_config"] == {"group_size": 64}
    with pytest.raises(CvtError, match="group sizes 64, 128, 256"):
        quantize(sources["ds"], sources["root"] / "m32", fmt="ascend", scheme="w4a16", group_size=32,
                 target="mindie", quiet=True)


@pytest.mark.slow
def test_mindie_static_mla_and_c8_config_keys(sources):
    c = cfg(sources["ds"])
    d = run(sources, "ds-w8a8c8-static-mindie", "ds", scheme="w8a8c8", static_attention=True, target="mindie")
    check(d, c, {**expected(c, "w8a8", static_attn=True), **kv_expected(c)},
          {".fa_": "FAQuant", ".self_attn.": "W8A8", ".": "W8A8_DYNAMIC"},
          {"model_quant_type": "W8A8", "fa_quant_type": "FAKQuant"})
    out = cfg(d)
    # static MLA + dynamic MLP: attention through mla_quantize, the rest w8a8_dynamic
    assert (out["quantize"], out["mla_quantize"]) == ("w8a8_dynamic", "w8a8")
    assert out["quantization_config"] == {"group_size": 0, "fa_quant_type": "FAKQuant"}
    q = run(sources, "qm-w8a8c8-mindie", "qmoe", scheme="w8a8c8", target="mindie")
    qc = cfg(sources["qmoe"])
    check(q, qc, {**expected(qc, "w8a8"), **kv_expected(qc)}, {".kv_cache_": "C8", ".": "W8A8_DYNAMIC"},
          {"kv_cache_type": "C8", "kv_quant_type": "C8", "model_quant_type": "W8A8_DYNAMIC"})
    assert cfg(q)["quantization_config"] == {"group_size": 0, "kv_quant_type": "C8"}


# ---- every new layout runs, verifies, shards and plans -------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", ["ds-w4a16", "ds-mxfp4", "ds-w8a8c8", "ds-w4a16-mindie"])
def test_new_layouts_run_and_verify(sources, name, tmp_path):
    spec = {"ds-w4a16": dict(scheme="w4a16", group_size=32), "ds-mxfp4": dict(scheme="fp4", fp4_format="mxfp4"),
            "ds-w8a8c8": dict(scheme="w8a8c8"), "ds-w4a16-mindie": dict(scheme="w4a16", target="mindie")}[name]
    d = run(sources, name, "ds", **spec)
    ref = sources["root"] / "ds-bf16"
    if not ref.exists():
        from cvt.convert.fp8_to_bf16 import fp8_to_bf16

        fp8_to_bf16(sources["ds"], ref, quiet=True)
    res = verify(d, ref, tmp_path / "report", seq_len=32, max_sequences=2)
    # random tiny weights quantize coarsely: the point is that every layout loads, runs and compares
    assert res.report.first_nonfinite_layer is None and res.report.logits.kl_mean < 1.0
    assert min(r.cosine for r in res.report.layers) > 0.5
    loaded = load_model(d, dtype=torch.float32)
    fmts = {type(m).fmt for m in loaded.model.modules() if hasattr(m, "fmt")}
    assert fmts & {"w4a16", "mxfp4", "w8a8_dynamic"}


# ---- reading what msModelSlim writes -------------------------------------------------------------

@pytest.mark.slow
def test_msmodelslim_static_w8a8_layout_loads(sources, tmp_path):
    """msModelSlim 26.1's ascendv1_saver writes static W8A8 linears as weight, input_scale,
    input_offset, deq_scale, quant_bias -- no weight_scale / weight_offset (the run in
    bench/msmodelslim_peer.py). cvt's static kernel reads neither, so that output loads and gives
    the same logits as cvt's own (which writes both for vllm-ascend's MLA fused paths)."""
    from safetensors.torch import load_file, save_file

    s = run(sources, "ds-w8a8-static", "ds", scheme="w8a8", static_attention=True)
    ms = tmp_path / "msmodelslim-like"
    ms.mkdir()
    desc = json.loads(next(s.glob("quant_model_description*.json")).read_text())
    static = {n[:-len(".weight")] for n, tag in desc.items() if n.endswith(".weight") and tag == "W8A8"}
    assert static
    dropped = 0
    for f in s.iterdir():
        if f.name == "cvt_manifest.json":
            continue  # msModelSlim writes none
        if f.suffix == ".safetensors":
            t = load_file(f)
            keep = {n: v for n, v in t.items()
                    if not (n.rsplit(".", 1)[0] in static and n.rsplit(".", 1)[1] in ("weight_scale", "weight_offset"))}
            dropped += len(t) - len(keep)
            save_file(keep, ms / f.name)
        elif f.name.endswith(".index.json"):
            idx = json.loads(f.read_text())
            idx["weight_map"] = {n: v for n, v in idx["weight_map"].items()
                                 if not (n.rsplit(".", 1)[0] in static
                                         and n.rsplit(".", 1)[1] in ("weight_scale", "weight_offset"))}
            (ms / f.name).write_text(json.dumps(idx))
        elif f.is_file():
            (ms / f.name).write_bytes(f.read_bytes())
    assert dropped == 2 * len(static)
    ids = torch.arange(1, 17)[None]
    a = load_model(s, dtype=torch.float32).model(ids)
    b = load_model(ms, dtype=torch.float32).model(ids)
    torch.testing.assert_close(b, a, rtol=0, atol=0)
    # a static linear missing a tensor the kernel does need names the module and what is missing
    name = sorted(static)[0]
    for f in ms.glob("*.safetensors"):
        t = load_file(f)
        if f"{name}.deq_scale" in t:
            del t[f"{name}.deq_scale"]
            save_file(t, f)
    for f in ms.glob("*.index.json"):
        idx = json.loads(f.read_text())
        del idx["weight_map"][f"{name}.deq_scale"]
        f.write_text(json.dumps(idx))
    with pytest.raises(CvtError, match=rf"{name}: none of the layouts .* \(missing deq_scale\)"):
        load_model(ms, dtype=torch.float32)


# ---- W4A8_DYNAMIC (vllm-ascend, MoE experts) -------------------------------------------------------
# vllm-ascend 0.23.0.post1 ``methods/w4a8.py`` AscendW4A8DynamicFusedMoEMethod, msModelSlim path with
# the description's ``version`` "1.0.0" (new_quant_version) and ``group_size`` 0 (is_per_channel_weight):
#   get_weight_modelslim: w13_weight int8 [E, I, H] (gate and up, each [I/2, H]: two int4 per byte
#     along the output dim), w2_weight int8 [E, H/2, I];
#   get_dynamic_quant_param_modelslim: w13_weight_scale / w13_weight_offset f32 [E, 2I, 1], w2_weight_scale
#     / w2_weight_offset f32 [E, H, 1]; no *_second tensors (per channel); w13_scale_bias f32 [E, 2I, 1],
#     w2_scale_bias f32 [E, H, 16 // tp] (tp 1 here: 16).
# AscendW4A8DynamicLinearMethod.get_pergroup_param divides input_size by group_size (0: ZeroDivisionError),
# so every other linear stays float (experts only, as W4A16 and MXFP4).


def w4a8_expected(config) -> dict[str, tuple[torch.dtype, tuple]]:
    out = {}
    for m, ((n, k), _, expert) in linears(config).items():
        if expert:
            runs = 16 if m.endswith("down_proj") else 1
            out.update({f"{m}.weight": (I8, (n // 2, k)), f"{m}.weight_scale": (F32, (n, 1)),
                        f"{m}.weight_offset": (F32, (n, 1)), f"{m}.scale_bias": (F32, (n, runs))})
    return out


@pytest.mark.parametrize("src", ["ds", "qmoe"])
def test_vllm_ascend_w4a8_dynamic_experts(sources, src):
    c = cfg(sources[src])
    d = run(sources, f"{src}-w4a8", src, scheme="w4a8")
    want = w4a8_expected(c)
    assert want and all(".experts." in n for n in want)
    desc = check(d, c, want, {".experts.": "W4A8_DYNAMIC"},
                 {"model_quant_type": "W4A8_DYNAMIC", "version": "1.0.0", "group_size": 0})
    assert desc["model.layers.1.mlp.gate.weight"] == "FLOAT"
    m = json.loads((d / "cvt_manifest.json").read_text())["quant"]
    assert {t["layout"] for t in m["tensors"].values()} == {"ascend-w4a8-dynamic", "ascend-w4a8-dynamic-row"}
    assert all(t["layout"].endswith("-row") == n.endswith("down_proj") for n, t in m["tensors"].items())
    assert "MoE experts only" in m["float_modules"]["model.layers.1.self_attn.o_proj"]


def test_w4a8_refused_where_no_stack_loads_it(sources):
    with pytest.raises(CvtError, match="for mindie has no layout for scheme 'w4a8'"):
        quantize(sources["ds"], sources["root"] / "w4a8-mindie", fmt="ascend", scheme="w4a8", target="mindie",
                 quiet=True)
    with pytest.raises(CvtError, match="w4a8"):
        quantize(sources["ds"], sources["root"] / "w4a8-ct", fmt="compressed-tensors", scheme="w4a8", quiet=True)


@pytest.mark.slow
def test_w4a8_quantize_load_verify_on_trained_fixture(trained_fixture, tmp_path):
    """End to end on real weight structure: quantize -> load_model -> verify. Observed (RTN, experts
    only, the rest bf16): mean KL 0.0007, ppl ratio 1.001, every layer's cosine > 0.998."""
    dst = tmp_path / "w4a8"
    quantize(trained_fixture, dst, fmt="ascend", scheme="w4a8", quiet=True)
    loaded = load_model(dst, dtype=torch.float32)
    fmts = [type(m).fmt for n, m in loaded.model.named_modules() if ".experts." in n and hasattr(m, "fmt")]
    assert fmts and set(fmts) == {"w4a8_dynamic"}
    r = verify(dst, trained_fixture, tmp_path / "report", seq_len=128, max_sequences=8).report
    assert r.first_nonfinite_layer is None
    assert r.logits.kl_mean < 0.005 and abs(r.logits.ppl_ratio - 1) < 0.01, (r.logits.kl_mean, r.logits.ppl_ratio)
    assert min(x.cosine for x in r.layers) > 0.99
    sqnr = {t["sqnr_db"] for t in json.loads((dst / "cvt_manifest.json").read_text())["quant"]["tensors"].values()}
    assert min(sqnr) > 14


@pytest.mark.skipif(not __import__("os").environ.get("CVT_VLLM_ASCEND_SRC"),
                    reason="set CVT_VLLM_ASCEND_SRC to a local vllm-ascend source tree to run its own loader")
@pytest.mark.parametrize("src", ["ds", "qmoe"])
def test_w4a8_vllm_ascend_referee(sources, src):
    """vllm-ascend's own AscendModelSlimConfig / create_weights (tests/quant/vllm_ascend_referee.py)."""
    from pathlib import Path

    from cvt.tests.quant.vllm_ascend_referee import check_output, inspect_output

    va = Path(__import__("os").environ["CVT_VLLM_ASCEND_SRC"])
    d = run(sources, f"{src}-w4a8", src, scheme="w4a8")
    assert check_output(d, va) == []
    r = inspect_output(d, va)
    assert r.schemes["model.layers.1.mlp.experts"] == "AscendW4A8DynamicFusedMoEMethod"


def test_w4a8_experts_w8a8_elsewhere_like_msmodelslims_deepseek_recipe(sources):
    """msModelSlim's lab_practice/deepseek_v3/deepseek_w4a8_per_channel.yaml: W8A8_DYNAMIC attention and
    dense / shared MLP, W4A8_DYNAMIC routed experts; model_quant_type by its priority (W4A8_DYNAMIC is
    not in QUANT_TYPE_PRIORITY): W8A8_DYNAMIC, group_size 0."""
    from cvt.quant.recipe import Recipe

    c = cfg(sources["ds"])
    rec = Recipe.model_validate({"rules": [{"pattern": r"mlp\.experts\.", "scheme": "w4a8"}]})
    d = run(sources, "ds-w8a8-w4a8-experts", "ds", scheme="w8a8", recipe=rec)
    want = {**{n: v for n, v in expected(c, "w8a8").items() if ".experts." not in n}, **w4a8_expected(c)}
    check(d, c, want, {".experts.": "W4A8_DYNAMIC", ".": "W8A8_DYNAMIC"},
          {"model_quant_type": "W8A8_DYNAMIC", "version": "1.0.0", "group_size": 0})


def test_w4a8_shards_like_vllm_ascend_loads_it(sources, tmp_path):
    """moe_tp 2: gate / up split their rows (weight pairs, scale_bias [n/2, 1]); down splits k, and its
    scale_bias [n, 16] into [n, 8] per rank -- vllm-ascend's w2_scale_bias [E, H, 16 // tp]."""
    from safetensors.torch import load_file

    from cvt.convert.placement import make_layout
    from cvt.convert.shard import shard

    d = run(sources, "ds-w4a8", "ds", scheme="w4a8")
    out = shard(d, tmp_path / "tp", make_layout(4, tp=4, ep=2, moe_tp=2, dense_tp=2, embed_tp=1), quiet=True).dst
    whole = {k: v for f in d.glob("*.safetensors") for k, v in load_file(f).items()}
    e = "model.layers.1.mlp.experts.0."
    held = {}
    for f in sorted(out.glob("rank-*/*.safetensors")):
        for k, v in load_file(f).items():
            if k.startswith(e):
                held.setdefault(k, []).append(v)
    assert [t.shape for t in held[e + "down_proj.scale_bias"]] == [(whole[e + "down_proj.scale_bias"].shape[0], 8)] * 2
    assert torch.equal(torch.cat(held[e + "down_proj.scale_bias"], 1), whole[e + "down_proj.scale_bias"])
    assert torch.equal(torch.cat(held[e + "down_proj.weight"], 1), whole[e + "down_proj.weight"])
    for p in ("weight", "weight_scale", "scale_bias"):
        assert torch.equal(torch.cat(held[e + "gate_proj." + p], 0), whole[e + "gate_proj." + p]), p


def test_w4a8_with_gptq_is_refused_before_calibrating(sources, tmp_path):
    """GPTQ has no grid for W4A8_DYNAMIC (`cvt.quant.methods.gptq.SUPPORTED`): refused from the
    options, before the checkpoint is read; a recipe giving gptq to W4A8 modules is refused while
    planning, naming the module, before any layer is calibrated or any file written."""
    from cvt.errors import OptionError
    from cvt.quant.recipe import Recipe

    dst = tmp_path / "w4a8-gptq"
    with pytest.raises(OptionError, match=r"^--method gptq does not apply to --scheme w4a8: "):
        quantize(sources["ds"], dst, scheme="w4a8", fmt="ascend", method="gptq", quiet=True)
    recipe = Recipe(rules=[{"pattern": "mlp\\.experts\\.", "scheme": "w4a8", "method": "gptq"}])
    with pytest.raises(CvtError, match=r"mlp\.experts\.\d+\.\w+_proj: --method gptq does not support scheme w4a8"):
        quantize(sources["ds"], dst, scheme="w4a8", fmt="ascend", recipe=recipe, quiet=True)
    assert not dst.exists() or not any(dst.rglob("*.safetensors"))
