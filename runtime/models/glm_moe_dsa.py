"""GLM-5 / GLM-5.1 (model_type glm_moe_dsa): DeepSeek-V3.2's sparse attention with GLM's indexer settings.

The math is `deepseek_v32`'s (absorbed MLA, lightning indexer, noaux_tc MoE, shared experts), which
transformers 5's GlmMoeDsaForCausalLM (the tests' referee) computes, with two differences read from
config.json (`cvt.convert.arch.glm_moe_dsa`):

* the indexer rotates q_pe / k_pe interleaved (``indexer_rope_interleave``, true: GlmMoeDsaIndexer's
  apply_rotary_pos_emb_interleave), where V3.2 rotates halves;
* ``indexer_types``: a "shared" decoder layer has no indexer and attends the keys the last "full"
  layer kept, for the same queries (GlmMoeDsaAttention's ``prev_topk_indices``). Its cache is the plain
  MLA cache; full layers keep `deepseek_v32.DSACache` (MLA latent + indexer keys).

Shapes are V3.2's (`deepseek_v32` module docstring); defaults are GlmMoeDsaConfig's (GLM-5's sizes).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from cvt.convert.arch.glm_moe_dsa import DEFAULTS, SHARED, indexer_types
from cvt.runtime.models import deepseek_v32 as v32
from cvt.runtime.models.base import ConfigError


@dataclasses.dataclass
class Args(v32.Args):
    """config.json of a GLM-5 checkpoint: `deepseek_v32.Args` with GlmMoeDsaConfig's defaults plus the
    indexer schedule keys (see the module docstring)."""

    family: ClassVar[str] = "glm_moe_dsa"
    # head_dim: transformers derives it (= qk_rope_head_dim); index_share_for_mtp_iteration: how
    # serving reuses the indexer across MTP steps (MTP layers are not run here)
    ignored: ClassVar[frozenset[str]] = frozenset({"head_dim", "index_share_for_mtp_iteration"})

    vocab_size: int = 154880
    hidden_size: int = 6144
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 78
    num_attention_heads: int = 64
    q_lora_rank: int | None = 2048
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 192
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    n_routed_experts: int = 256
    n_shared_experts: int | None = 1
    num_experts_per_tok: int = 8
    n_group: int | None = DEFAULTS["n_group"]
    topk_group: int | None = DEFAULTS["topk_group"]
    first_k_dense_replace: int | None = 3
    max_position_embeddings: int = 202752
    rms_norm_eps: float = 1e-5
    index_n_heads: int = DEFAULTS["index_n_heads"]
    index_head_dim: int = DEFAULTS["index_head_dim"]
    index_topk: int = DEFAULTS["index_topk"]
    indexer_rope_interleave: bool = DEFAULTS["indexer_rope_interleave"]
    indexer_types: list | None = None
    index_topk_pattern: str | list | None = None
    index_topk_freq: int = 1
    index_skip_topk_offset: int = 2

    def layer_indexers(self) -> list[str]:
        """"full" / "shared" per decoder layer (`cvt.convert.arch.glm_moe_dsa.indexer_types`)."""
        try:
            return indexer_types(dataclasses.asdict(self))
        except ValueError as exc:
            raise ConfigError(f"config.json {exc}") from None

    def validate(self) -> None:
        super().validate()
        if self.indexer_rope_interleave is not True:
            raise ConfigError(f"config.json indexer_rope_interleave {self.indexer_rope_interleave!r} is not supported "
                              "by the glm_moe_dsa runtime (supported: true, GLM-5's interleaved indexer rope)")
        types = self.layer_indexers()
        if len(types) != self.num_hidden_layers or set(types) - {"full", SHARED} or types[0] != "full":
            raise ConfigError(f"config.json indexer_types {types!r} is not supported by the glm_moe_dsa runtime "
                              f"(supported: {self.num_hidden_layers} x 'full' / 'shared', the first 'full')")


class TopkShare:
    """The keep mask bool [b, s, T] of the last full indexer layer of the running forward."""

    keep: torch.Tensor | None = None


class SparseMLA(v32.SparseMLA):
    """`deepseek_v32.SparseMLA`; with ``indexer = None`` (a shared layer) it attends the keys the last
    full layer kept (`share`), else it records its own keep mask there."""

    share: TopkShare | None = None

    def keep(self, x, qr, cos, sin, mask, start_pos, cache) -> torch.Tensor:
        if self.indexer is None:
            if self.share is None or self.share.keep is None:
                raise ConfigError("a shared indexer layer ran before any full one (indexer_types must start 'full')")
            return self.share.keep
        keep = super().keep(x, qr, cos, sin, mask, start_pos, cache)
        if self.share is not None:
            self.share.keep = keep
        return keep


class Model(v32.Model):
    """`deepseek_v32.Model` with GLM's indexer: shared layers built without one (MTP layers keep theirs)."""

    attention: ClassVar[type] = SparseMLA

    def __init__(self, args: Args, dtype=None, device=None, mtp: bool = True, experts=None):
        super().__init__(args, dtype, device, mtp, experts)
        self.topk_share = TopkShare()
        types = args.layer_indexers()
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.share = self.topk_share
            if i < args.num_hidden_layers and types[i] == SHARED:
                layer.self_attn.indexer = None

    def new_cache(self, batch: int, max_len: int, dtype=None, device=None, quant: str | None = "auto") -> list:
        """`deepseek_v32.Model.new_cache`, with the plain MLA cache (no indexer keys) for shared layers."""
        caches = super().new_cache(batch, max_len, dtype, device, quant)
        return [c if self.model.layers[i].self_attn.indexer is not None else c.mla for i, c in enumerate(caches)]
