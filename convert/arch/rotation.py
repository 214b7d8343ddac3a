"""Where an orthogonal rotation passes through an architecture exactly: the data `cvt quantize
--rotate` folds into the weights (`cvt.quant.rotate` does the math).

A QuaRot-style rotation turns the residual stream x into x Q (Q orthogonal): every norm that
reads the stream has its weight g folded into the linears reading its output (W -> W diag(g) Q,
the norm's weight -> ones: RMSNorm(x Q) = RMSNorm(x) Q since Q keeps the RMS), every linear that
adds to the stream turns (W -> Q^T W, bias -> Q^T b), the embeddings' rows turn (E -> E Q) and
the head folds the final norm (W -> W diag(g) Q). The same holds inside a layer for a low-rank
latent with its own RMSNorm (MLA's q and kv latents: the producer's rows turn, the norm folds into
the consumers' columns) and for the value heads (each head's value rows R^T W, the output
projection's columns per head W R, one R for every head so GQA's sharing does not matter).
Names are module paths under a decoder layer (``{E}``: a routed expert id); the tables list
every module that can be present, absent ones are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping


@dataclass(frozen=True)
class Latent:
    """A low-rank space inside a layer: the first `width` (a config key) output rows of
    `producer`, normed by the RMSNorm `norm`, read by `consumers`."""

    producer: str
    width: str
    norm: str
    consumers: tuple[str, ...]


@dataclass(frozen=True)
class Values:
    """Value heads: `producer`'s output rows hold the heads' values (`layout(config)` -> (number of
    row blocks, block stride, the value's offset in a block, head width)); `consumer` (the output
    projection) reads them as consecutive head-width column blocks."""

    producer: str
    consumer: str
    layout: Callable[[Mapping[str, Any]], tuple[int, int, int, int]]


@dataclass(frozen=True)
class Rotation:
    """What a family's decoder layers expose to a residual-stream rotation (module docstring)."""

    # a residual norm (under the layer) -> the linears reading its output
    readers: Mapping[str, tuple[str, ...]]
    # the linears adding to the residual stream
    writers: tuple[str, ...]
    latents: tuple[Latent, ...] = ()
    values: Values | None = None
    # a linear reading a concatenation of residual norms' outputs, in column order (DeepSeek's MTP
    # eh_proj: [enorm(embedding), hnorm(hidden)]); it writes the (MTP layer's) residual stream too
    concat_readers: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # a layer's own embeddings (DeepSeek's MTP layers store one)
    embeddings: tuple[str, ...] = ()


def mla_values(cfg: Mapping[str, Any]) -> tuple[int, int, int, int]:
    """kv_b_proj's rows per head: [qk_nope_head_dim key | v_head_dim value]."""
    nope, v = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    return cfg["num_attention_heads"], nope + v, nope, v


def gqa_values(cfg: Mapping[str, Any]) -> tuple[int, int, int, int]:
    """v_proj's rows: one head_dim block per KV head."""
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg.get("num_key_value_heads") or cfg["num_attention_heads"], d, 0, d


def swiglu(prefix: str, part: str) -> tuple[str, ...]:
    """The SwiGLU linears at `prefix` reading its input (part "in") or writing its output ("out")."""
    return (f"{prefix}.gate_proj", f"{prefix}.up_proj") if part == "in" else (f"{prefix}.down_proj",)


_MLP_IN = ("mlp.gate", *swiglu("mlp", "in"), *swiglu("mlp.experts.{E}", "in"), *swiglu("mlp.shared_experts", "in"))
_MLP_OUT = (*swiglu("mlp", "out"), *swiglu("mlp.experts.{E}", "out"), *swiglu("mlp.shared_experts", "out"))

DEEPSEEK_V3 = Rotation(
    readers={"input_layernorm": ("self_attn.q_a_proj", "self_attn.q_proj", "self_attn.kv_a_proj_with_mqa"),
             "post_attention_layernorm": _MLP_IN,
             "shared_head.norm": ("shared_head.head",)},  # an MTP layer's head
    writers=("self_attn.o_proj", *_MLP_OUT),
    latents=(Latent("self_attn.q_a_proj", "q_lora_rank", "self_attn.q_a_layernorm", ("self_attn.q_b_proj",)),
             Latent("self_attn.kv_a_proj_with_mqa", "kv_lora_rank", "self_attn.kv_a_layernorm",
                    ("self_attn.kv_b_proj",))),
    values=Values("self_attn.kv_b_proj", "self_attn.o_proj", mla_values),
    concat_readers={"eh_proj": ("enorm", "hnorm")},
    embeddings=("embed_tokens",),
)

# DeepSeek-V3.2 / GLM-5: the indexer reads the normed hidden state (wk, weights_proj) and the
# normed q latent (wq_b) (cvt.runtime.models.deepseek_v32)
DEEPSEEK_V32 = Rotation(
    readers={**DEEPSEEK_V3.readers,
             "input_layernorm": (*DEEPSEEK_V3.readers["input_layernorm"], "self_attn.indexer.wk",
                                 "self_attn.indexer.weights_proj")},
    writers=DEEPSEEK_V3.writers,
    latents=(Latent("self_attn.q_a_proj", "q_lora_rank", "self_attn.q_a_layernorm",
                    ("self_attn.q_b_proj", "self_attn.indexer.wq_b")),
             DEEPSEEK_V3.latents[1]),
    values=DEEPSEEK_V3.values,
    concat_readers=DEEPSEEK_V3.concat_readers,
    embeddings=DEEPSEEK_V3.embeddings,
)

QWEN3 = Rotation(
    readers={"input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
             "post_attention_layernorm": ("mlp.gate", *swiglu("mlp", "in"), *swiglu("mlp.experts.{E}", "in"))},
    writers=("self_attn.o_proj", *swiglu("mlp", "out"), *swiglu("mlp.experts.{E}", "out")),
    values=Values("self_attn.v_proj", "self_attn.o_proj", gqa_values),
)
