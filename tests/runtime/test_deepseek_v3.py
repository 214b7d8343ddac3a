"""DeepSeek-V3 family runtime model: parity with transformers, KV cache, config strictness, names.

Referees: transformers' DeepseekV3ForCausalLM (random weights copied in by name, fused experts
un-fused) and the official formulas of deepseek-ai/DeepSeek-V3 inference/model.py, transcribed
here. Where the two references differ the runtime follows the official code:

* YaRN: official `precompute_freqs_cis` / `MLA.__init__` apply the frequency correction and the
  softmax mscale only when max_seq_len > original_seq_len (the runtime uses
  max_position_embeddings as max_seq_len); transformers applies them whenever the rope type is
  yarn. Every release has max_position_embeddings > original_max_position_embeddings, where
  both agree (tested); `test_yarn_inactive_up_to_original_length` pins the difference.
* Group-limited routing: official and transformers 5 both fill dropped groups with -inf;
  older code (early official `scores * mask`, transformers 4.x) filled 0.0. That only
  matters when a kept expert's biased score is negative; `test_gate_group_masking_is_minus_inf`
  builds such a case. transformers adds 1e-20 to the top-k weight sum (official does not):
  invisible at float32.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

torch = pytest.importorskip("torch")

from cvt.convert.arch.deepseek_v3 import param_shapes  # noqa: E402
from cvt.testing.checkpoints import random_weights, tiny_deepseek_config  # noqa: E402
from cvt.runtime.models import build_model, family  # noqa: E402
from cvt.runtime.models.base import ConfigError  # noqa: E402
from cvt.runtime.models.deepseek_v3 import Args, Gate, Model, rope_tables  # noqa: E402


def fp32_config(**overrides) -> dict:
    cfg = tiny_deepseek_config(**overrides)
    cfg.pop("quantization_config")
    cfg["torch_dtype"] = "float32"
    return cfg


YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}

PARITY_CONFIGS = {
    "tiny": fp32_config(),
    "q_proj": fp32_config(q_lora_rank=None),
    # max_position_embeddings = factor * original (> original: official applies YaRN too)
    "yarn": fp32_config(rope_scaling=YARN, max_position_embeddings=128),
    # 8 experts in 2 groups, only the best group kept, 3 experts of it chosen
    "groups": fp32_config(n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=3),
    "halves": fp32_config(rope_interleave=False, n_shared_experts=2, first_k_dense_replace=0),
}


# ---------------------------------------------------------------------------------------------
# transformers reference
# ---------------------------------------------------------------------------------------------

HF_CLASSES = {"deepseek_v3": "DeepseekV3", "deepseek_v32": "DeepseekV32", "glm_moe_dsa": "GlmMoeDsa"}  # model_type -> transformers prefix


def hf_model(cfg: dict, seed: int = 0, bias_scale: float = 0.2):
    """transformers' DeepseekV3ForCausalLM (or DeepseekV32, by model_type) with every tensor
    redrawn (norms around 1, non-zero router bias; any other bias, e.g. V3.2's k_norm.bias, drawn
    like a weight)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    prefix = HF_CLASSES[cfg.get("model_type", "deepseek_v3")]
    hcfg = getattr(transformers, f"{prefix}Config")(**cfg, attn_implementation="eager")
    model = getattr(transformers, f"{prefix}ForCausalLM")(hcfg).eval()
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, t in model.state_dict().items():
        if name.endswith("norm.weight"):
            sd[name] = 1.0 + 0.1 * torch.randn(t.shape, generator=g)
        elif name.endswith("e_score_correction_bias"):
            sd[name] = bias_scale * torch.randn(t.shape, generator=g)
        else:
            sd[name] = torch.randn(t.shape, generator=g) / math.sqrt(t.shape[-1])
    model.load_state_dict(sd, strict=True)
    return model


def unfuse(sd: dict) -> dict:
    """transformers 5 fused experts -> checkpoint names: gate_up_proj [E, 2I, h], down_proj [E, h, I]."""
    out = {}
    for name, t in sd.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, inter = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{prefix}{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def runtime_from_hf(cfg: dict, hf):
    """cvt's runtime model of `cfg`'s family (`build_model`) with `hf`'s weights."""
    model = build_model(cfg, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(unfuse(hf.state_dict()), strict=False)
    assert not unexpected
    mtp = f"model.layers.{cfg['num_hidden_layers']}."
    assert missing and all(k.startswith(mtp) for k in missing), missing  # MTP: not in transformers
    return model


def tokens(b: int, s: int, vocab: int = 300, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    torch.testing.assert_close(ours, ref.float(), rtol=1e-5, atol=1e-5 * ref.abs().max().item())


# ---------------------------------------------------------------------------------------------
# 1. parity with transformers
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(PARITY_CONFIGS))
def test_logits_match_transformers(name):
    cfg = PARITY_CONFIGS[name]
    hf = hf_model(cfg)
    ours = runtime_from_hf(cfg, hf)
    t = tokens(2, 12)
    with torch.no_grad():
        ref = hf(input_ids=t).logits
    assert_logits_close(ours(t), ref)


@pytest.mark.slow
def test_yarn_is_not_a_no_op():
    """The YaRN parity case would catch a runtime that ignored rope_scaling."""
    cfg = PARITY_CONFIGS["yarn"]
    hf = hf_model(cfg)
    plain = runtime_from_hf({**cfg, "rope_scaling": None}, hf)
    yarn = runtime_from_hf(cfg, hf)
    t = tokens(1, 12)
    assert (yarn(t) - plain(t)).abs().max() > 1e-3


def test_yarn_inactive_up_to_original_length():
    """Official semantics: no YaRN when max_seq_len <= original_seq_len; transformers differs."""
    cfg = fp32_config(rope_scaling={**YARN, "original_max_position_embeddings": 128}, max_position_embeddings=128)
    hf_yarn = hf_model(cfg)
    ours = runtime_from_hf(cfg, hf_yarn)
    hf_plain = hf_model({**cfg, "rope_scaling": None})
    t = tokens(1, 12)
    with torch.no_grad():
        assert_logits_close(ours(t), hf_plain(input_ids=t).logits)
        assert (ours(t) - hf_yarn(input_ids=t).logits).abs().max() > 1e-3


V3_ROPE = {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
           "original_max_position_embeddings": 4096, "type": "yarn"}
K2_ROPE = {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
           "original_max_position_embeddings": 4096, "type": "yarn"}


def official_freqs(dim, seqlen, base, factor, beta_fast, beta_slow, original):
    """deepseek-ai/DeepSeek-V3 inference/model.py precompute_freqs_cis (inverse frequencies)."""
    def find_correction_dim(num_rotations):
        return dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(find_correction_dim(beta_fast)), 0)
    high = min(math.ceil(find_correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if seqlen > original:
        smooth = 1 - torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    return freqs


@pytest.mark.parametrize("rope,theta,max_pos", [(V3_ROPE, 10000, 163840), (K2_ROPE, 50000.0, 131072),
                                                 (YARN, 10000.0, 128)], ids=["v3", "kimi_k2", "tiny"])
def test_yarn_tables_match_official_and_transformers(rope, theta, max_pos):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = fp32_config(qk_rope_head_dim=64, qk_nope_head_dim=128, rope_scaling=dict(rope), rope_theta=theta,
                      max_position_embeddings=max_pos)
    inv_freq, attn, scale = rope_tables(Args.from_config(cfg))
    ref = official_freqs(64, max_pos, theta, rope["factor"], rope["beta_fast"], rope["beta_slow"],
                         rope["original_max_position_embeddings"])
    torch.testing.assert_close(inv_freq, ref, rtol=0, atol=0)
    mscale = 0.1 * rope["mscale_all_dim"] * math.log(rope["factor"]) + 1.0
    assert scale == pytest.approx(192 ** -0.5 * mscale ** 2, rel=1e-12)
    assert attn == 1.0
    hcfg = transformers.DeepseekV3Config(**cfg)
    hf_inv, hf_attn = ROPE_INIT_FUNCTIONS["yarn"](hcfg)
    torch.testing.assert_close(inv_freq, hf_inv.float(), rtol=1e-6, atol=0)
    assert hf_attn == pytest.approx(attn)


def test_gate_group_masking_is_minus_inf():
    """Kept-group biased scores all negative: -inf masking stays in the kept group, 0.0 would not."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = PARITY_CONFIGS["groups"]
    gate = Gate(Args.from_config(cfg), dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    gate.weight.copy_(torch.randn(gate.weight.shape, generator=g))
    gate.e_score_correction_bias.copy_(torch.tensor([-2.0] * 4 + [-5.0] * 4))
    x = torch.randn(64, cfg["hidden_size"], generator=g)
    w, idx = gate(x)
    assert (idx < 4).all()                                        # only group 0 (always the best)
    zero_filled = torch.cat([(torch.sigmoid(x @ gate.weight.T) - 2.0)[:, :4], torch.zeros(64, 4)], 1)
    assert (zero_filled.topk(3, dim=-1)[1] >= 4).any()            # a 0.0 fill picks dropped experts
    scores = torch.sigmoid(x @ gate.weight.T).gather(1, idx)
    torch.testing.assert_close(w, scores / scores.sum(-1, keepdim=True) * cfg["routed_scaling_factor"])

    router = DeepseekV3TopkRouter(transformers.DeepseekV3Config(**cfg))
    router.load_state_dict({"weight": gate.weight, "e_score_correction_bias": gate.e_score_correction_bias})
    with torch.no_grad():
        _, hf_w, hf_idx = router(x)
    order, hf_order = idx.sort(-1), hf_idx.sort(-1)
    assert torch.equal(order.values, hf_order.values)
    torch.testing.assert_close(w.gather(1, order.indices), hf_w.gather(1, hf_order.indices))

    # with random weights and small biases group limiting still changes some choices
    gate.e_score_correction_bias.copy_(0.1 * torch.randn(8, generator=g))
    sel = torch.sigmoid(x @ gate.weight.T) + gate.e_score_correction_bias
    free = sel.topk(3, dim=-1)[1].sort(-1).values
    assert not torch.equal(gate(x)[1].sort(-1).values, free)


# ---------------------------------------------------------------------------------------------
# 2. KV cache, 3. hidden states
# ---------------------------------------------------------------------------------------------

def random_model(cfg: dict) -> Model:
    model = Model(Args.from_config(cfg), dtype=torch.float32)
    weights = random_weights(cfg, seed=5)
    for name, t in weights.items():
        if name.endswith("e_score_correction_bias"):
            weights[name] = 20 * t                                # ~0.2: shifts the selection
    model.load_state_dict(weights, strict=True)
    return model


@pytest.mark.parametrize("name", ["tiny", "q_proj", "yarn"])
def test_incremental_decode_equals_full_forward(name):
    cfg = PARITY_CONFIGS[name]
    model = random_model(cfg)
    t = tokens(2, 11, seed=7)
    full = model(t)
    cache = model.new_cache(batch=2, max_len=16)
    steps = [model(t[:, :4], 0, cache), model(t[:, 4:7], 4, cache)]   # prefill, then a chunk
    steps += [model(t[:, p:p + 1], p, cache) for p in range(7, 11)]   # then one token at a time
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5 * full.abs().max().item())
    assert cache[0].kv.shape == (2, 16, cfg["kv_lora_rank"]) and cache[0].pe.shape == (2, 16, cfg["qk_rope_head_dim"])
    assert len(cache) == cfg["num_hidden_layers"] and cache[0].quant is None


def test_cache_limits_are_errors():
    model = random_model(PARITY_CONFIGS["tiny"])
    cache = model.new_cache(batch=1, max_len=4)
    with pytest.raises(Exception, match="max_len 4"):
        model(tokens(1, 5), 0, cache)
    with pytest.raises(Exception, match="max_position_embeddings"):
        model.new_cache(batch=1, max_len=2048)
    with pytest.raises(Exception, match="int8"):
        model.new_cache(batch=1, max_len=4, quant="int8")


def test_hidden_states():
    cfg = PARITY_CONFIGS["tiny"]
    model = random_model(cfg)
    hs: list = []
    logits = model(tokens(2, 5), hidden_states=hs)
    assert logits.shape == (2, 5, cfg["vocab_size"]) and logits.dtype == torch.float32
    assert len(hs) == 1 + cfg["num_hidden_layers"]
    assert all(h.shape == (2, 5, cfg["hidden_size"]) for h in hs)
    assert model.max_positions == cfg["max_position_embeddings"]


# ---------------------------------------------------------------------------------------------
# 4. config strictness
# ---------------------------------------------------------------------------------------------

DEEPSEEK_V3_CONFIG = {  # deepseek-ai/DeepSeek-V3 config.json (R1 / V3.1 have the same keys)
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModel": "modeling_deepseek.DeepseekV3Model",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "pretraining_tp": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06, "rope_scaling": V3_ROPE, "rope_theta": 10000, "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid", "seq_aux": True, "tie_word_embeddings": False, "topk_group": 4,
    "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "transformers_version": "4.33.1", "use_cache": True,
    "v_head_dim": 128, "vocab_size": 129280,
}

KIMI_K2_CONFIG = {  # moonshotai/Kimi-K2-Instruct config.json
    **{k: v for k, v in DEEPSEEK_V3_CONFIG.items() if k != "ep_size"},
    "bos_token_id": 163584, "eos_token_id": 163585, "first_k_dense_replace": 1, "max_position_embeddings": 131072,
    "model_type": "kimi_k2", "n_group": 1, "n_routed_experts": 384, "num_attention_heads": 64,
    "num_key_value_heads": 64, "num_nextn_predict_layers": 0, "rope_scaling": K2_ROPE, "rope_theta": 50000.0,
    "routed_scaling_factor": 2.827, "topk_group": 1, "transformers_version": "4.48.3", "vocab_size": 163840,
}


@pytest.mark.parametrize("cfg", [DEEPSEEK_V3_CONFIG, KIMI_K2_CONFIG], ids=["deepseek_v3", "kimi_k2"])
def test_release_configs_accepted(cfg):
    mod, text = family(cfg)
    assert mod.__name__ == "cvt.runtime.models.deepseek_v3"
    args = mod.Args.from_config(text)
    assert args.n_routed_experts == cfg["n_routed_experts"] and args.rope().kind == "yarn"
    short = mod.Args.from_config({**text, "num_hidden_layers": cfg["first_k_dense_replace"] + 1})
    model = Model(short, device="meta")                             # full width, 2-4 layers, no memory
    assert model.max_positions == cfg["max_position_embeddings"]
    assert dict(model.named_parameters()).keys() == param_shapes({**text, **dataclasses.asdict(short)}).keys()
    _, attn, scale = rope_tables(args)
    assert attn == 1.0 and scale > 192 ** -0.5


def test_transformers5_config_accepted():
    """A config saved by transformers 5 (rope_parameters, qk_head_dim, head_dim, ...)."""
    transformers = pytest.importorskip("transformers")
    saved = transformers.DeepseekV3Config(**PARITY_CONFIGS["yarn"]).to_dict()
    assert "rope_parameters" in saved
    args = Args.from_config(saved)
    assert rope_tables(args)[0].equal(rope_tables(Args.from_config(PARITY_CONFIGS["yarn"]))[0])
    build_model(saved, device="meta")


@pytest.mark.parametrize("change,words", [
    ({"index_topk": 2048}, ["index_topk"]),                               # DeepSeek-V3.2 sparse attention
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, ["rope type", "dynamic", "yarn"]),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, ["longrope"]),
    ({"rope_scaling": {**YARN, "attention_factor": 1.2}}, ["attention_factor"]),
    ({"hidden_act": "gelu"}, ["hidden_act", "gelu", "silu"]),
    ({"scoring_func": "softmax"}, ["scoring_func", "softmax", "sigmoid"]),
    ({"topk_method": "group_limited_greedy"}, ["topk_method", "noaux_tc"]),
    ({"attention_bias": True}, ["attention_bias"]),
    ({"num_key_value_heads": 2}, ["num_key_value_heads"]),
    ({"moe_layer_freq": 2}, ["moe_layer_freq"]),
    ({"n_group": 3}, ["n_group"]),
], ids=lambda v: str(v)[:40])
def test_unsupported_config_rejected(change, words):
    with pytest.raises(ConfigError) as e:
        Args.from_config(fp32_config(**change))
    for w in words:
        assert w in str(e.value)


# ---------------------------------------------------------------------------------------------
# 5. names and shapes = the architecture table
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg", [fp32_config(), fp32_config(q_lora_rank=None, num_nextn_predict_layers=2),
                                 fp32_config(n_shared_experts=0, first_k_dense_replace=0)],
                         ids=["tiny", "q_proj_mtp2", "no_shared"])
def test_meta_names_and_shapes_match_table(cfg):
    model = Model(Args.from_config(cfg), dtype=torch.bfloat16, device="meta")
    ours = {n: tuple(t.shape) for n, t in [*model.named_parameters(), *model.named_buffers()]}
    assert ours == param_shapes(cfg)
    assert all(t.is_meta for t in model.parameters())
    assert model.get_parameter("model.layers.1.mlp.gate.e_score_correction_bias").dtype == torch.float32
    no_mtp = Model(Args.from_config(cfg), device="meta", mtp=False).state_dict().keys()
    assert no_mtp == {n for n in ours if not n.startswith("model.layers.")
                      or int(n.split(".")[2]) < cfg["num_hidden_layers"]}


def test_built_on_meta_then_assigned_runs():
    """The loader's path: build under torch.device("meta"), assign real tensors by name, run."""
    cfg = PARITY_CONFIGS["yarn"]
    with torch.device("meta"):
        model = build_model(cfg, dtype=torch.float32)
    weights = random_weights(cfg, seed=5)
    weights = {n: 20 * t if n.endswith("e_score_correction_bias") else t for n, t in weights.items()}
    model.load_state_dict(weights, strict=True, assign=True)
    t = tokens(1, 6)
    torch.testing.assert_close(model(t), random_model(cfg)(t), rtol=0, atol=0)
