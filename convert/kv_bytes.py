"""KV-cache bytes per rank for the memory plan (`cvt.convert.memory_plan.memory_plan`), from config.json alone.

Each decoder layer's cache is its attention kind's (`cvt.convert.arch.attention`, declared by the
architecture table; MTP layers excluded): MLA caches ``kv_lora_rank + qk_rope_head_dim`` values
(whole on every TP rank: the latent has no heads), sparse MLA adds its lightning indexer's key
(``index_head_dim``, bf16) where the layer runs its own indexer (DeepSeek-V3.2: every layer;
GLM-5: its "full" ones), GQA caches ``2 x kv_heads / tp x head_dim``, DeepSeek-V4's kinds a window
and compressed entries per sequence (the table's `ArchTable.kv_note` says so). bf16, or int8
under w8a8c8 where the kind quantizes its cache (MLA: the latent only; the rope key stays bf16),
whose scale tensors every rank holds. Attention DP splits the tokens in flight evenly over the
dp ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from cvt.convert.arch import ArchSpec
from cvt.convert.arch.attention import site_bytes
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
    """The KV cache of `kv_tokens` over the world (module doc): each layer's kind counts its own
    (`AttentionKind.cache_bytes`); int8 under a C8 scheme (DeepSeek-V3.2 on Ascend: the indexer's C8)."""
    cfg = arch.config
    kinds = arch.attention()
    family = arch.table.attention.main
    n_layers = cfg["num_hidden_layers"]
    int8_kv = getattr(sch, "kv_cache", None) == "int8"  # asked for; held where the kind quantizes its cache
    from cvt.qtensor import indexer_c8

    index_c8 = int8_kv and indexer_c8.applies(cfg, disk.fmt)  # V3.2 on Ascend: the indexer's C8, not the MLA's
    scale_bytes = None
    if index_c8:  # q_rot / k_rot float32 [Di, Di] per decoder layer, replicated
        scale_bytes = sum(t.numel() * 4 for t in indexer_c8.rotation_tensors(cfg).values())
    elif int8_kv and family.kv_quant is not None:  # the KV-cache scale tensors of cvt.runtime.kv_cache, replicated
        scale_bytes = site_bytes(cfg, family)
    tokens = -(-kv_tokens // layout.dp)
    kv_rank = sum(k.cache_bytes(cfg, tokens, layout.tp, int8_kv, index_c8) for k in kinds)
    index_layers = sum(k.indexer_key for k in kinds)
    index_dim = cfg.get("index_head_dim", 128) if index_layers else 0
    mla = family.kv_quant is not None and family.kv_quant.latent
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_what = arch.table.kv_note(cfg) if arch.table.kv_note is not None else None
    line = (
        f"KV cache: {kv_tokens} tokens in flight over the world, split evenly over dp {layout.dp} "
        f"({tokens} per rank); " + (
            f"{kv_what}, counted as one sequence per rank" if kv_what else
            f"MLA latent {cfg['kv_lora_rank']} + rope {cfg['qk_rope_head_dim']}"
            + (f" + indexer key {index_dim} ({'int8 + a float16 scale' if index_c8 else 'bf16'}"
               + (f", {index_layers} full-indexer layers" if index_layers != n_layers else "") + ")" if index_dim else "")
            + " per token and layer, whole on every TP rank" if mla else f"GQA k+v {kv_heads} KV heads / tp x {head_dim}")
        + f"; {'int8' if int8_kv and family.kv_quant is not None and not index_c8 else 'bf16'}; {n_layers} decoder layers (MTP layers not cached)")
    return KVCache(kv_rank, scale_bytes, line)
