"""What every runtime model shares: typed args from config.json, RMSNorm, the model contract.

Model contract (DeepSeek-V3 family, Qwen3, Qwen3-MoE, ... all follow it):

* module tree named exactly like the Hugging Face checkpoint (``model.embed_tokens``,
  ``model.layers.{i}.self_attn.q_a_proj``, ``model.layers.{i}.mlp.experts.{e}.up_proj``,
  ``lm_head``, MTP layers at ``model.layers.{num_hidden_layers + j}``), so the loader maps
  tensor names onto modules without a rename table; every linear is a
  `cvt.runtime.kernels.Linear` (the loader swaps in quantized formats);
* ``forward(tokens [b, s] int64, start_pos=0, cache=None, hidden_states=None) -> logits
  [b, s, vocab] float32``; with a cache from ``new_cache(batch, max_len)`` the call
  appends positions ``start_pos .. start_pos+s-1`` (prefill, then one token at a time);
  a list passed as ``hidden_states`` receives the residual stream after the embedding
  and after each decoder layer (``1 + num_hidden_layers`` tensors ``[b, s, hidden]``);
* ``args`` is the typed args object; ``max_positions`` bounds ``start_pos + s``.

`CausalLM` holds what the families' Model classes share of that contract: the positions
bound, the cache choice's checks and the forward loop (embed -> layers -> norm -> logits); a
family gives its rope tables, its caches and its head.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Iterable, Mapping

import torch
from torch import nn

from cvt.convert.arch import config_problems
from cvt.errors import CvtError
from cvt.runtime import kv_cache
from cvt.runtime.models.families import ConfigError  # the family modules import it from here

# config.json keys that never change the forward math of any runtime model
HARMLESS_KEYS = frozenset({
    "architectures", "auto_map", "transformers_version", "torch_dtype", "dtype", "model_type",
    "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "initializer_range", "pretraining_tp",
    "output_router_logits", "router_aux_loss_coef", "aux_loss_alpha", "seq_aux", "attention_dropout",
    # training only: transformers adds router noise only while training (DeepseekV4Config defines it)
    "router_jitter_noise",
    "quantization_config", "tie_word_embeddings", "_name_or_path", "return_dict", "output_hidden_states",
    "output_attentions", "use_sliding_window", "sliding_window", "max_window_layers", "layer_types",
    "ep_size", "moe_layer_freq", "num_nextn_predict_layers", "is_encoder_decoder", "torchscript",
    "chunk_size_feed_forward", "id2label", "label2id", "tokenizer_class", "task_specific_params",
    "problem_type", "bad_words_ids", "begin_suppress_tokens", "suppress_tokens", "use_bfloat16",
    # transformers 4's generic PretrainedConfig attributes, saved into nested configs (Kimi-K2.5's text_config)
    "add_cross_attention", "cross_attention_hidden_size", "decoder_start_token_id", "finetuning_task", "is_decoder",
    "prefix", "pruned_heads", "sep_token_id", "tf_legacy_loss", "tie_encoder_decoder",
    # MindIE's quantization settings (cvt quantize --target mindie): they name the weights' formats,
    # which the loader reads from quant_model_description.json
    "quantize", "mla_quantize", "moe_quantize", "mtp_quantize",
})


@dataclasses.dataclass(frozen=True)
class ParallelNames:
    """Where the multi-rank runtime (`cvt.runtime.parallel`) finds a model's parts: attribute
    paths from the Model (dotted), and which Args fields a rank holds a share of. The defaults
    are the Hugging Face layout of the contract above; a family with other names gives its own
    (``Model.parallel``)."""

    embed: str = "model.embed_tokens"
    head: str = "lm_head"
    layers: str = "model.layers"
    attn_out: str = "self_attn.o_proj"   # row-parallel over tp (from a layer)
    # other token mixers' output projections, row-parallel over tp where a layer has one
    # (Qwen3.5's / Qwen3-Next's Gated DeltaNet: ``linear_attn.out_proj``)
    mixer_outs: tuple[str, ...] = ()
    mlp: str = "mlp"                     # a dense MLP (down row-parallel over dense_tp) or a MoE with `route`
    down: str = "down_proj"              # an MLP's / expert's down projection (from the MLP)
    # Args field -> the layout degree dividing it on a rank
    local_sizes: tuple[tuple[str, str], ...] = (("num_attention_heads", "tp"), ("num_key_value_heads", "tp"),
                                                ("intermediate_size", "dense_tp"),
                                                ("moe_intermediate_size", "moe_tp"))
    # linears (from a layer) whose output rows the sharder splits over tp while the model needs
    # them all: the rank computes its rows, an all-gather completes them
    gathered: tuple[str, ...] = ()


@dataclasses.dataclass
class ModelArgs:
    """Base of the per-family args dataclasses: `from_config` reads config.json strictly.

    A key that is a field is read; a key in HARMLESS_KEYS or the family's `ignored` set is
    skipped; any other key is an error naming it, so that a config feature the runtime does
    not implement (a new rope type, a new routing method) can never be silently ignored.
    """

    ignored: ClassVar[frozenset[str]] = frozenset()
    family: ClassVar[str] = "?"

    # keys every family reads the same way (each family validates the values it supports)
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float | None = None              # transformers < 5 keeps it top level
    rope_scaling: dict | None = None             # transformers < 5 name of rope_parameters
    rope_parameters: dict | None = None          # transformers 5: {rope_type, rope_theta, factor, ...}

    def rope_config(self) -> dict[str, Any]:
        """rope_scaling and rope_parameters merged (a copy; rope_parameters wins), as written."""
        return {**(self.rope_scaling or {}), **(self.rope_parameters or {})}

    def rope_with_theta(self, default_theta: float) -> dict[str, Any]:
        """`rope_config` with its type under ``rope_type`` (transformers < 5 wrote ``type``; "default"
        when absent) and ``rope_theta`` filled in (top level, else the family's `default_theta`)."""
        p = self.rope_config()
        p["rope_type"] = p.pop("rope_type", None) or p.pop("type", None) or "default"
        p.pop("type", None)
        p["rope_theta"] = float(p.get("rope_theta") or self.rope_theta or default_theta)
        return p

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "ModelArgs":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in config if k not in fields and k not in HARMLESS_KEYS and k not in cls.ignored)
        if unknown:
            raise ConfigError(
                f"config.json key(s) {', '.join(unknown)} are not understood by the {cls.family} runtime; "
                "refusing to run a model whose math may differ"
            )
        args = cls(**{k: v for k, v in config.items() if k in fields})
        args.validate()
        # the writers' check too (fp8-to-bf16 / quantize / shard refuse the same config.json)
        problems = config_problems(config)
        if problems:
            raise ConfigError(problems[0])
        return args

    def validate(self) -> None:
        """Family-specific checks (raise ConfigError naming the key and the supported values)."""

    def arch_table(self):
        """The family's architecture table (`cvt.convert.arch.ArchTable`), registered under `family`
        (a family whose tables are registered per model_type gives its own)."""
        from cvt.convert.arch import TABLES

        return TABLES[self.family]


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32, returned in x's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x).to(dtype)


class MLP(nn.Module):
    """SwiGLU: down_proj(silu(gate_proj(x)) * up_proj(x)); dense layers, experts, shared experts."""

    def __init__(self, dim: int, inter: int, *, bias: bool = False, dtype=None, device=None):
        super().__init__()
        from cvt.runtime.kernels import Linear

        self.gate_proj = Linear(dim, inter, bias=bias, dtype=dtype, device=device)
        self.up_proj = Linear(dim, inter, bias=bias, dtype=dtype, device=device)
        self.down_proj = Linear(inter, dim, bias=bias, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def shared_part(moe: nn.Module) -> nn.Module | None:
    """The MoE's module whose output is the shared part of the MoE output (``shared_experts``; a
    family naming it otherwise says where: ``shared_name``, Qwen3.5's gated ``shared_expert``)."""
    return getattr(moe, getattr(moe, "shared_name", "shared_experts"), None)


def build_experts(ids: Iterable[int] | None, count: int, make: Callable[[], nn.Module]) -> nn.Module:
    """A MoE layer's routed experts: all `count` in an nn.ModuleList (ids None), or only the global
    ids `ids` in an nn.ModuleDict keyed by str(id) -- a rank of the multi-rank runtime
    (`cvt.runtime.parallel`), which runs them itself. Either way expert e is ``experts.{e}``."""
    if ids is None:
        return nn.ModuleList(make() for _ in range(count))
    return nn.ModuleDict({str(e): make() for e in ids})


def run_experts(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, experts: nn.ModuleList,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Routed-expert sum: x [n, h], idx / weights [n, k] -> y [n, h] = sum_k weights * expert_idx(x).

    Loops over the experts that received tokens (each sees only its tokens), accumulating with
    index_add_: the reference-clear form, and what calibration hooks on experts rely on. `out`:
    an accumulator to continue (in place) instead of zeros -- calibration runs a layer's experts
    a chunk at a time and sums them in this same order (`cvt.quant.methods.expert_stream`)."""
    weights = weights.to(x.dtype)
    y = torch.zeros_like(x) if out is None else out
    counts = torch.bincount(idx.flatten(), minlength=len(experts)).tolist()
    for e, count in enumerate(counts):
        if count:
            tok, slot = torch.where(idx == e)
            y.index_add_(0, tok, experts[e](x[tok]) * weights[tok, slot, None])
    return y



def check_room(what: str, store: torch.Tensor, seq_dim: int, b: int, start_pos: int, end: int) -> None:
    """A layer cache's bound: `store` (batch first, positions on dim `seq_dim`) must hold batch `b`
    at positions start_pos .. end-1; else a CvtError naming the cache (`what`) and both sizes."""
    batch, max_len = store.shape[0], store.shape[seq_dim]
    if b > batch or end > max_len:
        raise CvtError(f"{what} of batch {batch}, max_len {max_len} cannot hold batch {b} "
                       f"at positions {start_pos}..{end - 1}")

class CausalLM(nn.Module):
    """Base of the families' Model classes (the contract above): ``self.args`` (max_position_embeddings,
    num_hidden_layers) and ``self.model`` (embed_tokens, layers, norm) are set by the subclass, which
    gives `rope_at` (cos / sin of the positions) and may give `logits` (default ``lm_head(x).float()``)."""

    cache_name: ClassVar[str] = "KV cache"   # how new_cache's errors name the family's cache
    parallel: ClassVar[ParallelNames] = ParallelNames()

    @property
    def max_positions(self) -> int:
        return self.args.max_position_embeddings

    def cache_scales(self, max_len: int, quant: str | None) -> tuple[list | None, str | None]:
        """new_cache's checks of (max_len, quant); returns (per-layer KV-cache scales, codec) for a
        quantized (C8) cache, (None, None) for a cache in the compute dtype. `quant`: "auto" = the
        model's scales when it carries them (`cvt.runtime.kv_cache`); "int8" / "fp8" = those scales,
        a CvtError when the model has none of that codec; None = no scales."""
        if quant not in (None, "auto", "int8", "fp8"):
            raise CvtError(f"{self.cache_name} quantization {quant!r} is not supported "
                           "(supported: None, auto, int8, fp8)")
        if max_len > self.max_positions:
            raise CvtError(f"{self.cache_name} max_len {max_len} exceeds max_position_embeddings {self.max_positions}")
        scales, codec = kv_cache.layer_kv_scales(self), kv_cache.kv_codec(self)
        if quant in ("int8", "fp8") and quant != codec:
            raise CvtError(f"an {quant} KV cache needs calibrated {quant} KV-cache scales and this model has "
                           f"{'none' if codec is None else codec + ' ones'} (load a w8a8c8 output, or "
                           "calibrate_kv_scales + attach_kv_cache_scales)")
        if quant in ("int8", "fp8") or (quant == "auto" and scales is not None):
            return scales, codec
        return None, None

    def rope_at(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of positions `pos` [s] as the family's attention takes them."""
        raise NotImplementedError

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Normed residual [b, s, h] -> logits [b, s, vocab] float32."""
        return self.lm_head(x).float()

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, start_pos: int = 0, cache: list | None = None,
                hidden_states: list | None = None) -> torch.Tensor:
        """tokens [b, s] int64 -> logits [b, s, vocab] float32 (see the module docstring); the decoder
        layers run, the MTP layers stored after them do not."""
        b, s = tokens.shape
        if start_pos + s > self.max_positions:
            raise CvtError(f"positions {start_pos}..{start_pos + s - 1} exceed max_position_embeddings "
                           f"{self.max_positions}")
        x = self.model.embed_tokens(tokens)                                  # [b, s, h]
        pos = torch.arange(start_pos, start_pos + s, device=x.device)
        cos, sin = self.rope_at(pos, x.dtype)
        # keys are positions 0..T-1 with a cache, start_pos..start_pos+s-1 without
        keys = torch.arange(start_pos + s, device=x.device) if cache is not None else pos
        mask = keys[None, :] <= pos[:, None]                                 # [s, T]
        if hidden_states is not None:
            hidden_states.append(x)
        for i in range(self.args.num_hidden_layers):
            x = self.model.layers[i](x, cos, sin, mask, start_pos, None if cache is None else cache[i])
            if hidden_states is not None:
                hidden_states.append(x)
        return self.logits(self.model.norm(x))
