"""Qwen3-MoE (qwen3_moe), and the dense Qwen3 / Llama family (qwen3, qwen2, llama).

GQA attention with separate q/k/v projections (Qwen3 adds per-head q_norm / k_norm),
SwiGLU MLP; Qwen3-MoE replaces the MLP with a softmax router `mlp.gate` over
`mlp.experts.{E}` (no shared experts) except in `mlp_only_layers`.
"""

from cvt.convert.arch import checks, rotation
from cvt.convert.arch.attention import GQA, every_layer
from cvt.convert.arch.base import DECODER_RULES, LAYER as L, ArchTable, Block, Parallel, Role, Rule, swiglu_rules

C, R, REP = Parallel.COLUMN, Parallel.ROW, Parallel.REPLICATED

_COMMON = DECODER_RULES + (
    Rule(f"{L}.self_attn.q_proj", Role.LINEAR, C, Block.ATTN, quantizable=True),
    Rule(f"{L}.self_attn.k_proj", Role.LINEAR, C, Block.ATTN, quantizable=True),
    Rule(f"{L}.self_attn.v_proj", Role.LINEAR, C, Block.ATTN, quantizable=True),
    Rule(f"{L}.self_attn.o_proj", Role.LINEAR, R, Block.ATTN, quantizable=True),
    Rule(f"{L}.self_attn.q_norm", Role.NORM, REP, Block.ATTN, float_default=True),
    Rule(f"{L}.self_attn.k_norm", Role.NORM, REP, Block.ATTN, float_default=True),
    *swiglu_rules(f"{L}.mlp", Role.LINEAR, Block.MLP),
    Rule(f"{L}.self_attn", Role.KV_CACHE, REP, Block.ATTN, float_default=True),  # C8 k_scale / v_scale
)
_KEYS = {
    "layers": "num_hidden_layers",
    "vocab": "vocab_size",
    "hidden": "hidden_size",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
}



def param_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Every weight of a Qwen3 / Qwen3-MoE / Llama checkpoint with its shape, from config alone."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or h // heads
    vocab, n_layers = cfg["vocab_size"], cfg["num_hidden_layers"]
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0  # transformers 5 renames it
    sparse_step = cfg.get("decoder_sparse_step") or 1
    mlp_only = set(cfg.get("mlp_only_layers") or [])
    qk_norm = cfg.get("model_type", "").startswith("qwen3")
    qkv_bias = cfg.get("model_type") == "qwen2" or bool(cfg.get("attention_bias"))
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(n_layers):
        p, a, m = f"model.layers.{i}", f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        out[f"{p}.input_layernorm.weight"] = (h,)
        out[f"{a}.q_proj.weight"] = (heads * hd, h)
        out[f"{a}.k_proj.weight"] = (kv * hd, h)
        out[f"{a}.v_proj.weight"] = (kv * hd, h)
        if qkv_bias:
            out[f"{a}.q_proj.bias"], out[f"{a}.k_proj.bias"], out[f"{a}.v_proj.bias"] = (heads * hd,), (kv * hd,), (kv * hd,)
        out[f"{a}.o_proj.weight"] = (h, heads * hd)
        if cfg.get("attention_bias"):
            out[f"{a}.o_proj.bias"] = (h,)
        if qk_norm:
            out[f"{a}.q_norm.weight"] = (hd,)
            out[f"{a}.k_norm.weight"] = (hd,)
        out[f"{p}.post_attention_layernorm.weight"] = (h,)
        if experts and i not in mlp_only and (i + 1) % sparse_step == 0:
            inter = cfg["moe_intermediate_size"]
            out[f"{m}.gate.weight"] = (experts, h)
            for e in range(experts):
                out[f"{m}.experts.{e}.gate_proj.weight"] = (inter, h)
                out[f"{m}.experts.{e}.up_proj.weight"] = (inter, h)
                out[f"{m}.experts.{e}.down_proj.weight"] = (h, inter)
        else:
            inter = cfg["intermediate_size"]
            out[f"{m}.gate_proj.weight"] = (inter, h)
            out[f"{m}.up_proj.weight"] = (inter, h)
            out[f"{m}.down_proj.weight"] = (h, inter)
            if cfg.get("mlp_bias"):
                out[f"{m}.gate_proj.bias"], out[f"{m}.up_proj.bias"], out[f"{m}.down_proj.bias"] = (inter,), (inter,), (h,)
    out["model.norm.weight"] = (h,)
    if not cfg.get("tie_word_embeddings"):
        out["lm_head.weight"] = (vocab, h)
    return out


# vLLM qwen3.py / qwen3_moe.py / llama.py: qkv_proj, gate_up_proj, each expert's w13
_CALIB_INPUTS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # `ArchTable.calib_shared_inputs`
_FUSED = ((f"{L}.self_attn.q_proj", f"{L}.self_attn.k_proj", f"{L}.self_attn.v_proj"),
          (f"{L}.mlp.gate_proj", f"{L}.mlp.up_proj"))

DENSE = ArchTable(
    name="qwen3", display="Qwen3 / Qwen2 / Llama", attention=every_layer(GQA), model_types=("qwen3", "qwen2", "llama"), rules=_COMMON, config_keys=_KEYS, param_shapes=param_shapes,
    fused_groups=_FUSED, config_checks=checks.qwen3, calib_shared_inputs=_CALIB_INPUTS, rotation=rotation.QWEN3,
)

MOE = ArchTable(
    name="qwen3_moe",
    display="Qwen3-MoE",
    attention=every_layer(GQA),
    rotation=rotation.QWEN3,
    param_shapes=param_shapes,
    model_types=("qwen3_moe",),
    config_checks=checks.qwen3,
    calib_shared_inputs=_CALIB_INPUTS,
    config_keys={**_KEYS, "experts": "num_experts", "experts_per_token": "num_experts_per_tok"},  # see param_shapes
    fused_groups=_FUSED + ((f"{L}.mlp.experts.{{E}}.gate_proj", f"{L}.mlp.experts.{{E}}.up_proj"),),
    rules=_COMMON
    + (
        Rule(f"{L}.mlp.gate", Role.ROUTER, REP, Block.MOE, float_default=True),
        *swiglu_rules(f"{L}.mlp.experts.{{E}}", Role.EXPERT, Block.MOE),
    ),
)
