"""DeepSeek-V3 family: V3, R1, V3.1 (model_type deepseek_v3) and Kimi-K2 (kimi_k2).

The semantics are those of the official reference (deepseek-ai/DeepSeek-V3 inference/model.py,
``attn_impl="absorb"``); tensor names are those of the Hugging Face checkpoints.

Shapes: b batch, s new tokens, T = start_pos + s attended positions, h hidden_size, H heads,
dn / dr / dv = qk_nope / qk_rope / v head dims, C = kv_lora_rank, E routed experts, G groups,
k experts per token, n = b*s tokens.

    x_0 = embed_tokens[tokens]                                                   [b, s, h]
    for each decoder layer (MTP layers excluded):
        a      = input_layernorm(x)
        q      = q_b_proj(q_a_layernorm(q_a_proj(a)))   (q_proj(a) when q_lora_rank is null)
               -> [b, s, H, dn + dr] = q_nope [.., dn] | q_pe [.., dr];  q_pe = rope(q_pe)
        c, kpe = kv_a_proj_with_mqa(a) -> [b, s, C] | [b, s, dr]
        c      = kv_a_layernorm(c);  kpe = rope(kpe)       (one rope key shared by all heads)
        cache  : kv[:, start_pos:T] = c,  pe[:, start_pos:T] = kpe    (absorbed MLA cache)
        Wk, Wv = kv_b_proj.weight viewed [H, dn + dv, C] -> [H, dn, C], [H, dv, C]
        q_abs  = q_nope @ Wk                          einsum bshd,hdc->bshc           [b, s, H, C]
        scores = (q_abs . kv + q_pe . pe) * softmax_scale + causal mask         [b, s, H, T]
        o      = (softmax_fp32(scores) @ kv) @ Wv^T   einsum bsht,btc->bshc ; bshc,hdc->bshd
        x      = x + o_proj(o.flatten(2))
        m      = post_attention_layernorm(x)
        x      = x + (mlp(m) if i < first_k_dense_replace else moe(m))
    logits = lm_head(norm(x)).float()                                              [b, s, vocab]

    SwiGLU:  mlp(m) = down_proj(silu(gate_proj(m)) * up_proj(m))
    MoE router (noaux_tc, float32):
        p      = sigmoid(m @ gate.weight^T)                                          [n, E]
        sel    = p + e_score_correction_bias                  (bias used for selection only)
        groups : score of a group = sum of its top-2 sel; keep topk_group of G groups,
                 sel of the others = -inf                          (only when n_group > 1)
        idx    = topk(sel, k);  w = p[idx];  w /= sum(w) if norm_topk_prob;  w *= routed_scaling_factor
        moe(m) = sum_j w_j * experts[idx_j](m) + shared_experts(m)

RoPE on dr dims: rope_interleave (the release layout) rotates adjacent pairs (x0, x1), (x2, x3)
like the official complex `apply_rotary_emb`; otherwise the halves (x_i, x_{i+dr/2}).
inv_freq_i = rope_theta^(-2i/dr). YaRN (rope type 'yarn'), as the official
`precompute_freqs_cis`, applies only when the model's sequence length (here
max_position_embeddings) exceeds original_max_position_embeddings; then
    inv_freq = inv_freq / factor * (1 - smooth) + inv_freq * smooth,  smooth = 1 - ramp(low, high)
    softmax_scale = (dn + dr)^-0.5 * mscale(factor, mscale_all_dim)^2,  mscale(f, m) = 0.1 m ln f + 1
    cos / sin are multiplied by mscale(factor, mscale) / mscale(factor, mscale_all_dim) (1 in all
    releases, where mscale == mscale_all_dim; DeepSeek's modeling_deepseek.py semantics).
transformers applies YaRN whenever the rope type is yarn; both agree for every release
(max_position_embeddings 131072-163840 > 4096).

MTP layers (model.layers.{num_hidden_layers + j}) are built so that checkpoints load by name,
but `forward` does not run them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from cvt.convert.arch.deepseek_v3 import DEFAULTS as ROUTING
from cvt.runtime import kv_cache
from cvt.runtime.kernels import Linear
from cvt.runtime.models.base import (MLP, CausalLM, ConfigError, ModelArgs, RMSNorm, build_experts, check_room,
                                     run_experts)

# eps of MLA's latent norms (q_a_layernorm, kv_a_layernorm): a constant, not rms_norm_eps, in
# DeepSeek's official inference/model.py (RMSNorm's default), the releases' modeling_deepseek.py and
# transformers 5 (DeepseekV3 / V32 / GlmMoeDsa RMSNorm(rank) with the default eps). Equal to
# rms_norm_eps in the DeepSeek and Kimi releases; GLM-5's rms_norm_eps is 1e-5 (vLLM and SGLang's
# deepseek_v2 read rms_norm_eps here, so they depart from transformers for GLM-5 only).
LATENT_NORM_EPS = 1e-6

YARN_KEYS = frozenset({"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                       "mscale_all_dim", "truncate"})


class Rope(NamedTuple):
    """RoPE settings resolved from rope_theta / rope_scaling / rope_parameters."""

    theta: float
    kind: str                      # "default" or "yarn"
    factor: float = 1.0
    original: int = 0              # original_max_position_embeddings
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclasses.dataclass
class Args(ModelArgs):
    """config.json of a DeepSeek-V3 / R1 / V3.1 / Kimi-K2 checkpoint; fields are the HF keys.

    Defaults are transformers' DeepseekV3Config defaults, so an omitted key means what it
    means to transformers. Only the released feature set is accepted (validate()).
    """

    family: ClassVar[str] = "deepseek_v3"
    ignored: ClassVar[frozenset[str]] = frozenset({"head_dim"})  # transformers 5 derives it (= qk_rope_head_dim)

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432               # dense MLP width (layers < first_k_dense_replace)
    moe_intermediate_size: int = 2048            # routed expert width; shared experts: x n_shared_experts
    num_hidden_layers: int = 61
    num_nextn_predict_layers: int | None = 0     # MTP layers stored after the decoder layers
    num_attention_heads: int = 128
    num_key_value_heads: int | None = None       # MLA: must equal num_attention_heads
    # MLA
    q_lora_rank: int | None = 1536               # None: q_proj instead of q_a_proj/q_a_layernorm/q_b_proj
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_head_dim: int | None = None               # derived (nope + rope), checked when present
    attention_bias: bool = False
    # MoE
    n_routed_experts: int = 256
    n_shared_experts: int | None = 1
    num_experts_per_tok: int = 8
    # routing defaults: the arch table's (written explicitly into every output config)
    n_group: int | None = ROUTING["n_group"]
    topk_group: int | None = ROUTING["topk_group"]
    routed_scaling_factor: float = ROUTING["routed_scaling_factor"]
    norm_topk_prob: bool = ROUTING["norm_topk_prob"]
    scoring_func: str = ROUTING["scoring_func"]
    topk_method: str = ROUTING["topk_method"]
    first_k_dense_replace: int | None = 3
    moe_layer_freq: int = 1
    # misc (hidden_act, rms_norm_eps and the rope keys: base.ModelArgs)
    max_position_embeddings: int = 4096
    rope_interleave: bool = True

    @property
    def n_mtp(self) -> int:
        return self.num_nextn_predict_layers or 0

    @property
    def n_dense(self) -> int:
        return self.first_k_dense_replace or 0

    def rope(self) -> Rope:
        """Merge rope_theta / rope_scaling / rope_parameters; ConfigError for anything else."""
        p = self.rope_config()
        kind = p.pop("rope_type", None) or p.pop("type", None) or "default"
        if p.get("type", kind) != kind:
            raise ConfigError(f"config.json rope 'type' {p['type']!r} disagrees with 'rope_type' {kind!r}")
        p.pop("type", None)
        theta = p.pop("rope_theta", None)
        if theta is not None and self.rope_theta is not None and float(theta) != float(self.rope_theta):
            raise ConfigError(f"config.json rope_theta {self.rope_theta} disagrees with "
                              f"rope_parameters.rope_theta {theta}")
        theta = float(theta if theta is not None else self.rope_theta if self.rope_theta is not None else 10000.0)
        if kind == "default":
            if p:
                raise ConfigError(f"config.json rope parameter(s) {', '.join(sorted(p))} are not understood "
                                  "for rope type 'default'")
            return Rope(theta, kind)
        if kind != "yarn":
            raise ConfigError(f"config.json rope type {kind!r} is not supported by the deepseek_v3 runtime "
                              "(supported: default, yarn)")
        extra = sorted(set(p) - YARN_KEYS)
        if extra:
            raise ConfigError(f"config.json rope parameter(s) {', '.join(extra)} are not understood for rope type "
                              f"'yarn' (known: {', '.join(sorted(YARN_KEYS))})")
        if p.get("truncate", True) is not True:
            raise ConfigError("config.json rope 'truncate' false is not supported (supported: true)")
        if not p.get("factor") or not p.get("original_max_position_embeddings"):
            raise ConfigError("config.json rope type 'yarn' needs 'factor' and 'original_max_position_embeddings'")
        if p["factor"] < 1:
            raise ConfigError(f"config.json rope 'factor' {p['factor']} must be >= 1")
        return Rope(theta, kind, float(p["factor"]), int(p["original_max_position_embeddings"]),
                    float(p.get("beta_fast") or 32), float(p.get("beta_slow") or 1),
                    float(p.get("mscale", 1.0) or 0.0), float(p.get("mscale_all_dim", 0.0) or 0.0))

    def validate(self) -> None:
        def bad(key, value, supported):
            raise ConfigError(f"config.json {key} {value!r} is not supported by the deepseek_v3 runtime "
                              f"(supported: {supported})")

        if self.hidden_act != "silu":
            bad("hidden_act", self.hidden_act, "silu")
        if self.attention_bias:
            bad("attention_bias", self.attention_bias, "false")
        if self.scoring_func != "sigmoid":
            bad("scoring_func", self.scoring_func, "sigmoid")
        if self.topk_method != "noaux_tc":
            bad("topk_method", self.topk_method, "noaux_tc")
        if self.moe_layer_freq != 1:
            bad("moe_layer_freq", self.moe_layer_freq, "1")
        if self.num_key_value_heads not in (None, self.num_attention_heads):
            bad("num_key_value_heads", self.num_key_value_heads, f"num_attention_heads ({self.num_attention_heads})")
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.qk_head_dim not in (None, qk):
            bad("qk_head_dim", self.qk_head_dim, f"qk_nope_head_dim + qk_rope_head_dim ({qk})")
        if self.qk_rope_head_dim % 2:
            bad("qk_rope_head_dim", self.qk_rope_head_dim, "an even number")
        g, e = self.n_group or 1, self.n_routed_experts
        if e % g or (g > 1 and e // g < 2):
            bad("n_group", self.n_group, f"a divisor of n_routed_experts ({e}) leaving >= 2 experts per group")
        if not 1 <= (self.topk_group or 1) <= g:
            bad("topk_group", self.topk_group, f"1..n_group ({g})")
        if not 1 <= self.num_experts_per_tok <= (self.topk_group or 1) * e // g:
            bad("num_experts_per_tok", self.num_experts_per_tok, "1..topk_group * experts per group")
        self.rope()


def yarn_mscale(factor: float, m: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def rope_tables(args: Args) -> tuple[torch.Tensor, float, float]:
    """(inv_freq float32 [dr/2], cos/sin multiplier, softmax_scale) as the official
    `precompute_freqs_cis` and `MLA.__init__` compute them, with max_seq_len = max_position_embeddings."""
    r, dim, cpu = args.rope(), args.qk_rope_head_dim, torch.device("cpu")  # cpu even under torch.device("meta")
    inv_freq = 1.0 / (r.theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=cpu) / dim))
    scale = (args.qk_nope_head_dim + args.qk_rope_head_dim) ** -0.5
    if r.kind != "yarn" or args.max_position_embeddings <= r.original:
        return inv_freq, 1.0, scale

    def correction_dim(rotations):
        return dim * math.log(r.original / (rotations * 2 * math.pi)) / (2 * math.log(r.theta))

    low = max(math.floor(correction_dim(r.beta_fast)), 0)
    high = min(math.ceil(correction_dim(r.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=cpu) - low) / (high - low)).clamp(0, 1)
    smooth = 1 - ramp
    inv_freq = inv_freq / r.factor * (1 - smooth) + inv_freq * smooth
    attn = yarn_mscale(r.factor, r.mscale) / yarn_mscale(r.factor, r.mscale_all_dim)
    if r.mscale_all_dim:
        scale *= yarn_mscale(r.factor, r.mscale_all_dim) ** 2
    return inv_freq, attn, scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """x [b, s, heads, dr]; cos, sin float32 [s, dr/2] -> rotated x (same layout, x's dtype).

    interleave: pairs (x_2i, x_2i+1), i.e. the official view_as_complex(x.reshape(.., dr/2, 2)) *
    freqs_cis; otherwise pairs (x_i, x_i+dr/2) (rotate_half)."""
    dtype, half = x.dtype, x.shape[-1] // 2
    x = x.float()
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleave else (x[..., :half], x[..., half:])
    cos, sin = cos[:, None], sin[:, None]
    y1, y2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    y = torch.stack((y1, y2), dim=-1).flatten(-2) if interleave else torch.cat((y1, y2), dim=-1)
    return y.to(dtype)


class MLACache:
    """One layer's absorbed MLA cache (official ``attn_impl="absorb"``).

    kv [batch, max_len, kv_lora_rank]: the normalized latent kv_a_layernorm(c);
    pe [batch, max_len, qk_rope_head_dim]: the rotated shared rope key.

    `quant` names the storage: None keeps the compute dtype; `Int8MLACache` (``quant =
    "int8"``, the C8 cache of `cvt.runtime.kv_cache`) stores int8 kv / pe and dequantizes in
    `read`. Attention only calls `write` / `read`; `Model.new_cache` is the one place that
    picks the class.
    """

    quant: str | None = None

    def __init__(self, batch: int, max_len: int, kv_lora_rank: int, rope_dim: int, dtype=None, device=None):
        self.kv = torch.zeros(batch, max_len, kv_lora_rank, dtype=dtype, device=device)
        self.pe = torch.zeros(batch, max_len, rope_dim, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        """Bytes of the cache storage."""
        return self.kv.nbytes + self.pe.nbytes

    def _check(self, b: int, start_pos: int, end: int) -> None:
        check_room("MLA cache", self.kv, 1, b, start_pos, end)

    def write(self, start_pos: int, kv: torch.Tensor, pe: torch.Tensor) -> None:
        """Store kv [b, s, C], pe [b, s, dr] at positions start_pos .. start_pos+s-1."""
        b, end = kv.shape[0], start_pos + kv.shape[1]
        self._check(b, start_pos, end)
        self.kv[:b, start_pos:end] = kv
        self.pe[:b, start_pos:end] = pe

    def read(self, batch: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """kv [batch, end, C], pe [batch, end, dr] for positions 0 .. end-1."""
        return self.kv[:batch, :end], self.pe[:batch, :end]


class Int8MLACache(MLACache):
    """C8 MLA cache (FAKQuant, `cvt.runtime.kv_cache`): the latent kv stored int8 with one
    static float32 scale (``kv_scale`` [1]: q = clamp(round(x / scale), -128, 127); read returns
    q * scale in `dtype`); pe int8 too when ``pe_scale`` is given, else kept in `dtype` (the
    Ascend stacks quantize only the latent)."""

    quant = "int8"  # or "fp8" (vLLM's FP8 cache, compressed-tensors outputs)

    def __init__(self, batch: int, max_len: int, kv_lora_rank: int, rope_dim: int, kv_scale: torch.Tensor,
                 pe_scale: torch.Tensor | None = None, dtype=None, device=None, codec: str = "int8"):
        device = device if device is not None else kv_scale.device
        self.dtype, self.quant = dtype or torch.get_default_dtype(), codec
        store = kv_cache.STORAGE[codec]
        self.kv = torch.zeros(batch, max_len, kv_lora_rank, dtype=store, device=device)
        self.pe = torch.zeros(batch, max_len, rope_dim, dtype=store if pe_scale is not None else self.dtype,
                              device=device)
        self.kv_scale = kv_scale.float().to(device)
        self.pe_scale = None if pe_scale is None else pe_scale.float().to(device)

    def write(self, start_pos: int, kv: torch.Tensor, pe: torch.Tensor) -> None:
        b, end = kv.shape[0], start_pos + kv.shape[1]
        self._check(b, start_pos, end)
        self.kv[:b, start_pos:end] = kv_cache.quantize(kv, self.kv_scale, self.quant)
        self.pe[:b, start_pos:end] = pe if self.pe_scale is None else kv_cache.quantize(pe, self.pe_scale, self.quant)

    def read(self, batch: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        pe = self.pe[:batch, :end]
        return (kv_cache.dequantize(self.kv[:batch, :end], self.kv_scale, self.dtype),
                pe if self.pe_scale is None else kv_cache.dequantize(pe, self.pe_scale, self.dtype))


class MLA(nn.Module):
    """Multi-head latent attention, computed absorbed (see the module docstring)."""

    def __init__(self, args: Args, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        h, self.n_heads = args.hidden_size, args.num_attention_heads
        self.nope, self.rope, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.kv_lora_rank, self.interleave = args.kv_lora_rank, args.rope_interleave
        qk = self.nope + self.rope
        self.q_lora = bool(args.q_lora_rank)
        if self.q_lora:
            self.q_a_proj = Linear(h, args.q_lora_rank, **kw)
            self.q_a_layernorm = RMSNorm(args.q_lora_rank, LATENT_NORM_EPS, **kw)
            self.q_b_proj = Linear(args.q_lora_rank, self.n_heads * qk, **kw)
        else:
            self.q_proj = Linear(h, self.n_heads * qk, **kw)
        self.kv_a_proj_with_mqa = Linear(h, self.kv_lora_rank + self.rope, **kw)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS, **kw)
        self.kv_b_proj = Linear(self.kv_lora_rank, self.n_heads * (self.nope + self.v_dim), **kw)
        self.o_proj = Linear(self.n_heads * self.v_dim, h, **kw)
        self.softmax_scale = rope_tables(args)[2]
        # C8 (cvt.runtime.kv_cache): (latent [1], k_pe None: float) float32 scales once attached;
        # plain attributes, not in the state_dict; kv_observer is set while calibrating
        self.kv_scales: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.kv_extra: dict[str, torch.Tensor] = {}
        self.kv_observer = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                start_pos: int, cache: MLACache | None) -> torch.Tensor:
        """x [b, s, h]; cos, sin [s, dr/2]; mask [s, T] bool (True = may attend) -> [b, s, h]."""
        b, s, _ = x.shape
        qr = self.q_a_layernorm(self.q_a_proj(x)) if self.q_lora else None              # [b, s, q_lora]
        q = self.q_b_proj(qr) if self.q_lora else self.q_proj(x)
        q_nope, q_pe = q.view(b, s, self.n_heads, -1).split([self.nope, self.rope], dim=-1)
        q_pe = apply_rope(q_pe, cos, sin, self.interleave)                         # [b, s, H, dr]
        kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.kv_a_layernorm(kv)                                               # [b, s, C]
        k_pe = apply_rope(k_pe.unsqueeze(2), cos, sin, self.interleave).squeeze(2)  # [b, s, dr]
        kv, k_pe = kv_cache.cache_input(self, cache is not None, kv, k_pe)        # C8 / calibration
        if cache is not None:
            cache.write(start_pos, kv, k_pe)
            kv, k_pe = cache.read(b, start_pos + s)                                # [b, T, C], [b, T, dr]
            kv, k_pe = kv.to(x.dtype), k_pe.to(x.dtype)
        wkv_b = self.kv_b_proj.dense_weight().to(x.dtype).view(self.n_heads, -1, self.kv_lora_rank)
        q_abs = torch.einsum("bshd,hdc->bshc", q_nope, wkv_b[:, :self.nope])       # [b, s, H, C]
        kv_cache.query_input(self, q_abs)                                          # fa_q calibration
        scores = (torch.einsum("bshc,btc->bsht", q_abs, kv)
                  + torch.einsum("bshr,btr->bsht", q_pe, k_pe)) * self.softmax_scale  # [b, s, H, T]
        keep = self.keep(x, qr, cos, sin, mask, start_pos, cache)                   # [1 or b, s, T]
        scores = scores.masked_fill(~keep[:, :, None, :], float("-inf"))
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(x.dtype)
        o = torch.einsum("bsht,btc->bshc", probs, kv)                              # [b, s, H, C]
        o = torch.einsum("bshc,hdc->bshd", o, wkv_b[:, -self.v_dim:])              # [b, s, H, dv]
        return self.o_proj(o.flatten(2))

    def keep(self, x: torch.Tensor, qr: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
             mask: torch.Tensor, start_pos: int, cache) -> torch.Tensor:
        """The keys each query attends, bool [1 or b, s, T]: here the causal mask; DeepSeek-V3.2's
        sparse attention (`deepseek_v32.SparseMLA`) narrows it to its indexer's top-k. Called after
        the MLA cache write, with qr = q_a_layernorm(q_a_proj(x)) (None without q_lora)."""
        return mask[None]


class Gate(nn.Module):
    """noaux_tc router: weight [E, h] (model dtype), e_score_correction_bias [E] (float32)."""

    def __init__(self, args: Args, dtype=None, device=None):
        super().__init__()
        self.top_k, self.n_group, self.topk_group = args.num_experts_per_tok, args.n_group or 1, args.topk_group or 1
        self.norm_topk_prob, self.scale = args.norm_topk_prob, args.routed_scaling_factor
        e = args.n_routed_experts
        self.weight = nn.Parameter(torch.empty(e, args.hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(e, dtype=torch.float32, device=device),
                                                    requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, h] -> (weights float32 [n, k], expert ids int64 [n, k])."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()              # [n, E]
        sel = scores + self.e_score_correction_bias.float()
        if self.n_group > 1:
            grouped = sel.view(x.shape[0], self.n_group, -1)                     # [n, G, E/G]
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)                # [n, G]
            keep = group_scores.topk(self.topk_group, dim=-1)[1]
            drop = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, keep, False)
            sel = grouped.masked_fill(drop[..., None], float("-inf")).flatten(1)
        idx = sel.topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, idx)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.scale, idx


class MoE(nn.Module):
    """Routed SwiGLU experts (`gate` picks k per token) plus always-on `shared_experts`.
    `experts`: the global ids to build (None: all; see `base.build_experts`)."""

    def __init__(self, args: Args, dtype=None, device=None, experts=None):
        super().__init__()
        h, inter = args.hidden_size, args.moe_intermediate_size
        self.gate = Gate(args, dtype, device)
        self.experts = build_experts(experts, args.n_routed_experts,
                                     lambda: MLP(h, inter, dtype=dtype, device=device))
        shared = args.n_shared_experts or 0
        self.shared_experts = MLP(h, inter * shared, dtype=dtype, device=device) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, s, h] -> [b, s, h]."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])                                             # [n, h]
        weights, idx = self.route(x)                                             # [n, k]
        y = run_experts(x, idx, weights, self.experts)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y.view(shape)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, h] -> (weights float32 [n, k], global expert ids int64 [n, k])."""
        return self.gate(x)


class DecoderLayer(nn.Module):
    def __init__(self, args: Args, i: int, dtype=None, device=None, experts=None, attention=MLA):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, **kw)
        self.self_attn = attention(args, **kw)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, **kw)
        self.mlp = (MLP(args.hidden_size, args.intermediate_size, **kw) if i < args.n_dense
                    else MoE(args, **kw, experts=experts))

    def forward(self, x, cos, sin, mask, start_pos, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, start_pos, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class SharedHead(nn.Module):
    def __init__(self, args: Args, dtype=None, device=None):
        super().__init__()
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype=dtype, device=device)
        self.head = Linear(args.hidden_size, args.vocab_size, dtype=dtype, device=device)


class MTPLayer(DecoderLayer):
    """Multi-token-prediction layer: a full decoder layer plus its own embed_tokens, enorm, hnorm,
    eh_proj [h, 2h] and shared_head (norm, head). Loadable by name; `Model.forward` skips it."""

    def __init__(self, args: Args, i: int, dtype=None, device=None, experts=None, attention=MLA):
        super().__init__(args, i, dtype, device, experts, attention)
        h = args.hidden_size
        self.embed_tokens = nn.Embedding(args.vocab_size, h, dtype=dtype, device=device)
        self.embed_tokens.weight.requires_grad_(False)
        self.enorm = RMSNorm(h, args.rms_norm_eps, dtype=dtype, device=device)
        self.hnorm = RMSNorm(h, args.rms_norm_eps, dtype=dtype, device=device)
        self.eh_proj = Linear(2 * h, h, dtype=dtype, device=device)
        self.shared_head = SharedHead(args, dtype, device)


class Backbone(nn.Module):
    """The checkpoint's `model.` prefix: embed_tokens, layers (decoder + MTP), norm."""

    def __init__(self, args: Args, dtype=None, device=None, mtp: bool = True, experts=None, attention=MLA):
        super().__init__()
        n = args.num_hidden_layers
        ids = (lambda i: None) if experts is None else experts.get
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, dtype=dtype, device=device)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList([DecoderLayer(args, i, dtype, device, ids(i), attention) for i in range(n)]
                                    + [MTPLayer(args, n + j, dtype, device, ids(n + j), attention)
                                       for j in range(args.n_mtp if mtp else 0)])
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype=dtype, device=device)


class Model(CausalLM):
    """Causal LM following the contract in `base.py`; parameter names = HF checkpoint names.

    dtype (default: torch's default dtype) applies to every weight but the float32 router bias;
    `mtp=False` leaves the MTP layers out (their tensors are then simply not loaded);
    `experts` (MoE layer -> global expert ids) builds only those routed experts (a rank of
    `cvt.runtime.parallel`; None: all). `attention`: the attention class of every layer (DeepSeek-V3.2
    sets its sparse one).
    """

    attention: ClassVar[type[nn.Module]] = MLA
    cache_name = "MLA cache"

    def __init__(self, args: Args, dtype=None, device=None, mtp: bool = True, experts=None):
        super().__init__()
        self.args = args
        self.model = Backbone(args, dtype, device, mtp, experts, self.attention)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, dtype=dtype, device=device)
        # plain attributes, not buffers: computed on CPU even for device="meta", not in state_dict
        self.inv_freq, self.rope_scale, self.softmax_scale = rope_tables(args)

    def new_cache(self, batch: int, max_len: int, dtype=None, device=None,
                  quant: str | None = "auto") -> list[MLACache]:
        """One absorbed cache per decoder layer: kv [batch, max_len, kv_lora_rank] and
        pe [batch, max_len, qk_rope_head_dim]. `quant`: "auto" (default) = "int8" when the model
        carries KV-cache scales (C8, `cvt.runtime.kv_cache`), else None; None = storage in the
        compute dtype (`dtype`, default the model's); "int8" = `Int8MLACache` (reads return
        `dtype`), a CvtError when the model has no scales."""
        scales, codec = self.cache_scales(max_len, quant)
        w, a = self.model.embed_tokens.weight, self.args
        if scales is not None:
            return [Int8MLACache(batch, max_len, a.kv_lora_rank, a.qk_rope_head_dim, ks, ps, dtype or w.dtype,
                                 device or w.device, codec) for ks, ps in scales]
        return [MLACache(batch, max_len, a.kv_lora_rank, a.qk_rope_head_dim, dtype or w.dtype, device or w.device)
                for _ in range(a.num_hidden_layers)]

    def rope_at(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin float32 [s, dr/2] (`apply_rope` rotates in float32)."""
        freqs = pos[:, None].float() * self.inv_freq.to(pos.device)[None]      # [s, dr/2] float32
        return freqs.cos() * self.rope_scale, freqs.sin() * self.rope_scale
