"""DeepSeek-V4 (model_type deepseek_v4): hyper-connected MoE with sliding + compressed attention.

Modules carry the release's names (`cvt.convert.arch.deepseek_v4`: ``embed``,
``layers.{i}.attn.wq_a``, ``layers.{i}.ffn.experts.{e}.w1``, ``head``, ``hc_head_fn``), so the
release's tensors load by name. The math is transformers 5's DeepseekV4ForCausalLM (the referee
of the tests). Shapes: b batch, s new tokens, t = start_pos + s positions so far, d hidden,
hc = hc_mult streams, H heads of D = head_dim (one shared K=V head), dr = qk_rope_head_dim.

* residual: ``hc`` streams [b, s, hc, d]; each block: (pre, post, comb) from the streams
  (`hyper`: RMS-normed flat streams @ hc_*_fn, sigmoid / 2 sigmoid / softmax + Sinkhorn),
  x = sum_k pre_k stream_k, y = block(norm(x)), streams = post * y + comb^T @ streams;
* attention: q = rms(wq_b(q_norm(wq_a x))) per head, kv = kv_norm(wkv x) [b, s, D], both
  roped on their last dr channels (adjacent pairs); keys = the last `sliding_window` kv
  (itself included) + compressed entries; per-head sink logit in the softmax; the output's
  rope slice rotated back (-sin); grouped wo_a (G groups) then wo_b;
* compressed entries (ratio r > 0): each complete window w of r tokens gives one entry
  norm(sum_j softmax_j(wgate x_j + ape_j) * wkv x_j) roped at position w*r; at r == 4 two
  series overlap (entry w mixes window w-1's first D channels with window w's last D) and a
  lightning indexer (its own compressor at index_head_dim) keeps, per query, the top
  index_topk entries by sum_h w_h relu(q_h . k); a query at t sees entries w < (t+1) // r;
* MoE: scores = sqrt(softplus(x @ gate^T)) (or sigmoid); top-k of scores + bias,
  or ``tid2eid[token]`` in the hash layers; weights normalized, times routed_scaling_factor;
  experts and the shared expert clamp gate <= swiglu_limit, |up| <= swiglu_limit;
* head: streams collapsed by hc_head (sigmoid weights), final norm, head.

RoPE: sliding-window layers use rope_theta; CSA / HCA layers (and their compressors and
indexer) compress_rope_theta with the config's YaRN (``rope_scaling``), cos / sin unscaled.
Not implemented (refused by `Args.validate`, by key): other rope scalings, softmax routing
(transformers has none). MTP layers (``mtp.{j}``) run through `Model.mtp_logits` (whole
sequences, no cache). The indexer breaks ties in its top-k towards the earlier entry (stable
sort; ReLU scores tie at 0), so cached decode keeps what the full forward keeps. The cache
holds every position's kv and compressor projections (cached decode = full forward).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from cvt.convert.arch.deepseek_v4 import DEFAULTS, compress_ratios, num_hash_layers
from cvt.errors import CvtError
from cvt.runtime.kernels import Linear
from cvt.runtime.models.deepseek_v4_rope import check_nested_rope, nested_compress
from cvt.runtime.models.base import ConfigError, ModelArgs, ParallelNames, RMSNorm, build_experts, run_experts


YARN_KEYS = frozenset({"type", "rope_type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                       "mscale", "mscale_all_dim", "attention_factor", "rope_theta", "partial_rotary_factor"})


@dataclasses.dataclass
class Args(ModelArgs):
    """config.json of a DeepSeek-V4 checkpoint; defaults are transformers' DeepseekV4Config's."""

    family: ClassVar[str] = "deepseek_v4"

    vocab_size: int = 129280
    hidden_size: int = 4096
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int | None = None
    partial_rotary_factor: float | None = None
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    scoring_func: str = DEFAULTS["scoring_func"]
    norm_topk_prob: bool = True
    routed_scaling_factor: float = DEFAULTS["routed_scaling_factor"]
    swiglu_limit: float = DEFAULTS["swiglu_limit"]
    sliding_window: int = DEFAULTS["sliding_window"]
    compress_ratios: list | None = None
    layer_types: list | None = None
    compress_rates: dict | None = None
    mlp_layer_types: list | None = None
    num_hash_layers: int | None = None
    compress_rope_theta: float = DEFAULTS["compress_rope_theta"]
    index_n_heads: int = DEFAULTS["index_n_heads"]
    index_head_dim: int = DEFAULTS["index_head_dim"]
    index_topk: int = DEFAULTS["index_topk"]
    hc_mult: int = DEFAULTS["hc_mult"]
    hc_sinkhorn_iters: int = DEFAULTS["hc_sinkhorn_iters"]
    hc_eps: float = DEFAULTS["hc_eps"]
    num_nextn_predict_layers: int = 1
    max_position_embeddings: int = 1048576
    expert_dtype: str | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    topk_method: str | None = None  # V4-Pro's config.json says "noaux_tc" (the bias-steered top-k below)

    def validate(self) -> None:
        def bad(key, why):
            raise ConfigError(f"config.json {key}: {why} (the deepseek_v4 runtime does not implement it)")

        check_nested_rope(self, bad)
        rc = self.rope_config()
        kind = rc.get("rope_type", rc.get("type", "default")) if rc else "default"
        if kind not in ("default", "yarn") or set(rc) - YARN_KEYS:
            bad("rope_scaling / rope_parameters", f"{rc!r}: YaRN (or no scaling) with keys {sorted(YARN_KEYS)} only")
        if kind == "yarn" and not (rc.get("factor") and rc.get("original_max_position_embeddings")):
            bad("rope_scaling", "YaRN needs factor and original_max_position_embeddings")
        if self.attention_bias or self.mlp_bias:
            bad("attention_bias / mlp_bias", "biases on the linears")
        if self.topk_method not in (None, "noaux_tc"):
            bad("topk_method", f"{self.topk_method!r} (noaux_tc only)")
        if self.hidden_act != "silu":
            bad("hidden_act", f"{self.hidden_act!r} (silu only)")
        if self.scoring_func not in ("sqrtsoftplus", "sigmoid"):
            bad("scoring_func", repr(self.scoring_func))
        if self.rope_dim % 2 or self.rope_dim >= self.head_dim:
            bad("qk_rope_head_dim", f"{self.rope_dim}: even and below head_dim")
        if self.rope_theta is None:
            self.rope_theta = DEFAULTS["rope_theta"]

    def rope_config(self) -> dict[str, Any]:
        """The compressed layers' rope scaling (transformers' nested form: `deepseek_v4_rope`)."""
        comp = nested_compress(self)
        return {**(self.rope_scaling or {}), **comp} if comp is not None else super().rope_config()

    @property
    def rope_dim(self) -> int:
        if self.qk_rope_head_dim is not None:
            return self.qk_rope_head_dim
        return int(self.head_dim * (self.partial_rotary_factor or 64 / 512))

    def compress_inv_freq(self) -> tuple[torch.Tensor, float]:
        """(inv_freq [dr/2], cos / sin multiplier) of the compressed layers' rope: base
        compress_rope_theta, YaRN when the config asks (transformers `_compute_yarn_parameters`,
        with the attention factor 1.0 DeepseekV4Config forces: the official code scales no cos / sin)."""
        dim, base = self.rope_dim, self.compress_rope_theta
        pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        rc = self.rope_config()
        if rc.get("rope_type", rc.get("type")) != "yarn":
            return 1.0 / pos_freqs, 1.0
        factor, orig = rc["factor"], rc["original_max_position_embeddings"]

        def corr(rot):
            return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corr(rc.get("beta_fast") or 32)), 0)
        high = min(math.ceil(corr(rc.get("beta_slow") or 1)), dim - 1)
        if low == high:
            high += 0.001
        extra = 1 - ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        inv = 1.0 / (factor * pos_freqs) * (1 - extra) + 1.0 / pos_freqs * extra
        return inv, float(rc.get("attention_factor", 1.0))

    def as_config(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def ratios(self) -> list[int]:
        return compress_ratios(self.as_config())

    def hash_layers(self) -> int:
        return num_hash_layers(self.as_config())


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the last 2 * cos.shape[-1] channels of x [..., s, heads, n] in adjacent pairs;
    cos / sin [s, dr/2] (transformers' DeepseekV4 `apply_rotary_pos_emb`)."""
    dr = 2 * cos.shape[-1]
    nope, r = x[..., :-dr], x[..., -dr:].float()
    x1, x2 = r[..., 0::2], r[..., 1::2]
    c, s_ = cos[:, None], sin[:, None]
    y = torch.stack((x1 * c - x2 * s_, x2 * c + x1 * s_), dim=-1).flatten(-2)
    return torch.cat([nope, y.to(x.dtype)], dim=-1)


def unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class Compressor(nn.Module):
    """One compressed series at `dim` channels (module docstring); ``ape`` [r, c*dim]."""

    def __init__(self, args: Args, ratio: int, dim: int, dtype=None, device=None):
        super().__init__()
        self.ratio, self.dim, self.overlap = ratio, dim, ratio == 4
        c = 2 if self.overlap else 1
        self.ape = nn.Parameter(torch.zeros(ratio, c * dim, dtype=dtype, device=device), requires_grad=False)
        self.wkv = Linear(args.hidden_size, c * dim, dtype=dtype, device=device)
        self.wgate = Linear(args.hidden_size, c * dim, dtype=dtype, device=device)
        self.norm = RMSNorm(dim, args.rms_norm_eps, dtype=dtype, device=device)

    def entries(self, kv: torch.Tensor, gate: torch.Tensor, first: int, cos, sin) -> torch.Tensor:
        """Entries of windows first.. of the projections kv / gate [b, t, c*dim] (positions 0..t-1;
        the complete windows only) -> [b, n, dim], roped with cos / sin of positions w * r."""
        b, r, dim = kv.shape[0], self.ratio, self.dim
        n = kv.shape[1] // r
        if n <= first:
            return kv.new_zeros(b, 0, dim)
        kv = kv[:, :n * r].view(b, n, r, -1)
        gate = gate[:, :n * r].view(b, n, r, -1) + self.ape.to(gate.dtype)
        if self.overlap:  # slots: window w-1's first dim channels, then window w's last dim
            pk = torch.cat([kv.new_zeros(b, 1, r, dim), kv[:, :-1, :, :dim]], 1)
            pg = torch.cat([gate.new_full((b, 1, r, dim), float("-inf")), gate[:, :-1, :, :dim]], 1)
            kv, gate = torch.cat([pk, kv[..., dim:]], 2), torch.cat([pg, gate[..., dim:]], 2)
        kv, gate = kv[:, first:], gate[:, first:]
        out = self.norm((kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2))
        pos = torch.arange(first, n, device=kv.device) * r
        return rope(out[:, :, None], cos[pos], sin[pos])[:, :, 0]


class Indexer(nn.Module):
    """CSA's lightning indexer: wq_b, weights_proj, its own compressor at index_head_dim."""

    def __init__(self, args: Args, dtype=None, device=None):
        super().__init__()
        self.heads, self.dim, self.topk = args.index_n_heads, args.index_head_dim, args.index_topk
        self.wq_b = Linear(args.q_lora_rank, self.heads * self.dim, dtype=dtype, device=device)
        self.weights_proj = Linear(args.hidden_size, self.heads, dtype=dtype, device=device)
        self.compressor = Compressor(args, 4, self.dim, dtype, device)

    def keep(self, x, qr, keys, pos, cos_q, sin_q, visible) -> torch.Tensor:
        """bool [b, s, n]: the entries each query keeps (top index_topk of the visible ones)."""
        b, s, _ = x.shape
        q = rope(self.wq_b(qr).view(b, s, self.heads, self.dim), cos_q, sin_q)
        scores = F.relu(torch.einsum("bshd,bnd->bshn", q.float(), keys.float())) * self.dim ** -0.5
        w = self.weights_proj(x).float() * self.heads ** -0.5
        index = (scores * w[..., None]).sum(2).masked_fill(~visible, float("-inf"))      # [b, s, n]
        k = min(self.topk, index.shape[-1])
        keep = torch.zeros_like(visible)
        if k:
            # ReLU makes exact ties (scores of 0) common: a stable sort breaks them towards the
            # earlier entry, the same whatever the number of entries, so that a query keeps the
            # same entries in a full forward and in cached decode (torch.topk's choice among equal
            # values depends on the length)
            keep.scatter_(-1, index.sort(dim=-1, descending=True, stable=True).indices[..., :k], True)
        return keep & visible


class Attention(nn.Module):
    def __init__(self, args: Args, ratio: int, dtype=None, device=None):
        super().__init__()
        H, D, q = args.num_attention_heads, args.head_dim, args.q_lora_rank
        self.args, self.ratio, self.heads, self.dim, self.groups = args, ratio, H, D, args.o_groups
        self.attn_sink = nn.Parameter(torch.zeros(H, dtype=dtype, device=device), requires_grad=False)
        self.wq_a = Linear(args.hidden_size, q, dtype=dtype, device=device)
        self.q_norm = RMSNorm(q, args.rms_norm_eps, dtype=dtype, device=device)
        self.wq_b = Linear(q, H * D, dtype=dtype, device=device)
        self.wkv = Linear(args.hidden_size, D, dtype=dtype, device=device)
        self.kv_norm = RMSNorm(D, args.rms_norm_eps, dtype=dtype, device=device)
        self.wo_a = Linear(H * D // args.o_groups, args.o_groups * args.o_lora_rank, dtype=dtype, device=device)
        self.wo_b = Linear(args.o_groups * args.o_lora_rank, args.hidden_size, dtype=dtype, device=device)
        self.compressor = Compressor(args, ratio, D, dtype, device) if ratio else None
        self.indexer = Indexer(args, dtype, device) if ratio == 4 else None

    def _series(self, comp: Compressor, name: str, x, pos0, rope_tab, cache) -> torch.Tensor:
        """All compressed entries so far [b, n, dim], computing only the new windows."""
        kv, gate = comp.wkv(x), comp.wgate(x)
        if cache is not None:
            kv = cache.append(f"{name}.kv", kv, pos0)
            gate = cache.append(f"{name}.gate", gate, pos0)
        done = cache.get(f"{name}.entries") if cache is not None else None
        first = 0 if done is None else done.shape[1]
        new = comp.entries(kv, gate, first, *rope_tab)
        if cache is None:
            return new
        out = new if done is None else torch.cat([done, new], 1)
        cache.put(f"{name}.entries", out)
        return out

    def forward(self, x, pos, ropes, cache=None) -> torch.Tensor:
        b, s, _ = x.shape
        H, D, eps = self.heads, self.dim, self.args.rms_norm_eps
        cos, sin = ropes["compress" if self.ratio else "main"]
        cq, sq = cos[pos], sin[pos]
        qr = self.q_norm(self.wq_a(x))
        q = rope(unweighted_rms(self.wq_b(qr).view(b, s, H, D), eps), cq, sq)
        kv = rope(self.kv_norm(self.wkv(x))[:, :, None], cq, sq)[:, :, 0]               # [b, s, D]
        keys_pos = pos
        if cache is not None:
            kv = cache.append("kv", kv, int(pos[0]))
            keys_pos = torch.arange(kv.shape[1], device=x.device)
        rel = pos[:, None] - keys_pos[None, :]
        allowed = ((rel >= 0) & (rel < self.args.sliding_window))[None].expand(b, -1, -1)  # [b, s, T]
        if self.compressor is not None:
            ckv = self._series(self.compressor, "c", x, int(pos[0]), ropes["compress"], cache)
            visible = (torch.arange(ckv.shape[1], device=x.device)[None, :] < ((pos + 1) // self.ratio)[:, None])
            visible = visible[None].expand(b, -1, -1)
            if self.indexer is not None:
                ikeys = self._series(self.indexer.compressor, "i", x, int(pos[0]), ropes["compress"], cache)
                visible = self.indexer.keep(x, qr, ikeys, pos, cq, sq, visible)
            kv = torch.cat([kv, ckv], 1)
            allowed = torch.cat([allowed, visible], -1)
        logits = torch.einsum("bshd,btd->bhst", q, kv) * D ** -0.5
        logits = logits.masked_fill(~allowed[:, None], float("-inf"))
        sink = self.attn_sink.to(logits.dtype).view(1, H, 1, 1).expand(b, H, s, 1)
        full = torch.cat([logits, sink], -1)
        probs = torch.softmax(full - full.amax(-1, keepdim=True), dim=-1)[..., :-1]
        o = torch.einsum("bhst,btd->bshd", probs.to(kv.dtype), kv)
        o = rope(o, cq, -sq)                                                                # undo V's rope
        g = o.reshape(b, s, self.groups, -1)                                                # [b, s, G, H*D/G]
        w = self.wo_a.weight.to(g.dtype).view(self.groups, -1, g.shape[-1])                 # [G, R, H*D/G]
        return self.wo_b(torch.einsum("bsgi,gri->bsgr", g, w).flatten(2))


class Expert(nn.Module):
    def __init__(self, args: Args, dtype=None, device=None):
        super().__init__()
        d, i = args.hidden_size, args.moe_intermediate_size
        self.limit = args.swiglu_limit
        self.w1 = Linear(d, i, dtype=dtype, device=device)
        self.w2 = Linear(i, d, dtype=dtype, device=device)
        self.w3 = Linear(d, i, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x), self.w3(x)
        if self.limit:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return self.w2(F.silu(gate) * up)


class Gate(nn.Module):
    def __init__(self, args: Args, hashed: bool, dtype=None, device=None):
        super().__init__()
        self.args, self.hashed = args, hashed
        self.weight = nn.Parameter(torch.zeros(args.n_routed_experts, args.hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(args.vocab_size, args.num_experts_per_tok, dtype=torch.int64,
                                                        device=device))
        else:
            self.bias = nn.Parameter(torch.zeros(args.n_routed_experts, dtype=torch.float32, device=device),
                                     requires_grad=False)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight.to(x.dtype))
        fn = self.args.scoring_func
        scores = F.softplus(logits).sqrt() if fn == "sqrtsoftplus" else logits.sigmoid()
        if self.hashed:
            idx = self.tid2eid[tokens.reshape(-1)].long()
            bad = (idx < 0) | (idx >= self.args.n_routed_experts)
            if bad.any():  # a corrupt table would index past the experts (or wrap around, negative)
                t = int(tokens.reshape(-1)[bad.any(-1)][0])
                raise CvtError(f"ffn.gate.tid2eid routes token {t} to expert {int(idx[bad][0])}, outside the "
                               f"config's {self.args.n_routed_experts} routed experts (n_routed_experts)")
        else:
            idx = torch.topk(scores + self.bias.to(scores.dtype), self.args.num_experts_per_tok, dim=-1).indices
        w = scores.gather(1, idx)
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * self.args.routed_scaling_factor, idx


class MoE(nn.Module):
    """Routed experts (`experts`: the global ids to build, None: all; `base.build_experts`) and
    the shared expert; `route` is what the multi-rank runtime calls (`cvt.runtime.parallel`)."""

    def __init__(self, args: Args, hashed: bool, dtype=None, device=None, experts=None):
        super().__init__()
        self.gate = Gate(args, hashed, dtype, device)
        self.experts = build_experts(experts, args.n_routed_experts, lambda: Expert(args, dtype, device))
        self.shared_experts = Expert(args, dtype, device)

    def route(self, flat: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """flat [n, d], tokens [b, s] (n = b * s) -> (weights [n, k], global expert ids [n, k])."""
        return self.gate(flat, tokens)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        w, idx = self.route(flat, tokens)
        # the experts that got tokens, in expert order (looked up in this module: calibration
        # swaps it to continue one sum over chunks of experts, `cvt.quant.methods.expert_stream`)
        y = run_experts(flat, idx, w, self.experts)
        return (y + self.shared_experts(flat)).view(shape)


def hyper(streams, fn, base, scale, hc: int, iters: int, eps: float, norm_eps: float):
    """(post [b, s, hc], comb [b, s, hc, hc], collapsed [b, s, d]) of a block's hyper-connection."""
    b, s = streams.shape[:2]
    flat = unweighted_rms(streams.reshape(b, s, -1).float(), norm_eps)
    mix = F.linear(flat, fn.float())
    pre_w, post_w, comb_w = mix.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.float().split([hc, hc, hc * hc])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(b, s, hc, hc) * scale[2] + comb_b.view(hc, hc), dim=-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return post, comb, (pre[..., None] * streams).sum(2).to(streams.dtype)


class Block(nn.Module):
    # AWQ skips its clipping search for the projections that produce queries / keys
    no_clip: ClassVar[tuple[str, ...]] = ("wq_a", "wq_b", "wkv")

    def __init__(self, args: Args, layer: int, ratio: int, dtype=None, device=None, experts=None):
        super().__init__()
        self.args = args
        d, hc = args.hidden_size, args.hc_mult
        mix = (2 + hc) * hc
        for part in ("attn", "ffn"):
            setattr(self, f"hc_{part}_fn", nn.Parameter(torch.zeros(mix, hc * d, device=device), requires_grad=False))
            setattr(self, f"hc_{part}_base", nn.Parameter(torch.zeros(mix, device=device), requires_grad=False))
            setattr(self, f"hc_{part}_scale", nn.Parameter(torch.zeros(3, device=device), requires_grad=False))
        self.attn_norm = RMSNorm(d, args.rms_norm_eps, dtype=dtype, device=device)
        self.ffn_norm = RMSNorm(d, args.rms_norm_eps, dtype=dtype, device=device)
        self.attn = Attention(args, ratio, dtype, device)
        self.ffn = MoE(args, layer < args.hash_layers(), dtype, device, experts)

    def _mix(self, part: str, streams):
        a = self.args
        return hyper(streams, getattr(self, f"hc_{part}_fn"), getattr(self, f"hc_{part}_base"),
                     getattr(self, f"hc_{part}_scale").float(), a.hc_mult, a.hc_sinkhorn_iters, a.hc_eps, a.rms_norm_eps)

    def forward(self, streams, tokens, pos, ropes, cache=None):
        dtype = streams.dtype
        post, comb, x = self._mix("attn", streams)
        y = self.attn(self.attn_norm(x), pos, ropes, cache)
        streams = post.to(dtype)[..., None] * y[..., None, :] + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
        post, comb, x = self._mix("ffn", streams)
        y = self.ffn(self.ffn_norm(x), tokens)
        return post.to(dtype)[..., None] * y[..., None, :] + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


    def smooth_groups(self, prefix: str) -> list[tuple[str, list[str], list[str]]]:
        """The calibration driver's smoothing folds (`cvt.quant.methods.sites`): (producer norm,
        consumer linears, other readers whose input columns scale too), only where norm / s and
        columns * s leave the block's output unchanged (the norms sit after the hc pre-mix):
        attn_norm -> wq_a, wkv (extras: the compressor's wkv / wgate, the indexer's weights_proj
        and compressor); q_norm -> wq_b (extra: the indexer's wq_b); ffn_norm -> every expert's
        and the shared expert's w1 / w3 (extra: the router). Not smoothed: kv_norm (no linear
        reads it), wo_a / wo_b (float), w3 -> w2 (the ``swiglu_limit`` clamp acts on w3's output)."""
        a, f = f"{prefix}.attn", f"{prefix}.ffn"
        extras = [f"{a}.compressor.wkv", f"{a}.compressor.wgate"] if self.attn.compressor is not None else []
        if self.attn.indexer is not None:
            extras += [f"{a}.indexer.weights_proj", f"{a}.indexer.compressor.wkv", f"{a}.indexer.compressor.wgate"]
        experts = [f"{f}.experts.{e}" for e, _ in self.ffn.experts.named_children()] + [f"{f}.shared_experts"]
        return [(f"{prefix}.attn_norm", [f"{a}.wq_a", f"{a}.wkv"], extras),
                (f"{a}.q_norm", [f"{a}.wq_b"], [f"{a}.indexer.wq_b"] if self.attn.indexer is not None else []),
                (f"{prefix}.ffn_norm", [f"{e}.{w}" for e in experts for w in ("w1", "w3")], [f"{f}.gate"])]


class MTPBlock(Block):
    """An MTP layer as the release stores it (``mtp.{j}``: a Block plus e_proj, h_proj, enorm,
    hnorm, norm and its own hc_head_*; DeepSeek's V4 inference/model.py `MTPBlock`); run by
    `Model.mtp_logits`, not by the decoder's forward."""

    def __init__(self, args: Args, layer: int, ratio: int, dtype=None, device=None):
        super().__init__(args, layer, ratio, dtype, device)
        d, hc = args.hidden_size, args.hc_mult
        self.e_proj = Linear(d, d, dtype=dtype, device=device)
        self.h_proj = Linear(d, d, dtype=dtype, device=device)
        self.enorm = RMSNorm(d, args.rms_norm_eps, dtype=dtype, device=device)
        self.hnorm = RMSNorm(d, args.rms_norm_eps, dtype=dtype, device=device)
        self.norm = RMSNorm(d, args.rms_norm_eps, dtype=dtype, device=device)
        self.hc_head_fn = nn.Parameter(torch.zeros(hc, hc * d, device=device), requires_grad=False)
        self.hc_head_base = nn.Parameter(torch.zeros(hc, device=device), requires_grad=False)
        self.hc_head_scale = nn.Parameter(torch.zeros(1, device=device), requires_grad=False)


class LayerCache:
    """One layer's state: named tensors growing along dim 1 (every position's kv and compressor
    projections, and the compressed entries emitted so far)."""

    def __init__(self, batch: int, max_len: int):
        self.batch, self.max_len, self.store = batch, max_len, {}

    def append(self, name: str, x: torch.Tensor, start: int) -> torch.Tensor:
        old = self.store.get(name)
        have = 0 if old is None else old.shape[1]
        if start != have:
            raise CvtError(f"DeepSeek-V4 cache holds positions 0..{have - 1}, the call starts at {start}")
        if x.shape[0] > self.batch or start + x.shape[1] > self.max_len:
            raise CvtError(f"DeepSeek-V4 cache of batch {self.batch}, max_len {self.max_len} cannot hold batch "
                           f"{x.shape[0]} at positions {start}..{start + x.shape[1] - 1}")
        self.store[name] = x if old is None else torch.cat([old, x], 1)
        return self.store[name]

    def get(self, name: str):
        return self.store.get(name)

    def put(self, name: str, x: torch.Tensor) -> None:
        self.store[name] = x


class Model(nn.Module):
    """The decoder (module docstring); ``forward(tokens, start_pos, cache)`` -> logits float32."""

    cache_name: ClassVar[str] = "DeepSeek-V4 cache"
    # tp (DeepSeek's V4 inference/convert.py split): heads, o_groups and index heads / tp, the KV head
    # whole; the indexer's projections all-gathered, so each rank keeps exactly one process's entries
    # (summing per-rank partial scores would round differently and could change the top-k)
    parallel: ClassVar[ParallelNames] = ParallelNames(
        embed="embed", head="head", layers="layers", attn_out="attn.wo_b", mlp="ffn", down="w2",
        local_sizes=(("num_attention_heads", "tp"), ("o_groups", "tp"), ("moe_intermediate_size", "moe_tp")),
        gathered=("attn.indexer.wq_b", "attn.indexer.weights_proj"))
    # the calibration driver (`cvt.quant.methods.decoder_layers.Layout`, paths from `parallel`) calls block i
    # as ``block(streams [b, s, hc, d], tokens [b, s], pos [s], ropes, None)``: the token ids (hash
    # routing; argument 0 after the streams) go with each mini-batch of sequences
    calib_per_sequence: ClassVar[tuple[int, ...]] = (0,)
    # no KV-cache quantization for V4 (`new_cache`): static attention / KV scales are not calibrated
    calibrates_kv: ClassVar[bool] = False

    def __init__(self, args: Args, dtype=None, device=None, mtp: bool = True, experts=None):
        """`mtp`: build the MTP layers; `experts` (decoder layer -> global expert ids) builds only
        those routed experts (a rank of `cvt.runtime.parallel`, which builds no MTP layers)."""
        super().__init__()
        self.args = args
        d, hc = args.hidden_size, args.hc_mult
        ratios = args.ratios()
        self.embed = nn.Embedding(args.vocab_size, d, dtype=dtype, device=device)
        self.embed.weight.requires_grad_(False)
        n = args.num_hidden_layers
        ids = (lambda i: None) if experts is None else experts.get
        self.layers = nn.ModuleList(Block(args, i, ratios[i], dtype, device, ids(i)) for i in range(n))
        self.mtp = nn.ModuleList(MTPBlock(args, n + j, ratios[n + j], dtype, device)
                                 for j in range((args.num_nextn_predict_layers or 0) if mtp else 0))
        self.norm = RMSNorm(d, args.rms_norm_eps, dtype=dtype, device=device)
        self.head = Linear(d, args.vocab_size, dtype=dtype, device=device)
        self.hc_head_fn = nn.Parameter(torch.zeros(hc, hc * d, device=device), requires_grad=False)
        self.hc_head_base = nn.Parameter(torch.zeros(hc, device=device), requires_grad=False)
        self.hc_head_scale = nn.Parameter(torch.zeros(1, device=device), requires_grad=False)

    @property
    def max_positions(self) -> int:
        return self.args.max_position_embeddings

    def new_cache(self, batch: int, max_len: int, dtype=None, device=None,
                  quant: str | None = "auto") -> list[LayerCache]:
        """One `LayerCache` per decoder layer (in the compute dtype, on the model's device: the
        tensors are the layer's own outputs). `quant`: None or "auto" only (no int8 V4 cache)."""
        if quant not in (None, "auto"):
            raise CvtError(f"{self.cache_name} quantization {quant!r} is not supported (supported: None, auto)")
        if max_len > self.max_positions:
            raise CvtError(f"{self.cache_name} max_len {max_len} exceeds max_position_embeddings {self.max_positions}")
        return [LayerCache(batch, max_len) for _ in range(self.args.num_hidden_layers)]

    def _ropes(self, end: int, device) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        a, out = self.args, {}
        main = 1.0 / (a.rope_theta ** (torch.arange(0, a.rope_dim, 2, dtype=torch.float32) / a.rope_dim))
        for name, (inv, mult) in (("main", (main, 1.0)), ("compress", a.compress_inv_freq())):
            f = torch.arange(end, device=device, dtype=torch.float32)[:, None] * inv.to(device)
            out[name] = (f.cos() * mult, f.sin() * mult)
        return out

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, start_pos: int = 0, cache: list | None = None,
                hidden_states: list | None = None) -> torch.Tensor:
        """tokens [b, s] -> logits [b, s, vocab] float32; a list as `hidden_states` receives the
        residual after the embedding and after each decoder layer, the hc streams side by side
        ``[b, s, hc_mult * hidden]``."""
        b, s = tokens.shape
        if start_pos + s > self.max_positions:
            raise CvtError(f"positions {start_pos}..{start_pos + s - 1} exceed max_position_embeddings "
                           f"{self.max_positions}")
        x = self.embed(tokens)
        pos = torch.arange(start_pos, start_pos + s, device=x.device)
        ropes = self._ropes(start_pos + s, x.device)
        streams = x[:, :, None].expand(-1, -1, self.args.hc_mult, -1).contiguous()
        if hidden_states is not None:
            hidden_states.append(streams.flatten(2))
        for i, layer in enumerate(self.layers):
            streams = layer(streams, tokens, pos, ropes, None if cache is None else cache[i])
            if hidden_states is not None:
                hidden_states.append(streams.flatten(2))
        return self._logits(streams, self)

    def _logits(self, streams: torch.Tensor, owner: nn.Module) -> torch.Tensor:
        """Streams [b, s, hc, d] -> logits: collapsed by owner's hc_head_* (sigmoid weights),
        owner's norm, the shared head."""
        flat = unweighted_rms(streams.flatten(2).float(), self.args.rms_norm_eps)
        pre = torch.sigmoid(F.linear(flat, owner.hc_head_fn.float()) * owner.hc_head_scale.float()
                            + owner.hc_head_base.float()) + self.args.hc_eps
        h = (pre[..., None] * streams).sum(2).to(streams.dtype)
        return self.head(owner.norm(h)).float()

    @torch.no_grad()
    def mtp_logits(self, j: int, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """MTP layer j over a whole sequence (no cache), DeepSeek's V4 inference/model.py
        `MTPBlock.forward`: x = e_proj(enorm(embed(tokens))) + h_proj(hnorm(streams)) on every
        stream, the block, then its own hc_head_* and norm before the shared head. `hidden`: the
        last decoder layer's streams ``[b, s, hc * d]`` (the last `hidden_states` entry);
        `tokens` [b, s]: the tokens the MTP layer reads at those positions (the next ones)."""
        if not 0 <= j < len(self.mtp):
            raise CvtError(f"MTP layer {j}: this model has {len(self.mtp)} loaded")
        b, s = tokens.shape
        blk, a = self.mtp[j], self.args
        streams = hidden.view(b, s, a.hc_mult, a.hidden_size)
        x = blk.e_proj(blk.enorm(self.embed(tokens)))[:, :, None] + blk.h_proj(blk.hnorm(streams))
        pos = torch.arange(s, device=x.device)
        x = blk(x, tokens, pos, self._ropes(s, x.device))
        return self._logits(x, blk)
