"""Kimi-K2.5's extra ``quant_model_description.json`` keys: the tags under vLLM's module prefixes.

vLLM's KimiK25ForConditionalGeneration (vllm/model_executor/models/kimi_k25.py) builds the text
model as ``DeepseekV2Model(prefix="language_model")``: its modules ask the quant config for
``language_model.layers.{i}.…``, while the checkpoint (and so the description) names them
``language_model.model.layers.{i}.…`` (its load_weights renames tensors, nothing renames
description keys: no hf_to_vllm_mapper). The class has no packed_modules_mapping and vllm-ascend's
table has no ``kimi_k25`` entry, so vllm-ascend (quantization/modelslim_config.py,
AscendModelSlimConfig.get_quant_method -> is_layer_skipped_ascend / get_linear_quant_type) looks
fused modules up under their fused names too: ``…self_attn.fused_qkv_a_proj.weight``,
``…mlp[.shared_experts].gate_up_proj.weight``, ``…mlp.experts.weight``. `vllm_prefix_keys` gives
those keys (the checkpoint-named tags stay: msModelSlim readers and cvt read them).
"""

from __future__ import annotations

import re

CKPT, VLLM = "language_model.model.", "language_model."
# (checkpoint module suffix, vLLM fused module suffix): the first shard's tag stands for the fused
# module (cvt gives fused shards one scheme: the arch table's fused groups)
_FUSED = ((".self_attn.q_a_proj", ".self_attn.fused_qkv_a_proj"),
          (".mlp.shared_experts.gate_proj", ".mlp.shared_experts.gate_up_proj"),
          (".mlp.gate_proj", ".mlp.gate_up_proj"))
_EXPERT0 = re.compile(r"\.mlp\.experts\.0\.gate_proj$")


def vllm_prefix_keys(config: dict, tags: dict[str, str]) -> dict[str, str]:
    """``{vLLM-prefix key: tag}`` for a Kimi-K2.5 (``model_type`` kimi_k25) output's `tags`
    (``{tensor name: tag}``); empty for any other model."""
    if config.get("model_type") != "kimi_k25":
        return {}
    out: dict[str, str] = {}
    for name, tag in tags.items():
        if not name.startswith(CKPT):
            continue
        module, _, local = name.rpartition(".")
        if local not in ("weight", "weight_packed"):
            continue
        vmod = VLLM + module[len(CKPT):]
        out[f"{vmod}.{local}"] = tag
        if _EXPERT0.search(vmod):
            out[f"{vmod[:-len('.0.gate_proj')]}.{local}"] = tag
            continue
        for ck, fused in _FUSED:
            if vmod.endswith(ck):
                out[f"{vmod[:-len(ck)]}{fused}.{local}"] = tag
                break
    return out
