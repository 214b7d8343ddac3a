"""GLM-5 runtime (model_type glm_moe_dsa): parity with transformers' GlmMoeDsaForCausalLM, the two
differences from DeepSeek-V3.2 mattering (interleaved indexer rope, shared indexer layers), cached
decode = full forward, config strictness, names = the architecture table.

Referee: transformers 5's GlmMoeDsaForCausalLM (models/glm_moe_dsa/modeling_glm_moe_dsa.py:
GlmMoeDsaIndexer.forward, GlmMoeDsaAttention.forward, GlmMoeDsaModel.forward's prev_topk_indices),
eager attention, random weights copied in by name. Prompts are longer than ``index_topk``; each
parity case checks first that no top-k edge is a near tie (`assert_clear_topk_edges`).
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from cvt.convert.arch.glm_moe_dsa import param_shapes  # noqa: E402
from cvt.testing.checkpoints import random_weights, tiny_glm_moe_dsa_config  # noqa: E402
from cvt.runtime.models import build_model, family  # noqa: E402
from cvt.runtime.models import deepseek_v32 as v32  # noqa: E402
from cvt.runtime.models.base import ConfigError  # noqa: E402
from cvt.runtime.models.deepseek_v3 import MLACache  # noqa: E402
from cvt.runtime.models.glm_moe_dsa import Args, Model  # noqa: E402
from cvt.tests.runtime.test_deepseek_v3 import (YARN, assert_logits_close, hf_model, runtime_from_hf,  # noqa: E402
                                                tokens, unfuse)
from cvt.tests.runtime.test_deepseek_v32 import IndexRecorder, assert_clear_topk_edges  # noqa: E402


def fp32_config(**overrides) -> dict:
    cfg = tiny_glm_moe_dsa_config(**overrides)
    cfg.pop("quantization_config")
    cfg["torch_dtype"] = "float32"
    return cfg


SEQ = 16  # > index_topk in every case
PARITY_CONFIGS = {
    "tiny": fp32_config(index_topk=4, index_n_heads=16),
    # layer 1 reuses layer 0's top-k (GLM-5.1-style IndexCache sharing)
    "shared": fp32_config(index_topk=5, index_n_heads=16, indexer_types=["full", "shared", "full"]),
    # the same schedule from transformers' freq / offset keys: layers 0, 1 full, layer 2 shared
    "freq_yarn": fp32_config(index_topk=3, index_n_heads=16, index_topk_freq=2, index_skip_topk_offset=2,
                             rope_scaling=YARN, max_position_embeddings=128),
}


def full_layers(cfg: dict) -> int:
    return len([k for k in Args.from_config(cfg).layer_indexers() if k == "full"])


@pytest.mark.parametrize("name", sorted(PARITY_CONFIGS))
def test_logits_match_transformers(name, monkeypatch):
    cfg = PARITY_CONFIGS[name]
    hf = hf_model(cfg)
    ours = runtime_from_hf(cfg, hf)
    kinds = Args.from_config(cfg).layer_indexers()
    assert [lay.self_attn.indexer is None for lay in hf.model.layers] == [k == "shared" for k in kinds]
    t = tokens(2, SEQ)
    rec = IndexRecorder(monkeypatch)
    logits = ours(t)
    assert len(rec.scores) == full_layers(cfg)                      # shared layers run no indexer
    assert assert_clear_topk_edges(rec.scores, cfg["index_topk"]) >= full_layers(cfg) * 2 * (SEQ - cfg["index_topk"])
    with torch.no_grad():
        ref = hf(input_ids=t).logits
    assert_logits_close(logits, ref)


# issue 41: GlmMoeDsaConfig's own keys, init-scale weights (activations small enough that the latent
# norms' eps shows: transformers uses 1e-6 there, not GLM-5's rms_norm_eps 1e-5), 65-token windows
INIT_SCALE_CONFIG = dict(vocab_size=256, hidden_size=64, moe_intermediate_size=32, intermediate_size=96,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                         num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16,
                         qk_nope_head_dim=32, v_head_dim=32, index_topk=6, index_n_heads=2, index_head_dim=32,
                         first_k_dense_replace=1, mlp_layer_types=["dense", "sparse", "sparse", "sparse"])


def init_perturbed_hf(cfg: dict, seed: int = 0):
    """transformers' GlmMoeDsaForCausalLM with its own init, every tensor moved by 0.02 N(0, 1) and a
    random router bias (the layout and scale a transformers-built tiny model has)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    hf = transformers.GlmMoeDsaForCausalLM(transformers.GlmMoeDsaConfig(**cfg, attn_implementation="eager")).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in hf.named_parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return hf


def test_init_scale_transformers_model_matches():
    """The transformers-written config (every key GlmMoeDsaConfig.to_dict writes) and init-scale
    weights: logits within 1e-5 on 65-token windows (4.7e-7 measured); with rms_norm_eps (1e-5) in
    the latent norms q_a_layernorm / kv_a_layernorm, as cvt had it, not (9.8e-5 measured)."""
    hf = init_perturbed_hf(INIT_SCALE_CONFIG)
    ours = build_model(hf.config.to_dict(), dtype=torch.float32)
    missing, unexpected = ours.load_state_dict(unfuse(hf.state_dict()), strict=False)
    assert not missing and not unexpected
    t = tokens(2, 65, vocab=256)
    with torch.no_grad():
        ref = hf(input_ids=t).logits
    assert_logits_close(ours(t), ref)
    for layer in ours.model.layers:
        layer.self_attn.q_a_layernorm.eps = layer.self_attn.kv_a_layernorm.eps = hf.config.rms_norm_eps
    with pytest.raises(AssertionError):
        assert_logits_close(ours(t), ref)


def test_schedules_resolve_like_transformers():
    transformers = pytest.importorskip("transformers")
    for cfg in (*PARITY_CONFIGS.values(), fp32_config(num_hidden_layers=7, index_topk_freq=4, index_skip_topk_offset=3),
                fp32_config(index_topk_pattern="FSF")):
        assert Args.from_config(cfg).layer_indexers() == transformers.GlmMoeDsaConfig(**cfg).indexer_types


def test_interleaved_indexer_rope_and_sharing_change_the_result():
    """With V3.2's half-split indexer rope, or with every layer running its own indexer, the logits
    move far beyond the parity tolerance: the parity cases would catch either mistake."""
    for name, other in (("tiny", None), ("shared", {"indexer_types": None})):
        cfg = PARITY_CONFIGS[name]
        ours = runtime_from_hf(cfg, hf_model(cfg))
        t = tokens(2, SEQ)
        want = ours(t)
        if other is None:
            alt = v32.Model(v32.Args.from_config({k: v for k, v in cfg.items() if k != "indexer_rope_interleave"}
                                                 | {"model_type": "deepseek_v32"}), dtype=torch.float32)
            alt.load_state_dict(ours.state_dict())
        else:
            alt = Model(Args.from_config({**cfg, **other}), dtype=torch.float32)
            missing, unexpected = alt.load_state_dict(ours.state_dict(), strict=False)
            assert not unexpected and missing and all(".layers.1.self_attn.indexer." in k for k in missing)
            alt.model.layers[1].self_attn.indexer.load_state_dict(ours.model.layers[0].self_attn.indexer.state_dict())
        assert (alt(t) - want).abs().max() > 0.1 * want.abs().max()


def random_model(cfg: dict) -> Model:
    model = Model(Args.from_config(cfg), dtype=torch.float32)
    weights = random_weights(cfg, seed=5)
    weights = {n: 20 * t if n.endswith("e_score_correction_bias") else t for n, t in weights.items()}
    model.load_state_dict(weights, strict=True)
    return model


@pytest.mark.parametrize("name", ["tiny", "shared"])
def test_incremental_decode_equals_full_forward(name, monkeypatch):
    cfg = PARITY_CONFIGS[name]
    model = random_model(cfg)
    t = tokens(2, SEQ, seed=7)
    rec = IndexRecorder(monkeypatch)
    full = model(t)
    assert assert_clear_topk_edges(rec.scores, cfg["index_topk"]) > 0
    cache = model.new_cache(batch=2, max_len=SEQ + 4)
    steps = [model(t[:, :3], 0, cache), model(t[:, 3:9], 3, cache)]
    steps += [model(t[:, p:p + 1], p, cache) for p in range(9, SEQ)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5 * full.abs().max().item())
    kinds = Args.from_config(cfg).layer_indexers()
    assert [type(c) for c in cache] == [v32.DSACache if k == "full" else MLACache for k in kinds]


GLM5_CONFIG = {  # zai-org/GLM-5 config.json (sizes = transformers' GlmMoeDsaConfig defaults)
    "architectures": ["GlmMoeDsaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "dtype": "bfloat16", "eos_token_id": [154820, 154827, 154829], "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "head_dim": 64, "hidden_size": 6144, "index_head_dim": 128, "index_n_heads": 32,
    "index_share_for_mtp_iteration": True, "index_topk": 2048, "indexer_rope_interleave": True,
    "initializer_range": 0.02, "intermediate_size": 12288, "kv_lora_rank": 512, "max_position_embeddings": 202752,
    "model_type": "glm_moe_dsa", "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 1,
    "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 64,
    "num_experts_per_tok": 8, "num_hidden_layers": 78, "num_key_value_heads": 64, "num_nextn_predict_layers": 1,
    "pad_token_id": 154820, "pretraining_tp": 1, "q_lora_rank": 2048, "qk_head_dim": 256, "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05, "rope_interleave": True,
    "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"}, "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid", "tie_word_embeddings": False, "topk_group": 1, "topk_method": "noaux_tc",
    "transformers_version": "5.0.2.dev0", "use_cache": True, "v_head_dim": 256, "vocab_size": 154880,
}


def test_release_config_accepted():
    mod, text = family(GLM5_CONFIG)
    assert mod.__name__ == "cvt.runtime.models.glm_moe_dsa"
    args = mod.Args.from_config(text)
    assert args.layer_indexers() == ["full"] * 78
    short = mod.Args.from_config({**text, "num_hidden_layers": 4})
    model = Model(short, device="meta")                      # full width, 4 layers + MTP
    ours = {n: tuple(t.shape) for n, t in model.named_parameters()}
    assert ours == param_shapes({**text, **dataclasses.asdict(short)})
    assert ours["model.layers.4.self_attn.indexer.wq_b.weight"] == (32 * 128, 2048)     # the MTP layer's
    assert ours["model.layers.0.self_attn.kv_b_proj.weight"] == (64 * (192 + 256), 512)


def test_transformers5_config_accepted():
    transformers = pytest.importorskip("transformers")
    saved = transformers.GlmMoeDsaConfig(**PARITY_CONFIGS["shared"]).to_dict()
    build_model(saved, device="meta")
    absent = {k: v for k, v in PARITY_CONFIGS["tiny"].items() if not k.startswith("index_") and k != "n_group"}
    args = Args.from_config(absent)
    ref = transformers.GlmMoeDsaConfig()
    assert (args.index_topk, args.index_n_heads, args.n_group) == (ref.index_topk, ref.index_n_heads, ref.n_group)


@pytest.mark.parametrize("change,words", [
    ({"indexer_rope_interleave": False}, ["indexer_rope_interleave", "true"]),
    ({"indexer_types": ["shared", "full", "full"]}, ["indexer_types", "first 'full'"]),
    ({"indexer_types": ["full", "full"]}, ["indexer_types", "3"]),
    ({"index_topk_pattern": "FXF"}, ["index_topk_pattern"]),
    ({"rope_interleave": False}, ["rope_interleave"]),
    ({"index_kpool": 4}, ["index_kpool"]),                                 # GLM-5.2's pooled indexer
], ids=lambda v: str(v)[:40])
def test_unsupported_config_rejected(change, words):
    with pytest.raises(ConfigError) as e:
        Args.from_config(fp32_config(**change))
    for w in words:
        assert w in str(e.value)


def test_meta_names_and_shapes_match_table():
    cfg = fp32_config(num_nextn_predict_layers=1, indexer_types=["full", "shared", "shared"])
    model = Model(Args.from_config(cfg), dtype=torch.bfloat16, device="meta")
    ours = {n: tuple(t.shape) for n, t in [*model.named_parameters(), *model.named_buffers()]}
    assert ours == param_shapes(cfg)
    assert {n.split(".")[2] for n in ours if ".indexer." in n} == {"0", "3"}          # full + MTP


@pytest.mark.slow
def test_two_ranks_match_one_process(tmp_path):
    """TP 2 x EP 2 shard of a GLM-5 with a shared indexer layer: the 2-rank world gives the
    single-process tokens and logits (tests/runtime/test_distributed.py's harness)."""
    from cvt.convert.placement import make_layout
    from cvt.convert.shard import shard
    from cvt.testing.checkpoints import write_bf16_checkpoint
    from cvt.tests.runtime.test_distributed import _check_dumps, _reference, _spawn

    cfg = tiny_glm_moe_dsa_config(index_topk=3, index_n_heads=16, indexer_types=["full", "shared", "full"])
    cfg.pop("quantization_config")
    src = write_bf16_checkpoint(tmp_path / "src", cfg)
    dst = shard(src, tmp_path / "tp2", make_layout(2, tp=2, ep=2), quiet=True).dst
    codes = _spawn(2, [("glm-tp2-ep2", str(dst))], tmp_path)
    assert codes["glm-tp2-ep2"] == [0, 0]
    _check_dumps(tmp_path / "out-2", "glm-tp2-ep2", 2, _reference(src))
