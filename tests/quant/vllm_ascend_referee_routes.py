"""load_weights name routing for the referee (vLLM 0.23, plus vllm-ascend's patches): where each
model's ``load_weights`` sends a checkpoint tensor name, as a verdict ("load" to a (param, shard,
expert) slot, "skip", "drop", "keyerror", "valueerror", "carried") the referee turns into problems.
"""

from __future__ import annotations

import re

from cvt.tests.quant.vllm_ascend_referee_layouts import _mtp_layers, _mtp_rewrite


_ROTARY_UNUSED = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")

_KV_SCALE_PATTERNS = [
    (r"\.self_attn\.([kv])_proj\.([kv])_scale$", r".self_attn.{attn}.\2_scale"),
    (r"\.self_attn\.qkv_proj\.([kv])_scale$", r".self_attn.attn.\1_scale"),
    (r"\.self_attn\.qkqkv_proj\.([kv])_scale$", r".self_attn.attn.\1_scale"),
    (r"\.mixer\.[kv]_proj\.([kv])_scale$", r".mixer.attn.\1_scale"),
    (r"\.self_attn\.q\.scale$", r".self_attn.attn.q_scale"),
    (r"\.self_attn\.([kv])_cache\.scale$", r".self_attn.attn.\1_scale"),
    (r"\.([qkv])_scale$", r".attn.\1_scale"),
    (r"\.([qkv])_zero_point$", r".attn.\1_zero_point"),
]
_KV_SCALE_ENDINGS = (".k_scale", ".v_scale", ".q_scale", ".k_zero_point", ".v_zero_point", ".q_zero_point",
                     ".q.scale", ".k_cache.scale", ".v_cache.scale")


def _vllm_remap_kv_scale(name: str, params: set[str]) -> str | None:
    """vllm.model_executor.model_loader.weight_utils.maybe_remap_kv_scale_name."""
    if name in params:
        return name
    if name.endswith(".kv_scale"):
        r = name.replace(".kv_scale", ".attn.k_scale")
        return r if r in params else None
    attn = "mla_attn.mla_attn" if any("mla_attn" in k for k in params) else "attn"
    if name.endswith(_KV_SCALE_ENDINGS):
        for pat, rep in _KV_SCALE_PATTERNS:
            if re.search(pat, name):
                r = re.sub(pat, rep.replace("{attn}", attn), name)
                return r if r in params else None
    return name


_FA_NAMES = ("fa_q.scale", "fa_k.scale", "fa_v.scale", "fa_q.offset", "fa_k.offset", "fa_v.offset",
             "indexer.q_rot", "indexer.k_rot")


def _va_remap_deepseek(name: str, params: set[str]) -> str | None:
    """vllm-ascend patch/worker/patch_weight_utils.py: deepseek_v2's remap, FA names to mla_attn."""
    name = _vllm_remap_kv_scale(name, params)
    if name is None:
        return None
    for s in _FA_NAMES:
        if name.endswith(s):
            r = name.replace(s, f"mla_attn.mla_attn.{s}")
            return r if r in params else r.replace(".mla_attn", "")
    return name


def _top_level(name: str, params: set[str], tied: bool):
    """AutoWeightsLoader at the CausalLM: ``model.`` goes to the model's load_weights, ``lm_head.`` to
    the head's parameters, anything else is a ValueError."""
    if any(s in name for s in _ROTARY_UNUSED):
        return "skip", None
    if name.startswith("model."):
        return None
    if name.startswith("lm_head."):
        if tied:
            return "skip", None
        return ("load", (name, None, None)) if name in params else ("valueerror", name)
    return "valueerror", name


_EXPERT_RE = re.compile(r"experts\.(\d+)\.(gate_proj|down_proj|up_proj)\.")
_EXPERT_SHARDS = {"gate_proj": ("experts.w13_", "w1"), "down_proj": ("experts.w2_", "w2"),
                  "up_proj": ("experts.w13_", "w3")}


def _experts(name: str, params: set[str], num_experts: int):
    """FusedMoE.make_expert_params_mapping(gate_proj, down_proj, up_proj) lookup: the checkpoint's
    ``experts.{e}.{gate,up,down}_proj.`` (e < num_experts) becomes ``experts.w13_`` / ``experts.w2_``."""
    for mo in _EXPERT_RE.finditer(name):
        e = int(mo.group(1))
        if e < num_experts and mo.group(1) == str(e):
            pn, sid = _EXPERT_SHARDS[mo.group(2)]
            return name.replace(mo.group(0), pn, 1), sid, e
    return None


def _route_deepseek(name: str, params: set[str], c: dict, cfg):
    """DeepseekV2ForCausalLM: AutoWeightsLoader, then DeepseekV2Model.load_weights (deepseek_v2.py; MLA,
    no ROCm shared-expert fusion), which skips the spec-decode (MTP) layers."""
    top = _top_level(name, params, False)
    if top is not None:
        return top
    if any(name.startswith(f"model.layers.{i}.") for i in _mtp_layers(c)):
        return "skip", None  # get_spec_layer_idx_from_weight_name: the main model skips it
    return _deepseek_body(name, params, c)


_KIMI_CARRIED = ("vision_tower.", "mm_projector.")


def _route_kimi_k25(name: str, params: set[str], c: dict, cfg):
    """KimiK25ForConditionalGeneration.load_weights (vLLM models/kimi_k25.py): spec layers skipped,
    ``language_model.lm_head`` -> ``lm_head``, ``language_model.model`` -> ``language_model``, then the
    DeepseekV2 stacked / expert / default routing.  The vision tower and projector (default loading
    into MoonViT / KimiK25MultiModalProjector, not modelled here) must be the float tensors cvt
    carries: an integer one is reported, a float one accepted."""
    t = c["text_config"]
    if "rotary_emb.inv_freq" in name:
        return "skip", None
    if name.startswith(_KIMI_CARRIED):
        return "carried", name
    if any(f"model.layers.{i}." in name for i in _mtp_layers(t)):
        return "skip", None
    name = name.replace("language_model.lm_head", "lm_head").replace("language_model.model", "language_model")
    if name.startswith("lm_head."):
        return ("load", (name, None, None)) if name in params else ("keyerror", name)
    if not name.startswith("language_model."):
        return "keyerror", name  # params_dict[name]
    return _deepseek_body(name, params, t)


def _route_deepseek_mtp(name: str, params: set[str], c: dict, cfg):
    """DeepSeekMTP.load_weights (deepseek_mtp.py; vllm-ascend's AscendDeepSeekMTP only adds a rot.weight
    case): only spec-layer names, rewritten by _rewrite_spec_layer_name, then the same stacked /
    expert / remap routing as the main model; a spec layer after the first skips its shared
    top-level weights (embed_tokens)."""
    if "rotary_emb.inv_freq" in name:
        return "skip", None
    spec = next((i for i in _mtp_layers(c) if name.startswith(f"model.layers.{i}.")), None)
    if spec is None:
        return "skip", None  # the main model's
    name = _mtp_rewrite(c, name)
    r = _deepseek_body(name, params, c)
    if r[0] in ("keyerror", "load") and spec != _mtp_layers(c)[0] and ".layers" not in (
            r[1][0] if isinstance(r[1], tuple) else r[1]):
        return "skip", None
    return r


def _deepseek_body(name: str, params: set[str], c: dict):
    stacked = [("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1),
               ("wk_weights_proj", "wk", 0), ("wk_weights_proj", "weights_proj", 1),
               ("fused_qkv_a_proj", "q_a_proj", 0), ("fused_qkv_a_proj", "kv_a_proj_with_mqa", 1)]
    for pn, wn, sid in stacked:
        if wn not in name:
            continue
        if "mlp.experts." in name and name not in params:
            continue
        mapped = name.replace(wn, pn)
        if pn == "fused_qkv_a_proj" and mapped not in params:
            continue
        name = mapped
        if name.endswith(".bias") and name not in params:
            return "drop", name
        if name not in params:
            return "keyerror", name
        return "load", (name, sid, None)
    ex = _experts(name, params, c.get("n_routed_experts") or 0)
    if ex is not None:
        mapped, sid, e = ex
        if mapped not in params:
            return "keyerror", mapped
        return "load", (mapped, sid, e)
    if name.endswith(".bias") and name not in params:
        return "drop", name
    remapped = _va_remap_deepseek(name, params)
    if remapped is None:
        return "drop", name
    if remapped not in params:
        return "keyerror", remapped
    return "load", (remapped, None, None)


# (fused param, checkpoint name, shard id): the stacked_params_mapping of qwen3.py and qwen3_moe.py
_QWEN3_STACKED = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
                  ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))


_C8_SUFFIXES = ((".k_proj.kv_cache_scale", ".attn.k_cache_scale"), (".k_proj.kv_cache_offset", ".attn.k_cache_offset"),
                (".v_proj.kv_cache_scale", ".attn.v_cache_scale"), (".v_proj.kv_cache_offset", ".attn.v_cache_offset"))


def _c8_cache_name(cfg, name: str) -> str | None:
    """The vLLM name of a C8 scale / offset: 0.23's AscendModelSlimConfig.get_cache_scale; on main (no
    get_cache_scale) the C8 part of get_cache_scale_mapper's suffix map, which vLLM applies to every
    weight name before load_weights."""
    if hasattr(cfg, "get_cache_scale"):
        return cfg.get_cache_scale(name)
    if getattr(cfg, "enable_c8_quant", False):
        for src, dst in _C8_SUFFIXES:
            if name.endswith(src):
                return name[: -len(src)] + dst
    return None


def _stacked_rename(name: str, params: set[str], ignore: tuple[str, ...]):
    """A Qwen3 / Qwen3-MoE checkpoint name just renamed to its fused (stacked) parameter: ("drop", name)
    where vLLM drops it (an ``ignore`` suffix with no such parameter, or a scale that
    maybe_remap_kv_scale_name maps to nothing), else (None, the name to look up)."""
    if name.endswith(ignore) and name not in params:
        return "drop", name
    if name.endswith("scale"):
        r = _vllm_remap_kv_scale(name, params)
        if r is None:
            return "drop", name
        name = r
    return None, name


def _route_qwen3(name: str, params: set[str], c: dict, cfg):
    """Qwen3ForCausalLM.load_weights as patched by vllm-ascend (patch_gqa_c8: C8 scales through
    get_cache_scale first), then Qwen2Model.load_weights (qwen2.py)."""
    top = _top_level(name, params, bool(c.get("tie_word_embeddings", False)))
    if top is not None:
        return top
    scale_name = _c8_cache_name(cfg, name)
    if scale_name is not None:
        return ("load", (scale_name, None, None)) if scale_name in params else ("drop", scale_name)
    for pn, wn, sid in _QWEN3_STACKED:
        if wn not in name:
            continue
        verdict, name = _stacked_rename(name.replace(wn, pn), params, (".bias",))
        if verdict is not None:
            return verdict, name
        if name not in params:
            return "keyerror", name
        return "load", (name, sid, None)
    if name.endswith(".bias") and name not in params:
        return "drop", name
    r = _vllm_remap_kv_scale(name, params)
    if r is None or r not in params:
        return "drop", r or name
    return "load", (r, None, None)


_QWEN3_MOE_IGNORE = (".bias", "_bias", ".weight_scale", "_weight_scale", ".input_scale", "_input_scale")


def _route_qwen3_moe(name: str, params: set[str], c: dict, cfg):
    """Qwen3MoeModel.load_weights (qwen3_moe.py); vllm-ascend has no C8 patch for it."""
    top = _top_level(name, params, False)  # AutoWeightsLoader(self): no skip_prefixes
    if top is not None:
        return top
    if "scale" in name or "zero_point" in name:
        r = _vllm_remap_kv_scale(name, params)
        if r is None:
            return "drop", name
        name = r
    for pn, wn, sid in _QWEN3_STACKED:
        if wn not in name:
            continue
        if "mlp.experts" in name:
            continue
        verdict, name = _stacked_rename(name.replace(wn, pn), params, _QWEN3_MOE_IGNORE)
        if verdict is not None:
            return verdict, name
        if name not in params:
            continue  # vLLM: `continue` with the renamed name (it ends up dropped below)
        return "load", (name, sid, None)
    ex = _experts(name, params, c.get("num_experts") or 0)
    if ex is not None:
        mapped, sid, e = ex
        if mapped.endswith(_QWEN3_MOE_IGNORE) and mapped not in params:
            return "drop", mapped
        if mapped not in params:
            return "keyerror", mapped
        return "load", (mapped, sid, e)
    if name.endswith(_QWEN3_MOE_IGNORE) and name not in params:
        return "drop", name
    if name not in params:
        return "drop", name
    return "load", (name, None, None)
