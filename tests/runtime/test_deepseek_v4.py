"""cvt's DeepSeek-V4 runtime against transformers' DeepseekV4ForCausalLM (float32, eager), on tiny
random configs covering every layer type (sliding window, CSA at rate 4 with the indexer, HCA at
rate 128), hash and scored routing, the swiglu clamp; prompts past the sliding window and twice
the largest compression rate; cached decode against the full forward.

The release names are mapped onto transformers' by its own table (transformers
``conversion_mapping.py``, "deepseek_v4": attn -> self_attn, ffn -> mlp, wq_a -> q_a_proj,
q_norm -> q_a_norm, wkv -> kv_proj, wo_a / wo_b -> o_a_proj / o_b_proj, attn_sink -> sinks,
ape -> position_bias, compressor.wgate -> gate_proj, compressor.norm -> kv_norm,
indexer.compressor -> compressor.indexer, indexer.weights_proj -> compressor.indexer.scorer.weights_proj,
gate.bias -> e_score_correction_bias, hc_attn_fn -> attn_hc.fn, experts' w1 / w3 -> gate_up_proj,
w2 -> down_proj, shared_experts w1 / w2 / w3 -> gate_proj / down_proj / up_proj).
"""

from __future__ import annotations

import re

import pytest
import torch

from cvt.testing.checkpoints import random_weights
from cvt.testing.checkpoints_v4 import tiny_deepseek_v4_config
from cvt.runtime.models import build_model

transformers = pytest.importorskip("transformers")
try:
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
except ImportError:  # transformers < 5.23
    pytest.skip("transformers has no DeepseekV4", allow_module_level=True)

HF_KEYS = ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
           "num_key_value_heads", "head_dim", "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank",
           "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "scoring_func", "routed_scaling_factor",
           "swiglu_limit", "sliding_window", "compress_ratios", "num_hash_layers", "compress_rope_theta",
           "rope_theta", "index_n_heads", "index_head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters", "hc_eps",
           "rms_norm_eps", "max_position_embeddings", "rope_scaling")

RENAMES = [  # transformers conversion_mapping.py "deepseek_v4", in its order
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"), (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_fn", "hc_head.hc_fn"), (r"^hc_head_base", "hc_head.hc_base"), (r"^hc_head_scale", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn", ".attn_hc.fn"), (r"\.hc_attn_base", ".attn_hc.base"), (r"\.hc_attn_scale", ".attn_hc.scale"),
    (r"\.hc_ffn_fn", ".ffn_hc.fn"), (r"\.hc_ffn_base", ".ffn_hc.base"), (r"\.hc_ffn_scale", ".ffn_hc.scale"),
    (r"\.attn_sink", ".sinks"), (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."), (r"\.norm\.", ".kv_norm."), (r"\.ape", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."), (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."), (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."), (r"\.gate\.bias", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."), (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
]


def to_hf(weights: dict, cfg: dict) -> dict:
    out, experts = {}, {}
    for name, t in weights.items():
        if name.startswith("mtp."):
            continue  # transformers does not instantiate MTP layers
        m = re.match(r"layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight", name)
        if m:
            experts.setdefault(int(m[1]), {})[(int(m[2]), m[3])] = t
            continue
        for a, b in RENAMES:
            name = re.sub(a, b, name)
        out[name if name.startswith("lm_head") else "model." + name] = t
    for layer, parts in experts.items():
        n = cfg["n_routed_experts"]
        p = f"model.layers.{layer}.mlp.experts"
        out[f"{p}.gate_up_proj"] = torch.stack([torch.cat([parts[(e, "w1")], parts[(e, "w3")]]) for e in range(n)])
        out[f"{p}.down_proj"] = torch.stack([parts[(e, "w2")] for e in range(n)])
    return out


def weights_for(cfg: dict, seed: int) -> dict:
    w = random_weights(cfg, seed)
    g = torch.Generator().manual_seed(seed + 7)
    for name in w:
        if name.endswith("tid2eid"):
            w[name] = torch.randint(0, cfg["n_routed_experts"], w[name].shape, generator=g)
        elif name.endswith(("hc_attn_scale", "hc_ffn_scale", "hc_head_scale")):
            w[name] = 0.5 + torch.rand(w[name].shape, generator=g)
        elif name.endswith("attn_sink"):
            w[name] = torch.randn(w[name].shape, generator=g)
    return w


CONFIGS = {
    # every layer type, 2 hash layers, sqrtsoftplus, 2 streams, MTP entry in compress_ratios
    "all-types": tiny_deepseek_v4_config(),
    # 3 streams, sigmoid scores, a tight swiglu clamp, index_topk 2 (the indexer drops entries)
    # + YaRN on the compressed layers' rope (V4's rope_scaling; a short original length so it bites)
    "sigmoid-clamp-yarn": tiny_deepseek_v4_config(
        hc_mult=3, scoring_func="sigmoid", swiglu_limit=0.05, index_topk=2, num_hash_layers=1, sliding_window=5,
        compress_ratios=[4, 128, 4, 0], rope_scaling={"type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1,
                                                      "original_max_position_embeddings": 64}),
    # no hash layer, CSA / HCA only, 3 experts of top-3 (all), 4 heads in 4 output groups
    "no-hash-csa-hca": tiny_deepseek_v4_config(num_hash_layers=0, o_groups=4, n_routed_experts=3,
                                               num_experts_per_tok=3, compress_ratios=[128, 4, 4, 128, 0],
                                               num_hidden_layers=4, hc_sinkhorn_iters=5),
}


def models(cfg: dict, seed: int = 0):
    w = weights_for(cfg, seed)
    ours = build_model(cfg, dtype=torch.float32)
    ours.load_state_dict(w, strict=True)
    hf_cfg = DeepseekV4Config(**{k: cfg[k] for k in HF_KEYS if k in cfg}, attn_implementation="eager")
    hf = DeepseekV4ForCausalLM(hf_cfg).float().eval()
    missing, unexpected = hf.load_state_dict(to_hf(w, cfg), strict=False)
    assert not unexpected and all("inv_freq" in k for k in missing), (missing, unexpected)
    return ours.eval(), hf


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_transformers_past_window_and_twice_the_largest_rate(name):
    cfg = CONFIGS[name]
    ours, hf = models(cfg)
    s = 2 * 128 + 5  # two HCA windows, many CSA windows, far past the sliding window
    tokens = torch.randint(0, cfg["vocab_size"], (2 if name == "all-types" else 1, s),
                           generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(input_ids=tokens, use_cache=False).logits.float()
    got = ours(tokens)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_cached_decode_equals_full_forward():
    cfg = CONFIGS["all-types"]
    ours, _ = models(cfg, seed=3)
    s = 2 * 128 + 5
    tokens = torch.randint(0, cfg["vocab_size"], (1, s), generator=torch.Generator().manual_seed(2))
    full = ours(tokens)
    cache = ours.new_cache(1, s)
    # prefill one short of an HCA window, single tokens across its edge and a CSA edge, then chunks
    # that end inside windows (the compressors carry partial windows between calls)
    parts, t = [], 0
    for n in (127, 1, 1, 2, 1, 60, 3, 66):
        parts.append(ours(tokens[:, t:t + n], t, cache))
        t += n
    assert t == s
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=1e-5)


def test_refuses_what_it_does_not_implement():
    from cvt.runtime.models.base import ConfigError

    with pytest.raises(ConfigError, match="rope_scaling"):
        build_model(tiny_deepseek_v4_config(rope_scaling={"type": "yarn", "factor": 16}))  # no original length
    with pytest.raises(ConfigError, match="rope_scaling"):
        build_model(tiny_deepseek_v4_config(rope_scaling={"type": "longrope", "factor": 16}))
    with pytest.raises(ConfigError, match="compress_ratios"):
        build_model(tiny_deepseek_v4_config(compress_ratios=[0, 8, 128, 0, 4]))


@pytest.mark.slow
def test_loads_and_runs_the_bf16_output_of_a_v4_release(tmp_path):
    """fp8-to-bf16 of a tiny V4 release (release names, FP4 experts) loads into the runtime by name,
    MTP layer included, and `cvt run` generates from it."""
    from safetensors.torch import load_file

    from cvt.convert.fp8_to_bf16 import fp8_to_bf16
    from cvt.testing.checkpoints_v4 import write_v4_release
    from cvt.runtime.loader import load_model
    from cvt.tests.conftest import run_cvt

    out = tmp_path / "bf16"
    fp8_to_bf16(write_v4_release(tmp_path / "src"), out, quiet=True)
    loaded = load_model(out, dtype=torch.float32).model
    assert len(loaded.mtp) == 1
    stored = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    ref = build_model(CONFIGS["all-types"], dtype=torch.float32)
    ref.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in stored.items()}, strict=True)
    tokens = torch.arange(40).view(1, 40)
    assert torch.equal(loaded(tokens), ref.eval()(tokens))
    r = run_cvt("run", out, "--input-ids", "1,2,3", "--max-new-tokens", "2")
    assert r.rc == 0 and "3 prompt + 2 new tokens" in r.out, r.err


def test_mtp_layer_is_the_official_mtp_block_around_transformers_decoder_layer():
    """DeepSeek's V4 inference/model.py `MTPBlock.forward` (e = enorm(embed(ids)); x = hnorm(x);
    x = e_proj(e).unsqueeze(2) + h_proj(x); x = Block.forward(x); head(x, hc_head_*, norm)) with
    transformers' own DeepseekV4DecoderLayer as the Block (transformers does not build MTP layers)."""
    from transformers.masking_utils import create_sliding_window_causal_mask
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperHead, DeepseekV4RMSNorm

    cfg = CONFIGS["all-types"]  # its MTP layer compresses at rate 4 (indexer included)
    w = weights_for(cfg, 5)
    ours = build_model(cfg, dtype=torch.float32)
    ours.load_state_dict(w, strict=True)
    ours.eval()
    s = 2 * 128 + 5
    tokens = torch.randint(0, cfg["vocab_size"], (1, s + 1), generator=torch.Generator().manual_seed(4))
    hidden: list = []
    ours(tokens[:, :-1], hidden_states=hidden)
    got = ours.mtp_logits(0, hidden[-1], tokens[:, 1:])

    # the MTP block as a one-layer transformers model: its compress ratio, scored routing
    one = {**cfg, "num_hidden_layers": 1, "compress_ratios": [cfg["compress_ratios"][4]], "num_hash_layers": 0}
    block = {k.replace("mtp.0.", "layers.0.", 1): v for k, v in w.items() if k.startswith("mtp.0.")}
    block["head.weight"] = w["head.weight"]  # shared with the decoder (MTPBlock.head = Transformer.head)
    hf = DeepseekV4ForCausalLM(DeepseekV4Config(**{k: one[k] for k in HF_KEYS if k in one},
                                                attn_implementation="eager")).float().eval()
    sd = to_hf(block, one)
    glue = {k: sd.pop(f"model.layers.0.{k}") for k in ("e_proj.weight", "h_proj.weight", "enorm.weight",
                                                        "hnorm.weight", "kv_norm.weight", "hc_head_fn",
                                                        "hc_head_base", "hc_head_scale")}
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and not [k for k in missing if k.startswith(("model.layers.0.", "lm_head"))], missing
    eps = cfg["rms_norm_eps"]

    def norm(weight):
        n = DeepseekV4RMSNorm(cfg["hidden_size"], eps)
        n.weight.data = weight
        return n

    head = DeepseekV4HyperHead(hf.config)
    head.hc_fn.data, head.hc_base.data, head.hc_scale.data = glue["hc_head_fn"], glue["hc_head_base"], glue["hc_head_scale"]
    with torch.no_grad():
        ids = tokens[:, 1:]
        streams = hidden[-1].view(1, s, cfg["hc_mult"], cfg["hidden_size"])
        e = norm(glue["enorm.weight"])(w["embed.weight"][ids])
        x = torch.nn.functional.linear(e, glue["e_proj.weight"])[:, :, None] + torch.nn.functional.linear(
            norm(glue["hnorm.weight"])(streams), glue["h_proj.weight"])
        pos = torch.arange(s)[None]
        model = hf.model
        mask = create_sliding_window_causal_mask(config=hf.config, inputs_embeds=e, attention_mask=None, cache=None,
                                                 position_ids=pos)
        pe = {k: model.rotary_emb(e, position_ids=pos, layer_type=k) for k in ("main", "compress")}
        x = model.layers[0](x, position_embeddings=pe, position_ids=pos, attention_mask=mask, input_ids=ids, cache=None)
        # the MTP layer's own norm (stored as mtp.0.norm, renamed kv_norm by the mapping's ".norm." rule)
        want = hf.lm_head(norm(glue["kv_norm.weight"])(head(x))).float()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_a_tid2eid_past_the_experts_is_refused_naming_it(tmp_path):
    from cvt.errors import CvtError

    cfg = CONFIGS["all-types"]
    w = weights_for(cfg, 0)
    w["layers.0.ffn.gate.tid2eid"][7, 1] = cfg["n_routed_experts"]  # one past the last expert
    ours = build_model(cfg, dtype=torch.float32)
    ours.load_state_dict(w, strict=True)
    with pytest.raises(CvtError, match=r"tid2eid routes token 7 to expert 4, outside the config's 4 routed"):
        ours(torch.tensor([[3, 7, 9]]))
