"""Attention kinds: what each kind of attention layer caches, declared once as data.

Every architecture table declares its decoder layers' kinds (`ArchTable.attention`, a
`LayerAttention`); the memory plan, the runtime's KV cache, KV-cache quantization, the quantize
stage and the ONNX export ask the kind instead of testing config keys or model names, so a new
kind is one entry here (plus the runtime model and graph that run it), not a branch in each.

=================== ============================== ===================== =========== ==================
kind                cache per layer and token       runtime cache         KV quant    families
=================== ============================== ===================== =========== ==================
mla                 latent C + rope key dr         MLACache / Int8MLA..  FAKQuant    DeepSeek-V3, Kimi-K2
sparse_mla          mla + the indexer's key Di     MLACache + key cache  FAKQuant    DeepSeek-V3.2, GLM-5
sparse_mla_shared   mla (reuses a full layer's     MLACache              FAKQuant    GLM-5 "shared" layers
                    top-k: no indexer key)
gqa                 k and v: kv_heads x head_dim   KVCache / Int8KVCache C8          Qwen3, Qwen2, Llama
gqa_sliding         gqa's, for the last            KVCache / Int8KVCache C8          gpt-oss sliding layers
                    sliding_window positions only
v4_sliding          last window K=V entries of D   V4 Cache              -           DeepSeek-V4 ratio 0
v4_csa              + D per 4 positions + the      V4 Cache              -           DeepSeek-V4 ratio 4
                    indexer's Di per 4
v4_hca              + D per 128 positions          V4 Cache              -           DeepSeek-V4 ratio 128
linear              conv state (kernel - 1 inputs) LinearState           -           Qwen3.5 / Qwen3-Next
                    + recurrent state (fixed)                                        linear layers
=================== ============================== ===================== =========== ==================

C = kv_lora_rank, dr = qk_rope_head_dim, Di = index_head_dim, D = head_dim. MTP layers are
never cached (the runtime does not run them while decoding).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple, Sequence

from cvt.errors import ArchError


class CacheEntry(NamedTuple):
    """One tensor a layer's cache holds, as the runtime cache and the ONNX graphs' cache I/O
    (``past_key_values.{i}.<name>`` / ``present.{i}.<name>``) name it. `dims`: "batch", "{t}"
    (the cached positions) or the name of a runtime model argument (``Args`` attribute)."""

    name: str
    dims: tuple[str, ...]


@dataclass(frozen=True)
class KVQuant:
    """A KV-cache quantization convention (the tensors: `cvt.qtensor.kv_tensors`; the math:
    `cvt.runtime.kv_cache`): its name in an Ascend description, the tag of its tensors, and
    whether it caches one latent per token (one scale per layer) or per-head k / v channels."""

    name: str          # the description's fa_quant_type / kv_cache_type
    tag: str           # each tensor's Ascend description tag
    latent: bool       # one cached latent (scales per layer; fa_q / fa_k / fa_v), else k / v per channel


FAKQUANT = KVQuant("FAKQuant", "FAQuant", latent=True)
C8 = KVQuant("C8", "C8", latent=False)


def _mla_bytes(cfg, tokens, tp, elem, index_c8):
    """MLA: the latent (int8 under the FAKQuant C8, `elem`) and the rope key (always bf16)."""
    return tokens * (cfg["kv_lora_rank"] * elem + cfg["qk_rope_head_dim"] * 2)


def _sparse_mla_bytes(cfg, tokens, tp, elem, index_c8):
    """sparse MLA: MLA's plus the indexer key (bf16, or int8 + a float16 scale under the indexer C8)."""
    index_dim = cfg.get("index_head_dim", 128)
    return _mla_bytes(cfg, tokens, tp, elem, index_c8) + tokens * (index_dim + 2 if index_c8 else index_dim * 2)


def _gqa_bytes(cfg, tokens, tp, elem, index_c8):
    """GQA: k and v of the rank's kv heads (split over tp, rounded up), head_dim each."""
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return tokens * 2 * -(-kv_heads // tp) * head_dim * elem


# what DeepSeek-V4's cache sizes mean when config.json omits them (`cvt.convert.arch.deepseek_v4.DEFAULTS`)
V4_CACHE_DEFAULTS = {"sliding_window": 128, "index_head_dim": 128}


def _gqa_sliding_bytes(cfg, tokens, tp, elem, index_c8):
    """Sliding-window GQA: GQA's k and v for at most ``sliding_window`` positions (what a serving
    stack keeps of such a layer; a query sees itself and the sliding_window - 1 before it)."""
    return _gqa_bytes(cfg, min(tokens, cfg["sliding_window"]), tp, elem, index_c8)


def _v4_bytes(ratio: int):
    """DeepSeek-V4 (its inference/model.py `Attention`): the last sliding_window K=V entries of
    head_dim, plus at ratio r > 0 one head_dim entry per r positions, and at r == 4 the
    indexer's index_head_dim key per 4 positions."""
    def count(cfg, tokens, tp, elem, index_c8):
        dim, window = cfg["head_dim"], cfg.get("sliding_window", V4_CACHE_DEFAULTS["sliding_window"])
        idim = cfg.get("index_head_dim", V4_CACHE_DEFAULTS["index_head_dim"])
        extra = tokens // ratio * (dim + (idim if ratio == 4 else 0)) if ratio else 0
        return (min(tokens, window) * dim + extra) * elem
    return count


def _linear_bytes(cfg, tokens, tp, elem, index_c8):
    """Gated DeltaNet: a fixed-size state, whatever the tokens: the causal conv's last
    (kernel - 1) inputs of q, k and v, and the [key_dim, value_dim] recurrent state per value
    head (transformers' Qwen3-Next / Qwen3.5 config keys), split over tp by value heads."""
    kh, vh = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    kd, vd = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    conv = (cfg["linear_conv_kernel_dim"] - 1) * (2 * kh * kd + vh * vd)
    return (conv + vh * kd * vd) // tp * elem


@dataclass(frozen=True)
class AttentionKind:
    """One kind of attention layer and what its cache holds (module docstring's table).

    cache:          the tensors the layer's cache holds, in the runtime's order (its caches'
                    ``cache_input`` order and the ONNX cache I/O)
    layout:         the cache layout's name in an ONNX export's manifest
    runtime_cache:  the runtime's cache object(s) for a layer of this kind
    kv_quant:       the KV-cache quantization convention of w8a8c8 (None: cvt quantizes no KV cache)
    heads_split:    the cache splits over TP by KV heads (so TP must divide them); otherwise
                    every TP rank holds it whole
    indexer_key:    the layer caches a lightning indexer's key beside its cache (the indexer C8's site)
    tp_heads:       (config key, what it counts) of other head counts TP splits and so must divide
                    (the Gated DeltaNet's key and value heads)
    calibrates:     cvt's layer-by-layer calibration (GPTQ, AWQ, SmoothQuant, static scales,
                    --kl-budget's measurement) runs through a layer of this kind
    count_bytes:    (config, tokens, tp, bytes per quantizable element, indexer C8) -> cache bytes of
                    one layer holding `tokens` positions of one sequence on one TP rank
    """

    name: str
    cache: tuple[CacheEntry, ...]
    layout: str
    runtime_cache: str
    kv_quant: KVQuant | None
    heads_split: bool
    count_bytes: Callable[[Mapping[str, Any], int, int, int, bool], int]
    indexer_key: bool = False
    calibrates: bool = True
    tp_heads: tuple[tuple[str, str], ...] = ()

    def cache_bytes(self, cfg: Mapping[str, Any], tokens: int, tp: int = 1, int8: bool = False,
                    index_c8: bool = False) -> int:
        """This layer's cache bytes for `tokens` positions on one of `tp` ranks: bf16, or int8
        where `int8` asks for the quantized cache and the kind quantizes it."""
        elem = 1 if int8 and self.kv_quant is not None and not index_c8 else 2
        return self.count_bytes(cfg, tokens, tp, elem, index_c8)


_MLA_CACHE = (CacheEntry("latent", ("batch", "{t}", "kv_lora_rank")),
              CacheEntry("rope_key", ("batch", "{t}", "qk_rope_head_dim")))
MLA = AttentionKind("mla", _MLA_CACHE, "mla-absorbed (latent, rope_key)", "MLACache / Int8MLACache (C8)",
                    FAKQUANT, heads_split=False, count_bytes=_mla_bytes)
SPARSE_MLA = dataclasses.replace(MLA, name="sparse_mla", runtime_cache="MLACache + the indexer's key cache",
                                 count_bytes=_sparse_mla_bytes, indexer_key=True)
SPARSE_MLA_SHARED = dataclasses.replace(MLA, name="sparse_mla_shared", runtime_cache="MLACache")
GQA = AttentionKind("gqa", (CacheEntry("key", ("batch", "kv_heads", "{t}", "dim_head")),
                            CacheEntry("value", ("batch", "kv_heads", "{t}", "dim_head"))),
                    "gqa (key, value)", "KVCache / Int8KVCache (C8)", C8, heads_split=True, count_bytes=_gqa_bytes)
GQA_SLIDING = dataclasses.replace(GQA, name="gqa_sliding", count_bytes=_gqa_sliding_bytes)
_V4_CACHE = (CacheEntry("window", ("batch", "sliding_window", "head_dim")),
             CacheEntry("compressed", ("batch", "{t}", "head_dim")))
V4_RATIOS = {0: "v4_sliding", 4: "v4_csa", 128: "v4_hca"}
V4 = {r: AttentionKind(name, _V4_CACHE[:1] if r == 0 else _V4_CACHE, "deepseek-v4 (window, compressed)",
                       "the V4 model's Cache", None, heads_split=False, count_bytes=_v4_bytes(r), indexer_key=r == 4)
      for r, name in V4_RATIOS.items()}


def v4_kind(ratio: int) -> AttentionKind:
    """The DeepSeek-V4 kind of a layer at compress ratio `ratio` (0, 4 or 128)."""
    if ratio not in V4:
        raise ArchError(f"compress ratio {ratio!r}: DeepSeek-V4 layers have {', '.join(map(str, V4))}")
    return V4[ratio]


# the conv state holds the last kernel - 1 inputs, as vLLM's MambaStateShapeCalculator.
# gated_delta_net_state_shape sizes it (conv_dim / tp x conv_kernel_size - 1, mamba_utils.py) and the
# plan counts it (`_linear_bytes`); the recurrent state is [Hv / tp, Dk, Dv]
LINEAR = AttentionKind("linear", (CacheEntry("conv_state", ("batch", "conv_channels", "conv_state_len")),
                                  CacheEntry("recurrent_state", ("batch", "linear_num_value_heads",
                                                                 "linear_key_head_dim", "linear_value_head_dim"))),
                       "gated-deltanet (conv_state, recurrent_state)", "LinearState (conv + recurrent state)", None,
                       heads_split=True, count_bytes=_linear_bytes,
                       tp_heads=(("linear_num_key_heads", "linear-attention key head"),
                                 ("linear_num_value_heads", "linear-attention value head")))

KINDS: dict[str, AttentionKind] = {k.name: k for k in (MLA, SPARSE_MLA, SPARSE_MLA_SHARED, GQA, GQA_SLIDING,
                                                       *V4.values(), LINEAR)}


@dataclass(frozen=True)
class LayerAttention:
    """A family's declaration of its decoder layers' attention kinds.

    kinds:  every kind its layers can have; the first is the family's (what every layer has
            when `of` is None, and what a question about the family as a whole reads)
    of:     config -> one kind per decoder layer, for families whose layers differ
    """

    kinds: tuple[AttentionKind, ...]
    of: Callable[[Mapping[str, Any]], Sequence[AttentionKind]] | None = None

    @property
    def main(self) -> AttentionKind:
        return self.kinds[0]

    @property
    def kv_quant(self) -> KVQuant | None:
        """The family's KV-cache quantization convention (None: cvt quantizes none of its caches)."""
        return self.main.kv_quant

    @property
    def latent(self) -> bool:
        """Whether the family's quantized cache is one latent per token (MLA's FAKQuant: one scale
        per layer, the fa_q / fa_k / fa_v sites) rather than k / v per channel (GQA's C8)."""
        return self.kv_quant is not None and self.kv_quant.latent

    def layers(self, cfg: Mapping[str, Any]) -> list[AttentionKind]:
        """One kind per decoder layer (MTP layers excluded); ArchError when the family's own
        rule gives a kind it did not declare or the wrong count."""
        n = cfg["num_hidden_layers"]
        if self.of is None:
            return [self.main] * n
        out = list(self.of(cfg))
        if len(out) != n or any(k not in self.kinds for k in out):
            raise ArchError(f"attention kinds {[k.name for k in out]}: must be {n} (num_hidden_layers) of "
                            f"{', '.join(k.name for k in self.kinds)}")
        return out

    def cache_bytes(self, cfg: Mapping[str, Any], tokens: int, tp: int = 1, int8: bool = False,
                    index_c8: bool = False) -> int:
        """The decoder layers' cache bytes for `tokens` positions of one sequence on one TP rank."""
        return sum(k.cache_bytes(cfg, tokens, tp, int8, index_c8) for k in self.layers(cfg))


def every_layer(kind: AttentionKind) -> LayerAttention:
    """The declaration of a family whose layers all have `kind`."""
    return LayerAttention((kind,))


def kv_sites(cfg: Mapping[str, Any], kind: AttentionKind):
    """The KV-cache quantization tensors (`cvt.qtensor.kv_tensors.KVTensorSpec`) of a model
    whose layers quantize their cache as `kind` does (the language model's config)."""
    from cvt.qtensor.kv_tensors import kv_tensor_specs

    if kind.kv_quant is None:
        raise ArchError(f"{kind.name} attention has no quantized KV cache in cvt")
    heads = int(cfg["num_attention_heads"])
    latent = kind.kv_quant.latent
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    return kv_tensor_specs(int(cfg["num_hidden_layers"]), latent, heads, 0 if latent else kv_heads * head_dim)


def site_bytes(cfg: Mapping[str, Any], kind: AttentionKind) -> int:
    """Bytes of `kv_sites` (every rank holds them)."""
    return sum(math.prod(sp.shape) * sp.dtype.itemsize for sp in kv_sites(cfg, kind))
