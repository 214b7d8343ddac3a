"""gpt-oss (gpt_oss): GQA attention with learned sinks, alternating sliding-window / full layers,
a top-k MoE with biases, under the release's tensor names.

The release (openai/gpt-oss-20b / -120b) names its tensors as transformers' GptOssForCausalLM
(modeling_gpt_oss.py, transformers 5.24) but stores the routed experts in MXFP4
(quantization_config ``quant_method: "mxfp4"``, read by `cvt.convert.mxfp4_source`): per layer the
experts of one projection are one tensor ``X_blocks`` (uint8, two E2M1 codes per byte) with
``X_scales`` (uint8 E8M0, one per 32 inputs), X = ``gate_up_proj`` / ``down_proj``. A BF16
checkpoint (transformers' dequantized save, e.g. ``Mxfp4Config(dequantize=True)``) stores X itself,
as transformers' GptOssExperts parameters, transposed against a linear's ``[out, in]``. With
h = hidden_size, H / K / D = attention heads / KV heads / head_dim, E / I = num_local_experts /
intermediate_size (each expert's width):

    tensor (under model.layers.i.)              shape                 dtype (release)   float under cvt
    self_attn.q_proj .weight / .bias            [H*D, h] / [H*D]      bf16              no
    self_attn.k_proj, v_proj .weight / .bias    [K*D, h] / [K*D]      bf16              no
    self_attn.o_proj .weight / .bias            [h, H*D] / [h]        bf16              no
    self_attn.sinks (one logit per head)        [H]                   bf16              always
    mlp.router .weight / .bias                  [E, h] / [E]          bf16              always
    mlp.experts.gate_up_proj_blocks             [E, 2I, h/32, 16]     u8 (MXFP4)        no
    mlp.experts.gate_up_proj_scales             [E, 2I, h/32]         u8 (E8M0)
    mlp.experts.gate_up_proj (BF16 layout)      [E, h, 2I]            -                 no
    mlp.experts.gate_up_proj_bias               [E, 2I]               bf16              always
    mlp.experts.down_proj_blocks / _scales      [E, h, I/32, 16] / [E, h, I/32]  u8     no
    mlp.experts.down_proj (BF16 layout)         [E, I, h]             -                 no
    mlp.experts.down_proj_bias                  [E, h]                bf16              always
    input_layernorm / post_attention_layernorm  [h]                   bf16              always

plus ``model.embed_tokens``, ``model.norm`` and ``lm_head`` (all float). gate_up_proj's outputs
interleave the two halves of the clamped SwiGLU: column 2j is gate j, column 2j + 1 is up j.
What stays float is the release's own ``modules_to_not_convert`` (attention, router, embeddings,
head) for MXFP4; cvt's schemes keep the router, the sinks, norms, embeddings and head float.
`param_shapes` gives the BF16 layout (transformers' model's own state_dict).

Layer i's attention is ``layer_types[i]`` (default, transformers' GptOssConfig: sliding at even i,
full at odd i): "sliding_attention" sees the last ``sliding_window`` positions (`GQA_SLIDING`),
"full_attention" all (`GQA`).

Parallel layout, as vLLM's gpt-oss loader splits it (vllm/model_executor/models/gpt_oss.py,
``GptOssModel.load_weights``): TP splits attention by heads, the sinks with them (``sinks.narrow(0,
head_start, heads_per_rank)``; role LINEAR here, as DeepSeek-V4's ``attn_sink``: the attention's tp
axis, never quantized); the router is replicated; the fused experts split over EP by contiguous
expert id ranges along their dim 0 (vLLM's ``use_ep`` branch, ``weight[ep_rank_start:ep_rank_end,
...]``), every ``[E, ...]`` tensor of the layer (biases included) alike (`cvt.convert.shard.split_of`:
a routed-expert tensor with no expert id in its name). vLLM's other branch (TP over the expert
width, gate / up interleaved) is not taken: moe_tp > 1 is refused for fused experts, and so is a
placement other than contiguous ranges (EPLB / redundant copies) (`cvt.convert.memory_plan.validate`:
`cvt plan` lists it, `cvt shard` and the multi-rank runtime refuse it).
"""

from __future__ import annotations

from typing import Any, Mapping

from cvt.convert.arch import checks
from cvt.convert.arch.attention import GQA, GQA_SLIDING, LayerAttention
from cvt.convert.arch.base import DECODER_RULES, LAYER as L, ArchTable, Block, Parallel, Role, Rule

C, R, REP = Parallel.COLUMN, Parallel.ROW, Parallel.REPLICATED
SLIDING, FULL = "sliding_attention", "full_attention"
PROJS = ("gate_up_proj", "down_proj")
MXFP4_PARTS = ("blocks", "scales")  # X_blocks, X_scales in the MXFP4 release
# the experts' parameters in either layout; the biases stay float
EXPERT_PARAMS = frozenset({*PROJS, *(f"{p}_bias" for p in PROJS), *(f"{p}_{q}" for p in PROJS for q in MXFP4_PARTS)})
SINKS = frozenset({"sinks"})
DEFAULT_ATTENTION_BIAS = True  # transformers' GptOssConfig.attention_bias


def layer_types(cfg: Mapping[str, Any]) -> list[str]:
    """Each decoder layer's attention: ``layer_types``, or transformers' default (sliding first)."""
    if cfg.get("layer_types") is not None:
        return list(cfg["layer_types"])
    return [SLIDING if (i + 1) % 2 else FULL for i in range(cfg["num_hidden_layers"])]


def attention_kinds(cfg: Mapping[str, Any]) -> list:
    return [GQA_SLIDING if t == SLIDING else GQA for t in layer_types(cfg)]


def num_experts(cfg: Mapping[str, Any]) -> int:
    return cfg["num_local_experts"]


def param_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Every tensor of a gpt-oss model in the BF16 layout, with its shape, from config alone."""
    h, vocab, heads = cfg["hidden_size"], cfg["vocab_size"], cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    d = cfg.get("head_dim") or h // heads
    e, i = num_experts(cfg), cfg["intermediate_size"]
    bias = cfg.get("attention_bias", DEFAULT_ATTENTION_BIAS)
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for n in range(cfg["num_hidden_layers"]):
        p, a, x = f"model.layers.{n}", f"model.layers.{n}.self_attn", f"model.layers.{n}.mlp.experts"
        out[f"{p}.input_layernorm.weight"] = (h,)
        for proj, rows, cols in (("q_proj", heads * d, h), ("k_proj", kv * d, h), ("v_proj", kv * d, h),
                                 ("o_proj", h, heads * d)):
            out[f"{a}.{proj}.weight"] = (rows, cols)
            if bias:
                out[f"{a}.{proj}.bias"] = (rows,)
        out[f"{a}.sinks"] = (heads,)
        out[f"{p}.post_attention_layernorm.weight"] = (h,)
        out[f"{p}.mlp.router.weight"], out[f"{p}.mlp.router.bias"] = (e, h), (e,)
        out.update({f"{x}.gate_up_proj": (e, h, 2 * i), f"{x}.gate_up_proj_bias": (e, 2 * i),
                    f"{x}.down_proj": (e, i, h), f"{x}.down_proj_bias": (e, h)})
    out["model.norm.weight"] = (h,)
    if not cfg.get("tie_word_embeddings"):
        out["lm_head.weight"] = (vocab, h)
    return out


def kv_note(cfg: Mapping[str, Any]) -> str:
    kinds = attention_kinds(cfg)
    n_sliding = sum(k is GQA_SLIDING for k in kinds)
    heads = cfg["num_attention_heads"]
    return (f"gpt-oss layers ({n_sliding} x sliding window {cfg.get('sliding_window')}, {len(kinds) - n_sliding} x "
            f"full attention): GQA k+v {cfg.get('num_key_value_heads') or heads} KV heads / tp x "
            f"{cfg.get('head_dim') or cfg['hidden_size'] // heads} per token, a sliding layer at most its window")


_A = f"{L}.self_attn"
RULES = DECODER_RULES + (
    Rule(f"{_A}.q_proj", Role.LINEAR, C, Block.ATTN, quantizable=True),
    Rule(f"{_A}.k_proj", Role.LINEAR, C, Block.ATTN, quantizable=True),
    Rule(f"{_A}.v_proj", Role.LINEAR, C, Block.ATTN, quantizable=True),
    Rule(f"{_A}.o_proj", Role.LINEAR, R, Block.ATTN, quantizable=True),
    Rule(_A, Role.KV_CACHE, REP, Block.ATTN, float_default=True),  # C8 k_scale / v_scale (before the sinks)
    Rule(_A, Role.LINEAR, C, Block.ATTN, float_default=True, params=SINKS),  # one per head: split with them
    Rule(f"{L}.mlp.router", Role.ROUTER, REP, Block.MOE, float_default=True),
    Rule(f"{L}.mlp.experts", Role.EXPERT, REP, Block.MOE, params=EXPERT_PARAMS),
)

TABLE = ArchTable(
    name="gpt_oss", display="gpt-oss", model_types=("gpt_oss",), rules=RULES,
    attention=LayerAttention((GQA_SLIDING, GQA), attention_kinds),
    config_keys={"layers": "num_hidden_layers", "vocab": "vocab_size", "hidden": "hidden_size",
                 "heads": "num_attention_heads", "kv_heads": "num_key_value_heads", "experts": "num_local_experts",
                 "experts_per_token": "num_experts_per_tok"},
    param_shapes=param_shapes, config_checks=checks.gpt_oss, kv_note=kv_note,
    fused_groups=((f"{_A}.q_proj", f"{_A}.k_proj", f"{_A}.v_proj"),),  # vLLM's qkv_proj
    calib_shared_inputs=(("q_proj", "k_proj", "v_proj"),),
    rotation="its attention sinks and expert biases are not mapped for rotation",
)
