"""Qwen3-Next: Qwen3.5-MoE's hybrid decoder (`cvt.runtime.models.qwen3_5`, whose pieces this
reuses) with its Gated DeltaNet's input projections fused (`FusedGatedDeltaNet`), a MoE block or
a dense SwiGLU per layer (``mlp_only_layers`` / ``decoder_sparse_step``), and the plain decoder
names (``model.layers.{i}``, ``model.embed_tokens``, ``lm_head``), as transformers'
Qwen3NextForCausalLM (modeling_qwen3_next.py, transformers 5.24). The release's MTP draft
(``mtp.*``) is carried by the stages and not built here.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from torch import nn

from cvt.convert.arch.qwen3_next import moe_layer
from cvt.runtime.models import qwen3_5
from cvt.runtime.models.base import ParallelNames
from cvt.runtime.models.gated_deltanet import FusedGatedDeltaNet

MODEL_TYPES = ("qwen3_next",)


@dataclasses.dataclass
class Args(qwen3_5.Args):
    """config.json of a qwen3_next model (keys as in transformers' Qwen3NextConfig)."""

    family = "qwen3_next"
    model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES

    model_type: str = "qwen3_next"
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] | None = None

    @property
    def moe(self) -> bool:
        return bool(self.num_experts)

    def moe_layer(self, i: int) -> bool:
        return moe_layer(dataclasses.asdict(self), i)

    def required(self) -> list[str]:
        n = self.num_hidden_layers or 0
        moe = [i for i in range(n) if self.moe_layer(i)]
        return (["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"]
                + (["num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"] if moe else [])
                + (["intermediate_size"] if len(moe) < n else []))


class DecoderLayer(qwen3_5.DecoderLayer):
    deltanet = FusedGatedDeltaNet
    no_clip: ClassVar[tuple[str, ...]] = ("in_proj_qkvz",)   # it produces queries and keys (AWQ's clip search)


class TextModel(qwen3_5.TextModel):
    """``model.``: embed_tokens, layers, norm."""

    layer = DecoderLayer


class Model(qwen3_5.Model):
    """Causal LM following `base.py`'s contract; parameter names = the release's tensor names."""

    cache_name: ClassVar[str] = "Qwen3-Next cache"
    parallel: ClassVar[ParallelNames] = ParallelNames(mixer_outs=qwen3_5.Model.parallel.mixer_outs,
                                                      local_sizes=qwen3_5.Model.parallel.local_sizes)

    @classmethod
    def build_text(cls, args: Args, dtype, device, experts) -> nn.Module:
        return TextModel(args, dtype, device, experts)


__all__ = ["Args", "Model"]
