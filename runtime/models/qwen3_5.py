"""Qwen3.5-MoE and Qwen3.5: hybrid Gated DeltaNet / gated full attention decoder (text model).

Shapes: b batch, s new tokens, T = start_pos + s, h hidden_size, H / K / D attention heads / KV
heads / head_dim, r = D * partial_rotary_factor rotated dims, E experts, k per token.

    x_0 = embed_tokens[tokens]
    for each layer (layer_types[i]: linear_attention or full_attention):
        a = input_layernorm(x)                        RMSNorm scaling by (1 + weight), float32
        linear:  x = x + GatedDeltaNet(a)             `cvt.runtime.models.gated_deltanet`
        full:    q | gate = q_proj(a) per head [b, s, H, 2D];  k, v = k_proj(a), v_proj(a) [b, s, K, D]
                 q, k = q_norm(q), k_norm(k)          (1 + weight) RMSNorm over D
                 q, k = RoPE on the first r dims (non-interleaved halves), the rest passed through
                 o = softmax_fp32(q k^T / sqrt(D) + causal) v, K heads shared by H/K q heads
                 x = x + o_proj(o * sigmoid(gate))
        m = post_attention_layernorm(x)
        MoE:     p = softmax_fp32(gate(m)); w, idx = topk(p, k); w /= sum(w)
                 x = x + sum_j w_j expert_{idx_j}(m) + sigmoid(shared_expert_gate(m)) * shared_expert(m)
        dense:   x = x + mlp(m)                       SwiGLU
    logits = lm_head(norm(x)).float()

Text only: the release's mRoPE (mrope_section over temporal / height / width) gives every text
position the same three ids, so it is plain RoPE at the token's position (transformers'
Qwen3_5MoeTextRotaryEmbedding with equal position ids). The module tree is the release's
(``model.language_model.layers.{i}``, ``lm_head``); the vision tower and the MTP draft are
carried by the stages and not built here.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from cvt.convert.arch.qwen3_5 import FULL, layer_types
from cvt.errors import CvtError
from cvt.runtime.kernels import Linear
from cvt.runtime.models.base import MLP, CausalLM, ConfigError, ModelArgs, ParallelNames, build_experts, run_experts
from cvt.runtime.models.gated_deltanet import GatedDeltaNet, LinearState
from cvt.runtime.models.qwen3 import KVCache, rotate_half

MODEL_TYPES = ("qwen3_5_moe_text", "qwen3_5_text")
ROPE_KEYS = {"rope_type", "rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"}


@dataclasses.dataclass
class Args(ModelArgs):
    """text_config of a qwen3_5_moe / qwen3_5 config.json (keys as in transformers' Qwen3_5MoeTextConfig)."""

    family = "qwen3_5"
    model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES
    # the release's keys that change no text forward math: the MTP draft's (not run here), the dtype
    ignored = frozenset({"mtp_num_hidden_layers", "mtp_use_dedicated_embeddings", "dtype"})

    model_type: str = "qwen3_5_moe_text"
    vocab_size: int | None = None
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_hidden_layers: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int = 256
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    attn_output_gate: bool = True
    tie_word_embeddings: bool = False
    partial_rotary_factor: float | None = None   # older files keep it top level; rope_parameters wins
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    layer_types: list[str] | None = None
    full_attention_interval: int | None = None
    num_experts: int | None = None
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None
    shared_expert_intermediate_size: int | None = None
    norm_topk_prob: bool = True                  # transformers' router always renormalises the top k

    @property
    def moe(self) -> bool:
        return self.model_type == "qwen3_5_moe_text"

    def moe_layer(self, i: int) -> bool:
        """Whether decoder layer `i` holds a MoE block (every layer of a Qwen3.5-MoE)."""
        return self.moe

    @property
    def conv_channels(self) -> int:
        """The causal conv's channels (q, k and v): its state's rows (`cvt.convert.arch.attention.LINEAR`)."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.linear_num_value_heads * \
            self.linear_value_head_dim

    @property
    def conv_state_len(self) -> int:
        """The conv state's length: the last kernel - 1 inputs (`cvt.convert.arch.attention.LINEAR`)."""
        return self.linear_conv_kernel_dim - 1

    def required(self) -> list[str]:
        """The config keys this model cannot run without."""
        return ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"] + (
            ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"]
            if self.moe else ["intermediate_size"])

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    def arch_table(self):
        """The text model's table, registered under its model_type (qwen3_5_moe_text / qwen3_5_text)."""
        from cvt.convert.arch import TABLES

        return TABLES[self.model_type]

    def types(self) -> list[str]:
        return layer_types(dataclasses.asdict(self))

    def rope(self) -> tuple[float, int]:
        """(theta, rotated dims)."""
        p = self.rope_config()
        factor = p.get("partial_rotary_factor", self.partial_rotary_factor if self.partial_rotary_factor else 0.25)
        return float(p.get("rope_theta") or self.rope_theta or 10000.0), int(self.head_dim * factor)

    def validate(self) -> None:
        if self.model_type not in self.model_types:
            raise ConfigError(f"config.json model_type {self.model_type!r} is not a {self.family} text model "
                              f"(supported: {', '.join(self.model_types)})")
        missing = [k for k in self.required() if getattr(self, k) is None]
        if missing:
            raise ConfigError(f"config.json ({self.model_type}) lacks required key(s) {', '.join(missing)}")
        for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("attn_output_gate", True),
                          ("norm_topk_prob", True)):
            if getattr(self, key) != want:
                raise ConfigError(f"config.json {key} {getattr(self, key)!r} is not supported (supported: {want!r})")
        p = self.rope_config()
        kind = p.get("rope_type") or p.get("type") or "default"
        extra = sorted(set(p) - ROPE_KEYS - {"type"})
        if kind != "default" or extra:
            raise ConfigError(f"config.json rope {kind!r} {extra or ''} is not supported (supported: default rope "
                              f"with {', '.join(sorted(ROPE_KEYS))})")
        if p.get("mrope_section") is not None and p.get("mrope_interleaved") is False:
            raise ConfigError("config.json mrope_interleaved false is not supported (supported: true)")
        if self.rope()[1] % 2 or not 0 < self.rope()[1] <= self.head_dim:
            raise ConfigError(f"config.json partial_rotary_factor gives {self.rope()[1]} rotated dims of head_dim "
                              f"{self.head_dim}: must be even and in 2..head_dim")


class ZeroCentredRMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * (1 + weight), float32, returned in x's dtype (Gemma's form)."""

    unit_offset: ClassVar[float] = 1.0   # the scale is unit_offset + weight (a smoothing fold reads it)

    def __init__(self, dim: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, s, D]; cos, sin [s, r]: rotate the first r dims, keep the rest."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    return torch.cat([rot * cos + rotate_half(rot) * sin, rest], dim=-1)


class GatedAttention(nn.Module):
    """The full layers' GQA with a per-head output gate (q_proj's second half of each head)."""

    def __init__(self, args: Args, dtype=None, device=None):
        super().__init__()
        h, kw = args.hidden_size, dict(dtype=dtype, device=device)
        self.n_heads, self.n_kv, self.head_dim = args.num_attention_heads, args.kv_heads, args.head_dim
        self.q_proj = Linear(h, 2 * self.n_heads * self.head_dim, **kw)
        self.k_proj = Linear(h, self.n_kv * self.head_dim, **kw)
        self.v_proj = Linear(h, self.n_kv * self.head_dim, **kw)
        self.o_proj = Linear(self.n_heads * self.head_dim, h, **kw)
        self.q_norm = ZeroCentredRMSNorm(self.head_dim, args.rms_norm_eps, **kw)
        self.k_norm = ZeroCentredRMSNorm(self.head_dim, args.rms_norm_eps, **kw)
        self.kv_scales, self.kv_observer = None, None   # no C8 cache for this family (`cvt.runtime.kv_cache`)

    def forward(self, x, cos, sin, mask, start_pos, cache: KVCache | None) -> torch.Tensor:
        b, s, _ = x.shape
        q, gate = self.q_proj(x).view(b, s, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
        gate = gate.reshape(b, s, -1)
        q = apply_partial_rope(self.q_norm(q).transpose(1, 2), cos, sin)                    # [b, H, s, D]
        k = apply_partial_rope(self.k_norm(self.k_proj(x).view(b, s, self.n_kv, -1)).transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(b, s, self.n_kv, -1).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, start_pos)                                               # [b, K, T, D]
        rep = self.n_heads // self.n_kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = (q @ k.transpose(-1, -2)) * self.head_dim ** -0.5
        scores = scores.masked_fill(~mask, float("-inf"))
        o = scores.softmax(-1, dtype=torch.float32).to(v.dtype) @ v                           # [b, H, s, D]
        o = o.transpose(1, 2).reshape(b, s, -1) * torch.sigmoid(gate)
        return self.o_proj(o)


class GatedSharedExpert(MLP):
    """The shared expert: a SwiGLU MLP whose output the MoE scales by sigmoid(gate(x)), the gate
    (``mlp.shared_expert_gate``, the MoE's) passed in, so that the module's output is the shared
    part of the MoE output (calibration's expert stream records and stubs it as one module)."""

    def forward(self, x: torch.Tensor, gate: nn.Module | None = None) -> torch.Tensor:
        y = super().forward(x)
        return y if gate is None else torch.sigmoid(gate(x)) * y


class MoE(nn.Module):
    """Softmax top-k router over SwiGLU experts, plus a shared expert scaled by sigmoid(shared_expert_gate)."""

    shared_name: ClassVar[str] = "shared_expert"   # where calibration's expert stream finds the shared part

    def __init__(self, args: Args, dtype=None, device=None, experts=None):
        super().__init__()
        h, kw = args.hidden_size, dict(dtype=dtype, device=device)
        self.top_k = args.num_experts_per_tok
        self.gate = Linear(h, args.num_experts, **kw)
        self.experts = build_experts(experts, args.num_experts, lambda: MLP(h, args.moe_intermediate_size, **kw))
        self.shared_expert = GatedSharedExpert(h, args.shared_expert_intermediate_size, **kw)
        self.shared_expert_gate = Linear(h, 1, **kw)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, h] -> (weights [n, k] in x's dtype, expert ids [n, k])."""
        probs = self.gate(x).softmax(-1, dtype=torch.float32)
        weights, idx = probs.topk(self.top_k, dim=-1)
        return (weights / weights.sum(-1, keepdim=True)).to(x.dtype), idx

    def shared_output(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, h] -> sigmoid(shared_expert_gate(x)) * shared_expert(x) (the multi-rank MoE adds it too)."""
        return self.shared_expert(x, self.shared_expert_gate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, idx = self.route(x)
        shared = self.shared_output(x)
        return (run_experts(x, idx, weights, self.experts) + shared).view(shape)


class DecoderLayer(nn.Module):
    # AWQ's clipping search skips the projections producing queries and keys (`cvt.quant.methods.calib`)
    no_clip: ClassVar[tuple[str, ...]] = ("in_proj_qkv",)

    deltanet: ClassVar[type[GatedDeltaNet]] = GatedDeltaNet   # the linear layers' token mixer

    def __init__(self, args: Args, i: int, dtype=None, device=None, experts=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.full = args.types()[i] == FULL
        self.mixer = "self_attn" if self.full else "linear_attn"   # the token mixer's attribute
        self.input_layernorm = ZeroCentredRMSNorm(args.hidden_size, args.rms_norm_eps, **kw)
        if self.full:
            self.self_attn = GatedAttention(args, **kw)
        else:
            self.linear_attn = self.deltanet(args, **kw)
            self.self_attn = None   # read by `cvt.runtime.kv_cache` (no KV-cache scales): a plain attribute
        self.post_attention_layernorm = ZeroCentredRMSNorm(args.hidden_size, args.rms_norm_eps, **kw)
        self.mlp = (MoE(args, **kw, experts=experts) if args.moe_layer(i)
                    else MLP(args.hidden_size, args.intermediate_size, **kw))

    def forward(self, x, cos, sin, mask, start_pos, cache):
        a = self.input_layernorm(x)
        x = x + (self.self_attn(a, cos, sin, mask, start_pos, cache) if self.full
                 else self.linear_attn(a, start_pos, cache))
        return x + self.mlp(self.post_attention_layernorm(x))


class TextModel(nn.Module):
    """The release's ``model.language_model.``: embed_tokens, layers, norm."""

    layer: ClassVar[type[DecoderLayer]] = DecoderLayer

    def __init__(self, args: Args, dtype=None, device=None, experts=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, dtype=dtype, device=device)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(self.layer(args, i, dtype, device, None if experts is None else experts.get(i))
                                    for i in range(args.num_hidden_layers))
        self.norm = ZeroCentredRMSNorm(args.hidden_size, args.rms_norm_eps, dtype=dtype, device=device)


class Wrapper(nn.Module):
    """``model.``: holds ``language_model``; embed_tokens / layers / norm read through to it, as
    `CausalLM.forward` and the loader ask for them."""

    def __init__(self, text: TextModel):
        super().__init__()
        self.language_model = text

    embed_tokens = property(lambda self: self.language_model.embed_tokens)
    layers = property(lambda self: self.language_model.layers)
    norm = property(lambda self: self.language_model.norm)


class Model(CausalLM):
    """Causal LM following `base.py`'s contract; parameter names = the release's text tensor names."""

    cache_name: ClassVar[str] = "Qwen3.5 cache"
    # the shared expert has its own width, split over moe_tp with the routed experts' (held whole when
    # the layout replicates it); the Gated DeltaNet's key and value heads split over tp as vLLM splits
    # them (`cvt.convert.arch.qwen3_5` (2)), its out_proj row-parallel
    parallel: ClassVar[ParallelNames] = ParallelNames(
        embed="model.language_model.embed_tokens", layers="model.language_model.layers",
        mixer_outs=("linear_attn.out_proj",), local_sizes=ParallelNames.local_sizes + (
            ("shared_expert_intermediate_size", "moe_tp"), ("linear_num_key_heads", "tp"),
            ("linear_num_value_heads", "tp")))

    def __init__(self, args: Args, dtype=None, device=None, experts=None):
        super().__init__()
        self.args = args
        self.model = self.build_text(args, dtype, device, experts)
        self.lm_head = None if args.tie_word_embeddings else Linear(args.hidden_size, args.vocab_size,
                                                                    dtype=dtype, device=device)
        theta, self.rot_dims = args.rope()
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, self.rot_dims, 2, dtype=torch.float, device="cpu")
                                         / self.rot_dims))

    @classmethod
    def build_text(cls, args: Args, dtype, device, experts) -> nn.Module:
        """The module at ``model.``: the release's wrapper around its text model."""
        return Wrapper(TextModel(args, dtype, device, experts))

    def new_cache(self, batch: int, max_len: int, dtype=None, device=None, quant: str | None = "auto") -> list:
        """Per layer: a `LinearState` (linear layers: fixed size) or a `KVCache` (full layers, k / v
        [batch, kv_heads, max_len, head_dim]); the cache is never quantized in this family."""
        if quant not in (None, "auto"):
            raise CvtError(f"a {quant} KV cache is not supported for {self.cache_name.removesuffix(' cache')} "
                           "(supported: None, auto)")
        if max_len > self.max_positions:
            raise CvtError(f"{self.cache_name} max_len {max_len} exceeds max_position_embeddings {self.max_positions}")
        w, a = self.model.embed_tokens.weight, self.args
        dtype, device = dtype or w.dtype, device or w.device
        return [KVCache(batch, a.kv_heads, max_len, a.head_dim, dtype, device) if layer.full
                else layer.linear_attn.new_state(batch, dtype, device) for layer in self.model.layers]

    def rope_at(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = pos[:, None].float() * self.inv_freq.to(pos.device)[None]                     # [s, r/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return F.linear(x, self.model.embed_tokens.weight.to(x.dtype)).float()
        return self.lm_head(x).float()


__all__ = ["Args", "LinearState", "Model"]
