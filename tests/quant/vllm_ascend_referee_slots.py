"""The referee's slots: one per (vLLM parameter, fused shard, expert) a checkpoint tensor loads
into, declared by vllm-ascend's own ``get_quant_method`` / ``create_weights`` on stand-in layers of
each module of a layout (vllm_ascend_referee_layouts), and the dtype / shape rules of vLLM's
loaders a checkpoint tensor must meet to fill one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cvt.tests.quant.vllm_ascend_referee_layouts import _Attn, _Embed, _Lin, _MoE, _Plain
from cvt.tests.quant.vllm_ascend_referee_stubs import _Env, _is_empty_made, _set_weight_attrs, _track_empty


@dataclass
class _Slot:
    param: str                 # vLLM parameter name
    ckpt: str                  # the checkpoint tensor expected to fill it
    shape: tuple[int, ...]
    dtype: torch.dtype
    loader: str                # plain | linear | fused | moe | fa | c8
    required: bool = True
    what: str = ""             # scheme / module, for messages
    numel_one_fill: bool = False   # FAKQuant: numel-1 param takes any numel-1 tensor
    c8_numels: tuple[int, ...] = ()
    filled_by: list[str] = field(default_factory=list)


def _is_int(dt: torch.dtype) -> bool:
    return not (dt.is_floating_point or dt.is_complex or dt == torch.bool)


def _dtype_problem(name: str, got: torch.dtype, s: _Slot) -> str | None:
    want = s.dtype
    local = s.param.rsplit(".", 1)[-1]
    offset_like = local.endswith("offset")
    if s.loader == "c8":
        return None if (got.is_floating_point or _is_int(got)) else f"{name}: dtype {got} cannot be a C8 scale/offset"
    if local == "deq_scale" and got != want:
        return (f"{name}: deq_scale is {got} but {s.what} declares {want} (float32 for bf16 models, int64 for "
                "fp16: npu_quant_matmul's scale; copy_ would convert the values)")
    if _is_int(want):
        if got == want or offset_like:
            return None
        if _is_int(got):
            return (f"{name}: integer payload is {got} but {s.param} is {want} ({s.what}); "
                    "copy_ would convert values, not reinterpret bits")
        return (f"{name}: float tensor ({got}) for integer parameter {s.param} ({want}, {s.what}); "
                "copy_ would truncate it")
    if not got.is_floating_point and not (offset_like and _is_int(got)):  # integer zero points convert exactly
        return (f"{name}: integer tensor ({got}) for float parameter {s.param} ({want}, {s.what}); "
                "copy_ would cast the raw integers")
    return None


def _shape_problems(name: str, shape: tuple[int, ...], s: _Slot) -> list[str]:
    if s.loader == "c8":
        sq = tuple(d for d in shape if d != 1)
        numel = 1
        for d in shape:
            numel *= d
        if len(sq) > 1 or numel not in s.c8_numels:
            return [(f"{name}: shape {list(shape)}: the C8 scale must squeeze to a scalar or "
                     f"[num_kv_heads*head_dim] = {list(s.c8_numels)[-1:]} (vllm-ascend _prepare_c8_scales)")]
        return []
    if s.numel_one_fill:
        numel = 1
        for d in shape:
            numel *= d
        if numel == 1:
            return []
    if tuple(shape) != tuple(s.shape):
        extra = ""
        if shape == () and s.shape == (1,):
            extra = " (a 0-d per-tensor value; fused linears assert [1], write [1] everywhere)"
        return [f"{name}: shape {list(shape)} but {s.param} ({s.what}) takes {list(s.shape)}{extra}"]
    return []


def _module_prefixes(m) -> list[str]:
    """Name prefixes (vLLM parameters and checkpoint tensors) that belong to module ``m``."""
    if isinstance(m, _Lin):
        return [m.prefix + "."] + [ck + "." for ck, _, _ in m.shards]
    if isinstance(m, _MoE):
        return [m.prefix + "."]
    if isinstance(m, _Attn):
        return [m.owner + ".", f"{m.ckpt}.fa_", f"{m.ckpt}.k_proj.kv_cache_", f"{m.ckpt}.v_proj.kv_cache_"]
    return [m.prefix + "."] if isinstance(m, _Embed) else [m.name]


def _fake(env: _Env, *bases: type):
    cls = type("Layer", (torch.nn.Module, *bases), {})
    layer = cls.__new__(cls)
    torch.nn.Module.__init__(layer)
    return layer


def _declare(env: _Env, cfg, m, dtype: torch.dtype, slots: dict, fused_pertensor: dict, schemes: dict) -> None:
    mt = env.holder.model_config.hf_config.model_type
    if isinstance(m, _Plain):
        slots[(m.name, None, None)] = _Slot(m.name, m.ckpt or m.name, m.shape, m.dtype, "plain",
                                            what="unquantized parameter")
        return
    if isinstance(m, _Embed):
        layer = _fake(env, env.VocabParallelEmbedding)
        meth = cfg.get_quant_method(layer, m.prefix)
        if isinstance(meth, env.adapters.AscendEmbeddingMethod):
            raise NotImplementedError(f"quantized VocabParallelEmbedding {m.prefix} is not modelled by the referee")
        slots[(f"{m.prefix}.weight", None, None)] = _Slot(f"{m.prefix}.weight", f"{m.prefix}.weight",
                                                          (m.vocab, m.hidden), dtype, "plain", m.required,
                                                          what="embedding")
        return
    if isinstance(m, _Lin):
        schemes[m.prefix] = _declare_linear(env, cfg, m, dtype, slots, fused_pertensor)
        return
    if isinstance(m, _MoE):
        schemes[m.prefix] = _declare_moe(env, cfg, m, dtype, slots)
        return
    if isinstance(m, _Attn):
        schemes[m.layer_name] = _declare_attention(env, cfg, m, slots, mt)
        return
    raise TypeError(m)


def _declare_linear(env: _Env, cfg, m: _Lin, dtype: torch.dtype, slots: dict, fused_pertensor: dict) -> str:
    sizes = [n for _, _, n in m.shards]
    bases = (env.RowParallelLinear, env.LinearBase) if m.kind == "row" else (env.LinearBase,)
    layer = _fake(env, *bases)
    meth = cfg.get_quant_method(layer, m.prefix) if m.quant else None
    params: list[tuple[str, torch.nn.Parameter, bool]] = []
    if isinstance(meth, env.adapters.AscendLinearMethod):
        what = f"{type(meth.quant_method).__name__} ({m.prefix})"
        with _track_empty() as made:
            meth.create_weights(layer, m.in_size, sizes, m.in_size, sum(sizes), dtype, weight_loader=None)
            params = [(n, p, _is_empty_made(p, made)) for n, p in layer.named_parameters(recurse=False)]
    else:  # AscendUnquantizedLinearMethod / no quant_config: a float weight [n, k]
        what = f"unquantized linear ({m.prefix})"
        w = torch.nn.Parameter(torch.empty(sum(sizes), m.in_size, dtype=dtype), requires_grad=False)
        _set_weight_attrs(w, {"input_dim": 1, "output_dim": 0})
        params = [("weight", w, True)]
    if m.bias:
        b = torch.nn.Parameter(torch.empty(sum(sizes), dtype=dtype), requires_grad=False)
        _set_weight_attrs(b, {"output_dim": 0})
        params.append(("bias", b, True))
    fused = m.kind in ("merged", "qkv")
    for local, p, required in params:
        full = f"{m.prefix}.{local}"
        out_dim = getattr(p, "output_dim", None)
        packed_dim, factor = getattr(p, "packed_dim", None), getattr(p, "packed_factor", None)
        if not fused:
            ck, _, _ = m.shards[0]
            slots[(full, None, None)] = _Slot(full, f"{ck}.{local}", tuple(p.shape), p.dtype, "linear", required, what)
            continue
        for ck, sid, n in m.shards:
            shape = list(p.shape)
            if out_dim is not None:  # MergedColumn/QKV weight_loader: narrow the param along output_dim
                size = n // factor if (packed_dim is not None and packed_dim == out_dim) else n
                shape[out_dim] = size
            else:  # "the same for all partitions": the whole param, each shard
                fused_pertensor.setdefault(full, []).append((full, sid, None))
            slots[(full, sid, None)] = _Slot(full, f"{ck}.{local}", tuple(shape), p.dtype, "fused", required,
                                             what + f" shard {sid}")
    return what.split(" (")[0]


def _declare_moe(env: _Env, cfg, m: _MoE, dtype: torch.dtype, slots: dict) -> str:
    layer = _fake(env, env.FusedMoE, *env.moe_bases)
    layer.moe_config = None
    layer.weight_loader = None  # main wraps it (_make_modelslim_moe_weight_loader)
    meth = cfg.get_quant_method(layer, m.prefix)
    if isinstance(meth, env.adapters.AscendFusedMoEMethod):
        what = f"{type(meth.quant_method).__name__} ({m.prefix})"
        with _track_empty() as made:
            meth.create_weights(layer, num_experts=1, hidden_size=m.hidden, intermediate_size_per_partition=m.inter,
                                params_dtype=dtype, weight_loader=None, intermediate_size_full=m.inter)
            params = [(n, p, _is_empty_made(p, made)) for n, p in layer.named_parameters(recurse=False)]
    else:  # AscendUnquantizedFusedMoEMethod (vLLM UnquantizedFusedMoEMethod.create_weights)
        what = f"unquantized FusedMoE ({m.prefix})"
        params = [("w13_weight", torch.nn.Parameter(torch.empty(1, 2 * m.inter, m.hidden, dtype=dtype)), True),
                  ("w2_weight", torch.nn.Parameter(torch.empty(1, m.hidden, m.inter, dtype=dtype)), True)]
    chan = {"channel", "group"}
    for local, p, required in params:
        full = f"{m.prefix}.{local}"
        if local.startswith("w13_"):
            suffix, shards = local[4:], (("w1", "gate_proj"), ("w3", "up_proj"))
        elif local.startswith("w2_"):
            suffix, shards = local[3:], (("w2", "down_proj"),)
        else:
            raise NotImplementedError(f"{full}: MoE parameter not named w13_/w2_ is not modelled by the referee")
        per_expert = tuple(p.shape[1:])
        qm = getattr(p, "quant_method", None)
        qm = getattr(qm, "value", qm)
        if "input_scale" in local or "weight_shape" in local:
            kind = "single"           # _load_single_value: param[expert] = loaded
        elif "scale" in local or "zero" in local or "offset" in local:
            if qm not in chan:        # FusedMoE.weight_loader: "quant method must be one of ..."
                raise ValueError(f"{full}: scale/offset parameter loaded with quant_method {qm!r}")
            kind = "split"
        else:
            kind = "split"            # weights: _load_w13 / _load_w2
        for sid, proj in shards:
            shape = per_expert
            if kind == "split" and sid in ("w1", "w3"):  # w13 halves along the intermediate dim
                shape = (per_expert[0] // 2, *per_expert[1:])
            for e in range(m.num_experts):
                ck = f"{m.prefix}.{e}.{proj}.{suffix}"
                slots[(full, sid, e)] = _Slot(full, ck, shape, p.dtype, "moe", required, what + f" {sid}")
    return what.split(" (")[0]


def _declare_attention(env: _Env, cfg, m: _Attn, slots: dict, mt: str) -> str:
    layer = _fake(env, env.AttentionLayerBase)
    layer.num_heads, layer.num_kv_heads, layer.head_size = m.num_heads, m.num_kv_heads, m.head_dim
    meth = cfg.get_quant_method(layer, m.layer_name)
    if not isinstance(meth, env.adapters.AscendKVCacheMethod):
        return "unquantized attention"
    scheme = meth.quant_method
    with _track_empty() as made:
        meth.create_weights(layer)
        params = [(n, p, _is_empty_made(p, made)) for n, p in layer.named_parameters()]
    name = type(scheme).__name__
    for local, p, required in params:
        full = f"{m.owner}.{local}"
        if isinstance(scheme, env.kv_c8.AscendC8KVCacheAttentionMethod):
            # checkpoint …self_attn.{k,v}_proj.kv_cache_{scale,offset} -> attn.{k,v}_cache_{scale,offset}
            kv, what_ = local.split("_", 1)[0], local.split("_")[-1]
            ck = f"{m.ckpt}.{kv}_proj.kv_cache_{what_}"
            slots[(full, None, None)] = _Slot(full, ck, tuple(p.shape), p.dtype, "c8", True, f"{name} ({m.layer_name})",
                                              c8_numels=(1, m.num_kv_heads * m.head_dim))
        elif isinstance(scheme, env.kv_c8.AscendFAQuantAttentionMethod):
            ck = f"{m.ckpt}.{local}"
            slots[(full, None, None)] = _Slot(full, ck, tuple(p.shape), p.dtype, "fa", required,
                                              f"{name} ({m.layer_name})",
                                              numel_one_fill=p.numel() == 1)
        else:
            ck = f"{m.ckpt}.{local}"
            slots[(full, None, None)] = _Slot(full, ck, tuple(p.shape), p.dtype, "plain", required,
                                              f"{name} ({m.layer_name})")
    return name
