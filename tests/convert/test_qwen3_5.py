"""Qwen3.5 / Qwen3.5-MoE architecture tables (`cvt.convert.arch.qwen3_5`): names and shapes against
transformers' own model, per-layer attention kinds, what stays float, config checks, `cvt inspect`
and `cvt plan` (the Qwen3.5-35B-A3B release's config counted by hand)."""

from __future__ import annotations

import json

import pytest
import torch

from cvt.convert.arch import Role, arch_for, carried_names, config_problems
from cvt.convert.arch.attention import GQA, LINEAR
from cvt.convert.memory_plan import memory_plan
from cvt.convert.placement import make_layout
from cvt.errors import ArchError
from cvt.testing.checkpoints import write_bf16_checkpoint
from cvt.testing.checkpoints_qwen3_5 import tiny_qwen3_5_config, tiny_qwen3_next_config
from cvt.tests.conftest import run_cvt

transformers = pytest.importorskip("transformers")

# Qwen/Qwen3.5-35B-A3B config.json (the smallest Qwen3.5-MoE release): its text_config and
# vision_config sizes as published (the defaults of transformers 5.24's Qwen3_5MoeTextConfig /
# Qwen3_5MoeVisionConfig, whose docstring names that checkpoint, but out_hidden_size = the text
# hidden size and mtp_num_hidden_layers = 1)
A3B = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe", "tie_word_embeddings": False,
    "image_token_id": 248056, "video_token_id": 248057, "vision_start_token_id": 248053, "vision_end_token_id": 248054,
    "text_config": {
        "model_type": "qwen3_5_moe_text", "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True,
        "dtype": "bfloat16", "eos_token_id": 248044, "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu",
        "hidden_size": 2048, "initializer_range": 0.02, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
        "max_position_embeddings": 262144, "moe_intermediate_size": 512, "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False, "num_attention_heads": 16, "num_experts": 256, "num_experts_per_tok": 8,
        "num_hidden_layers": 40, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 512, "use_cache": True, "vocab_size": 248320,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default",
                            "rope_theta": 10000000, "partial_rotary_factor": 0.25}},
    "vision_config": {"depth": 27, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1152, "in_channels": 3,
                      "intermediate_size": 4304, "model_type": "qwen3_5_moe", "num_heads": 16,
                      "num_position_embeddings": 2304, "out_hidden_size": 2048, "patch_size": 16,
                      "spatial_merge_size": 2, "temporal_patch_size": 2},
}


def hf_shapes(cfg: dict, moe: bool) -> dict[str, tuple[int, ...]]:
    """transformers' Qwen3_5(Moe)ForConditionalGeneration tensors (fused experts split per expert)."""
    conf = (transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config)(
        text_config=cfg["text_config"], vision_config=cfg["vision_config"])
    model_cls = transformers.Qwen3_5MoeForConditionalGeneration if moe else transformers.Qwen3_5ForConditionalGeneration
    with torch.device("meta"):
        model = model_cls(conf)
    out = {}
    for k, v in model.state_dict().items():
        if k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj"):
            e, n, i = v.shape
            pre, what = k.rsplit(".", 1)
            parts = (("gate_proj", "up_proj"), (n // 2, i)) if what == "gate_up_proj" else (("down_proj",), (n, i))
            out.update({f"{pre}.{x}.{w}.weight": parts[1] for x in range(e) for w in parts[0]})
        else:
            out[k] = tuple(v.shape)
    return out


@pytest.mark.parametrize("moe", [True, False], ids=["moe", "dense"])
def test_shapes_are_transformers_names(moe):
    cfg = tiny_qwen3_5_config(moe=moe)
    arch = arch_for(cfg)
    assert arch.table.name == ("qwen3_5_moe" if moe else "qwen3_5")
    assert arch.shapes() == hf_shapes(cfg, moe)
    for name in arch.shapes():
        arch.classify(name)  # every name the table describes, it reads


def test_attention_kind_per_layer():
    cfg = tiny_qwen3_5_config()
    assert arch_for(cfg).attention() == [LINEAR, LINEAR, LINEAR, GQA]
    no_types = tiny_qwen3_5_config(num_hidden_layers=8, layer_types=None)
    no_types["text_config"].pop("layer_types")
    assert arch_for(no_types).attention() == [LINEAR, LINEAR, LINEAR, GQA] * 2     # full_attention_interval 4
    every2 = tiny_qwen3_5_config(layer_types=None, full_attention_interval=2)
    every2["text_config"].pop("layer_types")
    assert arch_for(every2).attention() == [LINEAR, GQA, LINEAR, GQA]


def test_what_stays_float_and_carried():
    arch = arch_for(tiny_qwen3_5_config(mtp=1))
    p = "model.language_model.layers.0"
    floats = [f"{p}.linear_attn.conv1d.weight", f"{p}.linear_attn.A_log", f"{p}.linear_attn.dt_bias",
              f"{p}.linear_attn.norm.weight", f"{p}.linear_attn.in_proj_b.weight", f"{p}.linear_attn.in_proj_a.weight",
              f"{p}.mlp.gate.weight", f"{p}.mlp.shared_expert_gate.weight", "model.language_model.layers.3.self_attn.q_norm.weight"]
    quantized = [f"{p}.linear_attn.in_proj_qkv.weight", f"{p}.linear_attn.in_proj_z.weight",
                 f"{p}.linear_attn.out_proj.weight", f"{p}.mlp.experts.5.down_proj.weight",
                 f"{p}.mlp.shared_expert.up_proj.weight", "model.language_model.layers.3.self_attn.q_proj.weight"]
    assert all(arch.classify(n).rule.float_default for n in floats)
    assert not any(arch.classify(n).rule.float_default for n in quantized)
    assert arch.classify(f"{p}.mlp.experts.5.down_proj.weight").expert == 5
    assert arch.classify(f"{p}.mlp.shared_expert.up_proj.weight").role is Role.SHARED_EXPERT
    carried = carried_names(tiny_qwen3_5_config(mtp=1), arch.shapes())
    assert carried and all(n.startswith(("model.visual.", "mtp.")) for n in carried)
    assert "mtp.layers.0.mlp.experts.3.gate_proj.weight" in carried and "mtp.fc.weight" in carried
    with pytest.raises(ArchError, match="gate_up_proj"):  # the BF16 release's fused experts: no table name,
        arch.classify(f"{p}.mlp.experts.gate_up_proj")      # the reader splits them (test_fused_experts_*)


def test_config_checks():
    assert config_problems(tiny_qwen3_5_config()) == []
    bad = tiny_qwen3_5_config(layer_types=["linear_attention", "sliding_attention", "full_attention", "full_attention"])
    assert "'sliding_attention'" in config_problems(bad)[0]
    short = tiny_qwen3_5_config(layer_types=["full_attention"])
    assert "1 entries: must be 4" in config_problems(short)[0]
    heads = tiny_qwen3_5_config(linear_num_value_heads=3)
    assert config_problems(heads) == ["config.json linear_num_value_heads = 3 is not a multiple of linear_num_key_heads = 2"]


def test_inspect_tiny_release(tmp_path):
    cfg = tiny_qwen3_5_config(mtp=1)
    src = write_bf16_checkpoint(tmp_path / "q35", cfg)
    r = run_cvt("inspect", src)
    assert r.rc == 0, r.err
    assert "qwen3_5" in r.out


def _a3b_bytes() -> tuple[int, int, int]:
    """(text, vision, MTP) BF16 bytes of Qwen3.5-35B-A3B counted by hand from its config.json."""
    t, v = A3B["text_config"], A3B["vision_config"]
    h, V, E, I, S = 2048, 248320, 256, 512, 512
    H, K, D = 16, 2, 256
    conv = 2 * 16 * 128 + 32 * 128                                  # q, k (16 x 128 each), v (32 x 128)
    linear = conv * h + 32 * 128 * h + 2 * 32 * h + conv * 4 + 2 * 32 + 128 + h * 32 * 128
    full = 2 * H * D * h + 2 * K * D * h + h * H * D + 2 * D
    moe = E * h + E * 3 * I * h + 3 * S * h + h
    layer_norms = 2 * h
    text = 2 * (V * h * 2 + h + 30 * linear + 10 * full + 40 * (moe + layer_norms))
    d, i, m = 1152, 4304, 1152 * 4
    block = 4 * d + 3 * d * d + 3 * d + d * d + d + 2 * i * d + i + d
    vision = 2 * (d * 3 * 2 * 16 * 16 + d + 2304 * d + 27 * block + 2 * d + m * m + m + 2048 * m + 2048)
    mtp = 2 * (h * 2 * h + full + moe + layer_norms + 3 * h)
    assert (t["num_hidden_layers"], v["depth"]) == (40, 27)
    return text, vision, mtp


def test_plan_a3b_by_hand(tmp_path):
    text, vision, mtp = _a3b_bytes()
    plan = memory_plan(A3B, make_layout(), "bf16", kv_tokens=1000)
    assert plan.model_bytes["carried"] == vision + mtp
    assert sum(plan.model_bytes.values()) == text + vision + mtp
    assert round((text + vision + mtp) / 2 / 1e9, 1) == 36.0        # "35B" total parameters, vision and MTP included
    # per sequence: 30 linear layers' conv state (3 x 8192) + recurrent state (32 x 128 x 128);
    # per token: 10 full layers' k + v (2 KV heads x 256); bf16
    assert plan.ranks[0].kv_cache == 2 * (30 * (3 * 8192 + 32 * 128 * 128) + 10 * 1000 * 2 * 2 * 256)
    (tmp_path / "config.json").write_text(json.dumps(A3B))
    r = run_cvt("plan", tmp_path / "config.json", "--kv-tokens", "1000")
    assert r.rc == 0, r.err
    assert "30 x Gated DeltaNet, 10 x full attention" in r.out


def _folded(model, seed: int = 0,
            layers: str = "model.language_model.layers") -> list[list[tuple[str, list[str], list[str]]]]:
    """Every smoothing group of every decoder layer folded with random factors in [0.5, 2] (the
    calibration driver's groups and fold helpers); the groups, per layer."""
    from cvt.quant.methods.sites import _smooth_groups
    from cvt.quant.methods.smoothquant import scale_columns, scale_rows

    gen, out = torch.Generator().manual_seed(seed), []
    for i, layer in enumerate(model.model.layers):
        prefix = f"{layers}.{i}"
        mods = dict(layer.named_modules(prefix=prefix))
        groups = _smooth_groups(layer, prefix, model.args.arch_table())
        for g in groups:
            s = 0.5 + 1.5 * torch.rand(mods[g.consumers[0]].weight.shape[1], generator=gen)
            scale_rows(mods[g.producer], s, g.rows)
            for c in g.consumers + g.extras:
                scale_columns(mods[c], s)
        out.append([(g.producer.removeprefix(prefix + "."), [c.removeprefix(prefix + ".") for c in g.consumers],
                     [e.removeprefix(prefix + ".") for e in g.extras]) for g in groups if g.norm])
    return out


@pytest.mark.parametrize("moe", [True, False], ids=["moe", "dense"])
def test_smoothing_folds_keep_the_float_model(tmp_path, moe):
    """AWQ / SmoothQuant's folds into Qwen3.5's layers leave the float model's logits unchanged: the
    Gated DeltaNet's four input projections (b / a float, scaled too), the zero-centred norms
    (1 + weight divided, not weight), the shared expert and its gate beside the routed experts."""
    from cvt.runtime.loader import load_model

    src = write_bf16_checkpoint(tmp_path / "src", tiny_qwen3_5_config(moe=moe))
    model = load_model(src, dtype=torch.float32).model
    tokens = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    want = model(tokens)
    groups = _folded(model)
    gdn = ("input_layernorm", [f"linear_attn.{n}" for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")], [])
    full = ("input_layernorm", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], [])
    experts = ["shared_expert", *(f"experts.{e}" for e in range(6))]
    mlp = (("post_attention_layernorm", [f"mlp.{m}.{n}" for m in experts for n in ("gate_proj", "up_proj")],
            ["mlp.gate", "mlp.shared_expert_gate"]) if moe
           else ("post_attention_layernorm", ["mlp.gate_proj", "mlp.up_proj"], []))
    assert groups == [[gdn, mlp]] * 3 + [[full, mlp]]
    got = model(tokens)
    assert not torch.equal(got, want)     # the weights did change
    # float32 rounding through 4 layers: <= 3.2e-4 on logits up to 8 (a fold that misses the norms'
    # 1 + weight, or the shared-expert gate, is off by 8 to 10)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-3)


def _quantized(src, dst, scheme, method, *extra):
    r = run_cvt("quantize", src, dst, "--scheme", scheme, "--method", method, "--calib-tokens", "512", "--quiet", *extra)
    assert r.rc == 0, r.err
    return json.loads((dst / "cvt_manifest.json").read_text())


def _mean_kl(tmp_path, out, src) -> float:
    report = tmp_path / f"report-{out.name}"
    r = run_cvt("verify", out, "--reference", src, "--report", report, "--quiet")
    assert r.rc == 0, r.err
    return json.loads((report / "report.json").read_text())["logits"]["kl_mean"]


@pytest.mark.slow  # 4 calibrated quantize runs, 4 verifies: ~1.5 min on 2 cores
@pytest.mark.parametrize("moe", [True, False], ids=["moe", "dense"])
def test_gptq_runs_through_the_gated_deltanet(tmp_path, moe):
    """GPTQ w4a16 / w8a8 on tiny Qwen3.5(-MoE): every quantizable linear of the linear-attention
    and full layers calibrated with GPTQ (the float ones kept float), the output runs in `cvt run`,
    and its KL to the BF16 source (`cvt verify`) is below RTN's."""
    src = write_bf16_checkpoint(tmp_path / "src", tiny_qwen3_5_config(moe=moe, vocab_size=300))
    for scheme in ("w4a16", "w8a8"):
        kl = {}
        for method in ("rtn", "gptq"):
            out = tmp_path / f"{scheme}-{method}"
            m = _quantized(src, out, scheme, method)
            if method == "gptq":
                methods = {n: t["method"] for n, t in m["quant"]["tensors"].items()}
                gdn = "model.language_model.layers.0.linear_attn"
                assert {methods[f"{gdn}.{n}"] for n in ("in_proj_qkv", "in_proj_z", "out_proj")} == {"gptq"}
                assert methods["model.language_model.layers.3.self_attn.q_proj"] == "gptq"
                assert f"{gdn}.in_proj_b" in m["quant"]["float_modules"] and f"{gdn}.in_proj_b" not in methods
                assert set(methods.values()) == {"gptq"}, m["quant"]["fallbacks"]
                r = run_cvt("run", out, "--input-ids", "1,2,3,4", "--max-new-tokens", "3", "--quiet")
                assert r.rc == 0, r.err
            kl[method] = _mean_kl(tmp_path, out, src)
        # measured GPTQ / RTN (512 tokens): w4a16 moe 1.78 / 2.06, dense 1.28 / 1.55; w8a8 moe 0.209 / 0.291,
        # dense 0.102 / 0.107
        assert kl["gptq"] < (0.9 if scheme == "w4a16" else 1.0) * kl["rtn"], (scheme, kl)


@pytest.mark.slow  # AWQ, SmoothQuant and the streamed experts: ~1.5 min on 2 cores
def test_awq_smoothquant_and_streamed_experts(tmp_path, monkeypatch):
    """AWQ w4a16 and SmoothQuant w8a8 run on Qwen3.5-MoE and fold into the zero-centred input norm
    of the Gated DeltaNet layers; GPTQ with the routed experts read a chunk at a time (the gated
    shared expert's part recorded and replayed) writes the same bytes as the whole layer."""
    from cvt.quant.stage import quantize
    from cvt.runtime.loader import load_model
    from cvt.tests.quant.test_calibrate_stream import snapshot

    src = write_bf16_checkpoint(tmp_path / "src", tiny_qwen3_5_config(vocab_size=300))
    norm = "model.language_model.layers.0.input_layernorm.weight"
    for scheme, method in (("w8a8", "smoothquant"), ("w4a16", "awq")):
        out = tmp_path / method
        _quantized(src, out, scheme, method)
        assert not torch.equal(load_model(out, dtype=torch.float32).model.get_parameter(norm),
                               load_model(src, dtype=torch.float32).model.get_parameter(norm))  # folded
        r = run_cvt("run", out, "--input-ids", "1,2,3,4", "--max-new-tokens", "3", "--quiet")
        assert r.rc == 0, r.err
    args = dict(scheme="w4a16", fmt="compressed-tensors", method="gptq", calib_tokens=256, quiet=True)
    quantize(src, tmp_path / "whole", **args)
    from cvt.quant.methods.expert_stream import ExpertStream

    streamed, real = [], ExpertStream._chunks_then_output
    monkeypatch.setattr(ExpertStream, "_chunks_then_output", lambda self, *a, **k: streamed.append(self.prefix)
                        or real(self, *a, **k))
    quantize(src, tmp_path / "streamed", expert_memory=1, **args)
    assert len(streamed) == 4  # every layer's experts a chunk at a time
    assert snapshot(tmp_path / "whole") == snapshot(tmp_path / "streamed")


@pytest.mark.slow  # one streamed sensitivity pass and the KL bisection: ~30 s on 2 cores
def test_kl_budget(tmp_path):
    """--kl-budget on Qwen3.5-MoE: units per Gated DeltaNet layer named by its ``linear_attn``, the
    measured KL within the budget."""
    src = write_bf16_checkpoint(tmp_path / "src", tiny_qwen3_5_config(vocab_size=300))
    r = run_cvt("quantize", src, tmp_path / "out", "--scheme", "w4a16", "--kl-budget", "0.5", "--calib-tokens", "512",
                "--quiet")
    assert r.rc == 0, r.err
    mixed = json.loads((tmp_path / "out" / "cvt_manifest.json").read_text())["quant"]["mixed_precision"]
    units = {u["unit"] for u in mixed["units"]}
    assert "model.language_model.layers.0.linear_attn" in units and "model.language_model.layers.3.self_attn" in units
    assert mixed["kl_mean"] <= 0.5


def _fused_pair(tmp_path, **overrides):
    """(per-expert, fused) checkpoints of one tiny Qwen3.5-MoE (MTP draft included): the same weights."""
    from cvt.testing.checkpoints import random_weights
    from cvt.testing.checkpoints_qwen3_5 import fused_experts

    cfg = tiny_qwen3_5_config(mtp=1, vocab_size=300, **overrides)
    fused, per = fused_experts(random_weights(cfg))
    return (write_bf16_checkpoint(tmp_path / "per", cfg, weights=per),
            write_bf16_checkpoint(tmp_path / "fused", cfg, weights=fused))


def test_fused_experts_read_as_per_expert(tmp_path):
    """The BF16 release's ``mlp.experts.gate_up_proj`` [E, 2I, h] (gate rows first) and ``down_proj``
    [E, h, I], text layers and MTP draft, read as the per-expert tensors: same names, order, shapes
    and bytes, each a byte range of the fused tensor (no copy)."""
    from cvt.convert.reader import open_checkpoint

    per, fused = _fused_pair(tmp_path)
    a, b = open_checkpoint(per), open_checkpoint(fused)
    assert list(a.tensors) == list(b.tensors)
    assert all(a.tensors[n].shape == b.tensors[n].shape and bytes(a.view(n)) == bytes(b.view(n)) for n in a.tensors)
    up = b.tensors["mtp.layers.0.mlp.experts.5.up_proj.weight"]
    assert up.shape == (20, 48) and up.end - up.start == 20 * 48 * 2
    stored = b.tensors                       # no fused name is left
    assert not any(n.endswith("gate_up_proj") for n in stored)


def test_fused_experts_refusals(tmp_path):
    """A fused tensor whose experts are also stored one by one, or of another rank: one line, exit 1."""
    import safetensors.torch

    _, fused = _fused_pair(tmp_path)
    index = json.loads((fused / "model.safetensors.index.json").read_text())
    extra = {"model.language_model.layers.1.mlp.experts.2.up_proj.weight": torch.zeros(20, 48, dtype=torch.bfloat16)}
    safetensors.torch.save_file(extra, fused / "extra.safetensors")
    index["weight_map"].update({k: "extra.safetensors" for k in extra})
    (fused / "model.safetensors.index.json").write_text(json.dumps(index))
    r = run_cvt("inspect", fused)
    assert r.rc == 1 and len(r.err.strip().splitlines()) == 1, r.err
    assert "layers.1.mlp.experts.2.up_proj.weight is stored twice" in r.err and "experts.gate_up_proj" in r.err
    (fused / "extra.safetensors").unlink()
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k not in extra}
    name = "model.language_model.layers.2.mlp.experts.down_proj"
    f = fused / index["weight_map"][name]
    tensors = safetensors.torch.load_file(f)
    tensors[name] = tensors[name].reshape(-1, tensors[name].shape[-1])       # [E * h, I]: not 3-D
    safetensors.torch.save_file(tensors, f)
    (fused / "model.safetensors.index.json").write_text(json.dumps(index))
    r = run_cvt("inspect", fused)
    assert r.rc == 1 and len(r.err.strip().splitlines()) == 1, r.err
    assert f"{name} (BF16 [288, 20]" in r.err and "must be [experts, rows, columns]" in r.err, r.err


def _files(folder) -> dict[str, str]:
    import hashlib

    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != "cvt_manifest.json"}


@pytest.mark.slow  # 2 x (quantize RTN, GPTQ, shard, run): ~1 min on 2 cores
def test_fused_experts_give_the_per_expert_outputs(tmp_path):
    """quantize (RTN Ascend, GPTQ compressed-tensors), shard and run of the fused layout write the
    bytes (and tokens) the per-expert layout holding the same weights gives; inspect reads both
    alike."""
    per, fused = _fused_pair(tmp_path)
    runs = {"q": ("quantize", "--scheme", "w8a8", "--format", "ascend"),
            "g": ("quantize", "--scheme", "w4a16", "--method", "gptq", "--calib-tokens", "256"),
            "s": ("shard", "--world-size", "2")}
    for src in (per, fused):
        for key, (verb, *args) in runs.items():
            r = run_cvt(verb, src, tmp_path / f"{key}-{src.name}", *args, "--quiet")
            assert r.rc == 0, r.err
    for key in runs:
        assert _files(tmp_path / f"{key}-per") == _files(tmp_path / f"{key}-fused"), key
    outs = [run_cvt("run", src, "--input-ids", "1,2,3", "--max-new-tokens", "4", "--quiet") for src in (per, fused)]
    assert outs[0].rc == 0 and outs[0].out == outs[1].out, outs[1].err
    shown = [run_cvt("inspect", src).out.replace(str(src), "SRC") for src in (per, fused)]
    assert shown[0] == shown[1]


@pytest.mark.parametrize("make", [lambda: tiny_qwen3_5_config(mtp=1, vocab_size=300),
                                  lambda: tiny_qwen3_next_config(mtp_num_hidden_layers=1, vocab_size=300)],
                         ids=["qwen3_5", "qwen3_next"])
def test_fp8_release_to_bf16_is_the_official_dequant(tmp_path, make):
    """Qwen's FP8 block release (top-level quantization_config; an MTP draft weight in FP8 too), of
    Qwen3.5 and of Qwen3-Next (Qwen/Qwen3-Next-80B-A3B-Instruct-FP8): fp8-to-bf16 writes every FP8
    weight as `dequant_fp8_block`'s BF16, bit for bit, drops every scale and the
    quantization_config, and copies the rest byte for byte."""
    from safetensors.torch import load_file

    from cvt.convert.fp8 import dequant_fp8_block
    from cvt.testing.checkpoints import quantize_fp8_block, release_tensors, write_release

    cfg = make()
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": [128, 128]}
    t = release_tensors(cfg, seed=3)
    mtp = "mtp.layers.0.self_attn.q_proj.weight"
    t[mtp], t[mtp + "_scale_inv"] = quantize_fp8_block(t[mtp].float(), (128, 128), "F32")
    src = write_release(tmp_path / "src", cfg, t, n_shards=2)
    r = run_cvt("fp8-to-bf16", src, tmp_path / "bf16", "--quiet")
    assert r.rc == 0, r.err
    out = {}
    for f in sorted((tmp_path / "bf16").glob("*.safetensors")):
        out.update(load_file(str(f)))
    assert "quantization_config" not in json.loads((tmp_path / "bf16" / "config.json").read_text())
    fp8 = [n for n, v in t.items() if v.dtype == torch.float8_e4m3fn]
    assert mtp in fp8 and len(fp8) > 10
    assert set(out) == {n for n in t if not n.endswith("_scale_inv")}
    for n, v in t.items():
        if n in fp8:
            assert torch.equal(out[n].view(torch.int16), dequant_fp8_block(v, t[n + "_scale_inv"], (128, 128))
                               .view(torch.int16)), n
        elif not n.endswith("_scale_inv"):
            assert out[n].dtype == v.dtype and torch.equal(out[n].view(torch.uint8), v.view(torch.uint8)), n


def test_a_tokenizer_beyond_the_vocab_is_one_line(tmp_path):
    """Calibration on a model whose vocab_size (96 here) is below the ids its tokenizer gives (the
    byte-level one: up to 258): one line naming both, exit 1, no DST (was IndexError, exit 70)."""
    src = write_bf16_checkpoint(tmp_path / "src", tiny_qwen3_5_config())
    r = run_cvt("quantize", src, tmp_path / "out", "--scheme", "w8a8", "--method", "gptq", "--calib-tokens", "256")
    assert r.rc == 1 and len(r.err.strip().splitlines()) == 1 and "vocab_size 96" in r.err, r.err
    assert not (tmp_path / "out").exists()
