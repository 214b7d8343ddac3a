"""Qwen3.5-MoE (qwen3_5_moe) and Qwen3.5 (qwen3_5): hybrid Gated DeltaNet / gated attention, under
the release's tensor names.

config.json is a wrapper (``model_type`` qwen3_5_moe / qwen3_5, the text model in ``text_config``
with model_type qwen3_5_moe_text / qwen3_5_text, a vision tower in ``vision_config``), and the
release names its tensors as transformers' Qwen3_5MoeForConditionalGeneration does
(modeling_qwen3_5_moe.py, transformers 5.24): the text model under ``model.language_model.``,
the head at ``lm_head``, the vision tower under ``model.visual.``, the MTP draft under ``mtp.``.
Per decoder layer i, ``layer_types[i]`` (default: every ``full_attention_interval``-th layer,
4, is full attention) picks the token mixer; with h = hidden_size, H / K / D = attention heads /
KV heads / head_dim, Hk / Hv / Dk / Dv = linear_num_key_heads / linear_num_value_heads /
linear_key_head_dim / linear_value_head_dim, C = 2 * Hk * Dk + Hv * Dv (the conv channels),
k = linear_conv_kernel_dim, E / I / S = num_experts / moe_intermediate_size /
shared_expert_intermediate_size:

    tensor (under model.language_model.layers.i.)   shape         float under cvt
    linear_attn.in_proj_qkv .weight  (linear layers) [C, h]        no
    linear_attn.in_proj_z .weight                    [Hv*Dv, h]    no
    linear_attn.in_proj_b / in_proj_a .weight        [Hv, h]       yes (1)
    linear_attn.conv1d .weight (depthwise, no bias)  [C, 1, k]     always
    linear_attn.A_log / dt_bias                      [Hv]          always
    linear_attn.norm .weight (gated RMSNorm)         [Dv]          always
    linear_attn.out_proj .weight                     [h, Hv*Dv]    no
    self_attn.q_proj .weight (full layers; q and     [2*H*D, h]    no
        its output gate, per head [q_h | gate_h])
    self_attn.k_proj / v_proj .weight                [K*D, h]      no
    self_attn.o_proj .weight                         [h, H*D]      no
    self_attn.q_norm / k_norm .weight                [D]           always
    mlp.gate .weight (MoE: softmax top-k router)     [E, h]        always
    mlp.experts.e.gate_proj / up_proj / down_proj    [I, h] / [h, I]   no
    mlp.shared_expert.gate_proj / up_proj / down_proj  [S, h] / [h, S] no
    mlp.shared_expert_gate .weight                   [1, h]        always (1)
    mlp.gate_proj / up_proj / down_proj (dense)      [i, h] / [h, i]   no
    input_layernorm / post_attention_layernorm       [h]           always

plus ``model.language_model.embed_tokens`` / ``.norm`` and ``lm_head``. The RMSNorms (but the
gated one) scale by ``1 + weight`` (Gemma's zero-centred form): the runtime's, not a table concern.
Routed experts are per-expert tensors here, as the FP8 block release stores them
(Qwen/Qwen3.5-35B-A3B-FP8: ``...mlp.experts.0.gate_proj.weight`` + ``weight_scale_inv``); the BF16
release's fused ``mlp.experts.gate_up_proj`` [E, 2I, h] / ``down_proj`` [E, h, I] are read as those
per-expert tensors (`SAVED_SPLITS`: each one a contiguous byte range of the fused tensor), so every
stage sees, and writes, the per-expert layout.

(1) What stays float: vLLM's Qwen3.5 GatedDeltaNetAttention builds ``in_proj_ba`` (in_proj_b +
in_proj_a) and Qwen3NextSparseMoeBlock the router ``gate`` and ``shared_expert_gate`` as
unquantized ReplicatedLinear / quant_config=None layers (vllm/model_executor/models/qwen3_next.py),
and the conv1d, A_log, dt_bias and norms are no linears at all. vllm-ascend main builds in_proj_ba
*with* its quant config, so the description decides: its packed mapping (modelslim_config.py
``packed_modules_model_mapping["qwen3_5" / "qwen3_5_moe"]``: in_proj_ba = in_proj_b + in_proj_a) asks
both halves, FLOAT here, and loads them unquantized (tests/quant/vllm_ascend_referee_qwen3_5.py).
msModelSlim's Qwen3.5 recipes (lab_practice/qwen3_5_moe/*.yaml) quantize less by default: only
``*self_attn*`` and ``*mlp*`` (dense) or ``*self_attn*`` but o_proj and ``*mlp.experts*`` (MoE), never
``mtp*``; so the Gated DeltaNet projections and shared experts stay float there. cvt's default
quantizes every linear vllm-ascend can load quantized; a recipe (``--recipe``) keeps more float.

(2) TP, as vLLM's QwenGatedDeltaNetAttention splits the linear attention
(vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py): a rank holds Hk / tp key heads
and Hv / tp value heads. in_proj_qkv is column-parallel with its q, k and v rows split apart (a
rank's run of each, in order: `Rule.parts`, as the MergedColumnParallelLinear output_sizes
[key_dim, key_dim, value_dim, value_dim] of its in_proj_qkvz load it), in_proj_z / in_proj_b /
in_proj_a column-parallel, the conv1d weight split as q | k | v the same way
(mamba_v2_sharded_weight_loader), A_log / dt_bias by value heads (sharded_weight_loader(0)), the
gated norm whole, out_proj row-parallel. TP must divide both head counts (`cvt.convert.memory_plan`).
The full attention splits by heads.
The vision tower and the MTP draft are `Role.CARRIED`: copied byte for byte, never run.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from cvt.convert.arch import checks
from cvt.convert.arch.attention import GQA, LINEAR, LayerAttention
from cvt.convert.arch.base import ArchTable, Block, Parallel, Role, Rule, swiglu_rules

C, R, V, REP = Parallel.COLUMN, Parallel.ROW, Parallel.VOCAB, Parallel.REPLICATED
P = "model.language_model"
L = f"{P}.layers.{{L}}"
FULL, LINEAR_TYPE = "full_attention", "linear_attention"
DEFAULT_INTERVAL = 4  # transformers' Qwen3_5MoeTextConfig: full_attention_interval
GDN_PARAMS = frozenset({"A_log", "dt_bias"})
# transformers' Qwen3_5MoeTextConfig defaults that size tensors (config.json may omit them)
DEFAULTS = {"linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "linear_num_key_heads": 16, "linear_num_value_heads": 32, "head_dim": 256}


def layer_types(cfg: Mapping[str, Any]) -> list[str]:
    """Each decoder layer's token mixer: ``layer_types``, or every ``full_attention_interval``-th
    layer full attention (transformers' default)."""
    if cfg.get("layer_types") is not None:
        return list(cfg["layer_types"])
    every = cfg.get("full_attention_interval") or DEFAULT_INTERVAL
    return [FULL if (i + 1) % every == 0 else LINEAR_TYPE for i in range(cfg["num_hidden_layers"])]


def attention_kinds(cfg: Mapping[str, Any]) -> list:
    """One kind per decoder layer: Gated DeltaNet (`LINEAR`) or gated full attention (`GQA`)."""
    return [GQA if t == FULL else LINEAR for t in layer_types(cfg)]


def _get(cfg: Mapping[str, Any], key: str) -> int:
    return cfg[key] if cfg.get(key) is not None else DEFAULTS[key]


def conv_channels(cfg: Mapping[str, Any]) -> int:
    """The causal conv's channels: q, k (Hk * Dk each) and v (Hv * Dv)."""
    return (2 * _get(cfg, "linear_num_key_heads") * _get(cfg, "linear_key_head_dim")
            + _get(cfg, "linear_num_value_heads") * _get(cfg, "linear_value_head_dim"))


def _mixer_shapes(cfg, p: str, full: bool) -> dict[str, tuple[int, ...]]:
    h = cfg["hidden_size"]
    if full:
        heads, kv, d = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"], \
            _get(cfg, "head_dim")
        a = f"{p}.self_attn"
        return {f"{a}.q_proj.weight": (2 * heads * d, h), f"{a}.k_proj.weight": (kv * d, h),
                f"{a}.v_proj.weight": (kv * d, h), f"{a}.o_proj.weight": (h, heads * d),
                f"{a}.q_norm.weight": (d,), f"{a}.k_norm.weight": (d,)}
    vh, vd = _get(cfg, "linear_num_value_heads"), _get(cfg, "linear_value_head_dim")
    ch, a = conv_channels(cfg), f"{p}.linear_attn"
    return {f"{a}.in_proj_qkv.weight": (ch, h), f"{a}.in_proj_z.weight": (vh * vd, h),
            f"{a}.in_proj_b.weight": (vh, h), f"{a}.in_proj_a.weight": (vh, h),
            f"{a}.conv1d.weight": (ch, 1, _get(cfg, "linear_conv_kernel_dim")), f"{a}.A_log": (vh,),
            f"{a}.dt_bias": (vh,), f"{a}.norm.weight": (vd,), f"{a}.out_proj.weight": (h, vh * vd)}


def _mlp_shapes(cfg, p: str) -> dict[str, tuple[int, ...]]:
    h, m = cfg["hidden_size"], f"{p}.mlp"
    if not cfg.get("num_experts"):
        i = cfg["intermediate_size"]
        return {f"{m}.gate_proj.weight": (i, h), f"{m}.up_proj.weight": (i, h), f"{m}.down_proj.weight": (h, i)}
    e, i, s = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
    out = {f"{m}.gate.weight": (e, h)}
    for x in range(e):
        out.update({f"{m}.experts.{x}.gate_proj.weight": (i, h), f"{m}.experts.{x}.up_proj.weight": (i, h),
                    f"{m}.experts.{x}.down_proj.weight": (h, i)})
    out.update({f"{m}.shared_expert.gate_proj.weight": (s, h), f"{m}.shared_expert.up_proj.weight": (s, h),
                f"{m}.shared_expert.down_proj.weight": (h, s), f"{m}.shared_expert_gate.weight": (1, h)})
    return out


def param_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Every text-model tensor of a Qwen3.5 / Qwen3.5-MoE release with its shape, from the text
    config alone (the vision tower and MTP draft: `carried_shapes`)."""
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    types = layer_types(cfg)
    out: dict[str, tuple[int, ...]] = {f"{P}.embed_tokens.weight": (vocab, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"{P}.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = (h,)
        out.update(_mixer_shapes(cfg, p, types[i] == FULL))
        out[f"{p}.post_attention_layernorm.weight"] = (h,)
        out.update(_mlp_shapes(cfg, p))
    out[f"{P}.norm.weight"] = (h,)
    if not cfg.get("tie_word_embeddings"):
        out["lm_head.weight"] = (vocab, h)
    return out


def kv_note(cfg: Mapping[str, Any]) -> str:
    """How the memory plan counts the hybrid cache (the kinds' own bytes, `cvt.convert.arch.attention`)."""
    kinds = attention_kinds(cfg)
    n_full = sum(k is GQA for k in kinds)
    return (f"Qwen3.5 hybrid layers ({len(kinds) - n_full} x Gated DeltaNet, {n_full} x full attention): a fixed "
            f"conv state ({conv_channels(cfg)} channels x {_get(cfg, 'linear_conv_kernel_dim') - 1}) and recurrent "
            f"state ({_get(cfg, 'linear_num_value_heads')} heads x {_get(cfg, 'linear_key_head_dim')} x "
            f"{_get(cfg, 'linear_value_head_dim')}) per linear layer and sequence, both / tp by heads, GQA k+v "
            f"{cfg.get('num_key_value_heads')} KV heads / tp x {_get(cfg, 'head_dim')} per token per full layer")


def qkv_parts(cfg: Mapping[str, Any]) -> tuple[int, int, int]:
    """The q | k | v rows of in_proj_qkv and of the conv (key_dim, key_dim, value_dim)."""
    key = _get(cfg, "linear_num_key_heads") * _get(cfg, "linear_key_head_dim")
    return key, key, _get(cfg, "linear_num_value_heads") * _get(cfg, "linear_value_head_dim")


def gdn_state_rules(g: str) -> tuple[Rule, ...]:
    """The Gated DeltaNet's float parts at module `g` (Qwen3.5's and Qwen3-Next's alike): the conv
    split as q | k | v per rank, A_log / dt_bias by value heads, the gated norm (over one head's
    Dv) whole. Role LINEAR: they follow the attention's tp axis; never quantized (2)."""
    return (Rule(f"{g}.conv1d", Role.LINEAR, C, Block.ATTN, float_default=True, parts=qkv_parts),
            Rule(f"{g}.norm", Role.NORM, REP, Block.ATTN, float_default=True),
            Rule(g, Role.LINEAR, C, Block.ATTN, float_default=True, params=GDN_PARAMS))


GDN_STATE_RULES = gdn_state_rules(f"{L}.linear_attn")


def _rules(moe: bool) -> tuple[Rule, ...]:
    a, g = f"{L}.self_attn", f"{L}.linear_attn"

    def lin(mod, par, block=Block.ATTN, role=Role.LINEAR, float_default=False):
        return Rule(mod, role, par, block, quantizable=True, float_default=float_default)

    common = (
        Rule(f"{P}.embed_tokens", Role.EMBEDDING, V, Block.EMBED, float_default=True),
        Rule(f"{P}.norm", Role.NORM, REP, Block.NORM, float_default=True),
        Rule("lm_head", Role.HEAD, C, Block.HEAD, float_default=True),
        Rule(f"{L}.input_layernorm", Role.NORM, REP, Block.NORM, float_default=True),
        Rule(f"{L}.post_attention_layernorm", Role.NORM, REP, Block.NORM, float_default=True),
        lin(f"{a}.q_proj", C), lin(f"{a}.k_proj", C), lin(f"{a}.v_proj", C), lin(f"{a}.o_proj", R),
        Rule(f"{a}.q_norm", Role.NORM, REP, Block.ATTN, float_default=True),
        Rule(f"{a}.k_norm", Role.NORM, REP, Block.ATTN, float_default=True),
        Rule(f"{g}.in_proj_qkv", Role.LINEAR, C, Block.ATTN, quantizable=True, parts=qkv_parts),   # (2)
        lin(f"{g}.in_proj_z", C), lin(f"{g}.out_proj", R),
        lin(f"{g}.in_proj_b", C, float_default=True), lin(f"{g}.in_proj_a", C, float_default=True),  # (1)
        *GDN_STATE_RULES,
    )
    if not moe:
        return common + swiglu_rules(f"{L}.mlp", Role.LINEAR, Block.MLP)
    return common + (
        Rule(f"{L}.mlp.gate", Role.ROUTER, REP, Block.MOE, float_default=True),
        Rule(f"{L}.mlp.shared_expert_gate", Role.ROUTER, REP, Block.MOE, float_default=True),  # (1)
        *swiglu_rules(f"{L}.mlp.experts.{{E}}", Role.EXPERT, Block.MOE),
        *swiglu_rules(f"{L}.mlp.shared_expert", Role.SHARED_EXPERT, Block.MOE),
    )


_KEYS = {"layers": "num_hidden_layers", "vocab": "vocab_size", "hidden": "hidden_size",
         "heads": "num_attention_heads", "kv_heads": "num_key_value_heads"}
# vLLM's Qwen3.5 (qwen3_5.py load_weights stacked_params_mapping): qkv_proj, gate_up_proj, in_proj_ba,
# in_proj_qkvz (in_proj_qkv + in_proj_z), each expert's w13
_FUSED = ((f"{L}.self_attn.q_proj", f"{L}.self_attn.k_proj", f"{L}.self_attn.v_proj"),
          (f"{L}.linear_attn.in_proj_qkv", f"{L}.linear_attn.in_proj_z"),
          (f"{L}.linear_attn.in_proj_b", f"{L}.linear_attn.in_proj_a"))
_ATTENTION = LayerAttention((LINEAR, GQA), attention_kinds)
_ROTATION = "its RMSNorms scale by 1 + weight (zero-centred) and its Gated DeltaNet is not mapped for rotation"

DENSE = ArchTable(
    name="qwen3_5_text", display="Qwen3.5 (text model)", model_types=("qwen3_5_text",), rules=_rules(False),
    attention=_ATTENTION, config_keys=_KEYS, param_shapes=param_shapes, config_checks=checks.qwen3_5,
    kv_note=kv_note, rotation=_ROTATION,
    fused_groups=_FUSED + ((f"{L}.mlp.gate_proj", f"{L}.mlp.up_proj"),),
    # the Gated DeltaNet's four input projections read the normed hidden state (b / a stay float)
    calib_shared_inputs=(("q_proj", "k_proj", "v_proj"), ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
                         ("gate_proj", "up_proj")),
)
# the BF16 release's fused routed experts (transformers' Qwen3_5MoeExperts: gate_up_proj [E, 2I, h], gate rows
# first, as its forward's chunk(2) reads them; down_proj [E, h, I]), text layers and MTP draft alike
_EXPERTS = r"^(?P<p>(?:model\.language_model|mtp)\.layers\.\d+\.mlp\.experts)\."
SAVED_SPLITS = ((_EXPERTS + "gate_up_proj$", (r"\g<p>.{E}.gate_proj.weight", r"\g<p>.{E}.up_proj.weight")),
                (_EXPERTS + "down_proj$", (r"\g<p>.{E}.down_proj.weight",)))
MOE = dataclasses.replace(
    DENSE, name="qwen3_5_moe_text", display="Qwen3.5-MoE (text model)", model_types=("qwen3_5_moe_text",),
    rules=_rules(True), config_keys={**_KEYS, "experts": "num_experts", "experts_per_token": "num_experts_per_tok"},
    saved_splits=SAVED_SPLITS,
    fused_groups=_FUSED + ((f"{L}.mlp.experts.{{E}}.gate_proj", f"{L}.mlp.experts.{{E}}.up_proj"),
                           (f"{L}.mlp.shared_expert.gate_proj", f"{L}.mlp.shared_expert.up_proj")),
)
