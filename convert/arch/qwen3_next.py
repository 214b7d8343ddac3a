"""Qwen3-Next (qwen3_next): Qwen3.5-MoE's hybrid Gated DeltaNet / gated attention decoder with
the linear attention's input projections fused, under the release's tensor names.

The release (Qwen/Qwen3-Next-80B-A3B-Instruct, and its -FP8 block release) names its tensors as
transformers' Qwen3NextForCausalLM (modeling_qwen3_next.py, transformers 5.24) does, and its
``save_pretrained`` writes the same names (routed experts one by one: its qwen2_moe conversion
mapping fuses them on load and splits them back on save): ``model.layers.i.``,
``model.embed_tokens`` / ``model.norm``, ``lm_head``. What differs from Qwen3.5
(`cvt.convert.arch.qwen3_5`, whose shape letters this uses; r = Hv / Hk value heads per key head):

    tensor (under model.layers.i.)           shape               float under cvt
    linear_attn.in_proj_qkvz .weight         [2C' , h]           no
        per key head g, rows [q_g (Dk) | k_g (Dk) | v_g (r*Dv) | z_g (r*Dv)]  (C' = Hk*Dk + Hv*Dv)
    linear_attn.in_proj_ba .weight           [2*Hv, h]           yes (1)
        per key head g, rows [b_g (r) | a_g (r)]
    linear_attn.conv1d / A_log / dt_bias / norm / out_proj, self_attn.*: Qwen3.5's (the conv's
        channels in q | k | v order: the fused projection's rows are regrouped before it)
    mlp.*: a MoE block (router ``gate``, routed ``experts.e``, ``shared_expert``,
        ``shared_expert_gate``) in layer i unless i is in ``mlp_only_layers`` or
        (i + 1) % ``decoder_sparse_step`` != 0, where it is a dense SwiGLU of ``intermediate_size``
        (transformers' Qwen3NextDecoderLayer)

(1) What stays float, as for Qwen3.5: vLLM builds ``in_proj_ba`` and, in Qwen3NextSparseMoeBlock,
the router ``gate`` and ``shared_expert_gate`` unquantized (vllm/model_executor/layers/mamba/gdn/
qwen_gdn_linear_attn.py create_ba_proj: "ba_proj doesn't support blockwise fp8 quantization";
vllm/model_executor/models/qwen3_next.py: ReplicatedLinear(..., quant_config=None)); the conv1d,
A_log, dt_bias and norms are no linears.

TP (vLLM's QwenGatedDeltaNetAttention with ``gqa_interleaved_layout``): in_proj_qkvz and
in_proj_ba are each one column-parallel output shard, so a plain split of their rows gives a rank
whole key-head groups (Hk / tp of them, with their Hv / tp value heads); the conv splits as
q | k | v, A_log / dt_bias by value heads, out_proj row-parallel (`cvt.convert.arch.qwen3_5` (2)).

MTP: the release's ``mtp.*`` draft (vLLM's Qwen3NextMultiTokenPredictor: ``mtp.fc``, its norms
and full-attention MoE layers ``mtp.layers.J``) is `Role.CARRIED`, copied byte for byte, never run.
vLLM builds the draft's ``mtp.fc`` and its layers' linears with the quant config (qwen3_next_mtp.py,
prefix ``mtp``), so a compressed-tensors output lists them in ``ignore``
(`ArchTable.carried_linears_ignored`), or the draft would expect quantized parts the float weights
do not hold.
"""

from __future__ import annotations

from typing import Any, Mapping

from cvt.convert.arch import checks, qwen3_5, qwen3_5_wrapper
from cvt.convert.arch.base import DECODER_RULES, ArchTable, Block, Parallel, Role, Rule, swiglu_rules

C, R, REP = Parallel.COLUMN, Parallel.ROW, Parallel.REPLICATED
L = "model.layers.{L}"


def moe_layer(cfg: Mapping[str, Any], i: int) -> bool:
    """Whether decoder layer `i` holds a MoE block (transformers' Qwen3NextDecoderLayer's rule)."""
    step = cfg.get("decoder_sparse_step") or 1
    return bool(cfg.get("num_experts")) and i not in (cfg.get("mlp_only_layers") or []) and (i + 1) % step == 0


def _linear_shapes(cfg: Mapping[str, Any], p: str) -> dict[str, tuple[int, ...]]:
    """A linear layer's tensors: Qwen3.5's, with in_proj_qkv / z and in_proj_b / a fused."""
    out = qwen3_5._mixer_shapes(cfg, p, False)
    a, h = f"{p}.linear_attn", cfg["hidden_size"]
    (qkv, _), (z, _), (v_heads, _) = (out.pop(f"{a}.{n}.weight") for n in ("in_proj_qkv", "in_proj_z", "in_proj_b"))
    del out[f"{a}.in_proj_a.weight"]
    return {f"{a}.in_proj_qkvz.weight": (qkv + z, h), f"{a}.in_proj_ba.weight": (2 * v_heads, h), **out}


def param_shapes(cfg: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Qwen3-Next release with its shape, the MTP draft's (`qwen3_5_wrapper`'s
    names) when config.json counts its layers (``mtp_num_hidden_layers``)."""
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    types = qwen3_5.layer_types(cfg)
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    dense = {**cfg, "num_experts": None}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = (h,)
        out.update(qwen3_5._mixer_shapes(cfg, p, True) if types[i] == qwen3_5.FULL else _linear_shapes(cfg, p))
        out[f"{p}.post_attention_layernorm.weight"] = (h,)
        out.update(qwen3_5._mlp_shapes(cfg if moe_layer(cfg, i) else dense, p))
    out["model.norm.weight"] = (h,)
    if not cfg.get("tie_word_embeddings"):
        out["lm_head.weight"] = (vocab, h)
    return out | qwen3_5_wrapper._mtp_shapes(cfg)


def _rules() -> tuple[Rule, ...]:
    a, g = f"{L}.self_attn", f"{L}.linear_attn"

    def lin(mod, par, block=Block.ATTN, float_default=False):
        return Rule(mod, Role.LINEAR, par, block, quantizable=True, float_default=float_default)

    return DECODER_RULES + (
        lin(f"{a}.q_proj", C), lin(f"{a}.k_proj", C), lin(f"{a}.v_proj", C), lin(f"{a}.o_proj", R),
        Rule(f"{a}.q_norm", Role.NORM, REP, Block.ATTN, float_default=True),
        Rule(f"{a}.k_norm", Role.NORM, REP, Block.ATTN, float_default=True),
        lin(f"{g}.in_proj_qkvz", C), lin(f"{g}.in_proj_ba", C, float_default=True), lin(f"{g}.out_proj", R),  # (1)
        *qwen3_5.gdn_state_rules(g),
        Rule(f"{L}.mlp.gate", Role.ROUTER, REP, Block.MOE, float_default=True),
        Rule(f"{L}.mlp.shared_expert_gate", Role.ROUTER, REP, Block.MOE, float_default=True),  # (1)
        *swiglu_rules(f"{L}.mlp.experts.{{E}}", Role.EXPERT, Block.MOE),
        *swiglu_rules(f"{L}.mlp.shared_expert", Role.SHARED_EXPERT, Block.MOE),
        *swiglu_rules(f"{L}.mlp", Role.LINEAR, Block.MLP),     # mlp_only_layers / decoder_sparse_step
        *(r for r in qwen3_5_wrapper.CARRIED_RULES if r.pattern.startswith("mtp.")),
    )


def kv_note(cfg: Mapping[str, Any]) -> str:
    return qwen3_5.kv_note(cfg).replace("Qwen3.5 hybrid", "Qwen3-Next hybrid", 1)


TABLE = ArchTable(
    name="qwen3_next", display="Qwen3-Next (MTP carried)", model_types=("qwen3_next",), rules=_rules(),
    attention=qwen3_5.MOE.attention, param_shapes=param_shapes, config_checks=checks.qwen3_5, kv_note=kv_note,
    rotation=qwen3_5.MOE.rotation, carried_linears_ignored=True,  # the MTP draft's linears (module docstring)
    config_keys={"layers": "num_hidden_layers", "vocab": "vocab_size", "hidden": "hidden_size",
                 "heads": "num_attention_heads", "kv_heads": "num_key_value_heads", "experts": "num_experts",
                 "experts_per_token": "num_experts_per_tok"},
    # vLLM's Qwen3-Next (qwen3_next.py packed_modules_mapping): qkv_proj, gate_up_proj; in_proj_qkvz and
    # in_proj_ba are one tensor each already
    fused_groups=((f"{L}.self_attn.q_proj", f"{L}.self_attn.k_proj", f"{L}.self_attn.v_proj"),
                  (f"{L}.mlp.gate_proj", f"{L}.mlp.up_proj"),
                  (f"{L}.mlp.experts.{{E}}.gate_proj", f"{L}.mlp.experts.{{E}}.up_proj"),
                  (f"{L}.mlp.shared_expert.gate_proj", f"{L}.mlp.shared_expert.up_proj")),
    # the Gated DeltaNet's two input projections read the normed hidden state (in_proj_ba stays float)
    calib_shared_inputs=(("q_proj", "k_proj", "v_proj"), ("in_proj_qkvz", "in_proj_ba"), ("gate_proj", "up_proj")),
)
