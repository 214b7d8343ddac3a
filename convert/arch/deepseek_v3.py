"""DeepSeek-V3 family: V3, R1, V3.1 (model_type deepseek_v3) and Kimi-K2 (kimi_k2).

MLA attention (q_lora / kv_lora), MoE with a sigmoid router + e_score_correction_bias,
shared experts, `first_k_dense_replace` dense layers, and `num_nextn_predict_layers` MTP
layers stored as extra decoder layers (index >= num_hidden_layers) with their own
embed_tokens, enorm, hnorm, eh_proj and shared_head. q_a_proj and kv_a_proj_with_mqa are
not TP-split (the official model keeps them as plain Linear); kv_b_proj stays float under
quantization (msModelSlim and cann-recipes-infer agree).
"""

from cvt.convert.arch import checks, rotation
from cvt.convert.arch.attention import MLA, every_layer
from cvt.convert.arch.base import DECODER_RULES, LAYER as L, ArchTable, Block, Parallel, Role, Rule, swiglu_rules

C, R, V, REP = Parallel.COLUMN, Parallel.ROW, Parallel.VOCAB, Parallel.REPLICATED



def param_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Every weight of a DeepSeek-V3-family checkpoint with its shape, from config alone
    (MTP layers included; FP8 scales not). Order: embeddings, layers, final norm, head."""
    h = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    nope, rope, vdim = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    q_lora, kv_lora = cfg.get("q_lora_rank"), cfg["kv_lora_rank"]
    n_layers, n_mtp = cfg["num_hidden_layers"], cfg.get("num_nextn_predict_layers") or 0
    dense = cfg.get("first_k_dense_replace") or 0
    experts, moe_i = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    shared = cfg.get("n_shared_experts") or 0
    vocab = cfg["vocab_size"]
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(n_layers + n_mtp):
        p = f"model.layers.{i}"
        if i >= n_layers:
            out[f"{p}.embed_tokens.weight"] = (vocab, h)
            out[f"{p}.enorm.weight"] = (h,)
            out[f"{p}.hnorm.weight"] = (h,)
            out[f"{p}.eh_proj.weight"] = (h, 2 * h)
        out[f"{p}.input_layernorm.weight"] = (h,)
        a = f"{p}.self_attn"
        if q_lora:
            out[f"{a}.q_a_proj.weight"] = (q_lora, h)
            out[f"{a}.q_a_layernorm.weight"] = (q_lora,)
            out[f"{a}.q_b_proj.weight"] = (heads * (nope + rope), q_lora)
        else:
            out[f"{a}.q_proj.weight"] = (heads * (nope + rope), h)
        out[f"{a}.kv_a_proj_with_mqa.weight"] = (kv_lora + rope, h)
        out[f"{a}.kv_a_layernorm.weight"] = (kv_lora,)
        out[f"{a}.kv_b_proj.weight"] = (heads * (nope + vdim), kv_lora)
        out[f"{a}.o_proj.weight"] = (h, heads * vdim)
        out[f"{p}.post_attention_layernorm.weight"] = (h,)
        m = f"{p}.mlp"
        if i < dense:
            inter = cfg["intermediate_size"]
            out[f"{m}.gate_proj.weight"] = (inter, h)
            out[f"{m}.up_proj.weight"] = (inter, h)
            out[f"{m}.down_proj.weight"] = (h, inter)
        else:
            out[f"{m}.gate.weight"] = (experts, h)
            out[f"{m}.gate.e_score_correction_bias"] = (experts,)
            for e in range(experts):
                out[f"{m}.experts.{e}.gate_proj.weight"] = (moe_i, h)
                out[f"{m}.experts.{e}.up_proj.weight"] = (moe_i, h)
                out[f"{m}.experts.{e}.down_proj.weight"] = (h, moe_i)
            if shared:
                out[f"{m}.shared_experts.gate_proj.weight"] = (moe_i * shared, h)
                out[f"{m}.shared_experts.up_proj.weight"] = (moe_i * shared, h)
                out[f"{m}.shared_experts.down_proj.weight"] = (h, moe_i * shared)
        if i >= n_layers:
            out[f"{p}.shared_head.norm.weight"] = (h,)
            out[f"{p}.shared_head.head.weight"] = (vocab, h)
    out["model.norm.weight"] = (h,)
    out["lm_head.weight"] = (vocab, h)
    return out


# What an absent routing key means to transformers' DeepseekV3Config and cvt's runtime (which
# takes these as its defaults); vLLM's deepseek_v2.py reads topk_method / scoring_func with other
# defaults (softmax routing, no correction bias), so every output config states them.
DEFAULTS = {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
            "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4}

TABLE = ArchTable(
    name="deepseek_v3",
    display="DeepSeek-V3 / R1 / V3.1 and Kimi-K2",
    attention=every_layer(MLA),
    rotation=rotation.DEEPSEEK_V3,
    calib_shared_inputs=(("q_a_proj", "q_proj", "kv_a_proj_with_mqa"), ("gate_proj", "up_proj")),
    calib_norm_inputs={"kv_b_proj": "kv_a_layernorm"},  # the latent, normed
    param_shapes=param_shapes,
    explicit_defaults=DEFAULTS,
    config_checks=checks.deepseek,
    fused_groups=(  # vLLM deepseek_v2.py: fused_qkv_a_proj, gate_up_proj (dense, shared), experts' w13
        (f"{L}.self_attn.q_a_proj", f"{L}.self_attn.kv_a_proj_with_mqa"),
        (f"{L}.mlp.gate_proj", f"{L}.mlp.up_proj"),
        (f"{L}.mlp.shared_experts.gate_proj", f"{L}.mlp.shared_experts.up_proj"),
        (f"{L}.mlp.experts.{{E}}.gate_proj", f"{L}.mlp.experts.{{E}}.up_proj"),
    ),
    model_types=("deepseek_v3", "kimi_k2"),
    config_keys={
        "layers": "num_hidden_layers",
        "experts": "n_routed_experts",
        "shared_experts": "n_shared_experts",
        "experts_per_token": "num_experts_per_tok",
        "dense_layers": "first_k_dense_replace",
        "mtp_layers": "num_nextn_predict_layers",
        "vocab": "vocab_size",
        "hidden": "hidden_size",
        "heads": "num_attention_heads",
    },
    rules=DECODER_RULES + (
        # MLA
        Rule(f"{L}.self_attn.q_proj", Role.LINEAR, C, Block.ATTN, quantizable=True),  # q_lora_rank null
        Rule(f"{L}.self_attn.q_a_proj", Role.LINEAR, REP, Block.ATTN, quantizable=True),
        Rule(f"{L}.self_attn.q_a_layernorm", Role.NORM, REP, Block.ATTN, float_default=True),
        Rule(f"{L}.self_attn.q_b_proj", Role.LINEAR, C, Block.ATTN, quantizable=True),
        Rule(f"{L}.self_attn.kv_a_proj_with_mqa", Role.LINEAR, REP, Block.ATTN, quantizable=True),
        Rule(f"{L}.self_attn.kv_a_layernorm", Role.NORM, REP, Block.ATTN, float_default=True),
        Rule(f"{L}.self_attn.kv_b_proj", Role.LINEAR, C, Block.ATTN, quantizable=True, float_default=True),
        Rule(f"{L}.self_attn.o_proj", Role.LINEAR, R, Block.ATTN, quantizable=True),
        # dense MLP (layers < first_k_dense_replace)
        *swiglu_rules(f"{L}.mlp", Role.LINEAR, Block.MLP),
        # MoE
        Rule(f"{L}.mlp.gate", Role.ROUTER, REP, Block.MOE, float_default=True),
        *swiglu_rules(f"{L}.mlp.experts.{{E}}", Role.EXPERT, Block.MOE),
        *swiglu_rules(f"{L}.mlp.shared_experts", Role.SHARED_EXPERT, Block.MOE),
        # int8 KV cache (cvt.runtime.kv_cache): self_attn.{k,v}_scale (compressed-tensors), and
        # FAKQuant's self_attn.fa_{q,k,v}.{scale,offset} (Ascend)
        Rule(f"{L}.self_attn", Role.KV_CACHE, REP, Block.ATTN, float_default=True),
        *(Rule(f"{L}.self_attn.fa_{r}", Role.KV_CACHE, REP, Block.ATTN, float_default=True) for r in "qkv"),
        # MTP extras (only in layers >= num_hidden_layers)
        Rule(f"{L}.embed_tokens", Role.EMBEDDING, V, Block.MTP, float_default=True, mtp_only=True),
        Rule(f"{L}.enorm", Role.NORM, REP, Block.MTP, float_default=True, mtp_only=True),
        Rule(f"{L}.hnorm", Role.NORM, REP, Block.MTP, float_default=True, mtp_only=True),
        Rule(f"{L}.eh_proj", Role.MTP_PROJ, REP, Block.MTP, quantizable=True, float_default=True, mtp_only=True),
        Rule(f"{L}.shared_head.norm", Role.NORM, REP, Block.MTP, float_default=True, mtp_only=True),
        Rule(f"{L}.shared_head.head", Role.HEAD, C, Block.MTP, float_default=True, mtp_only=True),
    ),
)
