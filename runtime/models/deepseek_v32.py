"""DeepSeek-V3.2(-Exp) (model_type deepseek_v32): DeepSeek-V3 plus DeepSeek Sparse Attention (DSA).

Everything is `deepseek_v3` (MLA, MoE, MTP, YaRN) except that each attention layer has a
lightning indexer that picks, per query, the `index_topk` past tokens the MLA may attend. The
math is transformers 5's DeepseekV32Indexer / DeepseekV32Attention (the referee of the tests),
which is the official deepseek-ai/DeepSeek-V3.2-Exp inference/model.py `Indexer` without its
two speed devices: the Hadamard rotation of q and k (orthogonal, so q . k is unchanged) and
the FP8 quantization of q, k and the key cache (a precision shortcut).

Shapes: b batch, s new tokens, T = start_pos + s keys, h hidden, Hi / Di = index_n_heads /
index_head_dim, dr = qk_rope_head_dim, k = index_topk. x is the layer's input_layernorm output,
qr = q_a_layernorm(q_a_proj(x)) [b, s, q_lora] (shared with MLA's q_b_proj).

    q      = wq_b(qr) -> [b, s, Hi, Di] = q_pe [.., dr] | q_nope;  q_pe = rope(q_pe)   (rope first)
    key    = LayerNorm(wk(x)) (weight and bias, eps 1e-6, float32) -> [b, s, Di] = k_pe | k_nope;
             k_pe = rope(k_pe);  cached: index_k[:, start_pos:T] = key      (one key per token)
    score  = relu(q . key_t * Di^-0.5)                                            [b, s, Hi, T]
    w      = weights_proj(x) (float32) * Hi^-0.5                                   [b, s, Hi]
    index  = sum_h w_h * score_h;  index = -inf where the causal mask forbids      [b, s, T]
    keep   = the top-min(k, T) positions of index, and the causal mask             [b, s, T]
    MLA    = deepseek_v3's absorbed MLA with its scores masked to `keep`

RoPE: the indexer rotates halves (x_i, x_{i+dr/2}), MLA adjacent pairs (rope_interleave), with
the same cos / sin (YaRN included). The official demo first rotated the indexer interleaved and
fixed it on 2025-11-17 ("the input tensor to RoPE in the indexer module requires a
non-interleaved layout, whereas RoPE in the MLA module expects an interleaved layout",
DeepSeek-V3.2-Exp README); transformers and vLLM (``is_neox_style=True``) rotate halves.

When T <= index_topk every causal key is kept and the layer is exactly DeepSeek-V3's.
The indexer's key cache (`DSACache.index_k`) holds keys in the compute dtype (the official
and vLLM caches are FP8 with per-128 scales): cached decode equals the full forward.

Indexer C8 (vllm-ascend's "sparse LI C8", `cvt.qtensor.indexer_c8`): once a model has its
q_rot / k_rot [Di, Di] attached (`Model.attach_indexer_rotations`, done by the loader for a
w8a8c8 Ascend output), each decoder layer's indexer rotates q and key after RoPE (x @ rot, back
in the compute dtype), quantizes every row dynamically to int8 (scale amax / 127, kept float16),
caches int8 keys [b, T, Di] + float16 scales [b, T, 1], and scores
``relu(q_int8 . k_int8 * scale_q * scale_k * Di^-0.5)`` (the integer dot is exact in float32 for
Di * 127^2 < 2^24). The forward without a cache does the same, so decode equals the full
forward; ``new_cache(quant=None)`` gives the float indexer (the model without C8).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from cvt.convert.arch.deepseek_v32 import INDEX_DEFAULTS
from cvt.errors import CvtError
from cvt.qtensor import indexer_c8
from cvt.runtime.kernels import Linear
from cvt.runtime.models import deepseek_v3 as v3
from cvt.runtime.models.base import ConfigError, check_room
from cvt.runtime.models.deepseek_v3 import apply_rope

LAYERNORM_EPS = 1e-6  # transformers nn.LayerNorm(eps=1e-6); official LayerNorm(dim) default


@dataclasses.dataclass
class Args(v3.Args):
    """config.json of a DeepSeek-V3.2 checkpoint: `deepseek_v3.Args` plus the indexer keys.

    Defaults are transformers' DeepseekV32Config's (where they differ from V3's:
    max_position_embeddings 163840)."""

    family: ClassVar[str] = "deepseek_v32"

    max_position_embeddings: int = 163840
    index_n_heads: int = INDEX_DEFAULTS["index_n_heads"]
    index_head_dim: int = INDEX_DEFAULTS["index_head_dim"]
    index_topk: int = INDEX_DEFAULTS["index_topk"]
    # transformers 5 writes these into saved configs; any other value changes the math
    mlp_layer_types: list | None = None          # must be first_k_dense_replace x "dense", then "sparse"
    mlp_bias: bool = False

    def validate(self) -> None:
        super().validate()

        def bad(key, value, supported):
            raise ConfigError(f"config.json {key} {value!r} is not supported by the deepseek_v32 runtime "
                              f"(supported: {supported})")

        if not self.q_lora_rank:
            bad("q_lora_rank", self.q_lora_rank, "a positive integer (the indexer reads q_a_layernorm's output)")
        if self.rope_interleave is not True:
            bad("rope_interleave", self.rope_interleave, "true (V3.2's MLA rope is interleaved)")
        if self.mlp_bias:
            bad("mlp_bias", self.mlp_bias, "false")
        for key in ("index_n_heads", "index_topk"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                bad(key, v, "a positive integer")
        if not isinstance(self.index_head_dim, int) or self.index_head_dim < self.qk_rope_head_dim:
            bad("index_head_dim", self.index_head_dim, f"an integer >= qk_rope_head_dim ({self.qk_rope_head_dim})")
        n, d = self.num_hidden_layers, min(self.n_dense, self.num_hidden_layers)
        if self.mlp_layer_types is not None and list(self.mlp_layer_types) != ["dense"] * d + ["sparse"] * (n - d):
            bad("mlp_layer_types", self.mlp_layer_types, f"{d} x 'dense' then 'sparse' (first_k_dense_replace {d})")


class LayerNorm(nn.Module):
    """y = (x - mean) / sqrt(var + eps) * weight + bias over the last dim, in float32, x's dtype out."""

    def __init__(self, dim: int, eps: float = LAYERNORM_EPS, dtype=None, device=None):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), (self.dim,), self.weight.float(), self.bias.float(), self.eps).to(x.dtype)


class DSACache:
    """One layer's cache: the MLA cache (`deepseek_v3.MLACache` or its C8 `Int8MLACache`, reached
    through `write` / `read` like any MLA cache) and the indexer's keys
    index_k [batch, max_len, index_head_dim] in `dtype`, or with `int8` (indexer C8) int8 keys
    plus index_scale float16 [batch, max_len, 1]."""

    def __init__(self, mla: v3.MLACache, index_head_dim: int, dtype=None, device=None, int8: bool = False):
        self.mla = mla
        batch, max_len = mla.kv.shape[:2]
        self.index_k = torch.zeros(batch, max_len, index_head_dim, dtype=torch.int8 if int8 else dtype, device=device)
        self.index_scale = (torch.zeros(batch, max_len, 1, dtype=getattr(torch, indexer_c8.SCALE_DTYPE), device=device)
                            if int8 else None)

    @property
    def quant(self) -> str | None:
        return self.mla.quant

    @property
    def index_quant(self) -> bool:
        """Whether the indexer keys are cached as int8 (indexer C8)."""
        return self.index_scale is not None

    @property
    def kv(self) -> torch.Tensor:
        return self.mla.kv

    @property
    def pe(self) -> torch.Tensor:
        return self.mla.pe

    @property
    def nbytes(self) -> int:
        return self.mla.nbytes + self.index_k.nbytes + (0 if self.index_scale is None else self.index_scale.nbytes)

    def write(self, start_pos: int, kv: torch.Tensor, pe: torch.Tensor) -> None:
        self.mla.write(start_pos, kv, pe)

    def read(self, batch: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mla.read(batch, end)

    def index_write(self, start_pos: int, k: torch.Tensor, scale: torch.Tensor | None = None) -> None:
        """Store indexer keys k [b, s, Di] (int8 with `scale` [b, s, 1] in an int8 cache) at
        positions start_pos .. start_pos+s-1."""
        b, end = k.shape[0], start_pos + k.shape[1]
        check_room("indexer cache", self.index_k, 1, b, start_pos, end)
        if (scale is not None) != self.index_quant:
            raise CvtError("indexer cache: int8 keys need an int8 cache (and float keys a float one); "
                           "build the cache with the model's new_cache()")
        self.index_k[:b, start_pos:end] = k
        if scale is not None:
            self.index_scale[:b, start_pos:end] = scale

    def index_read(self, batch: int, end: int) -> torch.Tensor:
        """Indexer keys [batch, end, Di] of positions 0 .. end-1."""
        return self.index_k[:batch, :end]

    def index_read_scale(self, batch: int, end: int) -> torch.Tensor:
        """float16 scales [batch, end, 1] of the int8 keys of positions 0 .. end-1."""
        return self.index_scale[:batch, :end]


class Indexer(nn.Module):
    """The lightning indexer of one layer (module docstring): wq_b [Hi*Di, q_lora], wk [Di, h],
    k_norm (LayerNorm [Di] with bias), weights_proj [Hi, h]. Replicated under TP (every rank
    computes the same top-k, see `cvt.convert.arch.deepseek_v32`)."""

    def __init__(self, args: Args, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        h, self.n_heads, self.head_dim = args.hidden_size, args.index_n_heads, args.index_head_dim
        self.rope, self.topk = args.qk_rope_head_dim, args.index_topk
        # GLM-5 (`glm_moe_dsa`) rotates the indexer's rope dims interleaved; V3.2 rotates halves
        self.interleave = bool(getattr(args, "indexer_rope_interleave", False))
        self.wq_b = Linear(args.q_lora_rank, self.n_heads * self.head_dim, **kw)
        self.wk = Linear(h, self.head_dim, **kw)
        self.k_norm = LayerNorm(self.head_dim, **kw)
        self.weights_proj = Linear(h, self.n_heads, **kw)
        self.softmax_scale = self.head_dim ** -0.5
        # indexer C8: (q_rot, k_rot) float32 [Di, Di] once attached (Model.attach_indexer_rotations)
        self.rot: tuple[torch.Tensor, torch.Tensor] | None = None

    def _rope(self, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """t [b, s, heads, Di]: rotate the first dr dims, by halves (V3.2) or interleaved (GLM-5)."""
        pe, nope = t.split([self.rope, self.head_dim - self.rope], dim=-1)
        return torch.cat([apply_rope(pe, cos, sin, interleave=self.interleave), nope], dim=-1)

    def index_scores(self, x: torch.Tensor, qr: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     mask: torch.Tensor, start_pos: int, cache: DSACache | None) -> torch.Tensor:
        """x [b, s, h], qr [b, s, q_lora], cos / sin [s, dr/2], mask [s, T] bool -> index scores
        float32 [b, s, T] (-inf where the mask forbids). Writes this step's keys to the cache."""
        b, s, _ = x.shape
        q = self._rope(self.wq_b(qr).view(b, s, self.n_heads, self.head_dim), cos, sin)     # [b, s, Hi, Di]
        k = self._rope(self.k_norm(self.wk(x)).unsqueeze(2), cos, sin).squeeze(2)        # [b, s, Di]
        if self.rot is not None and (cache is None or cache.index_quant):
            scores = self._c8_scores(q, k, start_pos, cache)
        else:
            if cache is not None:
                cache.index_write(start_pos, k)
                k = cache.index_read(b, start_pos + s)                                   # [b, T, Di]
            # the reference's op order (transformers DeepseekV32Indexer): a different summation
            # order moves scores by an ulp, which can swap two near-tied keys at the top-k edge
            scores = F.relu(torch.matmul(q.float(), k.float().transpose(-1, -2).unsqueeze(1)) * self.softmax_scale)
        w = self.weights_proj(x.float()).float() * self.n_heads ** -0.5                  # [b, s, Hi]
        index = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)                        # [b, s, T]
        return index.masked_fill(~mask[None], float("-inf"))

    def _c8_scores(self, q: torch.Tensor, k: torch.Tensor, start_pos: int, cache: DSACache | None) -> torch.Tensor:
        """Indexer C8 (module docstring): q [b, s, Hi, Di], k [b, s, Di] after RoPE -> relu scores
        float32 [b, s, Hi, T]; int8 keys and their scales go to the cache."""
        q_rot, k_rot = self.rot
        qq, qs = indexer_c8.dynamic_quant((q.float() @ q_rot).to(q.dtype))            # [b, s, Hi, Di], [.., 1]
        kq, ks = indexer_c8.dynamic_quant((k.float() @ k_rot).to(k.dtype))            # [b, s, Di], [b, s, 1]
        if cache is not None:
            b, end = k.shape[0], start_pos + k.shape[1]
            cache.index_write(start_pos, kq, ks)
            kq, ks = cache.index_read(b, end), cache.index_read_scale(b, end)         # [b, T, Di], [b, T, 1]
        dots = torch.matmul(qq.float(), kq.float().transpose(-1, -2).unsqueeze(1))    # exact integers
        scale = qs.float() * ks.float().transpose(-1, -2).unsqueeze(1)                # [b, s, Hi, T]
        return F.relu(dots * scale * self.softmax_scale)

    def forward(self, x, qr, cos, sin, mask, start_pos, cache) -> torch.Tensor:
        """Same arguments as `index_scores` -> keep bool [b, s, T]: the top-min(k, T) keys of each
        query that the causal mask allows."""
        index = self.index_scores(x, qr, cos, sin, mask, start_pos, cache)
        top = index.topk(min(self.topk, index.shape[-1]), dim=-1).indices                # [b, s, k]
        keep = torch.zeros_like(index, dtype=torch.bool).scatter_(-1, top, True)
        return keep & mask[None]


class SparseMLA(v3.MLA):
    """DeepSeek-V3's absorbed MLA attending only the keys its `indexer` keeps."""

    def __init__(self, args: Args, dtype=None, device=None):
        super().__init__(args, dtype, device)
        self.indexer = Indexer(args, dtype, device)

    def keep(self, x, qr, cos, sin, mask, start_pos, cache) -> torch.Tensor:
        return self.indexer(x, qr, cos, sin, mask, start_pos, cache)


class Model(v3.Model):
    """`deepseek_v3.Model` with `SparseMLA` in every layer (MTP layers too: the release's MTP layer
    has an indexer) and a cache that holds the indexer's keys."""

    attention: ClassVar[type[nn.Module]] = SparseMLA

    def new_cache(self, batch: int, max_len: int, dtype=None, device=None,
                  quant: str | None = "auto") -> list[DSACache]:
        """`deepseek_v3.Model.new_cache` (float or C8 MLA caches, same `quant` choices) per layer, each
        with an indexer key cache [batch, max_len, index_head_dim] in `dtype` (default the model's)."""
        w = self.model.embed_tokens.weight
        mla = super().new_cache(batch, max_len, dtype, device, quant)
        int8 = [quant is not None and getattr(self._indexer(i), "rot", None) is not None for i in range(len(mla))]
        return [DSACache(c, self.args.index_head_dim, dtype or w.dtype, device or w.device, i8)
                for c, i8 in zip(mla, int8)]

    def has_indexer_rotations(self) -> bool:
        """Whether the decoder layers' indexers run C8 (rotations attached)."""
        return any(getattr(self._indexer(i), "rot", None) is not None for i in range(self.args.num_hidden_layers))

    def _indexer(self, i: int):
        """Decoder layer i's indexer (None in a layer without one: GLM-5's "shared" layers)."""
        return getattr(self.model.layers[i].self_attn, "indexer", None)

    def attach_indexer_rotations(self, tensors: dict[str, torch.Tensor]) -> None:
        """Switch the indexer C8 on with every decoder layer's ``self_attn.indexer.q_rot`` / ``k_rot``
        (float [Di, Di], orthogonal: the rotation must leave q . k unchanged). A missing, misshaped,
        non-finite or non-orthogonal matrix, or one for a layer the model lacks, is a CvtError."""
        n, d = self.args.num_hidden_layers, self.args.index_head_dim
        got: dict[int, dict[str, torch.Tensor]] = {}
        for name, t in tensors.items():
            m = indexer_c8.ROT_RE.match(name)
            if m is None or int(m.group(1)) >= n:
                raise CvtError(f"indexer rotation {name} has no place in the {n}-layer deepseek_v32 model "
                               "(expected model.layers.{i}.self_attn.indexer.q_rot / k_rot, i < num_hidden_layers)")
            t = t.detach().float()
            if tuple(t.shape) != (d, d):
                raise CvtError(f"indexer rotation {name}: shape {list(t.shape)}, expected [{d}, {d}] (index_head_dim)")
            eye = torch.eye(d, dtype=torch.float32, device=t.device)
            if not torch.isfinite(t).all() or not torch.allclose(t @ t.T, eye, atol=1e-4, rtol=0):
                raise CvtError(f"indexer rotation {name} is not an orthogonal matrix (it would change q . k)")
            got.setdefault(int(m.group(1)), {})[m.group(2)] = t
        missing = [f"model.layers.{i}.self_attn.indexer.{r}_rot" for i in range(n) for r in "qk"
                   if self._indexer(i) is not None and r not in got.get(i, {})]
        if missing:
            raise CvtError(f"the indexer C8 needs {missing[0]} ([{d}, {d}] float32): missing")
        for i in range(n):
            ix = self._indexer(i)
            if ix is None:
                continue
            dev = next(ix.parameters()).device
            ix.rot = (got[i]["q"].to(dev), got[i]["k"].to(dev))

    def detach_indexer_rotations(self) -> None:
        """Back to the float indexer."""
        for i in range(self.args.num_hidden_layers):
            if self._indexer(i) is not None:
                self._indexer(i).rot = None
