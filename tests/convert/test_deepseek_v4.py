"""DeepSeek-V4 under the release's names: the architecture table, config checks, the FP4 expert
dequant and `cvt fp8-to-bf16` on a tiny V4 release, `cvt plan` / `cvt inspect` on V4 configs.

Referees: DeepSeek's V4 ``inference/convert.py`` (``mapping``: the TP split dim of each release
name; ``FP4_TABLE`` and ``cast_e2m1fn_to_e4m3fn``: the E2M1 table, code 8 = +0.0, element 2i
in the low nibble, one scale per 32 inputs; the ``wo_a`` branch: an FP8 linear is
``float32(w) * float32(scale)`` per 128x128 block, rounded once to bf16) and its
``inference/model.py`` (``Linear``: FP4 ``[n, k/2]`` + float8_e8m0fnu ``[n, k/32]``, FP8 blocks
with float8_e8m0fnu ``[ceil(n/128), ceil(k/128)]``; ``MTPBlock`` / ``Block`` / ``Gate``: the
per-layer tensors). The reference math below is written from those, independently of cvt.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open

from cvt.convert.arch import arch_for, config_problems
from cvt.convert.fp4 import dequant_fp4_experts
from cvt.testing.checkpoints_v4 import tiny_deepseek_v4_config, v4_release_tensors, write_v4_release
from cvt.tests.conftest import run_cvt

# DeepSeek's V4 inference/convert.py FP4_TABLE (code 8 is +0.0)
OFFICIAL_FP4_TABLE = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                                   0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32)

# DeepSeek-V4-Flash as its config.json and inference/model.py ModelArgs describe it
FLASH = {"model_type": "deepseek_v4", "vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048,
         "num_hidden_layers": 43, "num_hash_layers": 3, "num_attention_heads": 64, "num_key_value_heads": 1,
         "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 6, "scoring_func": "sqrtsoftplus",
         "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "q_lora_rank": 1024, "head_dim": 512,
         "qk_rope_head_dim": 64, "o_groups": 8, "o_lora_rank": 1024, "sliding_window": 128,
         "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0], "index_n_heads": 64, "index_head_dim": 128,
         "index_topk": 512, "hc_mult": 4, "hc_sinkhorn_iters": 20, "num_nextn_predict_layers": 1,
         "expert_dtype": "fp4", "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                                        "weight_block_size": [128, 128]}}


def official_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """convert.py's unpack (low nibble first, FP4_TABLE) times the float32 scale, one bf16 rounding."""
    u = packed.view(torch.uint8)
    x = torch.stack([OFFICIAL_FP4_TABLE[(u & 0x0F).long()], OFFICIAL_FP4_TABLE[((u >> 4) & 0x0F).long()]], -1).flatten(1)
    return (x * scale.float().repeat_interleave(32, dim=1)).bfloat16()


def official_fp8(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    s = scale.float().repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    return (w.float() * s).bfloat16()


# ------------------------------------------------------------------------------ architecture table
@pytest.mark.parametrize("name, split", [
    # inference/convert.py mapping: wq_b 0, wo_a 0, wo_b 1, attn_sink 0, weights_proj 0, embed 0, head 0
    ("layers.1.attn.wq_b.weight", 0), ("layers.1.attn.wq_b.scale", 0), ("layers.1.attn.wo_a.weight", 0),
    ("layers.1.attn.wo_b.weight", 1), ("layers.1.attn.wo_b.scale", 1), ("layers.1.attn.attn_sink", 0),
    ("layers.1.attn.indexer.weights_proj.weight", 0), ("layers.1.attn.indexer.wq_b.weight", 0),
    ("embed.weight", 0), ("head.weight", 0),
    # every other name: whole on each rank
    ("layers.1.attn.wq_a.weight", None), ("layers.1.attn.wkv.weight", None), ("layers.1.attn.compressor.ape", None),
    ("layers.1.attn.compressor.wkv.weight", None), ("layers.1.attn.indexer.compressor.wgate.weight", None),
    ("layers.1.hc_attn_fn", None), ("hc_head_base", None), ("layers.0.ffn.gate.tid2eid", None),
    ("layers.3.ffn.gate.bias", None), ("mtp.0.e_proj.weight", None), ("mtp.0.hc_head_scale", None),
])
def test_split_dims_follow_the_official_convert_mapping(name, split):
    assert arch_for(tiny_deepseek_v4_config()).classify(name).split_dim == split


@pytest.mark.slow
def test_every_release_tensor_maps_and_mtp_is_a_layer_past_the_decoder():
    cfg = tiny_deepseek_v4_config()
    arch = arch_for(cfg)
    tensors = v4_release_tensors(cfg)
    infos = {n: arch.classify(n) for n in tensors}
    assert {i.layer for i in infos.values() if i.is_mtp} == {4}
    assert infos["mtp.0.ffn.experts.3.w2.weight"].expert == 3
    # hash layers carry tid2eid and no bias, scored layers (and MTP) the reverse (model.py Gate)
    assert {n for n in tensors if n.endswith("tid2eid")} == {"layers.0.ffn.gate.tid2eid", "layers.1.ffn.gate.tid2eid"}
    assert {n for n in tensors if n.endswith("gate.bias")} == {"layers.2.ffn.gate.bias", "layers.3.ffn.gate.bias",
                                                               "mtp.0.ffn.gate.bias"}
    # CSA (rate 4) layers have the indexer and an overlapping compressor (2 x head_dim); HCA does not
    assert tensors["layers.1.attn.compressor.ape"].shape == (4, 128)
    assert tensors["layers.2.attn.compressor.ape"].shape == (128, 64)
    assert not any(n.startswith(("layers.0.attn.compressor", "layers.2.attn.indexer")) for n in tensors)
    # msModelSlim's V4 recipes: wo_a, wo_b, the compressors and the indexer stay float
    for n in ("layers.1.attn.wo_a.weight", "layers.1.attn.wo_b.weight", "layers.1.attn.indexer.wq_b.weight",
              "layers.1.attn.compressor.wkv.weight"):
        assert infos[n].rule.float_default, n
    for n in ("layers.1.attn.wq_a.weight", "layers.1.attn.wq_b.weight", "layers.1.ffn.experts.0.w1.weight",
              "layers.1.ffn.shared_experts.w2.weight"):
        assert infos[n].rule.quantizable and not infos[n].rule.float_default, n


def test_flash_config_totals_by_hand():
    shapes = arch_for(FLASH).shapes()
    total = sum(torch.Size(s).numel() for s in shapes.values())
    experts = 44 * 256 * 3 * 2048 * 4096  # 43 layers + MTP, 256 experts of w1 / w2 / w3
    shared = 44 * 3 * 2048 * 4096
    attn_core = 44 * (64 + 1024 * 4096 + 1024 + 64 * 512 * 1024 + 512 * 4096 + 512 + 8 * 1024 * 64 * 512 // 8
                      + 4096 * 8 * 1024)
    csa = 21 * (4 * 1024 + 2 * 1024 * 4096 + 512 + 64 * 128 * 1024 + 64 * 4096 + 4 * 256 + 2 * 256 * 4096 + 128)
    hca = 20 * (128 * 512 + 2 * 512 * 4096 + 512)
    hc = 44 * 2 * (24 * 16384 + 24 + 3) + 2 * (4 * 16384 + 4 + 1)  # per layer attn + ffn; head + MTP head
    norms = 44 * 2 * 4096 + 4096 + 3 * 4096  # attn / ffn norms, final norm, MTP enorm / hnorm / norm
    router = 44 * 256 * 4096 + 3 * 129280 * 6 + 41 * 256
    embed_head = 2 * 129280 * 4096
    mtp_proj = 2 * 4096 * 4096
    assert total == experts + shared + attn_core + csa + hca + hc + norms + router + embed_head + mtp_proj
    assert 290e9 < total < 292e9  # V4-Flash: 284B without the MTP layer's ~7B


# ------------------------------------------------------------------------------ config checks
@pytest.mark.parametrize("override, key", [
    ({"compress_ratios": [0, 64, 128, 0, 4]}, "compress_ratios"),
    ({"compress_ratios": [0, 4]}, "compress_ratios"),
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"n_shared_experts": 2}, "n_shared_experts"),
    ({"o_groups": 3}, "o_groups"),
    ({"scoring_func": "relu"}, "scoring_func"),
    ({"expert_dtype": "int4"}, "expert_dtype"),
    ({"compress_ratios": None, "layer_types": ["sliding_attention", "full_attention", "sliding_attention",
                                               "sliding_attention"]}, "layer_types"),
    ({"mlp_layer_types": ["moe", "hash_moe", "moe", "moe"]}, "mlp_layer_types"),
    ({"compress_rates": {"compressed_sparse_attention": 8}}, "compress_rates"),
    ({"num_hash_layers": 9}, "num_hash_layers"),
    ({"qk_rope_head_dim": 64}, "qk_rope_head_dim"),
])
def test_config_checks_refuse_what_the_runtime_does_not_implement(override, key):
    problems = config_problems(tiny_deepseek_v4_config(**override))
    assert any(p.startswith(f"config.json {key}") for p in problems), problems


def test_real_flash_config_and_tiny_config_pass():
    assert config_problems(FLASH) == []
    assert config_problems(tiny_deepseek_v4_config()) == []


# ------------------------------------------------------------------------------ FP4 dequant
@pytest.mark.parametrize("scale_dtype", [torch.float8_e8m0fnu, torch.float32, torch.bfloat16])
def test_fp4_every_code_every_scale_matches_official(scale_dtype):
    # 4 rows x 64 inputs: each row holds all 256 byte values over its two groups' worth of pairs
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(4, 64)[:, :32].contiguous()
    packed = torch.cat([packed, torch.arange(128, 256, dtype=torch.int32).to(torch.uint8).view(4, 32)], 1)
    packed = packed.view(torch.int8)  # [4, 64] bytes: 128 codes per row
    if scale_dtype is torch.float8_e8m0fnu:  # edge exponents: 2**-127 (a float32 subnormal), 2**-126, 1, 2**120
        scale = torch.tensor([[0, 1, 127, 247]] * 4, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    else:
        scale = torch.tensor([[1e-3, 0.75, 3.3, 7e-30]] * 4).to(scale_dtype)
    got = dequant_fp4_experts(packed, scale)
    want = official_fp4(packed, scale)
    assert got.dtype == torch.bfloat16 and got.shape == (4, 128)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_fp4_hand_built_bytes():
    # byte 0x1F: low nibble 0xF = -6, high nibble 0x1 = 0.5; byte 0x08: code 8 = +0.0 (not -0.0), code 0
    row = torch.tensor([0x1F, 0x08] + [0x00] * 14, dtype=torch.uint8).view(1, 16).view(torch.int8)
    scale = torch.tensor([[130]], dtype=torch.uint8).view(torch.float8_e8m0fnu)  # 2**3
    got = dequant_fp4_experts(row, scale)
    assert got[0, :4].tolist() == [-48.0, 4.0, 0.0, 0.0]
    assert got.view(torch.int16)[0, 2].item() == 0  # +0.0 bits, as FP4_TABLE[8]


def test_fp4_wrong_scale_shape_names_both():
    with pytest.raises(Exception, match=r"needs a \[2, 2\] scale"):
        dequant_fp4_experts(torch.zeros(2, 32, dtype=torch.int8), torch.ones(2, 1))


# ------------------------------------------------------------------------------ fp8-to-bf16
@pytest.fixture(scope="module")
def v4_release(tmp_path_factory):
    return write_v4_release(tmp_path_factory.mktemp("v4") / "src")


def _load(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


@pytest.mark.slow
def test_fp8_to_bf16_v4_release_bit_exact(v4_release, tmp_path):
    r = run_cvt("fp8-to-bf16", v4_release, tmp_path / "out", "--quiet")
    assert r.rc == 0, r.err
    src, out = _load(v4_release), _load(tmp_path / "out")
    assert not [n for n in out if n.endswith(".scale")]
    assert set(out) == {n for n in src if not n.endswith(".scale")}
    n_fp4 = n_fp8 = 0
    for name, t in out.items():
        s = src[name]
        scale = src.get(name[:-len("weight")] + "scale") if name.endswith(".weight") else None
        if scale is None:
            assert t.dtype == s.dtype and torch.equal(t.view(torch.uint8), s.view(torch.uint8)), name
        elif s.dtype == torch.int8:
            n_fp4 += 1
            assert torch.equal(t.view(torch.int16), official_fp4(s, scale).view(torch.int16)), name
        else:
            n_fp8 += 1
            assert torch.equal(t.view(torch.int16), official_fp8(s, scale).view(torch.int16)), name
    assert n_fp4 == 5 * 4 * 3 and n_fp8 == 44
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in cfg and "expert_dtype" not in cfg
    assert cfg["compress_ratios"] == [0, 4, 128, 0, 4]


@pytest.mark.slow
def test_fp8_to_bf16_v4_misshapen_fp4_scale_is_refused(tmp_path):
    cfg = tiny_deepseek_v4_config()
    tensors = v4_release_tensors(cfg)
    tensors["layers.2.ffn.experts.1.w3.scale"] = tensors["layers.2.ffn.experts.1.w3.scale"][:, :4].contiguous()
    from cvt.testing.checkpoints import write_release

    src = write_release(tmp_path / "src", cfg, tensors, move_scale=False)
    r = run_cvt("fp8-to-bf16", src, tmp_path / "out")
    assert r.rc != 0 and r.err.startswith("cvt: error:") and "layers.2.ffn.experts.1.w3.scale" in r.err, r.err
    assert "Traceback" not in r.err and not (tmp_path / "out" / "config.json").exists()


@pytest.mark.slow
def test_fp8_to_bf16_v4_int8_experts_without_fp4_expert_dtype_refused(tmp_path):
    cfg = tiny_deepseek_v4_config()
    src = write_v4_release(tmp_path / "src", cfg)
    (src / "config.json").write_text(json.dumps({**cfg, "expert_dtype": "fp8"}))
    r = run_cvt("fp8-to-bf16", src, tmp_path / "out")
    assert r.rc != 0 and "expert_dtype" in r.err and "Traceback" not in r.err, r.err


# ------------------------------------------------------------------------------ inspect / plan
def test_inspect_recognises_a_v4_release(v4_release):
    r = run_cvt("inspect", v4_release)
    assert r.rc == 0, r.err
    assert "deepseek_v4" in r.out and "problems        none" in r.out


def test_plan_from_the_flash_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(FLASH))
    r = run_cvt("plan", tmp_path, "--world-size", "16", "--ep", "16")
    assert r.rc == 0, r.err
    assert "memory plan: deepseek_v4" in r.out
    # 256 experts over ep 16 = 16 per rank, 44 MoE layers (MTP included), w1 / w2 / w3 of 2048 x 4096, bf16
    per_rank = 16 * 44 * 3 * 2048 * 4096 * 2 / 2**30
    cell = f"{per_rank:.2f} GiB"
    assert re.search(rf"^experts +{cell} +{cell} +{cell}$", r.out, re.M), r.out


def test_plan_counts_each_layer_types_kv_cache():
    from cvt.convert.placement import make_layout
    from cvt.convert.memory_plan import memory_plan

    plan = memory_plan(FLASH, make_layout(world_size=16, ep=16), kv_tokens=1_000_000)
    per_rank = 62500  # 1M tokens over dp 16
    window = 43 * 128 * 512  # every decoder layer keeps the last 128 K=V entries of head_dim 512
    csa = 21 * (per_rank // 4) * (512 + 128)  # 21 layers at rate 4: one entry + one indexer key per 4 tokens
    hca = 20 * (per_rank // 128) * 512  # 20 layers at rate 128
    assert {r.kv_cache for r in plan.ranks} == {2 * (window + csa + hca)}


# ------------------------------------------------------------------------------ round trip
@pytest.fixture(scope="module")
def v4_bf16(v4_release, tmp_path_factory):
    from cvt.convert.fp8_to_bf16 import fp8_to_bf16

    return fp8_to_bf16(v4_release, tmp_path_factory.mktemp("v4bf16") / "bf16", quiet=True).dst


def test_shard_v4_reassembles_byte_for_byte_with_the_official_split_dims(v4_bf16, tmp_path):
    from cvt.convert.placement import make_layout
    from cvt.convert.shard import shard
    from cvt.tests.convert.test_shard import assert_reproduces

    m = assert_reproduces(v4_bf16, shard(v4_bf16, tmp_path / "out", make_layout(world_size=2, tp=2, ep=2),
                                         quiet=True).dst)
    t = m["shard"]["tensors"]
    # inference/convert.py mapping: wq_b / wo_a / attn_sink / weights_proj dim 0, wo_b dim 1, wkv whole
    assert [t[f"layers.1.attn.{n}"]["dim"] for n in ("wq_b.weight", "wo_a.weight", "attn_sink",
                                                      "indexer.weights_proj.weight", "wo_b.weight", "wkv.weight")] \
        == [0, 0, 0, 0, 1, None]
    assert t["mtp.0.ffn.experts.3.w2.weight"]["expert"] == [4, 3]  # MTP layer 0 is layer num_hidden_layers


@pytest.mark.slow
def test_quantize_v4_w8a8_ascend_keeps_the_recipe_floats_and_runs(v4_bf16, tmp_path):
    from cvt.runtime.loader import load_model

    r = run_cvt("quantize", v4_bf16, tmp_path / "q", "--scheme", "w8a8", "--format", "ascend", "--quiet")
    assert r.rc == 0, r.err
    desc = json.loads((tmp_path / "q" / "quant_model_description.json").read_text())
    # msModelSlim's V4 recipes: wo_a, wo_b, compressors, indexer float; the rest of attention and
    # the experts W8A8_DYNAMIC (vllm-ascend's MoE and linear schemes)
    for n in ("layers.1.attn.wo_a", "layers.1.attn.wo_b", "layers.1.attn.compressor.wkv",
              "layers.1.attn.indexer.wq_b", "layers.1.attn.indexer.weights_proj", "mtp.0.e_proj", "head"):
        assert desc[f"{n}.weight"] == "FLOAT", n
    for n in ("layers.1.attn.wq_a", "layers.1.attn.wq_b", "layers.1.attn.wkv", "layers.1.ffn.experts.2.w1",
              "layers.1.ffn.shared_experts.w2", "mtp.0.ffn.experts.0.w3"):
        assert desc[f"{n}.weight"] == "W8A8_DYNAMIC", n
    tokens = torch.arange(64).view(1, 64) % 300
    ref = load_model(v4_bf16, dtype=torch.float32).model(tokens)
    got = load_model(tmp_path / "q", dtype=torch.float32).model(tokens)
    cos = torch.nn.functional.cosine_similarity(got.flatten().double(), ref.flatten().double(), dim=0)
    assert cos > 0.99, float(cos)
    # cvt verify compares the two layer by layer (the hc streams side by side) and at the logits
    r = run_cvt("verify", tmp_path / "q", "--reference", v4_bf16, "--report", tmp_path / "rep", "--quiet",
                "--seq-len", "32", "--max-sequences", "2")
    assert r.rc == 0, r.err
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert [row["name"] for row in report["layers"]] == ["embed", "layer.0", "layer.1", "layer.2", "layer.3", "logits"]
    assert report["layers"][0]["Cosine"] == 1.0 and report["layers"][-1]["Cosine"] > 0.99


# DeepSeek-V4-Pro's config.json as published (deepseek-ai/DeepSeek-V4-Pro)
PRO = {"architectures": ["DeepseekV4ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0,
       "eos_token_id": 1, "expert_dtype": "fp4", "hc_eps": 1e-06, "hc_mult": 4, "hc_sinkhorn_iters": 20, "head_dim": 512,
       "hidden_act": "silu", "hidden_size": 7168, "index_head_dim": 128, "index_n_heads": 64, "index_topk": 1024,
       "initializer_range": 0.02, "max_position_embeddings": 1048576, "model_type": "deepseek_v4",
       "moe_intermediate_size": 3072, "n_routed_experts": 384, "n_shared_experts": 1, "norm_topk_prob": True,
       "num_attention_heads": 128, "num_experts_per_tok": 6, "num_hidden_layers": 61, "num_hash_layers": 3,
       "num_key_value_heads": 1, "num_nextn_predict_layers": 1, "o_groups": 16, "o_lora_rank": 1024,
       "q_lora_rank": 1536, "qk_rope_head_dim": 64,
       "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                               "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
       "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16,
                                               "original_max_position_embeddings": 65536, "type": "yarn"},
       "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sqrtsoftplus", "sliding_window": 128,
       "swiglu_limit": 10.0, "tie_word_embeddings": False, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
       "transformers_version": "4.57.1", "use_cache": True, "vocab_size": 129280, "compress_rope_theta": 160000,
       "compress_ratios": [128, 128] + [4, 128] * 29 + [4, 0]}


def test_pro_config_totals_by_hand():
    assert len(PRO["compress_ratios"]) == 62 and config_problems(PRO) == []
    total = sum(torch.Size(s).numel() for s in arch_for(PRO).shapes().values())
    d, H, D, q, G, R, E, inter, vocab = 7168, 128, 512, 1536, 16, 1024, 384, 3072, 129280
    experts = 62 * E * 3 * inter * d  # 61 layers + MTP
    shared = 62 * 3 * inter * d
    attn_core = 62 * (H + q * d + q + H * D * q + D * d + D + G * R * (H * D // G) + d * G * R)
    csa = 30 * (4 * 2 * D + 2 * 2 * D * d + D + 64 * 128 * q + 64 * d + 4 * 2 * 128 + 2 * 2 * 128 * d + 128)
    hca = 31 * (128 * D + 2 * D * d + D)  # layers 0, 1 and every other one after: rate 128; the MTP layer: none
    hc = 62 * 2 * (24 * 4 * d + 24 + 3) + 2 * (4 * 4 * d + 4 + 1)
    norms = 62 * 2 * d + d + 3 * d
    router = 62 * E * d + 3 * vocab * 6 + 59 * E  # tid2eid in the 3 hash layers, bias in the 58 others + MTP
    assert total == experts + shared + attn_core + csa + hca + hc + norms + router + 2 * vocab * d + 2 * d * d
    assert 1.59e12 < total < 1.61e12  # "1.6T parameters"


def test_runtime_accepts_the_real_configs():
    from cvt.runtime.models import family

    mod, cfg = family(PRO)
    args = mod.Args.from_config(cfg)
    assert args.ratios()[:3] == [128, 128, 4] and args.hash_layers() == 3
    inv, mult = args.compress_inv_freq()
    assert mult == 1.0 and inv.shape == (32,)


def test_static_attention_is_refused_for_v4_before_writing(v4_bf16, tmp_path):
    # GPTQ / AWQ / SmoothQuant calibrate V4 (tests/quant/test_calibrate_v4.py); static attention
    # scales do not (no V4 KV-cache or attention-input quantization)
    r = run_cvt("quantize", v4_bf16, tmp_path / "q", "--scheme", "w8a8", "--format", "ascend", "--static-attention")
    assert r.rc != 0 and r.err.startswith("cvt: error: deepseek_v4: --static-attention is not calibrated"), r.err
    assert not (tmp_path / "q").exists()
