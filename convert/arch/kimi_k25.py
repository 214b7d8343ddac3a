"""Kimi-K2.5 / K2.6 (model_type kimi_k25): the DeepSeek-V3 text model under ``language_model.``, plus a
vision tower and projector that every stage carries through untouched.

A wrapper, not a family: config.json's ``text_config`` is a DeepSeek-V3 config (model_type
deepseek_v3, or kimi_k2 in older files) and picks the text table; `wrap(text_table, config)` binds it
to the release's names (moonshotai/Kimi-K2.5 model.safetensors.index.json, the remote code's
KimiK25ForConditionalGeneration):

    language_model.model.embed_tokens / .layers.{L}.* / .norm, language_model.lm_head   the text table
    vision_tower.patch_embed.proj            weight [h, 3, p, p], bias [h]    (Conv2d)
    vision_tower.patch_embed.pos_emb         weight [H, W, h]
    vision_tower.encoder.blocks.{B}.norm0 / norm1          weight, bias [h]  (LayerNorm)
    vision_tower.encoder.blocks.{B}.wqkv                   weight [3h, h], bias [3h]
    vision_tower.encoder.blocks.{B}.wo                     weight [h, h], bias [h]
    vision_tower.encoder.blocks.{B}.mlp.fc0 / fc1          weight [i, h] / [h, i], bias
    vision_tower.encoder.final_layernorm                   weight, bias [h]
    mm_projector.pre_norm                    weight, bias [m]                 (LayerNorm)
    mm_projector.proj.0                      weight [m*k, m*k], bias [m*k]
    mm_projector.proj.2                      weight [text hidden, m*k], bias

with, from ``vision_config``: h = vt_hidden_size, i = vt_intermediate_size, B < vt_num_hidden_layers,
p = patch_size, H x W = init_pos_emb_height x init_pos_emb_width, m = mm_hidden_size,
k = merge_kernel_size[0] * merge_kernel_size[1]; text hidden = text_config.hidden_size.
A checkpoint transformers' save_pretrained wrote is read under these names (`SAVED_RENAMES`), its
vision_config under transformers' key names (`SAVED_VISION_KEYS`; m = projection_hidden_size).

Vision and projector tensors have role CARRIED: float (BF16 in the release), never quantized,
replicated on every rank, copied byte for byte by fp8-to-bf16, quantize and shard; the runtime
(text only) does not load them. Every text tensor of the release is under ``language_model.``,
which calibration and the KV-cache scales' names rely on: a checkpoint under this config with
text names lacking it, or mixing both, is refused before any work (`ArchSpec.lacks_prefix`,
`ArchSpec.prefix_problem`: every writer and `cvt inspect` through the survey, `cvt run` / `verify` /
`export` through the loader), naming a tensor and the prefix.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from cvt.convert.arch.base import ArchTable, Block, Parallel, Role, Rule

DISPLAY = "Kimi-K2.5 / K2.6 (vision tower carried)"
TEXT_PREFIX = "language_model."
VT, BLK = "vision_tower", "vision_tower.encoder.blocks.{B}"
TEXT_MODEL_TYPE = "deepseek_v3"  # what text_config holds (kimi_k2 in older files): the family it wraps
CARRIED_MODULES = (f"{VT}.patch_embed.proj", f"{VT}.patch_embed.pos_emb", f"{BLK}.norm0", f"{BLK}.norm1",
                   f"{BLK}.wqkv", f"{BLK}.wo", f"{BLK}.mlp.fc0", f"{BLK}.mlp.fc1", f"{VT}.encoder.final_layernorm",
                   "mm_projector.pre_norm", "mm_projector.proj.0", "mm_projector.proj.2")
CARRIED_RULES = tuple(Rule(m, Role.CARRIED, Parallel.REPLICATED, Block.CARRIED, float_default=True)
                      for m in CARRIED_MODULES)
CARRIED_PREFIXES = ("vision_tower.", "mm_projector.")
# the towers' modules in compressed-tensors ``ignore``, under the release's names (vision_tower.encoder.
# blocks.B.wqkv, mm_projector.proj.0) and transformers 5's (model.vision_tower.layers.B.attn.q_proj,
# model.mm_projector.in_proj, all nn.Linear); vLLM builds both towers without the quant config
# (vllm/model_executor/models/kimi_k25.py: MoonViT3dPretrainedModel, KimiK25MultiModalProjector)
CARRIED_IGNORE = ("re:^(model\\.)?(" + "|".join(p.rstrip(".") for p in CARRIED_PREFIXES) + ")\\.",)
# the text model's modules as the consumers build them, for compressed-tensors ``ignore`` (matched
# against these names, unmapped): vLLM's KimiK25ForConditionalGeneration builds DeepseekV2Model(prefix
# "language_model") and a top-level lm_head, with no hf_to_vllm_mapper (its load_weights renames
# ``language_model.model`` -> ``language_model``, ``language_model.lm_head`` -> ``lm_head``:
# vllm/model_executor/models/kimi_k25.py at vllm-project/vllm 009dff45 / dd4ad005); transformers 5's
# Kimi_K25ForConditionalGeneration holds ``model.language_model.layers.L`` and ``lm_head``
# (conversion_mapping.py "kimi_k25"). Moonshot's INT4 release sidesteps this with prefix-free
# patterns (``lm_head``, ``re:.*self_attn.*``, ...: tests/data/configs/kimi-k2.5.json)
CONSUMER_PREFIXES = ((f"{TEXT_PREFIX}model.", (TEXT_PREFIX, "model.language_model.")),
                     (f"{TEXT_PREFIX}lm_head", ("lm_head",)))
# ... and that class declares no packed_modules_mapping, so vLLM matches its fused linears by their own
# names (deepseek_v2.py: fused_qkv_a_proj = q_a_proj + kv_a_proj_with_mqa, gate_up_proj = gate + up;
# compressed_tensors/utils.py should_ignore_layer)
CONSUMER_FUSED = (("fused_qkv_a_proj", ("q_a_proj", "kv_a_proj_with_mqa")), ("gate_up_proj", ("gate_proj", "up_proj")))

# transformers 5.24's save_pretrained (Kimi_K25ForConditionalGeneration, conversion_mapping.py "kimi_k25"
# undone) -> the release: its reversed ``blocks`` -> ``layers`` rename (meant for the vision blocks) also
# hits the text layers; the projector's pre_norm keeps transformers' ``model.`` prefix; the patch
# embedding lands under ``encoder.`` with the blocks. Every other name is the release's.
SAVED_RENAMES = (
    (r"^language_model\.model\.blocks\.(\d+)\.", r"language_model.model.layers.\1."),
    (r"^model\.mm_projector\.pre_norm\.", "mm_projector.pre_norm."),
    (r"^vision_tower\.encoder\.patch_embed\.proj\.", "vision_tower.patch_embed.proj."),
)
# the release's vision_config keys -> transformers' Kimi_K25VisionConfig names for the same size
# (mm_hidden_size: Kimi_K25Config's top-level projection_hidden_size)
SAVED_VISION_KEYS = {"vt_hidden_size": "hidden_size", "vt_intermediate_size": "intermediate_size",
                     "vt_num_hidden_layers": "num_hidden_layers", "vt_num_attention_heads": "num_attention_heads",
                     "init_pos_emb_height": "pos_emb_height", "init_pos_emb_width": "pos_emb_width"}


def is_carried(name: str) -> bool:
    """A tensor of the vision tower or projector (by name; `CARRIED_RULES` classify it)."""
    return name.startswith(CARRIED_PREFIXES)


def text_name(name: str) -> str:
    """The text model's tensor name as cvt's runtime names it (``language_model.`` dropped)."""
    return name[len(TEXT_PREFIX):] if name.startswith(TEXT_PREFIX) else name


def carried_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every vision tower and projector tensor with its shape (module docstring), from config.json's
    ``vision_config`` (none without one: a text-only export); ValueError naming the key when one is
    missing or not a positive integer."""
    vc = config.get("vision_config")
    if vc is None:
        return {}
    if not isinstance(vc, Mapping):
        raise ValueError(f"vision_config = {vc!r}: must be an object")

    saved = "vt_hidden_size" not in vc  # transformers' key names (SAVED_VISION_KEYS)

    def get(key: str, cfg: Mapping[str, Any] = vc, where: str = "vision_config") -> int:
        if saved and cfg is vc:
            key = SAVED_VISION_KEYS.get(key, key)
        v = cfg.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{where}.{key} = {v!r}: must be a positive integer")
        return v

    h, inter, blocks, p = get("vt_hidden_size"), get("vt_intermediate_size"), get("vt_num_hidden_layers"), get("patch_size")
    m = config.get("projection_hidden_size", h) if saved else vc.get("mm_hidden_size", h)
    merge = vc.get("merge_kernel_size") or [2, 2]
    if not (isinstance(merge, (list, tuple)) and merge and all(isinstance(v, int) and v >= 1 for v in merge)):
        raise ValueError(f"vision_config.merge_kernel_size = {merge!r}: must be a list of positive integers")
    mk = m * math.prod(merge)
    text_h = get("hidden_size", config["text_config"], "text_config")
    out = {f"{VT}.patch_embed.proj.weight": (h, 3, p, p), f"{VT}.patch_embed.proj.bias": (h,),
           f"{VT}.patch_embed.pos_emb.weight": (get("init_pos_emb_height"), get("init_pos_emb_width"), h)}
    for b in range(blocks):
        q = f"{VT}.encoder.blocks.{b}"
        for norm in ("norm0", "norm1"):
            out[f"{q}.{norm}.weight"] = out[f"{q}.{norm}.bias"] = (h,)
        out.update({f"{q}.wqkv.weight": (3 * h, h), f"{q}.wqkv.bias": (3 * h,), f"{q}.wo.weight": (h, h),
                    f"{q}.wo.bias": (h,), f"{q}.mlp.fc0.weight": (inter, h), f"{q}.mlp.fc0.bias": (inter,),
                    f"{q}.mlp.fc1.weight": (h, inter), f"{q}.mlp.fc1.bias": (h,)})
    out[f"{VT}.encoder.final_layernorm.weight"] = out[f"{VT}.encoder.final_layernorm.bias"] = (h,)
    out.update({"mm_projector.pre_norm.weight": (m,), "mm_projector.pre_norm.bias": (m,),
                "mm_projector.proj.0.weight": (mk, mk), "mm_projector.proj.0.bias": (mk,),
                "mm_projector.proj.2.weight": (text_h, mk), "mm_projector.proj.2.bias": (text_h,)})
    return out


def wrap(text: ArchTable, config: Mapping[str, Any]) -> ArchTable:
    """The kimi_k25 table of a config.json whose text model is `text`'s: its rules and fused groups
    under ``language_model.``, the carried rules, shapes = prefixed text shapes + `carried_shapes`."""
    def prefixed(rule: Rule) -> Rule:
        return dataclasses.replace(rule, pattern=TEXT_PREFIX + rule.pattern)

    def param_shapes(cfg: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
        return {TEXT_PREFIX + n: s for n, s in text.param_shapes(cfg).items()} | carried_shapes(config)

    return ArchTable(
        name="kimi_k25",
        display=DISPLAY,
        attention=text.attention,
        kv_note=text.kv_note,
        calib_shared_inputs=text.calib_shared_inputs,
        calib_norm_inputs=text.calib_norm_inputs,
        model_types=("kimi_k25",),
        rules=tuple(map(prefixed, text.rules)) + CARRIED_RULES,
        config_keys=text.config_keys,
        param_shapes=param_shapes,
        explicit_defaults=text.explicit_defaults,
        fused_groups=tuple(tuple(TEXT_PREFIX + p for p in g) for g in text.fused_groups),
        config_checks=text.config_checks,
        text_prefix=TEXT_PREFIX,
        mtp_required=text.mtp_required,
        id_params=text.id_params,
        # the vision projector (carried byte-identical) writes image features into the text model's
        # residual stream: a rotation would have to turn its output too
        rotation="its vision projector writes the residual stream and is carried unchanged",
        saved_renames=SAVED_RENAMES,
        carried_ignore=CARRIED_IGNORE,
        consumer_prefixes=CONSUMER_PREFIXES,
        consumer_fused=CONSUMER_FUSED,
    )
