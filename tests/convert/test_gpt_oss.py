"""gpt-oss architecture table (`cvt.convert.arch.gpt_oss`): names and shapes against transformers' own
model, per-layer attention kinds (sliding-window GQA counted by its window), what stays float, config
checks, `cvt inspect` and `cvt plan` (the gpt-oss-20b release's config counted by hand)."""

from __future__ import annotations

import json

import pytest
import torch

from cvt.convert.arch import Role, arch_for, config_problems
from cvt.convert.arch.attention import GQA, GQA_SLIDING
from cvt.convert.memory_plan import memory_plan
from cvt.convert.placement import make_layout
from cvt.testing.checkpoints import random_weights, write_bf16_checkpoint, write_release
from cvt.testing.checkpoints_gpt_oss import mxfp4_release_tensors, tiny_gpt_oss_config
from cvt.tests.conftest import run_cvt

transformers = pytest.importorskip("transformers")

# openai/gpt-oss-20b config.json as published (transformers 4.55's names: rope_scaling + rope_theta)
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880, "max_position_embeddings": 131072, "model_type": "gpt_oss",
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088,
}


def hf_config(cfg: dict):
    return transformers.GptOssConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type",
                                                                                  "quantization_config")})


def test_shapes_are_transformers_names():
    cfg = tiny_gpt_oss_config()
    arch = arch_for(cfg)
    assert arch.table.name == "gpt_oss"
    with torch.device("meta"):
        model = transformers.GptOssForCausalLM(hf_config(cfg))
    assert arch.shapes() == {k: tuple(v.shape) for k, v in model.state_dict().items()}
    for name in arch.shapes():
        arch.classify(name)  # every name the table describes, it reads


def test_attention_kind_per_layer():
    assert arch_for(tiny_gpt_oss_config()).attention() == [GQA_SLIDING, GQA, GQA_SLIDING, GQA]
    default = tiny_gpt_oss_config(num_hidden_layers=3, layer_types=None)
    assert arch_for(default).attention() == [GQA_SLIDING, GQA, GQA_SLIDING]  # transformers' default: sliding first
    assert hf_config(default).layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    cfg = tiny_gpt_oss_config(num_key_value_heads=2, head_dim=16, sliding_window=5)
    assert GQA_SLIDING.cache_bytes(cfg, 1000) == 5 * 2 * 2 * 16 * 2       # the window, not the tokens
    assert GQA_SLIDING.cache_bytes(cfg, 3) == GQA.cache_bytes(cfg, 3) == 3 * 2 * 2 * 16 * 2


def test_what_stays_float():
    arch = arch_for(tiny_gpt_oss_config())
    p = "model.layers.1"
    floats = [f"{p}.self_attn.sinks", f"{p}.mlp.router.weight", f"{p}.mlp.router.bias", f"{p}.input_layernorm.weight",
              "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]
    assert all(arch.classify(n).rule.float_default for n in floats)
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        info = arch.classify(f"{p}.self_attn.{proj}.weight")
        assert info.rule.quantizable and not info.rule.float_default
    for part in ("gate_up_proj", "gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias", "down_proj",
                 "down_proj_blocks", "down_proj_scales", "down_proj_bias"):
        info = arch.classify(f"{p}.mlp.experts.{part}")
        assert info.role is Role.EXPERT and info.layer == 1 and info.expert is None
    assert arch.classify(f"{p}.self_attn.sinks").split_dim == 0  # one per head: split with them under TP
    assert arch.classify(f"{p}.self_attn.k_scale").role is Role.KV_CACHE


def test_config_checks():
    assert config_problems(tiny_gpt_oss_config()) == []
    assert config_problems(GPT_OSS_20B) == []
    bad = tiny_gpt_oss_config(layer_types=["sliding_attention", "linear_attention", "full_attention", "full_attention"])
    assert "'linear_attention'" in config_problems(bad)[0]
    assert "2 entries: must be 4" in config_problems(tiny_gpt_oss_config(layer_types=["full_attention"] * 2))[0]
    assert config_problems(tiny_gpt_oss_config(sliding_window=0)) == [
        "config.json sliding_window = 0: must be a positive integer (sliding_attention layers)"]
    assert config_problems(tiny_gpt_oss_config(num_key_value_heads=3)) == [
        "config.json num_attention_heads = 4 is not a multiple of num_key_value_heads = 3"]
    assert "swiglu_limit" in config_problems(tiny_gpt_oss_config(swiglu_limit=-1.0))[0]


@pytest.mark.parametrize("mxfp4", [False, True], ids=["bf16", "mxfp4"])
def test_inspect(tmp_path, mxfp4):
    cfg = tiny_gpt_oss_config(mxfp4=mxfp4)
    if mxfp4:
        src = write_release(tmp_path / "go", cfg, mxfp4_release_tensors(random_weights(cfg)), n_shards=2)
    else:
        src = write_bf16_checkpoint(tmp_path / "go", cfg)
    r = run_cvt("inspect", src)
    assert r.rc == 0, r.err
    assert "gpt_oss" in r.out and "moe layers      4 (dense: 0)" in r.out and "problems        none" in r.out
    if mxfp4:
        assert "gpt-oss-mxfp4" in r.out


def test_inspect_finds_missing_experts(tmp_path):
    """A fused experts tensor holds as many experts as its first dim: fewer than config.json counts is a problem."""
    cfg = tiny_gpt_oss_config(mxfp4=True)
    tensors = mxfp4_release_tensors(random_weights(cfg))
    name = "model.layers.2.mlp.experts.down_proj_blocks"
    tensors[name] = tensors[name][:5].clone()
    r = run_cvt("inspect", write_release(tmp_path / "go", cfg, tensors, n_shards=1))
    assert f"{name} (model-00001-of-00001.safetensors): holds 5 experts (dim 0 of [5, 64, 1, 16]), config.json " \
        "num_local_experts = 6" in r.out


def _gpt_oss_20b_bytes() -> int:
    """BF16 bytes of gpt-oss-20b (experts dequantized) counted by hand from its config.json."""
    h, V, E, I, H, K, D = 2880, 201088, 32, 2880, 64, 8, 64
    attn = (H * D * h + H * D) + 2 * (K * D * h + K * D) + (h * H * D + h) + H      # q, k, v, o with biases; sinks
    moe = (E * h + E) + (E * h * 2 * I + E * 2 * I) + (E * I * h + E * h)          # router, gate_up, down
    return 2 * (2 * V * h + h + 24 * (attn + moe + 2 * h))


def test_plan_gpt_oss_20b_by_hand(tmp_path):
    total = _gpt_oss_20b_bytes()
    assert round(total / 2 / 1e9, 1) == 20.9               # "21B parameters" (OpenAI's model card)
    plan = memory_plan(GPT_OSS_20B, make_layout(), "bf16", kv_tokens=1000)
    assert sum(plan.model_bytes.values()) == total
    # per token: 12 full layers' k + v (8 KV heads x 64); the 12 sliding layers hold at most 128 positions
    assert plan.ranks[0].kv_cache == 2 * (12 * 1000 + 12 * 128) * 2 * 8 * 64
    (tmp_path / "config.json").write_text(json.dumps(GPT_OSS_20B))
    r = run_cvt("plan", tmp_path / "config.json", "--kv-tokens", "1000", "--ep", "4")
    assert r.rc == 0, r.err
    assert "12 x sliding window 128, 12 x full attention" in r.out
    four = memory_plan(GPT_OSS_20B, make_layout(ep=4), "bf16", kv_tokens=1000)
    experts = 2 * 24 * ((32 * 2880 * 2 * 2880 + 32 * 2 * 2880) + (32 * 2880 * 2880 + 32 * 2880))
    assert four.ranks[0].weights["experts"] == experts // 4  # a quarter of every layer's fused experts


def _mxfp4_release(tmp_path, edit=None, low=118, high=130):
    cfg = tiny_gpt_oss_config(mxfp4=True)
    tensors = mxfp4_release_tensors(random_weights(cfg), low=low, high=high)
    if edit is not None:
        edit(tensors)
    return write_release(tmp_path / "go", cfg, tensors, n_shards=2, move_scale=False), tensors


def _read_all(path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_mxfp4_dequant_is_transformers_bit_for_bit(tmp_path):
    """fp8-to-bf16 on the MXFP4 release: every experts tensor is transformers' own
    convert_moe_packed_tensors (the referee) bit for bit, -0.0 and subnormal scales included, in the
    layout of its dequantized model ([E, in, out], no _blocks / _scales), every other tensor copied."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src, release = _mxfp4_release(tmp_path, low=0, high=254)   # the whole scale range a weight survives
    dst = tmp_path / "bf16"
    r = run_cvt("fp8-to-bf16", src, dst)
    assert r.rc == 0, r.err
    out = _read_all(dst)
    assert set(out) == set(arch_for(tiny_gpt_oss_config()).shapes())
    n = 0
    for name, t in release.items():
        if name.endswith("_blocks"):
            x = name[: -len("_blocks")]
            want = convert_moe_packed_tensors(t, release[x + "_scales"])
            assert out[x].dtype == torch.bfloat16 and torch.equal(out[x].view(torch.int16), want.view(torch.int16)), x
            n += 1
        elif not name.endswith("_scales"):
            assert torch.equal(out[name].view(torch.int16), t.view(torch.int16)), name
    assert n == 8 and any(bool((v.view(torch.int16) == -32768).any()) for k, v in out.items() if "proj" in k)
    cfg = json.loads((dst / "config.json").read_text())
    assert "quantization_config" not in cfg
    manifest = json.loads((dst / "cvt_manifest.json").read_text())
    assert manifest["source"]["format"] == "gpt-oss-mxfp4" and manifest["summary"]["counts"]["dequantized"] == 8
    # transformers reads the output as its own BF16 gpt-oss
    model = transformers.GptOssForCausalLM.from_pretrained(dst, dtype=torch.bfloat16)
    x = "model.layers.3.mlp.experts.down_proj"
    assert torch.equal(model.state_dict()[x].view(torch.int16), out[x].view(torch.int16))


@pytest.mark.parametrize("case", ["nan-scale", "overflow-scale", "scale-shape", "no-scales", "experts"])
def test_mxfp4_corrupt_parts_are_refused(tmp_path, case):
    name = "model.layers.1.mlp.experts.gate_up_proj"

    def edit(t):
        if case == "nan-scale":
            t[name + "_scales"][2, 3, 1] = 255
        elif case == "overflow-scale":
            t[name + "_scales"][0, 0, 0] = 254
        elif case == "scale-shape":
            t[name + "_scales"] = t[name + "_scales"][:, :, :1].clone()
        elif case == "no-scales":
            del t[name + "_scales"]
        else:
            t[name + "_blocks"] = t[name + "_blocks"][:4].clone()
            t[name + "_scales"] = t[name + "_scales"][:4].clone()

    src, _ = _mxfp4_release(tmp_path, edit)
    dst = tmp_path / "out"
    r = run_cvt("fp8-to-bf16", src, dst)
    assert r.rc == 1 and len(r.err.strip().splitlines()) == 1 and name in r.err, r.err
    assert {"nan-scale": "0xFF", "overflow-scale": "overflows bfloat16", "scale-shape": "expected u8 (E8M0) [6, 64, 2]",
            "no-scales": "_scales is missing", "experts": "config.json describes"}[case] in r.err
    assert not (dst / "cvt_manifest.json").exists()
