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
* a rope scaling ``factor``: a finite number >= 1 (transformers' rule for every rope type).

Counts that are not integers at all are `ArchSpec`'s (`cvt.convert.arch.base._count`).
"""

from __future__ import annotations

import math
from typing import Any, Mapping


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
