"""Qwen3-MoE, Qwen3, Qwen2 and Llama: one GQA + SwiGLU / softmax-top-k-MoE decoder.

Shapes: b batch, s new tokens, T = start_pos + s cached positions, h hidden_size,
H / K query / key-value heads, D head_dim, E experts, k experts per token, I expert width.

    x_0 = embed_tokens[tokens]                                          [b, s, h]
    for each layer:
        a   = input_layernorm(x)
        q   = q_proj(a) -> [b, s, H, D];  k, v = k_proj(a), v_proj(a) -> [b, s, K, D]
        q,k = q_norm(q), k_norm(k)           per-head RMSNorm over D (qwen3, qwen3_moe only)
        q,k = q*cos + rotate_half(q)*sin     RoPE, non-interleaved halves (HF layout)
        k,v = cache[:, :, :T] after writing positions start_pos .. T-1    [b, K, T, D]
        o   = softmax_fp32(q k^T / sqrt(D) + causal) v, each K head shared by H/K q heads
        x   = x + o_proj(o)                                             [b, s, h]
        m   = post_attention_layernorm(x)
        x   = x + mlp(m)
    logits = lm_head(norm(x)).float()      lm_head = embed_tokens when tie_word_embeddings

    SwiGLU:  mlp(m) = down_proj(silu(gate_proj(m)) * up_proj(m))
    MoE (qwen3_moe layers where num_experts > 0, (i+1) % decoder_sparse_step == 0 and i not
    in mlp_only_layers; no shared expert):
        p      = softmax_fp32(m @ gate^T)                                [n, E]
        w, idx = topk(p, k);  w /= sum(w) if norm_topk_prob;  w cast to m's dtype
        mlp(m) = sum_j w_j * expert_{idx_j}(m)     experts are SwiGLU, width I

RoPE inverse frequencies: default theta^(-2i/D); 'linear' divides them by factor; 'llama3'
rescales low frequencies (Llama 3.1); 'yarn' blends interpolation / extrapolation by a
linear ramp and scales cos / sin by attention_factor. Any other rope type is a ConfigError.

Biases: Qwen2 has q/k/v biases (no config key); Llama / Qwen3 follow `attention_bias`
(all four projections) and Llama `mlp_bias`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cvt.runtime import kv_cache
from cvt.runtime.kernels import Linear
from cvt.runtime.models.base import (MLP, CausalLM, ConfigError, ModelArgs, RMSNorm, build_experts, check_room,
                                     run_experts)

MODEL_TYPES = ("qwen3_moe", "qwen3", "qwen2", "llama")
ROPE_KEYS = {  # keys each rope type may carry, besides rope_type / type / rope_theta
    "default": set(),
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor",
             "mscale", "mscale_all_dim", "truncate"},
}


@dataclasses.dataclass
class Args(ModelArgs):
    """config.json of a qwen3_moe / qwen3 / qwen2 / llama checkpoint (keys as in HF)."""

    family = "qwen3"
    ignored = frozenset()  # every harmless key of these configs is already in base.HARMLESS_KEYS

    model_type: str = "qwen3"
    vocab_size: int | None = None
    hidden_size: int | None = None
    intermediate_size: int | None = None         # dense MLP width (also mlp_only_layers of MoE models)
    num_hidden_layers: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None       # None: = num_attention_heads (MHA)
    head_dim: int | None = None                  # None: hidden_size // num_attention_heads (not qwen3)
    max_position_embeddings: int = 2048          # (hidden_act, rms_norm_eps, rope keys: base.ModelArgs)
    attention_bias: bool | None = None           # None: qwen2 -> q/k/v bias, others -> no bias
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    use_sliding_window: bool = False
    # Qwen3-MoE
    num_experts: int | None = None
    num_local_experts: int | None = None         # transformers 5 writes num_experts under this name
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = dataclasses.field(default_factory=list)

    # -- derived ---------------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def qk_norm(self) -> bool:
        return self.model_type in ("qwen3", "qwen3_moe")

    @property
    def qkv_bias(self) -> bool:
        return self.model_type == "qwen2" if self.attention_bias is None else bool(self.attention_bias)

    @property
    def o_bias(self) -> bool:
        return self.model_type != "qwen2" and bool(self.attention_bias)

    def is_moe_layer(self, i: int) -> bool:
        return (bool(self.num_experts) and i not in (self.mlp_only_layers or [])
                and (i + 1) % self.decoder_sparse_step == 0)

    def rope(self) -> dict[str, Any]:
        """rope_scaling / rope_parameters / rope_theta merged: {rope_type, rope_theta, ...}."""
        return self.rope_with_theta(10000.0)

    def validate(self) -> None:
        if self.num_local_experts is not None:
            if self.num_experts is not None and self.num_experts != self.num_local_experts:
                raise ConfigError(f"config.json num_experts {self.num_experts} and num_local_experts "
                                  f"{self.num_local_experts} disagree")
            self.num_experts = self.num_local_experts
        if self.model_type not in MODEL_TYPES:
            raise ConfigError(f"config.json model_type {self.model_type!r} is not a qwen3-family model "
                              f"(supported: {', '.join(MODEL_TYPES)})")
        if self.model_type != "qwen3_moe" and self.num_experts:
            raise ConfigError(f"config.json num_experts={self.num_experts} with model_type {self.model_type!r}: "
                              "experts are supported for model_type qwen3_moe only")
        required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
        if self.model_type == "qwen3_moe":
            required += ["num_experts", "num_experts_per_tok", "moe_intermediate_size"]
        if self.model_type == "qwen3":
            required.append("head_dim")  # HF defaults it to 128, not hidden_size // heads: be explicit
        missing = [k for k in required if getattr(self, k) is None]
        if missing:
            raise ConfigError(f"config.json ({self.model_type}) lacks required key(s) {', '.join(missing)}")
        if self.hidden_act != "silu":
            raise ConfigError(f"config.json hidden_act {self.hidden_act!r} is not supported (supported: silu)")
        if self.use_sliding_window:
            raise ConfigError("config.json use_sliding_window=true is not supported (supported: false)")
        if self.num_attention_heads % self.kv_heads:
            raise ConfigError(f"config.json num_attention_heads {self.num_attention_heads} is not a multiple "
                              f"of num_key_value_heads {self.kv_heads}")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"config.json hidden_size {self.hidden_size} is not a multiple of "
                              f"num_attention_heads {self.num_attention_heads} and head_dim is not given")
        if self.dim_head % 2:
            raise ConfigError(f"config.json head_dim {self.dim_head} must be even for RoPE")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"config.json num_experts_per_tok {self.num_experts_per_tok} must be in "
                              f"1..num_experts ({self.num_experts})")
        if self.decoder_sparse_step < 1:
            raise ConfigError(f"config.json decoder_sparse_step {self.decoder_sparse_step} must be >= 1")
        rope = self.rope()
        kind = rope["rope_type"]
        if kind not in ROPE_KEYS:
            raise ConfigError(f"config.json rope type {kind!r} is not supported (supported: {', '.join(ROPE_KEYS)})")
        if rope.pop("partial_rotary_factor", 1.0) != 1.0:
            raise ConfigError("config.json partial_rotary_factor != 1.0 is not supported (supported: 1.0)")
        extra = sorted(set(rope) - ROPE_KEYS[kind] - {"rope_type", "rope_theta"})
        if extra:
            raise ConfigError(f"config.json rope parameter(s) {', '.join(extra)} are not understood for rope "
                              f"type {kind!r} (known: {', '.join(sorted(ROPE_KEYS[kind])) or 'none'})")
        if kind != "default" and rope.get("factor") is None:
            raise ConfigError(f"config.json rope type {kind!r} needs 'factor'")
        if kind == "llama3" and not {"low_freq_factor", "high_freq_factor"} <= set(rope):
            raise ConfigError("config.json rope type 'llama3' needs 'low_freq_factor' and 'high_freq_factor'")


def rope_frequencies(args: Args) -> tuple[torch.Tensor, float]:
    """(inv_freq float32 [D/2], cos/sin scale) for the config's rope type, as HF computes them."""
    p, dim = args.rope(), args.dim_head
    base, kind = p["rope_theta"], p["rope_type"]
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    if kind == "default":
        return inv_freq, 1.0
    factor = float(p["factor"])
    old_len = p.get("original_max_position_embeddings") or args.max_position_embeddings
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        low, high = p["low_freq_factor"], p["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled), 1.0
    # yarn
    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = p.get("attention_factor")
    if attn is None:
        ms, ms_all = p.get("mscale"), p.get("mscale_all_dim")
        attn = mscale(factor, ms) / mscale(factor, ms_all) if ms and ms_all else mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rot):
        return dim * math.log(old_len / (rot * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    hi = hi + 0.001 if lo == hi else hi
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - lo) / (hi - lo)).clamp(0, 1)
    extrapolate = 1 - ramp
    return inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate, float(attn)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, s, D]; cos, sin [s, D] in x's dtype."""
    return x * cos + rotate_half(x) * sin


class KVCache:
    """One layer's cache: k, v ``[batch, kv_heads, max_len, head_dim]`` in the model dtype.

    Attention only calls `update`; `Int8KVCache` (``quant = "int8"``, the C8 cache of
    `cvt.runtime.kv_cache`) stores int8 k / v and returns dequantized ``[b, kv_heads, T,
    head_dim]`` tensors; `Model.new_cache` is the one place to choose it.
    """

    quant: str | None = None

    def __init__(self, batch: int, kv_heads: int, max_len: int, head_dim: int, dtype=None, device=None):
        self.k = torch.zeros(batch, kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    @property
    def nbytes(self) -> int:
        """Bytes of the cache storage."""
        return self.k.nbytes + self.v.nbytes

    def _check(self, b: int, start_pos: int, end: int) -> None:
        check_room("KV cache", self.k, 2, b, start_pos, end)

    def update(self, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [b, kv_heads, s, D] at positions start_pos..; return all T = start_pos+s."""
        b, end = k.shape[0], start_pos + k.shape[2]
        self._check(b, start_pos, end)
        self.k[:b, :, start_pos:end] = k
        self.v[:b, :, start_pos:end] = v
        return self.k[:b, :, :end], self.v[:b, :, :end]


class Int8KVCache(KVCache):
    """C8 cache: int8 k / v with static per-channel float32 scales k_scale, v_scale
    [kv_heads * head_dim] (channel = head * head_dim + d; `cvt.runtime.kv_cache`:
    q = clamp(round(x / scale), -128, 127), read as q * scale in the input dtype)."""

    quant = "int8"

    def __init__(self, batch: int, kv_heads: int, max_len: int, head_dim: int, k_scale: torch.Tensor,
                 v_scale: torch.Tensor, device=None, codec: str = "int8"):
        device = device if device is not None else k_scale.device
        self.quant = codec
        self.k = torch.zeros(batch, kv_heads, max_len, head_dim, dtype=kv_cache.STORAGE[codec], device=device)
        self.v = torch.zeros_like(self.k)
        shape = (kv_heads, 1, head_dim) if k_scale.numel() > 1 else (1,)  # per channel (int8) / per tensor (fp8)
        self.k_scale = k_scale.float().to(device).view(shape)
        self.v_scale = v_scale.float().to(device).view(shape)

    def update(self, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        b, end = k.shape[0], start_pos + k.shape[2]
        self._check(b, start_pos, end)
        self.k[:b, :, start_pos:end] = kv_cache.quantize(k, self.k_scale, self.quant)
        self.v[:b, :, start_pos:end] = kv_cache.quantize(v, self.v_scale, self.quant)
        return (kv_cache.dequantize(self.k[:b, :, :end], self.k_scale, k.dtype),
                kv_cache.dequantize(self.v[:b, :, :end], self.v_scale, v.dtype))


class Attention(nn.Module):
    def __init__(self, args: Args, dtype=None, device=None):
        super().__init__()
        h, self.n_heads, self.n_kv, self.head_dim = args.hidden_size, args.num_attention_heads, args.kv_heads, args.dim_head
        kw = dict(dtype=dtype, device=device)
        self.q_proj = Linear(h, self.n_heads * self.head_dim, bias=args.qkv_bias, **kw)
        self.k_proj = Linear(h, self.n_kv * self.head_dim, bias=args.qkv_bias, **kw)
        self.v_proj = Linear(h, self.n_kv * self.head_dim, bias=args.qkv_bias, **kw)
        self.o_proj = Linear(self.n_heads * self.head_dim, h, bias=args.o_bias, **kw)
        if args.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps, **kw)
            self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps, **kw)
        else:
            self.q_norm = self.k_norm = None
        # C8 (cvt.runtime.kv_cache): (k, v) float32 [kv_heads*head_dim] scales once attached; plain
        # attributes, not in the state_dict; kv_observer is set while calibrating
        self.kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None
        self.kv_observer = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                start_pos: int, cache: KVCache | None) -> torch.Tensor:
        """x [b, s, h]; mask [s, T] bool (True = may attend) -> [b, s, h]."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)                      # [b, H, s, D]
        k = apply_rope(k.transpose(1, 2), cos, sin)                      # [b, K, s, D]
        k, v = kv_cache.cache_input(self, cache is not None, k, v)       # C8 / calibration
        if cache is not None:
            k, v = cache.update(k, v, start_pos)                         # [b, K, T, D]
        rep = self.n_heads // self.n_kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = (q @ k.transpose(-1, -2)).float() * self.head_dim ** -0.5   # [b, H, s, T]
        scores = scores.masked_fill(~mask, float("-inf"))
        o = scores.softmax(-1).to(v.dtype) @ v                           # [b, H, s, D]
        return self.o_proj(o.transpose(1, 2).reshape(b, s, -1))


class MoE(nn.Module):
    """Softmax top-k router `gate` [E, h] over SwiGLU `experts`; no shared expert.
    `experts`: the global ids to build (None: all; see `base.build_experts`)."""

    def __init__(self, args: Args, dtype=None, device=None, experts=None):
        super().__init__()
        self.top_k, self.norm_topk_prob = args.num_experts_per_tok, args.norm_topk_prob
        self.gate = Linear(args.hidden_size, args.num_experts, dtype=dtype, device=device)
        self.experts = build_experts(experts, args.num_experts, lambda: MLP(
            args.hidden_size, args.moe_intermediate_size, dtype=dtype, device=device))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, h] -> (weights float32 [n, k], global expert ids int64 [n, k])."""
        probs = self.gate(x).float().softmax(-1)                         # [n, E]
        weights, idx = probs.topk(self.top_k, dim=-1)                    # [n, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])                                     # [n, h]
        weights, idx = self.route(x)                                     # [n, k]
        return run_experts(x, idx, weights, self.experts).view(shape)


class DecoderLayer(nn.Module):
    def __init__(self, args: Args, i: int, dtype=None, device=None, experts=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, **kw)
        self.self_attn = Attention(args, **kw)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, **kw)
        self.mlp = (MoE(args, **kw, experts=experts) if args.is_moe_layer(i)
                    else MLP(args.hidden_size, args.intermediate_size, bias=args.mlp_bias, **kw))

    def forward(self, x, cos, sin, mask, start_pos, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, start_pos, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """The checkpoint's `model.` prefix: embed_tokens, layers, norm."""

    def __init__(self, args: Args, dtype=None, device=None, experts=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, dtype=dtype, device=device)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(args, i, dtype, device, None if experts is None else experts.get(i))
                                    for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype=dtype, device=device)


class Model(CausalLM):
    """Causal LM following the contract in `base.py`; parameter names = HF checkpoint names.
    `experts` (MoE layer -> global expert ids) builds only those routed experts (a rank of
    `cvt.runtime.parallel`; None: all)."""

    def __init__(self, args: Args, dtype=None, device=None, experts=None):
        super().__init__()
        self.args = args
        self.model = Backbone(args, dtype, device, experts)
        self.lm_head = (None if args.tie_word_embeddings
                        else Linear(args.hidden_size, args.vocab_size, dtype=dtype, device=device))
        # plain attributes, not buffers: computed on CPU even for device="meta", not in state_dict
        self.inv_freq, self.rope_scale = rope_frequencies(args)

    def new_cache(self, batch: int, max_len: int, dtype=None, device=None,
                  quant: str | None = "auto") -> list[KVCache]:
        """One cache per layer, k / v [batch, kv_heads, max_len, head_dim] (model dtype/device by
        default). `quant`: "auto" (default) = "int8" when the model carries KV-cache scales (C8,
        `cvt.runtime.kv_cache`), else None; None = storage in `dtype`; "int8" = `Int8KVCache`,
        a CvtError when the model has no scales."""
        scales, codec = self.cache_scales(max_len, quant)
        w, a = self.model.embed_tokens.weight, self.args
        if scales is not None:
            return [Int8KVCache(batch, a.kv_heads, max_len, a.dim_head, ks, vs, device or w.device, codec)
                    for ks, vs in scales]
        return [KVCache(batch, a.kv_heads, max_len, a.dim_head, dtype or w.dtype, device or w.device)
                for _ in range(a.num_hidden_layers)]

    def rope_at(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [s, D] in the model's dtype (`apply_rope` rotates in x's dtype, as HF)."""
        freqs = pos[:, None].float() * self.inv_freq.to(pos.device)[None]     # [s, D/2], float32
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.rope_scale).to(dtype), (emb.sin() * self.rope_scale).to(dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:  # tie_word_embeddings
            return F.linear(x, self.model.embed_tokens.weight.to(x.dtype)).float()
        return self.lm_head(x).float()
