"""KV-cache bytes per rank for the memory plan (`cvt.convert.memory_plan.memory_plan`), from config.json alone.

Per token and decoder layer (MTP layers excluded): MLA caches ``kv_lora_rank + qk_rope_head_dim``
values (whole on every TP rank: the latent has no heads), plus a lightning indexer's key
(``index_head_dim``, bf16) in the layers the architecture table names (`ArchTable.indexer_layers`);
GQA caches ``2 x kv_heads / tp x head_dim``; a family that sizes its own cache says so in its table
(`ArchTable.kv_cache`: DeepSeek-V4). bf16, or int8 under w8a8c8 (MLA: the latent only; the rope key
stays bf16), whose scale tensors every rank holds. Attention DP splits the tokens in flight evenly
over the dp ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cvt.convert.arch import ArchSpec
from cvt.convert.placement import Layout
from cvt.convert.disk_bytes import DiskBytes


@dataclass(frozen=True)
class KVCache:
    """One rank's KV cache: its bytes, the replicated scale tensors of an int8 cache (None
    without), and the assumption line that says how it was counted."""

    per_rank: int
    scale_bytes: int | None
    assumption: str


def kv_cache_bytes(arch: ArchSpec, layout: Layout, sch, disk: DiskBytes | None, kv_tokens: int) -> KVCache:
    """The KV cache of `kv_tokens` over the world (module doc): MLA's latent + rope key (plus an
    indexer key in the table's `indexer_layers`), GQA's k and v, or the family's own count
    (`ArchTable.kv_cache`); int8 under a C8 scheme (DeepSeek-V3.2 on Ascend: the indexer's C8)."""
    cfg = arch.config
    mla = "kv_lora_rank" in cfg
    n_layers = cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    int8_kv = getattr(sch, "kv_cache", None) == "int8"
    from cvt.qtensor import indexer_c8

    index_c8 = int8_kv and indexer_c8.applies(cfg, disk.fmt)  # V3.2 on Ascend: the indexer's C8, not the MLA's
    scale_bytes = None
    if index_c8:  # q_rot / k_rot float32 [Di, Di] per decoder layer, replicated
        scale_bytes = sum(t.numel() * 4 for t in indexer_c8.rotation_tensors(cfg).values())
    elif int8_kv:  # the KV-cache scale tensors of cvt.runtime.kv_cache, replicated
        from cvt.qtensor.kv_tensors import kv_tensor_specs_for_config

        scale_bytes = sum(math.prod(sp.shape) * sp.dtype.itemsize for sp in kv_tensor_specs_for_config(cfg))
    elem = 1 if int8_kv and not index_c8 else 2
    # MLA: latent int8 under C8 (FAKQuant), rope key always bf16; GQA: k and v
    # a lightning indexer caches its own key (index_head_dim, bf16 in cvt's runtime; int8 + a float16
    # scale under the indexer C8) in the layers the table names (DeepSeek-V3.2: every one; GLM-5: its
    # "full" indexer layers)
    indexed = arch.table.indexer_layers
    index_dim = cfg.get("index_head_dim", 128) if indexed is not None else 0
    index_layers = indexed(cfg) if indexed is not None else n_layers
    index_bytes = index_dim + 2 if index_c8 else index_dim * 2
    per_token = (n_layers * (cfg["kv_lora_rank"] * elem + cfg["qk_rope_head_dim"] * 2) + index_layers * index_bytes
                 if mla else n_layers * 2 * -(-kv_heads // layout.tp) * head_dim * elem)
    kv_rank = -(-kv_tokens // layout.dp) * per_token
    kv_what = None
    if arch.table.kv_cache is not None:  # the family counts its own cache (one sequence per rank)
        kv_rank, kv_what = arch.table.kv_cache(cfg, -(-kv_tokens // layout.dp), 2)
    line = (
        f"KV cache: {kv_tokens} tokens in flight over the world, split evenly over dp {layout.dp} "
        f"({-(-kv_tokens // layout.dp)} per rank); " + (
            f"{kv_what}, counted as one sequence per rank" if kv_what else
            f"MLA latent {cfg['kv_lora_rank']} + rope {cfg['qk_rope_head_dim']}"
            + (f" + indexer key {index_dim} ({'int8 + a float16 scale' if index_c8 else 'bf16'}"
               + (f", {index_layers} full-indexer layers" if index_layers != n_layers else "") + ")" if index_dim else "")
            + " per token and layer, whole on every TP rank" if mla else f"GQA k+v {kv_heads} KV heads / tp x {head_dim}")
        + f"; {'int8' if int8_kv and not index_c8 else 'bf16'}; {n_layers} decoder layers (MTP layers not cached)")
    return KVCache(kv_rank, scale_bytes, line)
