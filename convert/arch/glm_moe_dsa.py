"""GLM-5 / GLM-5.1 (model_type glm_moe_dsa): the DeepSeek-V3.2 table with GLM's sizes and indexer schedule.

Tensor names, roles, TP splits, FP8-ness and float defaults are DeepSeek-V3.2's
(`cvt.convert.arch.deepseek_v32`: MLA + a lightning indexer under ``self_attn.indexer``, MoE with
a sigmoid router and shared experts, ``first_k_dense_replace`` dense layers, MTP layers after the
decoder layers). What differs, per transformers 5's ``models/glm_moe_dsa`` (GlmMoeDsaConfig,
GlmMoeDsaIndexer, GlmMoeDsaAttention):

* the indexer rotates its rope dims interleaved (pairs (x0, x1), ...), like MLA; V3.2 rotates halves.
  vLLM reads ``indexer_rope_interleave`` (its default changed between versions), so every output
  config states it;
* ``indexer_types`` (per decoder layer, "full" or "shared"): a "shared" layer has no indexer tensors
  and reuses the previous full layer's top-k. Absent, transformers derives it from
  ``index_topk_pattern`` ("F"/"S" per layer) or ``index_topk_freq`` / ``index_skip_topk_offset``
  (layer i is full when max(i - offset + 1, 0) % freq == 0; freq 1 = every layer full, GLM-5);
* defaults (what an absent key means): 32 indexer heads, one routing group, GLM-5's sizes.

MTP layers (index >= num_hidden_layers) have no entry in indexer_types; they carry an indexer,
as DeepSeek-V3.2's do (GLM's ``index_share_for_mtp_iteration`` only changes how serving reuses it).
"""

from __future__ import annotations

from typing import Any, Mapping

from cvt.convert.arch import checks, deepseek_v3, deepseek_v32
from cvt.convert.arch.attention import SPARSE_MLA, SPARSE_MLA_SHARED, LayerAttention
from cvt.convert.arch.base import ArchTable

FULL, SHARED = "full", "shared"

# transformers' GlmMoeDsaConfig defaults for the keys whose reading differs between stacks
DEFAULTS = {**deepseek_v3.DEFAULTS, "n_group": 1, "topk_group": 1,
            "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32, "indexer_rope_interleave": True}


def indexer_types(cfg: Mapping[str, Any]) -> list[str]:
    """Per decoder layer "full" / "shared", as GlmMoeDsaConfig.__post_init__ derives it: `indexer_types`,
    else `index_topk_pattern`, else the `index_topk_freq` / `index_skip_topk_offset` schedule.
    ValueError naming the key for a value transformers could not read."""
    n = cfg["num_hidden_layers"]
    given = cfg.get("indexer_types")
    if given is not None:
        return list(given)
    pattern = cfg.get("index_topk_pattern")
    if pattern is not None:
        if isinstance(pattern, str):
            if set(pattern) - {"F", "S"}:
                raise ValueError(f"index_topk_pattern {pattern!r}: letters must be F (full) or S (shared)")
            return [FULL if c == "F" else SHARED for c in pattern]
        return list(pattern)
    freq, offset = cfg.get("index_topk_freq", 1), cfg.get("index_skip_topk_offset", 2)
    for key, v in (("index_topk_freq", freq), ("index_skip_topk_offset", offset)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{key} {v!r}: must be an integer")
    freq = max(freq, 1)
    return [FULL if max(i - offset + 1, 0) % freq == 0 else SHARED for i in range(n)]


def attention_kinds(cfg: Mapping[str, Any]) -> list:
    """Each decoder layer's attention kind: sparse MLA in the "full" layers (which cache their
    indexer's key), sparse MLA reusing a full layer's top-k in the "shared" ones."""
    return [SPARSE_MLA if t == FULL else SPARSE_MLA_SHARED for t in indexer_types(cfg)]


def param_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """DeepSeek-V3.2's weights without the indexer of "shared" layers (`indexer_types`)."""
    types = indexer_types(cfg)
    out = deepseek_v32.param_shapes({**cfg, "index_n_heads": cfg.get("index_n_heads") or DEFAULTS["index_n_heads"]})
    for i, kind in enumerate(types):
        if kind == SHARED:
            for name in [k for k in out if k.startswith(f"model.layers.{i}.self_attn.indexer.")]:
                del out[name]
    return out


def config_problems(cfg: Mapping[str, Any]) -> list[str]:
    """DeepSeek-V3.2's checks (`cvt.convert.arch.checks.deepseek_v32`) plus the indexer schedule: one
    "full" or "shared" per decoder layer, layer 0 full (a shared layer reuses an earlier full one's top-k)."""
    out = checks.deepseek_v32(cfg)
    n = cfg.get("num_hidden_layers")
    if not (isinstance(n, int) and not isinstance(n, bool) and n >= 1):
        return out
    try:
        types = indexer_types(cfg)
    except ValueError as exc:
        return out + [f"config.json {exc}"]
    if len(types) != n or set(types) - {FULL, SHARED} or types[0] != FULL:
        out.append(f"config.json indexer_types {types!r}: must be {n} (num_hidden_layers) of 'full' / 'shared', "
                   "the first 'full'")
    return out


TABLE = ArchTable(
    name="glm_moe_dsa",
    display="GLM-5",
    attention=LayerAttention((SPARSE_MLA, SPARSE_MLA_SHARED), attention_kinds),
    model_types=("glm_moe_dsa",),
    param_shapes=param_shapes,
    explicit_defaults=DEFAULTS,
    config_checks=config_problems,
    fused_groups=deepseek_v32.TABLE.fused_groups,
    config_keys=deepseek_v32.TABLE.config_keys,
    calib_shared_inputs=deepseek_v32.TABLE.calib_shared_inputs,
    calib_norm_inputs=deepseek_v32.TABLE.calib_norm_inputs,
    rotation=deepseek_v32.TABLE.rotation,  # a shared layer lacks the indexer: its readers are absent
    rules=deepseek_v32.TABLE.rules,
)
