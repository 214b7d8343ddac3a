"""Qwen3.5 / Qwen3.5-MoE releases (model_type qwen3_5 / qwen3_5_moe): the text table of
`cvt.convert.arch.qwen3_5` plus the vision tower and MTP draft, which every stage carries through.

The release's names (transformers 5.24 Qwen3_5MoeForConditionalGeneration, modeling_qwen3_5_moe.py
``Qwen3_5MoeVisionModel``; vLLM's ``Qwen3_5MultiTokenPredictor``, qwen3_5_mtp.py), with from
``vision_config`` (absent keys: transformers' Qwen3_5MoeVisionConfig defaults) d = hidden_size,
i = intermediate_size, B < depth, c = in_channels, t = temporal_patch_size, p = patch_size,
n = num_position_embeddings, m = d * spatial_merge_size^2, o = out_hidden_size; and from
``text_config`` h = hidden_size, J < mtp_num_hidden_layers:

    model.visual.patch_embed.proj         weight [d, c, t, p, p], bias [d]   (Conv3d)
    model.visual.pos_embed                weight [n, d]
    model.visual.blocks.B.norm1 / norm2   weight, bias [d]                   (LayerNorm)
    model.visual.blocks.B.attn.qkv        weight [3d, d], bias [3d]
    model.visual.blocks.B.attn.proj       weight [d, d], bias [d]
    model.visual.blocks.B.mlp.linear_fc1 / linear_fc2   weight [i, d] / [d, i], bias
    model.visual.merger.norm              weight, bias [d]
    model.visual.merger.linear_fc1        weight [m, m], bias [m]
    model.visual.merger.linear_fc2        weight [o, m], bias [o]
    mtp.fc                                weight [h, 2h]
    mtp.norm / pre_fc_norm_hidden / pre_fc_norm_embedding   weight [h]
    mtp.layers.J.*                        one full-attention decoder layer (the text layer's names)

All are `Role.CARRIED`: copied byte for byte by every stage, replicated, never run by cvt's text
runtime (which runs no MTP draft). vLLM builds both with the quant config (qwen3_5.py
``Qwen3_VisionTransformer(quant_config=...)``, qwen3_5_mtp.py), and transformers' compressed-tensors
quantizer takes every nn.Linear, so a compressed-tensors output lists their linears in ``ignore``
(`ArchTable.carried_linears_ignored`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from cvt.convert.arch import qwen3_5
from cvt.convert.arch.base import ArchTable, Block, Parallel, Role, Rule

VIS, BLK, MTP = "model.visual", "model.visual.blocks.{B}", "mtp.layers.{B}"
VISION_DEFAULTS = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "in_channels": 3, "patch_size": 16,
                   "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 3584,
                   "num_position_embeddings": 2304}  # transformers' Qwen3_5MoeVisionConfig
_MTP_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate",
                "mlp.shared_expert_gate", *(f"mlp.{x}.{w}_proj" for x in ("shared_expert", "experts.{B}")
                                            for w in ("gate", "up", "down")),
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_MTP_NORMS = ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm")
CARRIED_MODULES = (f"{VIS}.patch_embed.proj", f"{VIS}.pos_embed", f"{BLK}.norm1", f"{BLK}.norm2", f"{BLK}.attn.qkv",
                   f"{BLK}.attn.proj", f"{BLK}.mlp.linear_fc1", f"{BLK}.mlp.linear_fc2", f"{VIS}.merger.norm",
                   f"{VIS}.merger.linear_fc1", f"{VIS}.merger.linear_fc2", "mtp.fc", "mtp.norm",
                   "mtp.pre_fc_norm_hidden", "mtp.pre_fc_norm_embedding",
                   *(f"{MTP}.{m}" for m in _MTP_LINEARS + _MTP_NORMS))
CARRIED_RULES = tuple(Rule(m, Role.CARRIED, Parallel.REPLICATED, Block.CARRIED, float_default=True)
                      for m in CARRIED_MODULES)
TEXT = {"qwen3_5_moe": "qwen3_5_moe_text", "qwen3_5": "qwen3_5_text"}  # wrapper -> the text model_type
DISPLAY = {"qwen3_5_moe": "Qwen3.5-MoE (vision tower and MTP carried)",
           "qwen3_5": "Qwen3.5 (vision tower and MTP carried)"}


def _vision_shapes(vc: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    def get(key: str) -> int:
        v = vc.get(key, VISION_DEFAULTS[key])
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"vision_config.{key} = {v!r}: must be a positive integer")
        return v

    d, i, p, t = get("hidden_size"), get("intermediate_size"), get("patch_size"), get("temporal_patch_size")
    m, o = d * get("spatial_merge_size") ** 2, get("out_hidden_size")
    out = {f"{VIS}.patch_embed.proj.weight": (d, get("in_channels"), t, p, p), f"{VIS}.patch_embed.proj.bias": (d,),
           f"{VIS}.pos_embed.weight": (get("num_position_embeddings"), d)}
    for b in range(get("depth")):
        q = f"{VIS}.blocks.{b}"
        for norm in ("norm1", "norm2"):
            out[f"{q}.{norm}.weight"] = out[f"{q}.{norm}.bias"] = (d,)
        out.update({f"{q}.attn.qkv.weight": (3 * d, d), f"{q}.attn.qkv.bias": (3 * d,),
                    f"{q}.attn.proj.weight": (d, d), f"{q}.attn.proj.bias": (d,),
                    f"{q}.mlp.linear_fc1.weight": (i, d), f"{q}.mlp.linear_fc1.bias": (i,),
                    f"{q}.mlp.linear_fc2.weight": (d, i), f"{q}.mlp.linear_fc2.bias": (d,)})
    out.update({f"{VIS}.merger.norm.weight": (d,), f"{VIS}.merger.norm.bias": (d,),
                f"{VIS}.merger.linear_fc1.weight": (m, m), f"{VIS}.merger.linear_fc1.bias": (m,),
                f"{VIS}.merger.linear_fc2.weight": (o, m), f"{VIS}.merger.linear_fc2.bias": (o,)})
    return out


def _mtp_shapes(tc: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    h = tc["hidden_size"]
    out: dict[str, tuple[int, ...]] = {"mtp.fc.weight": (h, 2 * h)}
    for j in range(tc.get("mtp_num_hidden_layers") or 0):
        p = f"mtp.layers.{j}"
        out.update({**qwen3_5._mixer_shapes(tc, p, True), **qwen3_5._mlp_shapes(tc, p)})
        out[f"{p}.input_layernorm.weight"] = out[f"{p}.post_attention_layernorm.weight"] = (h,)
    out.update({f"mtp.{n}.weight": (h,) for n in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding")})
    return out if tc.get("mtp_num_hidden_layers") else {}


def carried_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The vision tower's tensors (none without ``vision_config``) and the MTP draft's (none without
    ``text_config.mtp_num_hidden_layers``) with their shapes (module docstring)."""
    vc = config.get("vision_config")
    if vc is not None and not isinstance(vc, Mapping):
        raise ValueError(f"vision_config = {vc!r}: must be an object")
    return (_vision_shapes(vc) if vc is not None else {}) | _mtp_shapes(config["text_config"])


def wrap(text: ArchTable, config: Mapping[str, Any]) -> ArchTable:
    """The qwen3_5 / qwen3_5_moe table of a config.json whose text model is `text`'s: its rules (the
    release's names already), the carried rules, shapes = text shapes + `carried_shapes`."""
    def param_shapes(cfg: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
        return text.param_shapes(cfg) | carried_shapes(config)

    mt = config.get("model_type")
    return dataclasses.replace(text, name=mt, display=DISPLAY[mt], model_types=(mt,),
                               rules=text.rules + CARRIED_RULES, param_shapes=param_shapes, carried_linears_ignored=True)
