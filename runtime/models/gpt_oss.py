"""gpt-oss: GQA attention with learned sinks, alternating sliding-window / full layers, and a top-k
MoE with biases and the clamped SwiGLU, as transformers' GptOssForCausalLM (modeling_gpt_oss.py, 5.24).

Shapes: b batch, s new tokens, T cached positions, h hidden_size, H / K query / KV heads, D
head_dim, E experts, k experts per token, I expert width, W sliding_window.

    for each layer:
        a    = input_layernorm(x)
        q, k, v = q_proj(a), k_proj(a), v_proj(a)          (all with biases)
        q, k = rope(q), rope(k)                              YaRN (qwen3's `rope_frequencies`), HF halves
        z    = q k^T / sqrt(D), masked causal (sliding layers: also key > query - W)     [b, H, s, T]
        p    = softmax_fp32([z | sink_h])[..., :T]           one learned logit per head, dropped after
        x    = x + o_proj(p v)
        m    = post_attention_layernorm(x)
        r    = router(m) (with bias);  w, idx = topk(r, k);  w = softmax(w)
        x    = x + sum_j w_j * expert_{idx_j}(m)

    expert e:  g = m @ gate_up_proj[e] + gate_up_proj_bias[e]       [n, 2I]; gate = g[:, 0::2], up = g[:, 1::2]
               gate = min(gate, limit);  up = clamp(up, -limit, limit)
               y = ((up + 1) * gate * sigmoid(alpha * gate)) @ down_proj[e] + down_proj_bias[e]
    alpha = swiglu_alpha (1.702), limit = swiglu_limit (7.0).

The experts are transformers' fused parameters (``mlp.experts.gate_up_proj`` [E, h, 2I],
``down_proj`` [E, I, h]), loaded as stored (the MXFP4 release is dequantized on load by
`cvt.runtime.loader`). Cache: one `KVCache` per layer over all positions; a sliding layer's
mask reads only the window.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cvt.runtime import kv_cache
from cvt.runtime.kernels import Linear
from cvt.runtime.models.base import CausalLM, ConfigError, ModelArgs, ParallelNames, RMSNorm
from cvt.runtime.models.qwen3 import ROPE_KEYS, Int8KVCache, KVCache, apply_rope, rope_frequencies

SLIDING = "sliding_attention"


@dataclasses.dataclass
class Args(ModelArgs):
    """config.json of a gpt_oss checkpoint (keys as in HF; the release's transformers 4.55 names too)."""

    family = "gpt_oss"
    # the release's names of values other keys give (experts_per_token: num_experts_per_tok;
    # initial_context_length: rope original_max_position_embeddings)
    ignored = frozenset({"experts_per_token", "initial_context_length"})

    model_type: str = "gpt_oss"
    vocab_size: int | None = None
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_hidden_layers: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 131072
    attention_bias: bool = True
    tie_word_embeddings: bool = False
    num_local_experts: int | None = None
    num_experts_per_tok: int = 4
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    sliding_window: int | None = 128
    layer_types: list[str] | None = None

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def sliding(self, i: int) -> bool:
        types = self.layer_types or [SLIDING if (j + 1) % 2 else "full_attention" for j in range(self.num_hidden_layers)]
        return types[i] == SLIDING

    def rope(self) -> dict[str, Any]:
        return self.rope_with_theta(150000.0)  # GptOssConfig's default theta

    def validate(self) -> None:
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads", "num_local_experts") if getattr(self, k) is None]
        if missing:
            raise ConfigError(f"config.json (gpt_oss) lacks required key(s) {', '.join(missing)}")
        if self.hidden_act != "silu":
            raise ConfigError(f"config.json hidden_act {self.hidden_act!r} is not supported (supported: silu, which "
                              "gpt-oss's experts replace by their clamped SwiGLU)")
        rope = self.rope()
        kind = rope["rope_type"]
        if kind not in ROPE_KEYS:
            raise ConfigError(f"config.json rope type {kind!r} is not supported (supported: {', '.join(ROPE_KEYS)})")
        extra = sorted(set(rope) - ROPE_KEYS[kind] - {"rope_type", "rope_theta"})
        if extra:
            raise ConfigError(f"config.json rope parameter(s) {', '.join(extra)} are not understood for rope "
                              f"type {kind!r}")
        if self.dim_head % 2:
            raise ConfigError(f"config.json head_dim {self.dim_head} must be even for RoPE")


class Attention(nn.Module):
    def __init__(self, args: Args, sliding: bool, dtype=None, device=None):
        super().__init__()
        h, self.n_heads, self.n_kv, self.head_dim = args.hidden_size, args.num_attention_heads, args.kv_heads, args.dim_head
        kw = dict(dtype=dtype, device=device)
        b = args.attention_bias
        self.q_proj = Linear(h, self.n_heads * self.head_dim, bias=b, **kw)
        self.k_proj = Linear(h, self.n_kv * self.head_dim, bias=b, **kw)
        self.v_proj = Linear(h, self.n_kv * self.head_dim, bias=b, **kw)
        self.o_proj = Linear(self.n_heads * self.head_dim, h, bias=b, **kw)
        self.sinks = nn.Parameter(torch.zeros(self.n_heads, **kw), requires_grad=False)
        self.window = args.sliding_window if sliding else None
        self.kv_scales, self.kv_observer = None, None  # C8 (cvt.runtime.kv_cache), as qwen3's Attention

    def forward(self, x, cos, sin, mask, start_pos, cache):
        """x [b, s, h]; mask [s, T] bool (True = may attend) -> [b, s, h]."""
        b, s, _ = x.shape
        q = apply_rope(self.q_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2), cos, sin)
        k = apply_rope(self.k_proj(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        k, v = kv_cache.cache_input(self, cache is not None, k, v)       # C8 / calibration
        if cache is not None:
            k, v = cache.update(k, v, start_pos)                         # [b, K, T, D]
        if self.window is not None:                                      # keys > query - W
            t = mask.shape[1]
            qpos = torch.arange(t - s, t, device=x.device)[:, None]
            mask = mask & (torch.arange(t, device=x.device)[None, :] > qpos - self.window)
        rep = self.n_heads // self.n_kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        z = (q @ k.transpose(-1, -2)).float() * self.head_dim ** -0.5    # [b, H, s, T]
        z = z.masked_fill(~mask, float("-inf"))
        sink = self.sinks.float().view(1, -1, 1, 1).expand(b, -1, s, 1)
        p = torch.cat((z, sink), dim=-1).softmax(-1)[..., :-1]
        return self.o_proj((p.to(v.dtype) @ v).transpose(1, 2).reshape(b, s, -1))


class Experts(nn.Module):
    """transformers' fused GptOssExperts parameters (module docstring), of the global experts `ids`
    (a contiguous range, `[E, ...]` rows ``e - ids[0]``; all E in one process, a rank's share of
    them in `cvt.runtime.parallel`, where the sharder split the fused tensors along dim 0).

    Seen as the per-expert containers of the other families: ``experts[str(e)](x)`` runs expert
    e (global id) and ``keys()`` lists the ids held, which `cvt.runtime.parallel.ParallelMoE` reads."""

    def __init__(self, args: Args, ids: list[int], dtype=None, device=None):
        super().__init__()
        e, h, i = len(ids), args.hidden_size, args.intermediate_size
        if not ids or ids != list(range(ids[0], ids[0] + e)):
            raise ConfigError(f"gpt-oss's fused experts are held as one contiguous id range per rank, not {ids}")
        self.first = ids[0]
        kw = dict(dtype=dtype, device=device)
        self.gate_up_proj = nn.Parameter(torch.zeros(e, h, 2 * i, **kw), requires_grad=False)
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, 2 * i, **kw), requires_grad=False)
        self.down_proj = nn.Parameter(torch.zeros(e, i, h, **kw), requires_grad=False)
        self.down_proj_bias = nn.Parameter(torch.zeros(e, h, **kw), requires_grad=False)
        self.alpha, self.limit = args.swiglu_alpha, args.swiglu_limit

    def keys(self) -> list[str]:
        return [str(self.first + j) for j in range(self.gate_up_proj.shape[0])]

    def __getitem__(self, key: str):
        return functools.partial(self.expert, int(key))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `e` (global id) on x [n, h] -> [n, h]."""
        j = e - self.first
        g = x @ self.gate_up_proj[j] + self.gate_up_proj_bias[j]
        gate, up = g[..., ::2].clamp(max=self.limit), g[..., 1::2].clamp(-self.limit, self.limit)
        return ((up + 1) * (gate * torch.sigmoid(gate * self.alpha))) @ self.down_proj[j] + self.down_proj_bias[j]


class MoE(nn.Module):
    def __init__(self, args: Args, ids: list[int] | None = None, dtype=None, device=None):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.router = Linear(args.hidden_size, args.num_local_experts, bias=True, dtype=dtype, device=device)
        self.experts = Experts(args, list(range(args.num_local_experts)) if ids is None else list(ids), dtype, device)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, h] -> (weights [n, k], global expert ids [n, k]): the top k router logits, softmaxed."""
        top, idx = self.router(x).topk(self.top_k, dim=-1)
        return top.softmax(-1), idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        w, idx = self.route(x)                                           # [n, k]
        y = torch.zeros_like(x)
        for e in idx.unique().tolist():
            tok, slot = torch.where(idx == e)
            y.index_add_(0, tok, self.experts.expert(e, x[tok]) * w[tok, slot, None])
        return y.view(shape)


class DecoderLayer(nn.Module):
    def __init__(self, args: Args, i: int, dtype=None, device=None, experts: list[int] | None = None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, **kw)
        self.self_attn = Attention(args, args.sliding(i), **kw)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, **kw)
        self.mlp = MoE(args, experts, **kw)

    def forward(self, x, cos, sin, mask, start_pos, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, start_pos, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, args: Args, dtype=None, device=None, experts: dict[int, list[int]] | None = None):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, dtype=dtype, device=device)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(args, i, dtype, device, None if experts is None else experts[i])
                                    for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype=dtype, device=device)


class Model(CausalLM):
    """Causal LM following the contract in `base.py`; parameter names = HF checkpoint names."""

    # a rank's share (`cvt.runtime.parallel`): heads and KV heads / tp; intermediate_size is the
    # experts' width, whole (fused experts split over ep only, `cvt.convert.arch.gpt_oss`)
    parallel = ParallelNames(local_sizes=(("num_attention_heads", "tp"), ("num_key_value_heads", "tp")))

    def __init__(self, args: Args, dtype=None, device=None, experts: dict[int, list[int]] | None = None):
        """`experts`: layer -> the global expert ids this rank holds (None: all)."""
        super().__init__()
        self.args = args
        self.model = Backbone(args, dtype, device, experts)
        self.lm_head = (None if args.tie_word_embeddings
                        else Linear(args.hidden_size, args.vocab_size, dtype=dtype, device=device))
        self.inv_freq, self.rope_scale = rope_frequencies(args)

    def new_cache(self, batch: int, max_len: int, dtype=None, device=None, quant: str | None = "auto") -> list:
        """One cache per layer, k / v [batch, kv_heads, max_len, head_dim] (a sliding layer's too:
        its window is the mask's); `quant` as qwen3's `new_cache` (the C8 `Int8KVCache` when the
        model carries KV-cache scales)."""
        scales, codec = self.cache_scales(max_len, quant)
        w, a = self.model.embed_tokens.weight, self.args
        if scales is not None:
            return [Int8KVCache(batch, a.kv_heads, max_len, a.dim_head, ks, vs, device or w.device, codec)
                    for ks, vs in scales]
        return [KVCache(batch, a.kv_heads, max_len, a.dim_head, dtype or w.dtype, device or w.device)
                for _ in range(a.num_hidden_layers)]

    def rope_at(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = pos[:, None].float() * self.inv_freq.to(pos.device)[None]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.rope_scale).to(dtype), (emb.sin() * self.rope_scale).to(dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return F.linear(x, self.model.embed_tokens.weight.to(x.dtype)).float()
        return self.lm_head(x).float()
