"""Where the calibration driver (`cvt.quant.methods.calib`) finds a runtime model's decoder
layers and embedding, and which captured layer arguments go with each mini-batch of sequences.

Most families follow `cvt.runtime.models.base.CausalLM`'s HF layout (``model.layers.{i}``,
``model.embed_tokens``; a layer takes hidden states [b, s, h] plus arguments shared by every
sequence: rope, mask). DeepSeek-V4 declares its own (``Model.parallel``, ``calib_per_sequence``): blocks
``layers.{i}`` taking the hc streams [b, s, hc, h] and the token ids [b, s] (hash routing), which
must be cut with the streams per mini-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Layout:
    """Where the driver finds a runtime model's decoder layers and embedding: where the model
    class says the multi-rank runtime finds them (``Model.parallel``,
    `cvt.runtime.models.base.ParallelNames`; the HF layout of `CausalLM` by default:
    ``model.layers.{i}``, ``model.embed_tokens``, ``mlp``), and ``Model.calib_per_sequence``.

    layers:       module path of the decoder layers (ModuleList); layer i is ``{layers}.{i}``,
                  also its checkpoint name (after a wrapper's text prefix)
    embed:        module path of the token embedding (its ``.weight`` in the checkpoint)
    per_sequence: positions, among the positional arguments after the layer input, of those that
                  hold one row per sequence ([b, ...]: DeepSeek-V4's token ids): each mini-batch
                  gets its rows, as it gets its rows of the layer input
    moe:          attribute of a layer holding its MoE (``.experts``), whose routed experts may be
                  calibrated a chunk at a time (`cvt.quant.methods.expert_stream`)
    attn:         attribute of a layer holding its attention (the first part of the parallel
                  names' ``attn_out``: ``self_attn``, V4's ``attn``)
    """

    layers: str = "model.layers"
    embed: str = "model.embed_tokens"
    per_sequence: tuple[int, ...] = ()
    moe: str = "mlp"
    attn: str = "self_attn"

    @classmethod
    def of(cls, model: nn.Module) -> "Layout":
        from cvt.runtime.models.base import ParallelNames

        names = getattr(model, "parallel", None) or ParallelNames()
        return cls(layers=names.layers, embed=names.embed, moe=names.mlp, attn=names.attn_out.split(".")[0],
                   per_sequence=tuple(getattr(model, "calib_per_sequence", ())))

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        return model.get_submodule(self.layers)


class _PerSequence:
    """A captured layer argument with one row per sequence: `_run_layer` passes each mini-batch
    its rows (`Layout.per_sequence`)."""

    def __init__(self, t: torch.Tensor):
        self.t = t
