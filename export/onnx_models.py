"""The runtime models as ONNX graphs: DeepSeek-V3 family (MLA + noaux_tc MoE) and Qwen3 family
(GQA + softmax top-k MoE), whole model, one decoder layer, or one module of a layer.

One graph serves prefill and decode. Its cache inputs hold the positions already seen (length
P, 0 for a prefill: arrays with a zero-length axis); ``input_ids`` holds the s new tokens at
positions P .. P+s-1; the cache outputs are the inputs with the s new positions appended
(length P+s), ready to feed back. Positions, RoPE tables and the causal mask are computed in
the graph from P and s, so batch, sequence and cache length are all dynamic axes.

Cache I/O per decoder layer i (what the runtime's caches hold):

The graphs of each attention kind (`cvt.convert.arch.attention`, declared by the architecture
tables) are one row of `GRAPHS`; the cache I/O are the kind's `AttentionKind.cache` entries:

* DeepSeek-V3 (absorbed MLA): ``past_key_values.{i}.latent`` [batch, past, kv_lora_rank]
  (kv_a_layernorm of the latent) and ``past_key_values.{i}.rope_key`` [batch, past,
  qk_rope_head_dim] (the rotated shared rope key); outputs ``present.{i}.latent`` / ``.rope_key``.
* Qwen3 / Qwen3-MoE / Qwen2 / Llama: ``past_key_values.{i}.key`` / ``.value`` [batch, kv_heads,
  past, head_dim]; outputs ``present.{i}.key`` / ``.value``.

float32, or int8 for a C8 model (KV-cache scales attached): new entries are quantized with the
runtime's rule (round half to even of x / scale, clamped to -128..127), appended, and the whole
cache is dequantized (q * scale) for attention.

MoE: the top-k routing becomes a dense [tokens, experts] weight matrix (0 where a token did not
select an expert); y = sum over experts, in expert order, of weight[:, e] * expert_e(x) -- the
runtime's per-expert dispatch sum, exactly. ``moe="gated"`` (default) wraps each expert in an
``If`` on "some token selected it", so a decode step runs top_k experts, not all of them;
``moe="dense"`` computes every expert for every token (no control flow: a static graph for
atc; n_experts / top_k times the expert FLOPs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np
from onnx import TensorProto

from cvt.convert.arch.attention import GQA, MLA, AttentionKind
from cvt.errors import ArchError, CvtError
from cvt.export.onnx_graph import Graph, LinearOptions, linear

F = TensorProto.FLOAT
NEG_INF = float("-inf")


@dataclass
class Positions:
    """Per-graph position tensors: cos / sin (float32), the additive causal mask [s, T]."""

    cos: str
    sin: str
    mask: str


@dataclass
class CacheIO:
    """One cache tensor of one layer: names, symbolic shape, element type, C8 scale."""

    past: str
    present: str
    dims: list
    kind: int
    scale: object = None          # torch float32 flat per-channel scale (C8) or None
    seq_axis: int = 1


@dataclass
class GraphSpec:
    """An emitted graph's name and file (its I/O are the Graph's inputs / outputs)."""

    name: str
    file: str


def kind_of(model) -> AttentionKind:
    """The runtime model's attention kind, as its family's architecture table declares it."""
    return model.args.arch_table().attention.main


def graphs(model) -> "Graphs":
    """The emitters of the model's attention kind (`GRAPHS`); ArchError for a kind without any."""
    kind = kind_of(model)
    if kind.name not in GRAPHS:
        raise ArchError(f"{model.args.family}: {kind.name} attention has no ONNX graphs (exported: "
                        f"{', '.join(GRAPHS)})")
    return GRAPHS[kind.name]


def family_name(model) -> str:
    return graphs(model).family


def cache_io(model, i: int) -> list[CacheIO]:
    """The cache tensors of decoder layer i, in runtime order (the kind's `AttentionKind.cache`:
    MLA latent, rope key; GQA key, value); a dim named by the kind is the model argument's value."""
    a = model.args
    attn = model.model.layers[i].self_attn
    scales = getattr(attn, "kv_scales", None) or (None, None)  # a None scale: that tensor is cached float
    out = [(e.name, [d if d in ("batch", "{t}") else getattr(a, d) for d in e.dims]) for e in kind_of(model).cache]
    return [CacheIO(f"past_key_values.{i}.{n}", f"present.{i}.{n}", dims,
                    F if scales[j] is None else TensorProto.INT8,
                    None if scales[j] is None else scales[j].float().cpu(), dims.index("{t}"))
            for j, (n, dims) in enumerate(out)]


def _dims(dims, t: str) -> list:
    return [t if d == "{t}" else d for d in dims]


# ---------------------------------------------------------------------------- positions
def positions(g: Graph, model, past_len: str, seq: str) -> Positions:
    """cos / sin and the causal mask for positions past_len .. past_len+seq-1 (int64 [1] inputs)."""
    p0 = g.squeeze(past_len, [0])
    total = g.squeeze(g.add(past_len, seq), [0])
    pos = g.op("Range", [p0, total, g.const(1)], hint="positions")                        # [s]
    freqs = g.mul(g.unsqueeze(g.op("Cast", [pos], to=F), [1]),
                  g.const(model.inv_freq.float().cpu().numpy()[None, :], np.float32))     # [s, r/2]
    if graphs(model).rope_halves:
        freqs = g.op("Concat", [freqs, freqs], axis=-1)                                   # [s, D]
    cos, sin = g.op("Cos", [freqs]), g.op("Sin", [freqs])
    if float(model.rope_scale) != 1.0:
        cos, sin = g.mul(cos, g.fconst(float(model.rope_scale))), g.mul(sin, g.fconst(float(model.rope_scale)))
    keys = g.op("Range", [g.const(0), total, g.const(1)])                                 # [T]
    allowed = g.op("LessOrEqual", [g.unsqueeze(keys, [0]), g.unsqueeze(pos, [1])])        # [s, T]
    mask = g.op("Where", [allowed, g.fconst(0.0), g.fconst(NEG_INF)], hint="causal_mask")
    return Positions(cos, sin, mask)


# ------------------------------------------------------------------------------ caches
def _append(g: Graph, io: CacheIO, past: str, new: str) -> tuple[str, str]:
    """(present to output, float32 full cache for attention)."""
    if io.scale is None:
        present = g.op("Concat", [past, new], axis=io.seq_axis)
        return present, present
    scale = io.scale.numpy()
    if io.seq_axis == 2:  # GQA [b, K, s, D]: channel = head * D + d
        scale = scale.reshape(io.dims[1], 1, io.dims[3])
    sc = g.const(scale, np.float32)
    q = g.op("Clip", [g.op("Round", [g.op("Div", [new, sc])]), g.fconst(-128.0), g.fconst(127.0)])
    present = g.op("Concat", [past, g.op("Cast", [q], to=TensorProto.INT8)], axis=io.seq_axis)
    return present, g.mul(g.op("Cast", [present], to=F), sc)


# ------------------------------------------------------------------------ DeepSeek (MLA)
def _rope_mla(g: Graph, x: str, pos: Positions, dr: int, interleave: bool) -> str:
    """x [b, s, heads, dr] rotated like deepseek_v3.apply_rope (cos / sin [s, dr/2])."""
    cos, sin = g.unsqueeze(pos.cos, [1]), g.unsqueeze(pos.sin, [1])                       # [s, 1, dr/2]
    if interleave:
        x1 = g.op("Slice", [x, g.const([0]), g.const([dr]), g.const([3]), g.const([2])])
        x2 = g.op("Slice", [x, g.const([1]), g.const([dr]), g.const([3]), g.const([2])])
    else:
        x1, x2 = g.slice(x, 0, dr // 2, 3), g.slice(x, dr // 2, dr, 3)
    y1 = g.op("Sub", [g.mul(x1, cos), g.mul(x2, sin)])
    y2 = g.add(g.mul(x2, cos), g.mul(x1, sin))
    if interleave:
        y = g.op("Concat", [g.unsqueeze(y1, [-1]), g.unsqueeze(y2, [-1])], axis=-1)        # [.., dr/2, 2]
        return g.reshape(y, [0, 0, 0, dr])
    return g.op("Concat", [y1, y2], axis=-1)


def mla(g: Graph, attn, x: str, pos: Positions, cache: list[CacheIO], past: list[str], hint: str,
        opts: LinearOptions) -> tuple[str, list[str]]:
    """Absorbed MLA (deepseek_v3.MLA.forward) on x [b, s, h] -> (out [b, s, h], presents)."""
    H, dn, dr, dv, C = attn.n_heads, attn.nope, attn.rope, attn.v_dim, attn.kv_lora_rank
    if attn.q_lora:
        q = linear(g, attn.q_a_proj, x, hint + ".q_a_proj", opts)
        q = g.rms_norm(q, attn.q_a_layernorm, hint + ".q_a_layernorm")
        q = linear(g, attn.q_b_proj, q, hint + ".q_b_proj", opts)
    else:
        q = linear(g, attn.q_proj, x, hint + ".q_proj", opts)
    q = g.reshape(q, [0, 0, H, dn + dr])                                                  # [b, s, H, dn+dr]
    q_nope = g.slice(q, 0, dn, 3)
    q_pe = _rope_mla(g, g.slice(q, dn, dn + dr, 3), pos, dr, attn.interleave)
    kvpe = linear(g, attn.kv_a_proj_with_mqa, x, hint + ".kv_a_proj_with_mqa", opts)     # [b, s, C+dr]
    kv = g.rms_norm(g.slice(kvpe, 0, C, 2), attn.kv_a_layernorm, hint + ".kv_a_layernorm")
    k_pe = g.squeeze(_rope_mla(g, g.unsqueeze(g.slice(kvpe, C, C + dr, 2), [2]), pos, dr, attn.interleave), [2])
    present_kv, kv_all = _append(g, cache[0], past[0], kv)                               # [b, T, C]
    present_pe, pe_all = _append(g, cache[1], past[1], k_pe)                             # [b, T, dr]
    wkv_b = attn.kv_b_proj.dense_weight().view(H, dn + dv, C)
    wk = g.weight(wkv_b[:, :dn].contiguous(), hint + ".kv_b_proj.wk")                    # [H, dn, C]
    wv_t = g.weight(wkv_b[:, dn:].transpose(1, 2).contiguous(), hint + ".kv_b_proj.wv_t")  # [H, C, dv]
    q_abs = g.mm(g.transpose(q_nope, [0, 2, 1, 3]), wk)                                  # [b, H, s, C]
    kv4 = g.unsqueeze(kv_all, [1])                                                       # [b, 1, T, C]
    s1 = g.mm(q_abs, g.transpose(kv4, [0, 1, 3, 2]))                                     # [b, H, s, T]
    s2 = g.mm(g.transpose(q_pe, [0, 2, 1, 3]), g.transpose(g.unsqueeze(pe_all, [1]), [0, 1, 3, 2]))
    scores = g.add(g.mul(g.add(s1, s2), g.fconst(float(attn.softmax_scale))), pos.mask)
    probs = g.op("Softmax", [scores], axis=-1)
    o = g.mm(g.mm(probs, kv4), wv_t)                                                     # [b, H, s, dv]
    o = g.reshape(g.transpose(o, [0, 2, 1, 3]), [0, 0, H * dv])
    return linear(g, attn.o_proj, o, hint + ".o_proj", opts), [present_kv, present_pe]


def _scatter_dense(g: Graph, idx: str, w: str, like: str) -> str:
    """Top-k weights [n, k] at expert ids idx into a dense [n, E] routing matrix (0 elsewhere)."""
    zeros = g.op("ConstantOfShape", [g.op("Shape", [like])])
    return g.op("ScatterElements", [zeros, idx, w], axis=1, hint="routing")


def _experts(g: Graph, experts, x2: str, idx: str, dense: str, hint: str, opts: LinearOptions) -> str:
    """sum_e dense[:, e] * expert_e(x2) over the routed experts, in expert order. Gated (the
    default), each expert is an If on "some token selected it" (a decode step runs top_k
    experts, not all); a selected expert runs on every token, weighted by its routing column
    (0 for the tokens that did not select it): the runtime's sum exactly."""
    from torch import nn

    if not isinstance(experts, nn.ModuleList):  # a rank's subset (cvt.runtime.parallel)
        raise CvtError(f"{hint}: holds only some routed experts (one rank of a sharded model); export needs them all")
    y = g.op("ConstantOfShape", [g.op("Shape", [x2])], hint=hint + ".experts.sum")
    for e, expert in enumerate(experts):
        h = f"{hint}.experts.{e}"
        if opts.moe == "dense":
            y = g.add(y, g.mul(g.slice(dense, e, e + 1, 1), mlp(g, expert, x2, h, opts)))
            continue
        hit = g.reduce("ReduceMax", g.op("Cast", [g.op("Equal", [idx, g.const(e)])], to=F), [0, 1], keepdims=0)
        then, other = g.branch(), g.branch()
        out = then.add(y, then.mul(then.slice(dense, e, e + 1, 1), mlp(then, expert, x2, h, opts)))
        y = g.if_(g.op("Greater", [hit, g.fconst(0.0)]), then, out, other, other.op("Identity", [y]), h + ".if")
    return y


def deepseek_moe(g: Graph, moe, x: str, hint: str, opts: LinearOptions) -> str:
    """noaux_tc routing (deepseek_v3.Gate) + routed experts (dense, masked) + shared experts."""
    gate = moe.gate
    shape = g.op("Shape", [x])
    x2 = g.reshape(x, [-1, int(gate.weight.shape[1])])                                   # [n, h]
    scores = g.op("Sigmoid", [g.mm(x2, g.weight(gate.weight.t(), hint + ".gate.weight_t"))])  # [n, E]
    sel = g.add(scores, g.weight(gate.e_score_correction_bias, hint + ".gate.e_score_correction_bias", dtype="fp32"))
    E = int(gate.weight.shape[0])
    if gate.n_group > 1:
        grouped = g.reshape(sel, [-1, gate.n_group, E // gate.n_group])                  # [n, G, E/G]
        top2 = g.op("TopK", [grouped, g.const([2])], n_out=2, axis=-1)[0]
        gscore = g.reduce("ReduceSum", top2, [-1], keepdims=0)                           # [n, G]
        keep_idx = g.op("TopK", [gscore, g.const([gate.topk_group])], n_out=2, axis=-1)[1]
        ones = g.op("ConstantOfShape", [g.op("Shape", [keep_idx])],
                    value=_tensor_value(1.0))
        keep = g.op("ScatterElements", [g.op("ConstantOfShape", [g.op("Shape", [gscore])]), keep_idx, ones], axis=1)
        keep = g.op("Greater", [g.unsqueeze(keep, [2]), g.fconst(0.0)])                  # [n, G, 1]
        sel = g.reshape(g.op("Where", [keep, grouped, g.fconst(NEG_INF)]), [-1, E])
    idx = g.op("TopK", [sel, g.const([gate.top_k])], n_out=2, axis=-1)[1]               # [n, k]
    w = g.op("GatherElements", [scores, idx], axis=1)
    if gate.norm_topk_prob:
        w = g.op("Div", [w, g.reduce("ReduceSum", w, [-1])])
    w = g.mul(w, g.fconst(float(gate.scale)))
    y = _experts(g, moe.experts, x2, idx, _scatter_dense(g, idx, w, scores), hint, opts)
    if moe.shared_experts is not None:
        y = g.add(y, mlp(g, moe.shared_experts, x2, hint + ".shared_experts", opts))
    return g.reshape(y, shape)


def _tensor_value(v: float):
    from onnx import helper

    return helper.make_tensor("v", F, [1], [v])


# ------------------------------------------------------------------------------ Qwen3 (GQA)
def _rotate(g: Graph, x: str, pos: Positions, d: int) -> str:
    """x [b, heads, s, D] * cos + rotate_half(x) * sin (qwen3.apply_rope; cos / sin [s, D])."""
    half = d // 2
    rot = g.op("Concat", [g.op("Neg", [g.slice(x, half, d, 3)]), g.slice(x, 0, half, 3)], axis=-1)
    return g.add(g.mul(x, pos.cos), g.mul(rot, pos.sin))


def gqa(g: Graph, attn, x: str, pos: Positions, cache: list[CacheIO], past: list[str], hint: str,
        opts: LinearOptions) -> tuple[str, list[str]]:
    """qwen3.Attention.forward on x [b, s, h] -> (out [b, s, h], presents)."""
    H, K, D = attn.n_heads, attn.n_kv, attn.head_dim
    q = g.reshape(linear(g, attn.q_proj, x, hint + ".q_proj", opts), [0, 0, H, D])
    k = g.reshape(linear(g, attn.k_proj, x, hint + ".k_proj", opts), [0, 0, K, D])
    v = g.transpose(g.reshape(linear(g, attn.v_proj, x, hint + ".v_proj", opts), [0, 0, K, D]), [0, 2, 1, 3])
    if attn.q_norm is not None:
        q, k = g.rms_norm(q, attn.q_norm, hint + ".q_norm"), g.rms_norm(k, attn.k_norm, hint + ".k_norm")
    q = _rotate(g, g.transpose(q, [0, 2, 1, 3]), pos, D)                                  # [b, H, s, D]
    k = _rotate(g, g.transpose(k, [0, 2, 1, 3]), pos, D)                                  # [b, K, s, D]
    present_k, k_all = _append(g, cache[0], past[0], k)                                  # [b, K, T, D]
    present_v, v_all = _append(g, cache[1], past[1], v)
    q5 = g.reshape(q, [0, K, H // K, -1, D])                                             # [b, K, H/K, s, D]
    k5 = g.transpose(g.unsqueeze(k_all, [2]), [0, 1, 2, 4, 3])                           # [b, K, 1, D, T]
    scores = g.add(g.mul(g.mm(q5, k5), g.fconst(D ** -0.5)), pos.mask)
    o = g.mm(g.op("Softmax", [scores], axis=-1), g.unsqueeze(v_all, [2]))                # [b, K, H/K, s, D]
    o = g.reshape(g.transpose(g.reshape(o, [0, H, -1, D]), [0, 2, 1, 3]), [0, 0, H * D])
    return linear(g, attn.o_proj, o, hint + ".o_proj", opts), [present_k, present_v]


def qwen_moe(g: Graph, moe, x: str, hint: str, opts: LinearOptions) -> str:
    """Softmax top-k router (qwen3.MoE) + routed experts (dense, masked)."""
    shape = g.op("Shape", [x])
    x2 = g.reshape(x, [-1, int(moe.gate.in_features)])
    probs = g.op("Softmax", [linear(g, moe.gate, x2, hint + ".gate", opts)], axis=-1)   # [n, E]
    w, idx = g.op("TopK", [probs, g.const([moe.top_k])], n_out=2, axis=-1)
    if moe.norm_topk_prob:
        w = g.op("Div", [w, g.reduce("ReduceSum", w, [-1])])
    y = _experts(g, moe.experts, x2, idx, _scatter_dense(g, idx, w, probs), hint, opts)
    return g.reshape(y, shape)


# -------------------------------------------------------------------------------- shared
def mlp(g: Graph, m, x: str, hint: str, opts: LinearOptions) -> str:
    """SwiGLU: down_proj(silu(gate_proj(x)) * up_proj(x))."""
    a = g.silu(linear(g, m.gate_proj, x, hint + ".gate_proj", opts))
    return linear(g, m.down_proj, g.mul(a, linear(g, m.up_proj, x, hint + ".up_proj", opts)), hint + ".down_proj", opts)


class Graphs(NamedTuple):
    """How one attention kind's families are emitted: the manifest's family, the attention and
    MoE emitters, and whether the rope tables span head_dim (rotate-half: cos / sin repeated)
    rather than the rope dims' pairs."""

    family: str
    attention: Callable
    moe: Callable
    rope_halves: bool


# by attention kind (`cvt.convert.arch.attention`): a kind absent here is not exported
GRAPHS = {MLA.name: Graphs("deepseek_v3", mla, deepseek_moe, rope_halves=False),
          GQA.name: Graphs("qwen3", gqa, qwen_moe, rope_halves=True)}


def attention(g, model, attn, x, pos, cache, past, hint, opts):
    return graphs(model).attention(g, attn, x, pos, cache, past, hint, opts)


def ffn(g: Graph, model, m, x: str, hint: str, opts: LinearOptions) -> str:
    if hasattr(m, "experts"):
        return graphs(model).moe(g, m, x, hint, opts)
    return mlp(g, m, x, hint, opts)


def _past_inputs(g: Graph, cache: list[CacheIO]) -> list[str]:
    return [g.add_input(io.past, io.kind, _dims(io.dims, "past")) for io in cache]


def _present_outputs(g: Graph, cache: list[CacheIO], values: list[str]) -> None:
    for io, v in zip(cache, values):
        g.add_output(v, io.present, io.kind, _dims(io.dims, "total"))


def _past_len(g: Graph, cache: list[CacheIO], past: list[str]) -> str:
    return g.dim(past[0], cache[0].seq_axis)


def decoder_layer(g: Graph, model, i: int, x: str, pos: Positions, past: list[str], opts: LinearOptions):
    layer = model.model.layers[i]
    hint = f"model.layers.{i}"
    a, presents = attention(g, model, layer.self_attn, g.rms_norm(x, layer.input_layernorm, hint + ".input_layernorm"),
                            pos, cache_io(model, i), past, hint + ".self_attn", opts)
    x = g.add(x, a)
    m = ffn(g, model, layer.mlp, g.rms_norm(x, layer.post_attention_layernorm, hint + ".post_attention_layernorm"),
            hint + ".mlp", opts)
    return g.add(x, m), presents


# -------------------------------------------------------------------------------- graphs
def build_model_graph(g: Graph, model, opts: LinearOptions) -> GraphSpec:
    """The whole causal LM: input_ids [batch, seq] + caches -> logits [batch, seq, vocab] + caches."""
    a = model.args
    spec = GraphSpec("model", "model.onnx")
    ids = g.add_input("input_ids", TensorProto.INT64, ["batch", "seq"])
    caches = [cache_io(model, i) for i in range(a.num_hidden_layers)]
    pasts = [_past_inputs(g, c) for c in caches]
    emb = model.model.embed_tokens.weight
    table = g.weight(emb, "model.embed_tokens.weight", cast=False)  # gathered rows are cast, not the table
    x = g.op("Gather", [table, ids], axis=0)
    if g.weight_dtype != "fp32":
        x = g.op("Cast", [x], to=F)
    pos = positions(g, model, _past_len(g, caches[0], pasts[0]), g.dim(ids, 1))
    presents = []
    for i in range(a.num_hidden_layers):
        x, pr = decoder_layer(g, model, i, x, pos, pasts[i], opts)
        presents.append(pr)
    x = g.rms_norm(x, model.model.norm, "model.norm")
    if getattr(model, "lm_head", None) is None:  # tied to the embedding
        w = table if g.weight_dtype == "fp32" else g.op("Cast", [table], to=F)
        logits = g.mm(x, g.transpose(w, [1, 0]))
    else:
        logits = linear(g, model.lm_head, x, "lm_head", opts)
    g.add_output(logits, "logits", F, ["batch", "seq", a.vocab_size])
    for c, pr in zip(caches, presents):
        _present_outputs(g, c, pr)
    return spec


def build_layer_graph(g: Graph, model, i: int, opts: LinearOptions) -> GraphSpec:
    """Decoder layer i: hidden_states [batch, seq, hidden] + its cache -> output + its cache."""
    spec = GraphSpec(f"layer_{i}", f"layer_{i}.onnx")
    x = g.add_input("hidden_states", F, ["batch", "seq", model.args.hidden_size])
    cache = cache_io(model, i)
    past = _past_inputs(g, cache)
    pos = positions(g, model, _past_len(g, cache, past), g.dim(x, 1))
    y, presents = decoder_layer(g, model, i, x, pos, past, opts)
    g.add_output(y, "output", F, ["batch", "seq", model.args.hidden_size])
    _present_outputs(g, cache, presents)
    return spec


def build_block_graph(g: Graph, model, i: int, block: str, opts: LinearOptions) -> GraphSpec:
    """One module of decoder layer i: ``self_attn`` (its input is the normalized hidden state;
    with layer i's cache) or ``mlp`` (dense MLP or MoE), as the runtime module computes it."""
    h = model.args.hidden_size
    layer = model.model.layers[i]
    spec = GraphSpec(f"layer_{i}.{block}", f"layer_{i}.{block}.onnx")
    x = g.add_input("hidden_states", F, ["batch", "seq", h])
    hint = f"model.layers.{i}.{block}"
    if block == "self_attn":
        cache = cache_io(model, i)
        past = _past_inputs(g, cache)
        pos = positions(g, model, _past_len(g, cache, past), g.dim(x, 1))
        y, presents = attention(g, model, layer.self_attn, x, pos, cache, past, hint, opts)
        g.add_output(y, "output", F, ["batch", "seq", h])
        _present_outputs(g, cache, presents)
    elif block == "mlp":
        g.add_output(ffn(g, model, layer.mlp, x, hint, opts), "output", F, ["batch", "seq", h])
    else:
        raise CvtError(f"block {block!r} is not one of self_attn, mlp")
    return spec


def check_exportable(model) -> None:
    """ArchError for a runtime model this exporter has no emitter for."""
    if not hasattr(model, "args") or not hasattr(model, "inv_freq"):
        raise ArchError(f"{type(model).__name__}: not a runtime model the ONNX exporter knows")
    from cvt.runtime.kv_cache import kv_codec

    if kv_codec(model) == "fp8":
        from cvt.errors import CvtError

        raise CvtError("the model has an FP8 KV cache (a compressed-tensors w8a8c8 output): the ONNX exporter "
                       "writes float or int8 caches; export the Ascend w8a8c8 output (int8 cache), or the w8a8 one")
