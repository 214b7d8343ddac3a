"""Qwen3-Next's table (`cvt.convert.arch.qwen3_next`) and the linear attention's TP split (Qwen3.5's
and Qwen3-Next's, as vLLM splits it): names and shapes against transformers' own model, what stays
float, `cvt plan` of the published Qwen3-Next-80B-A3B config counted by hand, `cvt shard --tp 2`
(each rank's q | k | v rows, reassembled to the source bytes) and its refusal, `cvt quantize` RTN,
calibration (smoothing folds, GPTQ) through the fused Gated DeltaNet."""

from __future__ import annotations

import json

import pytest
import torch

from cvt.convert.arch import Role, arch_for, carried_names
from cvt.convert.arch.attention import GQA, LINEAR
from cvt.convert.memory_plan import memory_plan
from cvt.convert.placement import make_layout
from cvt.convert.shard import shard
from cvt.testing.checkpoints import write_bf16_checkpoint
from cvt.testing.checkpoints_qwen3_5 import tiny_qwen3_5_config, tiny_qwen3_next_config
from cvt.tests.conftest import run_cvt
from cvt.tests.convert.test_qwen3_5 import _folded
from cvt.tests.convert.test_shard import assert_reproduces, read_all

transformers = pytest.importorskip("transformers")

# Qwen/Qwen3-Next-80B-A3B-Instruct config.json as published (the defaults of transformers 5.24's
# Qwen3NextConfig, whose docstring names that checkpoint, with its rope_theta and vocabulary)
A3B = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "attention_bias": False,
       "attention_dropout": 0.0, "decoder_sparse_step": 1, "full_attention_interval": 4, "head_dim": 256,
       "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 5120,
       "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
       "linear_num_value_heads": 32, "linear_value_head_dim": 128, "max_position_embeddings": 262144,
       "mlp_only_layers": [], "moe_intermediate_size": 512, "norm_topk_prob": True, "num_attention_heads": 16,
       "num_experts": 512, "num_experts_per_tok": 10, "num_hidden_layers": 48, "num_key_value_heads": 2,
       "output_router_logits": False, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6, "rope_scaling": None,
       "rope_theta": 10000000, "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 512,
       "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
       "vocab_size": 151936}


def hf_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """transformers' Qwen3NextForCausalLM tensors (fused experts split per expert, as it saves them)."""
    conf = transformers.Qwen3NextConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
    with torch.device("meta"):
        model = transformers.Qwen3NextForCausalLM(conf)
    out = {}
    for k, v in model.state_dict().items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, n, i = v.shape
            pre, what = k.rsplit(".", 1)
            names = ("gate_proj", "up_proj") if what == "gate_up_proj" else ("down_proj",)
            out.update({f"{pre}.{x}.{w}.weight": (n // len(names), i) for x in range(e) for w in names})
        else:
            out[k] = tuple(v.shape)
    return out


@pytest.mark.slow  # transformers' model on meta: ~6 s on 2 busy cores
def test_shapes_are_transformers_names():
    cfg = tiny_qwen3_next_config()
    arch = arch_for(cfg)
    assert arch.table.name == "qwen3_next" and arch.attention() == [LINEAR, LINEAR, LINEAR, GQA]
    assert arch.shapes() == hf_shapes(cfg)
    assert arch.shapes()["model.layers.0.linear_attn.in_proj_qkvz.weight"] == (2 * 2 * 8 + 2 * 4 * 12, 48)
    assert "model.layers.1.mlp.gate_proj.weight" in arch.shapes()       # mlp_only_layers: dense
    for name in arch.shapes():
        arch.classify(name)


def test_what_stays_float_and_the_mtp_draft_carried():
    cfg = tiny_qwen3_next_config(mtp_num_hidden_layers=1)
    arch = arch_for(cfg)
    g = "model.layers.0.linear_attn"
    floats = [f"{g}.in_proj_ba.weight", f"{g}.conv1d.weight", f"{g}.A_log", f"{g}.dt_bias", f"{g}.norm.weight",
              "model.layers.0.mlp.gate.weight", "model.layers.0.mlp.shared_expert_gate.weight"]
    quantized = [f"{g}.in_proj_qkvz.weight", f"{g}.out_proj.weight", "model.layers.0.mlp.experts.5.up_proj.weight",
                 "model.layers.1.mlp.down_proj.weight", "model.layers.3.self_attn.q_proj.weight"]
    assert all(arch.classify(n).rule.float_default for n in floats)
    assert not any(arch.classify(n).rule.float_default for n in quantized)
    carried = carried_names(cfg, arch.shapes())
    assert carried == [n for n in arch.shapes() if n.startswith("mtp.")] and "mtp.fc.weight" in carried
    assert arch.classify("mtp.layers.0.mlp.experts.3.down_proj.weight").role is Role.CARRIED


@pytest.mark.slow  # 48 layers x 512 experts planned three times: ~7 s
def test_plan_a3b_by_hand(tmp_path):
    h, V, E, I, S, H, K, D = 2048, 151936, 512, 512, 512, 16, 2, 256
    conv = 2 * 16 * 128 + 32 * 128
    linear = (conv + 32 * 128) * h + 2 * 32 * h + conv * 4 + 2 * 32 + 128 + h * 32 * 128
    full = 2 * H * D * h + 2 * K * D * h + h * H * D + 2 * D
    moe = E * h + E * 3 * I * h + 3 * S * h + h
    text = 2 * (2 * V * h + h + 36 * linear + 12 * full + 48 * (moe + 2 * h))
    assert round(text / 2 / 1e9, 1) == 79.7                            # "80B" (no MTP draft counted)
    for tp in (1, 2):
        plan = memory_plan(A3B, make_layout(tp, tp=tp), "bf16", kv_tokens=1000)
        assert sum(plan.model_bytes.values()) == text
        # per sequence and rank: 36 linear layers' conv state (3 x 8192) + recurrent state (32 x 128 x
        # 128), heads / tp; per token 12 full layers' k + v (2 KV heads / tp x 256); bf16
        assert plan.ranks[0].kv_cache == 2 * (36 * (3 * 8192 + 32 * 128 * 128) + 12 * 1000 * 2 * 2 * 256) // tp
    (tmp_path / "config.json").write_text(json.dumps(A3B))
    r = run_cvt("plan", tmp_path / "config.json", "--kv-tokens", "1000")
    assert r.rc == 0, r.err
    assert "Qwen3-Next hybrid layers (36 x Gated DeltaNet, 12 x full attention)" in r.out


@pytest.mark.parametrize("make", [tiny_qwen3_5_config, tiny_qwen3_next_config], ids=["qwen3_5", "qwen3_next"])
def test_shard_tp2_splits_the_linear_attention_by_heads(tmp_path, make):
    """Each rank holds its key heads' q and k rows and its value heads' v rows (in_proj_qkv and the
    conv: a run of each part; Qwen3-Next's fused in_proj_qkvz / in_proj_ba: whole key-head groups),
    its value heads' A_log / dt_bias, out_proj's columns; the shards give back the source bytes."""
    src = write_bf16_checkpoint(tmp_path / "src", make(moe=False) if make is tiny_qwen3_5_config else make())
    dst = shard(src, tmp_path / "tp2", make_layout(2, tp=2), quiet=True).dst
    m = assert_reproduces(src, dst)
    source, ranks = read_all(src), [read_all(dst / f"rank-0000{r}") for r in (0, 1)]
    nxt = make is tiny_qwen3_next_config
    g = ("model.layers.0" if nxt else "model.language_model.layers.0") + ".linear_attn"
    key, value = 2 * 8, 4 * 12                                          # Hk x Dk, Hv x Dv; a rank has half
    rows = [*range(0, 8), *range(16, 24), *range(32, 56)]              # rank 0: q heads 0, k heads 0, v heads 0-1
    conv = torch.cat([source[f"{g}.conv1d.weight"][r:r + 1] for r in rows])
    assert torch.equal(ranks[0][f"{g}.conv1d.weight"], conv)
    assert m["shard"]["tensors"][f"{g}.conv1d.weight"]["parts"] == [key, key, value]
    if nxt:   # one key-head group (q, k, 2 v, 2 z heads) and its b / a rows per rank: a plain row split
        assert torch.equal(ranks[1][f"{g}.in_proj_qkvz.weight"], source[f"{g}.in_proj_qkvz.weight"][64:])
        assert torch.equal(ranks[1][f"{g}.in_proj_ba.weight"], source[f"{g}.in_proj_ba.weight"][4:])
    else:
        assert torch.equal(ranks[0][f"{g}.in_proj_qkv.weight"], source[f"{g}.in_proj_qkv.weight"][rows])
        assert torch.equal(ranks[1][f"{g}.in_proj_b.weight"], source[f"{g}.in_proj_b.weight"][2:])
    assert torch.equal(ranks[1][f"{g}.A_log"], source[f"{g}.A_log"][2:])
    assert torch.equal(ranks[1][f"{g}.out_proj.weight"], source[f"{g}.out_proj.weight"][:, value // 2:])
    assert torch.equal(ranks[1][f"{g}.norm.weight"], source[f"{g}.norm.weight"])
    plan = memory_plan(json.loads((src / "config.json").read_text()), make_layout(2, tp=2), "bf16")
    assert [u.weight_bytes for u in plan.ranks] == [e["bytes"] for e in m["shard"]["ranks"]]   # the plan = the shard


def test_shard_refuses_a_tp_the_linear_heads_do_not_divide(tmp_path):
    src = write_bf16_checkpoint(tmp_path / "src", tiny_qwen3_next_config(num_attention_heads=4, num_key_value_heads=4,
                                                                        linear_num_key_heads=1))
    r = run_cvt("shard", src, tmp_path / "out", "--world-size", "2", "--tp", "2")
    assert r.rc == 1 and not (tmp_path / "out" / "cvt_manifest.json").exists()
    assert "config.linear_num_key_heads = 1 linear-attention key heads: tp 2 does not divide it" in r.err, r.err


@pytest.mark.slow  # a quantize and a `cvt run`: ~8 s
def test_rtn_w8a8_quantize_and_run(tmp_path):
    """`cvt quantize --scheme w8a8` (RTN) keeps in_proj_ba, the conv, decays, norms, the router and the
    shared-expert gate float (module docstring (1)), quantizes in_proj_qkvz and the rest, carries the
    MTP draft; `cvt run` runs its output."""
    src = write_bf16_checkpoint(tmp_path / "src", tiny_qwen3_next_config(mtp_num_hidden_layers=1))
    dst = tmp_path / "w8"
    r = run_cvt("quantize", src, dst, "--scheme", "w8a8", "--format", "ascend", "--quiet")
    assert r.rc == 0, r.err
    tags = json.loads((dst / "quant_model_description.json").read_text())
    g = "model.layers.0.linear_attn"
    floats = [f"{g}.in_proj_ba.weight", f"{g}.conv1d.weight", f"{g}.A_log", f"{g}.dt_bias",
              "model.layers.0.mlp.gate.weight", "model.layers.0.mlp.shared_expert_gate.weight", "mtp.fc.weight"]
    assert {tags[n] for n in floats} == {"FLOAT"}
    assert {tags[n] for n in (f"{g}.in_proj_qkvz.weight", f"{g}.out_proj.weight", "model.layers.1.mlp.up_proj.weight",
                              "model.layers.2.mlp.experts.4.down_proj.weight")} == {"W8A8_DYNAMIC"}
    r = run_cvt("run", dst, "--input-ids", "5,6,7", "--max-new-tokens", "3", "--device", "cpu", "--quiet")
    assert r.rc == 0, r.err


@pytest.mark.slow  # a load and the folds of 4 layers: ~13 s on 2 busy cores
def test_smoothing_folds_keep_the_float_model(tmp_path):
    """AWQ / SmoothQuant's folds into Qwen3-Next's layers: the fused in_proj_qkvz and the float
    in_proj_ba read input_layernorm together; the MoE and the dense layer 1 their own; logits kept."""
    from cvt.runtime.loader import load_model

    src = write_bf16_checkpoint(tmp_path / "src", tiny_qwen3_next_config())
    model = load_model(src, dtype=torch.float32).model
    tokens = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    want = model(tokens)
    groups = _folded(model, layers="model.layers")
    gdn = ("input_layernorm", ["linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba"], [])
    full = ("input_layernorm", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], [])
    experts = ["shared_expert", *(f"experts.{e}" for e in range(6))]
    moe = ("post_attention_layernorm", [f"mlp.{m}.{n}" for m in experts for n in ("gate_proj", "up_proj")],
           ["mlp.gate", "mlp.shared_expert_gate"])
    dense = ("post_attention_layernorm", ["mlp.gate_proj", "mlp.up_proj"], [])
    assert groups == [[gdn, moe], [gdn, dense], [gdn, moe], [full, moe]]
    got = model(tokens)
    assert not torch.equal(got, want)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-3)     # as Qwen3.5's (float32 rounding only)


@pytest.mark.slow  # a calibrated quantize: ~10 s
def test_gptq_runs_through_the_fused_gated_deltanet(tmp_path):
    src = write_bf16_checkpoint(tmp_path / "src", tiny_qwen3_next_config(vocab_size=300))
    r = run_cvt("quantize", src, tmp_path / "gptq", "--scheme", "w8a8", "--method", "gptq", "--calib-tokens", "256",
                "--quiet")
    assert r.rc == 0, r.err
    q = json.loads((tmp_path / "gptq" / "cvt_manifest.json").read_text())["quant"]
    methods = {n: t["method"] for n, t in q["tensors"].items()}
    g = "model.layers.0.linear_attn"
    assert methods[f"{g}.in_proj_qkvz"] == methods[f"{g}.out_proj"] == methods["model.layers.1.mlp.up_proj"] == "gptq"
    assert set(methods.values()) == {"gptq"} and not q["fallbacks"]
    assert f"{g}.in_proj_ba" in q["float_modules"] and f"{g}.in_proj_ba" not in methods


@pytest.mark.slow  # two quantize runs and their shards: ~15 s
@pytest.mark.parametrize("fmt, scheme, group", [("ascend", "w8a8", ()),
                                                ("compressed-tensors", "w4a16", ("--group-size", "8"))])
def test_quantized_linear_attention_shards_by_parts(tmp_path, fmt, scheme, group):
    """A quantized in_proj_qkv (int8 / packed int4 weight, per-channel scales, Ascend's description)
    splits as q | k | v like the float one, and the shards give back the quantized bytes."""
    src = write_bf16_checkpoint(tmp_path / "src", tiny_qwen3_5_config(moe=False, intermediate_size=64))
    q = tmp_path / "q"
    r = run_cvt("quantize", src, q, "--scheme", scheme, "--format", fmt, *group, "--quiet")
    assert r.rc == 0, r.err
    dst = shard(q, tmp_path / "tp2", make_layout(2, tp=2), quiet=True).dst
    tensors = assert_reproduces(q, dst)["shard"]["tensors"]
    g = "model.language_model.layers.0.linear_attn.in_proj_qkv"
    split = {n: t.get("parts") for n, t in tensors.items() if n.startswith(g + ".") and t["dim"] == 0}
    assert split and all(p is not None and len(p) == 3 for p in split.values()), split
