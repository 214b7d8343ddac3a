"""DeepSeek-V3.2 runtime (sparse attention with the lightning indexer): parity with transformers,
sparsity that matters, the indexer's cache, config strictness, names = the architecture table.

Referee: transformers 5's DeepseekV32ForCausalLM (eager attention), random weights copied in by
name. The prompts are longer than ``index_topk``, so every layer drops keys; each parity case
first checks that no query's top-k edge is a near tie (two keys whose index scores are within
1e-4 relative), where an ulp of difference in the layers before could legitimately swap a key.
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from cvt.convert.arch.deepseek_v32 import param_shapes  # noqa: E402
from cvt.testing.checkpoints import random_weights, tiny_deepseek_v32_config  # noqa: E402
from cvt.runtime import kv_cache  # noqa: E402
from cvt.runtime.models import build_model, family  # noqa: E402
from cvt.runtime.models import deepseek_v3 as v3  # noqa: E402
from cvt.runtime.models.base import ConfigError  # noqa: E402
from cvt.runtime.models.deepseek_v32 import Args, DSACache, Indexer, Model  # noqa: E402
from cvt.tests.runtime.test_deepseek_v3 import (YARN, assert_logits_close, hf_model, runtime_from_hf,  # noqa: E402
                                                tokens)


def fp32_config(**overrides) -> dict:
    cfg = tiny_deepseek_v32_config(**overrides)
    cfg.pop("quantization_config")
    cfg["torch_dtype"] = "float32"
    return cfg


SEQ = 16  # prompt length: > index_topk in every case below
# 16 indexer heads: a key scores exactly 0 when relu zeroes it in every head (2^-16 of the pairs,
# 2^-4 with 4 heads), and exact ties at the top-k edge are broken by topk's internals
PARITY_CONFIGS = {
    "tiny": fp32_config(index_topk=4, index_n_heads=16),
    # index_head_dim = qk_rope_head_dim: the whole indexer key is rotated
    "rope_only_key": fp32_config(index_topk=6, index_n_heads=16, index_head_dim=16),
    "yarn": fp32_config(index_topk=5, index_n_heads=16, rope_scaling=YARN, max_position_embeddings=128),
    "groups_no_dense": fp32_config(index_topk=3, index_n_heads=16, n_routed_experts=8, n_group=2, topk_group=1,
                                   num_experts_per_tok=3, first_k_dense_replace=0),
}


class IndexRecorder:
    """Records every layer's index scores [b, s, T] (through `Indexer.index_scores`)."""

    def __init__(self, monkeypatch):
        self.scores: list[torch.Tensor] = []
        real = Indexer.index_scores

        def record(indexer, *a, **kw):
            out = real(indexer, *a, **kw)
            self.scores.append(out.detach().clone())
            return out

        monkeypatch.setattr(Indexer, "index_scores", record)


def assert_clear_topk_edges(scores: list[torch.Tensor], topk: int) -> int:
    """Every query with more than `topk` allowed keys has a k-th and (k+1)-th index score at least
    1e-4 (relative) apart; returns how many queries drop keys."""
    dropping = 0
    for layer, s in enumerate(scores):
        allowed = torch.isfinite(s).sum(-1)                                   # [b, s]
        top = s.topk(topk + 1, dim=-1).values if s.shape[-1] > topk else None
        for b, q in zip(*torch.where(allowed > topk)):
            kth, nxt = top[b, q, topk - 1].item(), top[b, q, topk].item()
            assert kth - nxt > 1e-4 * max(abs(kth), 1e-3), f"layer {layer} query {q.item()}: near tie {kth} / {nxt}"
            dropping += 1
    return dropping


# ---------------------------------------------------------------------------------------------
# 1. parity with transformers, with sparsity that changes the result
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(PARITY_CONFIGS))
def test_logits_match_transformers(name, monkeypatch):
    cfg = PARITY_CONFIGS[name]
    hf = hf_model(cfg)
    ours = runtime_from_hf(cfg, hf)
    t = tokens(2, SEQ)
    rec = IndexRecorder(monkeypatch)
    logits = ours(t)
    assert len(rec.scores) == cfg["num_hidden_layers"]
    dropping = assert_clear_topk_edges(rec.scores, cfg["index_topk"])
    assert dropping >= cfg["num_hidden_layers"] * 2 * (SEQ - cfg["index_topk"])  # every long-enough query
    with torch.no_grad():
        ref = hf(input_ids=t).logits
    assert_logits_close(logits, ref)


@pytest.mark.parametrize("name", ["tiny", "yarn"])
def test_sparsity_changes_the_result_and_dense_is_deepseek_v3(name):
    """index_topk >= T keeps every causal key: then V3.2 is exactly DeepSeek-V3's MLA (the V3 runtime
    without the indexer tensors); with the parity case's top-k the logits move far beyond tolerance."""
    cfg = PARITY_CONFIGS[name]
    sparse = runtime_from_hf(cfg, hf_model(cfg))
    dense = Model(Args.from_config({**cfg, "index_topk": SEQ}), dtype=torch.float32)
    dense.load_state_dict(sparse.state_dict())
    t = tokens(2, SEQ)
    ls, ld = sparse(t), dense(t)
    assert (ls - ld).abs().max() > 0.1 * ld.abs().max()
    v3_cfg = {k: v for k, v in cfg.items() if not k.startswith("index_")}
    plain = v3.Model(v3.Args.from_config({**v3_cfg, "model_type": "deepseek_v3"}), dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(sparse.state_dict(), strict=False)
    assert not missing and unexpected and all(".indexer." in k for k in unexpected)
    torch.testing.assert_close(ld, plain(t), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# 2. the cache: MLA latent + the indexer's keys
# ---------------------------------------------------------------------------------------------

def random_model(cfg: dict) -> Model:
    model = Model(Args.from_config(cfg), dtype=torch.float32)
    weights = random_weights(cfg, seed=5)
    for name, t in weights.items():
        if name.endswith("e_score_correction_bias"):
            weights[name] = 20 * t
    model.load_state_dict(weights, strict=True)
    return model


@pytest.mark.parametrize("name", ["tiny", "yarn"])
def test_incremental_decode_equals_full_forward(name, monkeypatch):
    cfg = PARITY_CONFIGS[name]
    model = random_model(cfg)
    t = tokens(2, SEQ, seed=7)
    rec = IndexRecorder(monkeypatch)
    full = model(t)
    assert assert_clear_topk_edges(rec.scores, cfg["index_topk"]) > 0
    cache = model.new_cache(batch=2, max_len=SEQ + 4)
    steps = [model(t[:, :3], 0, cache), model(t[:, 3:9], 3, cache)]      # prefill <= topk, then a chunk
    steps += [model(t[:, p:p + 1], p, cache) for p in range(9, SEQ)]     # then one token at a time
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5 * full.abs().max().item())
    c = cache[0]
    assert isinstance(c, DSACache) and len(cache) == cfg["num_hidden_layers"] and c.quant is None
    assert c.index_k.shape == (2, SEQ + 4, cfg["index_head_dim"])
    assert c.kv.shape == (2, SEQ + 4, cfg["kv_lora_rank"]) and c.pe.shape == (2, SEQ + 4, cfg["qk_rope_head_dim"])
    assert c.nbytes == c.mla.nbytes + c.index_k.nbytes
    assert bool(c.index_k[:, :SEQ].abs().sum(-1).gt(0).all()) and not bool(c.index_k[:, SEQ:].any())


@pytest.mark.slow
def test_c8_cache_wraps_the_int8_latent_and_decodes_like_the_full_forward():
    cfg = PARITY_CONFIGS["tiny"]
    model = random_model(cfg)
    t = tokens(1, SEQ, seed=3)
    kv_cache.attach_kv_cache_scales(model, kv_cache.calibrate_kv_scales(model, t))
    cache = model.new_cache(batch=1, max_len=SEQ)
    assert cache[0].quant == "int8" and cache[0].kv.dtype == torch.int8
    assert cache[0].index_k.dtype == torch.float32                      # the indexer keys stay float
    full = model(t)
    steps = [model(t[:, :6], 0, cache)] + [model(t[:, p:p + 1], p, cache) for p in range(6, SEQ)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5 * full.abs().max().item())


def test_cache_limits_are_errors():
    model = random_model(PARITY_CONFIGS["tiny"])
    cache = model.new_cache(batch=1, max_len=4)
    with pytest.raises(Exception, match="max_len 4"):
        model(tokens(1, 5), 0, cache)
    with pytest.raises(Exception, match="int8"):
        model.new_cache(batch=1, max_len=4, quant="int8")


# ---------------------------------------------------------------------------------------------
# 3. config strictness
# ---------------------------------------------------------------------------------------------

V32_ROPE = {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096, "type": "yarn"}
DEEPSEEK_V32_CONFIG = {  # deepseek-ai/DeepSeek-V3.2-Exp config.json: DeepSeek-V3's keys + the indexer's
    "architectures": ["DeepseekV32ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
    "hidden_size": 7168, "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048,
    "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "model_type": "deepseek_v32", "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8,
    "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06, "rope_scaling": V32_ROPE, "rope_theta": 10000, "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid", "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16", "transformers_version": "4.44.2", "use_cache": True, "v_head_dim": 128,
    "vocab_size": 129280,
}


def test_release_config_accepted():
    mod, text = family(DEEPSEEK_V32_CONFIG)
    assert mod.__name__ == "cvt.runtime.models.deepseek_v32"
    args = mod.Args.from_config(text)
    assert (args.index_topk, args.index_n_heads, args.index_head_dim) == (2048, 64, 128)
    short = mod.Args.from_config({**text, "num_hidden_layers": 4})
    model = Model(short, device="meta")                      # full width, 4 layers + MTP, no memory
    ours = {n: tuple(t.shape) for n, t in model.named_parameters()}
    assert ours == param_shapes({**text, **dataclasses.asdict(short)})
    assert ours["model.layers.4.self_attn.indexer.wq_b.weight"] == (64 * 128, 1536)   # the MTP layer's
    assert ours["model.layers.0.self_attn.indexer.wk.weight"] == (128, 7168)


def test_transformers5_config_accepted():
    transformers = pytest.importorskip("transformers")
    saved = transformers.DeepseekV32Config(**PARITY_CONFIGS["yarn"]).to_dict()
    assert {"mlp_layer_types", "mlp_bias", "index_topk"} <= set(saved) and "rope_interleave" not in saved
    args = Args.from_config(saved)
    assert args.index_topk == 5 and args.rope().kind == "yarn"
    build_model(saved, device="meta")
    absent = {k: v for k, v in PARITY_CONFIGS["tiny"].items() if not k.startswith("index_")}
    assert Args.from_config(absent).index_topk == transformers.DeepseekV32Config().index_topk


@pytest.mark.parametrize("change,words", [
    ({"q_lora_rank": None}, ["q_lora_rank"]),
    ({"rope_interleave": False}, ["rope_interleave", "true"]),
    ({"index_head_dim": 8}, ["index_head_dim", "qk_rope_head_dim"]),
    ({"index_topk": 0}, ["index_topk"]),
    ({"mlp_layer_types": ["sparse", "sparse", "sparse"]}, ["mlp_layer_types", "dense"]),
    ({"mlp_bias": True}, ["mlp_bias"]),
    ({"indexer_rope_interleave": True}, ["indexer_rope_interleave"]),     # vLLM reads it; not DeepSeek's
    ({"index_topk_freq": 2}, ["index_topk_freq"]),                        # vLLM's IndexCache sharing
], ids=lambda v: str(v)[:40])
def test_unsupported_config_rejected(change, words):
    with pytest.raises(ConfigError) as e:
        Args.from_config(fp32_config(**change))
    for w in words:
        assert w in str(e.value)


# ---------------------------------------------------------------------------------------------
# 4. names and shapes = the architecture table
# ---------------------------------------------------------------------------------------------

def test_meta_names_and_shapes_match_table():
    cfg = fp32_config(num_nextn_predict_layers=2)
    model = Model(Args.from_config(cfg), dtype=torch.bfloat16, device="meta")
    ours = {n: tuple(t.shape) for n, t in [*model.named_parameters(), *model.named_buffers()]}
    assert ours == param_shapes(cfg)
    assert {n.split("indexer.")[1] for n in ours if ".indexer." in n} == {
        "wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight"}


@pytest.mark.slow
def test_built_on_meta_then_assigned_runs():
    cfg = PARITY_CONFIGS["yarn"]
    with torch.device("meta"):
        model = build_model(cfg, dtype=torch.float32)
    weights = random_weights(cfg, seed=5)
    weights = {n: 20 * t if n.endswith("e_score_correction_bias") else t for n, t in weights.items()}
    model.load_state_dict(weights, strict=True, assign=True)
    t = tokens(1, SEQ)
    torch.testing.assert_close(model(t), random_model(cfg)(t), rtol=0, atol=0)
