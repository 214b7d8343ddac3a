"""config.json values every reader of a model needs to be sane: one check for writers and runtime.

Each architecture table names its check (`ArchTable.config_checks`: `deepseek`, `deepseek_v32`,
`qwen3` here); `cvt.convert.arch.config_problems(cfg)` returns one line per value that no model can have (empty: none): the
writers (fp8-to-bf16, quantize, shard, through `cvt.convert.validate.survey`) refuse before
writing, `cvt inspect` lists them, and the runtime (`ModelArgs.from_config`) refuses the same
config, so that nothing a writer accepts is refused by `cvt run` later. Checked:

* ``rms_norm_eps``: a finite number > 0 (a negative eps makes RMSNorm's sqrt NaN);
* ``num_experts_per_tok`` within 1..experts of a MoE model; ``first_k_dense_replace`` no
  more than the decoder layers;
* DeepSeek routing groups: ``n_group`` divides the routed experts leaving >= 2 per group,
  ``topk_group`` in 1..n_group, top-k within the experts of the kept groups;
* DeepSeek-V3.2's indexer sizes (``index_topk``, ``index_n_heads``, ``index_head_dim``):
  positive integers;
* DeepSeek-V4 (`deepseek_v4`): what its runtime implements, by key: compress ratios 0 / 4 /
  128 only (``compress_ratios``, ``layer_types``, ``compress_rates``), one KV head, one
  shared expert, hash layers first, ``scoring_func`` / ``expert_dtype`` among the known ones;
* a rope scaling ``factor``: a finite number >= 1 (transformers' rule for every rope type).

Counts that are not integers at all are `ArchSpec`'s (`cvt.convert.arch.base._count`).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from cvt.convert.fp4 import EXPERT_DTYPES


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _count(cfg: Mapping[str, Any], key: str) -> int | None:
    v = cfg.get(key)
    return v if _is_int(v) else None


def _common(cfg: Mapping[str, Any], experts_key: str | None) -> list[str]:
    out = []
    if "rms_norm_eps" in cfg:
        eps = cfg["rms_norm_eps"]
        if not (_is_number(eps) and eps > 0):
            out.append(f"config.json rms_norm_eps = {eps!r}: must be a finite number > 0")
    experts = _count(cfg, experts_key) if experts_key else None
    k = cfg.get("num_experts_per_tok")
    if experts and k is not None and not (_is_int(k) and 1 <= k <= experts):
        out.append(f"config.json num_experts_per_tok = {k!r}: must be an integer in 1..{experts} "
                   f"({experts_key} = {experts})")
    for key in ("rope_scaling", "rope_parameters"):
        p = cfg.get(key)
        if isinstance(p, Mapping) and "factor" in p and p["factor"] is not None:
            f = p["factor"]
            if not (_is_number(f) and f >= 1):
                out.append(f"config.json {key}.factor = {f!r}: must be a finite number >= 1")
    return out


def deepseek(cfg: Mapping[str, Any]) -> list[str]:
    out = _common(cfg, "n_routed_experts")
    layers, dense = _count(cfg, "num_hidden_layers"), cfg.get("first_k_dense_replace")
    if layers is not None and _is_int(dense) and dense > layers:
        out.append(f"config.json first_k_dense_replace = {dense}: past the model's {layers} decoder layers "
                   "(num_hidden_layers)")
    e = _count(cfg, "n_routed_experts")
    if e:
        g, tg, k = cfg.get("n_group"), cfg.get("topk_group"), cfg.get("num_experts_per_tok")
        g = 1 if g is None else g
        tg = 1 if tg is None else tg
        if not (_is_int(g) and g >= 1 and e % g == 0 and (g == 1 or e // g >= 2)):
            out.append(f"config.json n_group = {g!r}: must divide n_routed_experts ({e}) leaving >= 2 experts "
                       "per group")
        elif not (_is_int(tg) and 1 <= tg <= g):
            out.append(f"config.json topk_group = {tg!r}: must be an integer in 1..n_group ({g})")
        elif _is_int(k) and e >= k > tg * (e // g):
            out.append(f"config.json num_experts_per_tok = {k}: more than the {tg * (e // g)} experts of the "
                       f"topk_group ({tg}) kept groups")
    return out


def deepseek_v32(cfg: Mapping[str, Any]) -> list[str]:
    out = deepseek(cfg)
    for key in ("index_topk", "index_n_heads", "index_head_dim"):
        if key in cfg and not (_is_int(cfg[key]) and cfg[key] >= 1):
            out.append(f"config.json {key} = {cfg[key]!r}: must be a positive integer")
    return out


def qwen3(cfg: Mapping[str, Any]) -> list[str]:
    return _common(cfg, "num_experts")


V4_RATIOS = (0, 4, 128)  # transformers' _COMPRESS_RATIO_TO_LAYER_TYPE: what cvt's V4 runtime implements
V4_LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
V4_SCORING = ("sqrtsoftplus", "sigmoid")  # transformers' DeepseekV4 routers (ACT2FN has no softmax)


def deepseek_v4(cfg: Mapping[str, Any]) -> list[str]:
    """DeepSeek-V4: the common checks, then what its runtime implements, by key."""
    out = _common(cfg, "n_routed_experts")
    layers = _count(cfg, "num_hidden_layers")
    for key in ("head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "qk_rope_head_dim", "hc_mult",
                "hc_sinkhorn_iters", "sliding_window", "index_n_heads", "index_head_dim", "index_topk",
                "moe_intermediate_size"):
        if key in cfg and not (_is_int(cfg[key]) and cfg[key] >= 1):
            out.append(f"config.json {key} = {cfg[key]!r}: must be a positive integer")
    heads, dim, rope, groups = (cfg.get(k) for k in ("num_attention_heads", "head_dim", "qk_rope_head_dim", "o_groups"))
    if _is_int(heads) and _is_int(groups) and groups >= 1 and heads % groups:
        out.append(f"config.json o_groups = {groups}: must divide num_attention_heads ({heads})")
    if _is_int(dim) and _is_int(rope) and not (rope < dim and rope % 2 == 0):
        out.append(f"config.json qk_rope_head_dim = {rope}: must be even and below head_dim ({dim})")
    kv = cfg.get("num_key_value_heads")
    if kv is not None and kv != 1:
        out.append(f"config.json num_key_value_heads = {kv!r}: DeepSeek-V4 attention has one shared KV head (1)")
    if cfg.get("n_shared_experts") is not None and cfg["n_shared_experts"] != 1:
        out.append(f"config.json n_shared_experts = {cfg['n_shared_experts']!r}: DeepSeek-V4 has exactly 1 "
                   "(the official inference/model.py asserts it)")
    sf = cfg.get("scoring_func")
    if sf is not None and sf not in V4_SCORING:
        out.append(f"config.json scoring_func = {sf!r}: must be one of {', '.join(V4_SCORING)}")
    ed = cfg.get("expert_dtype")
    if ed is not None and ed not in EXPERT_DTYPES:
        out.append(f"config.json expert_dtype = {ed!r}: must be one of {', '.join(EXPERT_DTYPES)} or absent")
    sl = cfg.get("swiglu_limit")
    if sl is not None and not (_is_number(sl) and sl >= 0):
        out.append(f"config.json swiglu_limit = {sl!r}: must be a finite number >= 0 (0: no clamp)")
    ratios = cfg.get("compress_ratios")
    if ratios is not None:
        if not isinstance(ratios, list) or any(r not in V4_RATIOS or isinstance(r, bool) for r in ratios):
            out.append(f"config.json compress_ratios = {ratios!r}: must be a list of "
                       f"{', '.join(map(str, V4_RATIOS))} (sliding window, CSA, HCA)")
        elif layers is not None and len(ratios) < layers:
            out.append(f"config.json compress_ratios has {len(ratios)} entries: one per decoder layer "
                       f"(num_hidden_layers = {layers}) is needed")
    for key, allowed in (("layer_types", V4_LAYER_TYPES), ("mlp_layer_types", ("hash_moe", "moe"))):
        types = cfg.get(key)
        if types is None:
            continue
        if not isinstance(types, list) or any(t not in allowed for t in types):
            out.append(f"config.json {key} = {types!r}: entries must be one of {', '.join(allowed)}")
        elif layers is not None and len(types) != layers:
            out.append(f"config.json {key} has {len(types)} entries, num_hidden_layers = {layers}")
        elif key == "mlp_layer_types" and types != sorted(types, key=lambda t: t != "hash_moe"):
            out.append(f"config.json {key}: the hash_moe layers must come first (tid2eid routes the first layers)")
    rates = cfg.get("compress_rates")
    if rates is not None:
        ok = isinstance(rates, Mapping) and all(
            k in V4_LAYER_TYPES[1:] and dict(zip(V4_LAYER_TYPES, V4_RATIOS))[k] == v for k, v in rates.items())
        if not ok:
            out.append(f"config.json compress_rates = {rates!r}: cvt implements compressed_sparse_attention at 4 and "
                       "heavily_compressed_attention at 128 only")
    nh = cfg.get("num_hash_layers")
    if nh is not None and not (_is_int(nh) and 0 <= nh <= (layers if layers is not None else nh)):
        out.append(f"config.json num_hash_layers = {nh!r}: must be an integer in 0..num_hidden_layers ({layers})")
    return out


QWEN3_5_LAYER_TYPES = ("linear_attention", "full_attention")  # transformers' Qwen3_5MoeDecoderLayer.block_type


def _layer_types(cfg: Mapping[str, Any], known: tuple[str, ...]) -> list[str]:
    """config.json ``layer_types``: each one of `known`, one per decoder layer (absent: fine)."""
    n, types = cfg.get("num_hidden_layers"), cfg.get("layer_types")
    if types is None:
        return []
    bad = [t for t in types if t not in known] if isinstance(types, list) else [types]
    if bad:
        return [f"config.json layer_types has {bad[0]!r}: each must be one of {', '.join(known)}"]
    if _is_int(n) and len(types) != n:
        return [f"config.json layer_types has {len(types)} entries: must be {n} (num_hidden_layers)"]
    return []


def qwen3_5(cfg: Mapping[str, Any]) -> list[str]:
    """Qwen3.5 / Qwen3.5-MoE: one known token mixer per decoder layer, value heads a multiple of key
    heads (each key head serves Hv / Hk value heads), query heads a multiple of KV heads."""
    out = _common(cfg, "num_experts")
    out += _layer_types(cfg, QWEN3_5_LAYER_TYPES)
    pairs = (("linear_num_value_heads", "linear_num_key_heads"), ("num_attention_heads", "num_key_value_heads"))
    for many, few in pairs:
        a, b = _count(cfg, many), _count(cfg, few)
        if a and b and a % b:
            out.append(f"config.json {many} = {a} is not a multiple of {few} = {b}")
    return out


GPT_OSS_LAYER_TYPES = ("sliding_attention", "full_attention")  # transformers' GptOssModel's mask kinds


def gpt_oss(cfg: Mapping[str, Any]) -> list[str]:
    """gpt-oss: one known attention per decoder layer, a positive ``sliding_window`` when a layer
    slides, query heads a multiple of KV heads, the swiglu clamp a positive number."""
    out = _common(cfg, "num_local_experts")
    types = cfg.get("layer_types")
    out += _layer_types(cfg, GPT_OSS_LAYER_TYPES)
    slides = types is None or (isinstance(types, list) and "sliding_attention" in types)
    w = cfg.get("sliding_window", 128)
    if slides and not (_is_int(w) and w >= 1):
        out.append(f"config.json sliding_window = {w!r}: must be a positive integer (sliding_attention layers)")
    a, b = _count(cfg, "num_attention_heads"), _count(cfg, "num_key_value_heads")
    if a and b and a % b:
        out.append(f"config.json num_attention_heads = {a} is not a multiple of num_key_value_heads = {b}")
    for key in ("swiglu_limit", "swiglu_alpha"):
        if key in cfg and not (_is_number(cfg[key]) and cfg[key] > 0):
            out.append(f"config.json {key} = {cfg[key]!r}: must be a finite number > 0")
    return out
