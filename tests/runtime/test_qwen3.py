"""cvt.runtime.models.qwen3 against transformers (the referee), on tiny random configs, CPU fp32.

Covers Qwen3-MoE (mlp_only_layers, norm_topk_prob on / off, decoder_sparse_step), Qwen3
(yarn rope, head_dim != hidden/heads, tied embeddings), Llama (llama3 rope, attention /
MLP biases) and Qwen2 (q/k/v biases); KV-cache decode; hidden_states; strict config
reading; the meta-device module tree against the convert arch table.
"""

from __future__ import annotations

import json

import pytest
import torch

from cvt.convert.arch.qwen3 import param_shapes
from cvt.errors import CvtError
from cvt.runtime.models import build_model
from cvt.runtime.models.base import ConfigError
from cvt.runtime.models.qwen3 import Args, Model

transformers = pytest.importorskip("transformers")

_BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, hidden_act="silu",
             tie_word_embeddings=False)
_MOE = dict(_BASE, model_type="qwen3_moe", head_dim=8, num_experts=6, num_experts_per_tok=2,
            moe_intermediate_size=12, rope_theta=10000.0)

CONFIGS = {
    "qwen3_moe-norm-mlp_only": dict(_MOE, norm_topk_prob=True, mlp_only_layers=[1]),
    "qwen3_moe-nonorm-mlp_only-step2": dict(_MOE, num_hidden_layers=4, norm_topk_prob=False, mlp_only_layers=[3],
                                            decoder_sparse_step=2),
    "qwen3-yarn": dict(_BASE, model_type="qwen3", head_dim=16, rope_theta=1e6,
                       rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
    "qwen3-tied": dict(_BASE, model_type="qwen3", head_dim=8, tie_word_embeddings=True, rope_theta=1e6),
    "llama-llama3": dict(_BASE, model_type="llama", num_key_value_heads=1, rope_theta=5e5,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8}),
    "llama-bias": dict(_BASE, model_type="llama", attention_bias=True, mlp_bias=True),
    "qwen2": dict(_BASE, model_type="qwen2", rope_theta=1e6),
}
HAS_BIAS = {"llama-bias", "qwen2"}

HF = {"qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
      "llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}


def hf_model(cfg: dict):
    """A transformers model of `cfg` with random weights of useful size (norms around 1)."""
    conf_cls, model_cls = (getattr(transformers, n) for n in HF[cfg["model_type"]])
    torch.manual_seed(0)
    model = model_cls(conf_cls(**{k: v for k, v in cfg.items() if k != "model_type"})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_((0.5 if "embed" in name else 0.15) * torch.randn_like(p))
    return model


def hf_state_dict(model, tied: bool) -> dict[str, torch.Tensor]:
    """The model's tensors under checkpoint names: fused experts (transformers 5) split per expert."""
    out = {}
    for k, v in model.state_dict().items():
        if k.endswith("mlp.experts.gate_up_proj"):            # [E, 2I, H] = gate rows, then up rows
            pre = k[: -len("gate_up_proj")]
            for e in range(v.shape[0]):
                out[f"{pre}{e}.gate_proj.weight"], out[f"{pre}{e}.up_proj.weight"] = v[e].chunk(2, dim=0)
        elif k.endswith("mlp.experts.down_proj"):             # [E, H, I]
            pre = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{pre}{e}.down_proj.weight"] = v[e]
        else:
            out[k] = v
    if tied:
        out.pop("lm_head.weight", None)
    return out


def pair(name: str):
    cfg = CONFIGS[name]
    ref = hf_model(cfg)
    ours = Model(Args.from_config(cfg), dtype=torch.float32)
    ours.load_state_dict(hf_state_dict(ref, cfg["tie_word_embeddings"]), strict=True)
    return ref, ours


def tokens(b=2, s=9, vocab=96, seed=1):
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_transformers(name):
    ref, ours = pair(name)
    x = tokens()
    with torch.no_grad():
        expected = ref(x).logits.float()
    got = ours(x)
    assert got.dtype == torch.float32 and got.shape == (2, 9, 96)
    assert expected.abs().max() > 1  # the random weights give logits worth comparing
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["qwen3_moe-norm-mlp_only", "qwen3-yarn", "llama-bias"])
def test_cached_decode_equals_full_forward(name):
    _, ours = pair(name)
    x = tokens(s=10)
    full = ours(x)
    cache = ours.new_cache(2, 16)
    assert cache[0].k.shape == (2, ours.args.kv_heads, 16, ours.args.dim_head) and cache[0].v.shape == cache[0].k.shape
    steps = [ours(x[:, :4], 0, cache)] + [ours(x[:, t:t + 1], t, cache) for t in range(4, 10)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_hidden_states_are_residual_stream():
    ref, ours = pair("qwen3_moe-norm-mlp_only")
    x = tokens()
    hs: list = []
    ours(x, hidden_states=hs)
    n = ours.args.num_hidden_layers
    assert len(hs) == 1 + n and all(h.shape == (2, 9, 32) for h in hs)
    with torch.no_grad():
        expected = ref(x, output_hidden_states=True).hidden_states
    # transformers' last entry is after the final norm; ours is the raw residual stream
    for got, want in zip(hs[:n], expected[:n]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.model.norm(hs[n]), expected[n], rtol=1e-5, atol=1e-5)


def test_past_max_positions_is_an_error():
    _, ours = pair("qwen3-tied")
    with pytest.raises(CvtError, match="max_position_embeddings 64"):
        ours(tokens(s=2), start_pos=63)
    cache = ours.new_cache(2, 8)
    with pytest.raises(CvtError, match="max_len 8"):
        ours(tokens(s=2), start_pos=7, cache=cache)


# ---- config.json reading ------------------------------------------------------------------

QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B config.json
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
QWEN3_8B = {  # Qwen/Qwen3-8B config.json
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 40960,
    "max_window_layers": 36, "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 36,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
LLAMA_31_8B = {  # meta-llama/Llama-3.1-8B-Instruct config.json
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
}


@pytest.mark.parametrize("cfg", [QWEN3_30B_A3B, QWEN3_8B, LLAMA_31_8B], ids=["qwen3-30b-a3b", "qwen3-8b", "llama-3.1-8b"])
def test_real_configs_are_accepted(cfg):
    args = Args.from_config(cfg)
    assert args.dim_head == 128 and args.rope()["rope_theta"] == cfg["rope_theta"]
    assert args.is_moe_layer(0) == (cfg["model_type"] == "qwen3_moe")


def test_transformers5_saved_config_is_accepted():
    """transformers 5 writes rope_parameters and renames num_experts to num_local_experts."""
    conf = transformers.Qwen3MoeConfig(**{k: v for k, v in CONFIGS["qwen3_moe-norm-mlp_only"].items()
                                          if k != "model_type"})
    saved = json.loads(conf.to_json_string())
    assert "num_local_experts" in saved and "rope_parameters" in saved
    args = Args.from_config(saved)
    assert args.num_experts == 6 and args.rope() == {"rope_type": "default", "rope_theta": 10000.0}


@pytest.mark.parametrize("change, needle", [
    ({"foo_bar": 1}, "foo_bar"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'.*silu"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope type 'dynamic'.*yarn"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e6}}, "rope type 'longrope'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mrope_section": [1]}}, "mrope_section"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"model_type": "qwen2_moe"}, "qwen2_moe"),
    ({"num_experts": None}, "num_experts"),
    ({"num_local_experts": 64}, "num_local_experts 64 disagree"),
    ({"num_experts_per_tok": 200}, "num_experts_per_tok 200"),
], ids=["unknown-key", "hidden_act", "rope-dynamic", "rope-longrope", "rope-extra-key", "partial-rotary",
        "sliding-window", "model_type", "missing-experts", "experts-alias-conflict", "topk"])
def test_unsupported_config_is_a_config_error(change, needle):
    with pytest.raises(ConfigError, match=needle):
        Args.from_config({**QWEN3_30B_A3B, **change})


def test_experts_on_a_dense_model_type_are_refused():
    with pytest.raises(ConfigError, match="num_experts=4 with model_type 'qwen3'"):
        Args.from_config({**QWEN3_8B, "num_experts": 4})


# ---- module tree ----------------------------------------------------------------------------

@pytest.mark.parametrize("cfg", [c for n, c in CONFIGS.items() if n not in HAS_BIAS]
                         + [dict(QWEN3_30B_A3B, num_hidden_layers=3), QWEN3_8B],
                         ids=[n for n in CONFIGS if n not in HAS_BIAS] + ["qwen3-30b-a3b(3 layers)", "qwen3-8b"])
def test_meta_model_matches_arch_table(cfg):
    model = build_model(cfg, device="meta")
    got = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert got == param_shapes(cfg)
    assert all(p.is_meta for p in model.parameters())


def test_biases_are_named_like_the_checkpoint():
    q2 = {n for n, _ in Model(Args.from_config(CONFIGS["qwen2"]), device="meta").named_parameters()}
    assert "model.layers.0.self_attn.q_proj.bias" in q2 and "model.layers.0.self_attn.o_proj.bias" not in q2
    assert "model.layers.0.self_attn.q_norm.weight" not in q2
