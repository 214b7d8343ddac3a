"""The int8 KV cache ("C8" of w8a8c8): convention, quantization math, scales, calibration.

Runtime (the int8 cache classes in ``models/deepseek_v3.py`` / ``models/qwen3.py``), the
quantize stage and the format writers all take the convention from here (`KV_CONVENTION`,
`kv_cache_tensor_specs`), so there is one definition. It is the one the Ascend serving stacks
load (vllm-ascend 0.23 ``quantization/methods/kv_c8.py``, msModelSlim 26.1
``model/deepseek_v3/model_adapter.py`` + ``save/ascendv1.py``, MindIE ``utils/layers/attention/fa3.py``).

Convention (``KV_CONVENTION``, version 2)
-----------------------------------------
Per decoder layer i (MTP layers have no scales: the runtime never runs them):

* MLA (DeepSeek-V3 / R1 / V3.1, Kimi-K2): FAKQuant (msModelSlim "FA3", per head). Cached int8:
  the normalized latent ``c_kv = kv_a_layernorm(kv_a_proj_with_mqa(x)[..., :C])`` (C =
  kv_lora_rank), one scale per layer (MLA has one KV head); the rope key ``k_pe`` stays in
  the compute dtype (vllm-ascend quantizes only K for MLA: ``get_kv_quant_dtype``).
  Tensors (offsets int8 zeros, scales float32)::

      model.layers.{i}.self_attn.fa_q.scale / .offset   [num_attention_heads, 1]
      model.layers.{i}.self_attn.fa_k.scale / .offset   [1, 1]
      model.layers.{i}.self_attn.fa_v.scale / .offset   [1, 1]

  ``fa_k`` scales the cached latent; ``fa_v`` the same latent read as the value (absorbed MLA:
  one tensor; its scale equals fa_k's); ``fa_q`` per head the absorbed query
  ``q_abs = q_nope @ W_UK`` (in latent space). vllm-ascend uses only ``fa_k``; MindIE also
  quantizes Q with ``fa_q``; cvt's runtime quantizes the cache (fa_k), not the query.
  Description: tag ``FAQuant`` per tensor, global ``fa_quant_type: "FAKQuant"``.
* GQA (Qwen3 / Qwen3-MoE / Qwen2 / Llama): k after k_norm and RoPE, v as projected, channel
  index = head * head_dim + d (the k_proj / v_proj output layout). The msModelSlim C8 names:
           ``model.layers.{i}.self_attn.k_proj.kv_cache_scale``  f32 [kv_heads * head_dim]
           ``model.layers.{i}.self_attn.k_proj.kv_cache_offset`` f32 [kv_heads * head_dim] (zeros)
           ``model.layers.{i}.self_attn.v_proj.kv_cache_scale`` / ``.kv_cache_offset`` (same)
  Description: tag ``C8``, global ``kv_cache_type: "C8"`` (vllm-ascend) and ``kv_quant_type:
  "C8"`` (MindIE, msModelSlim's saver writes both).

Math (int8, symmetric, static; x in float32), per channel c (GQA) or per tensor (MLA):
    amax = max |x| over all calibration tokens (per channel / per layer / per head for fa_q)
    scale = max(amax / 127, 2**-14)            (msModelSlim's symmetric minmax: max(-min, max) / 127;
                                                the floor keeps dead channels finite)
    q = clamp(round_half_to_even(x / scale), -128, 127) -> int8
    x^ = q * scale, cast to the compute dtype   (documented dequant (q - offset) * scale, offset 0)

compressed-tensors (`to_compressed_tensors`): ``self_attn.k_scale`` / ``self_attn.v_scale``
with ``kv_cache_scheme = {num_bits 8, type int, symmetric, dynamic false, strategy}``:
strategy "tensor" -> shape [1] = max over the per-channel scales; "attn_head" (GQA only) ->
[kv_heads, 1, 1] = max over each head's channels. Lossy direction: per-channel -> per-tensor /
per-head: channels with a smaller range get the larger step (never clipped); per-tensor /
per-head -> per-channel (`from_compressed_tensors`, used on load) is an exact broadcast. For
MLA: k_scale = v_scale = the latent's (fa_k) scale.

Run-time behaviour
------------------
A model is "in C8 mode" once scales are attached (`attach_kv_cache_scales`; each attention
module then holds ``kv_scales``: (first, second) cached-tensor scales shaped for the cache,
the second None when that tensor stays float, and ``kv_extra``: stored tensors the runtime
does not apply, kept for writing them back). Then ``new_cache()`` (``quant="auto"``) and
``new_cache(quant="int8")`` give int8 caches, ``new_cache(quant=None)`` a float cache (the model
without C8, for comparisons), and the forward without a cache quantize-dequantizes the same
tensors, so a full forward equals prefill + incremental decode through the int8 cache
(``cvt verify`` and ``cvt run`` see the same model). ``new_cache(quant="int8")`` without
scales is a CvtError.

Calibration: `calibrate_kv_scales(model, tokens)` runs float forwards (C8 switched off while
it runs) with an observer on every cache input (and, for MLA, the absorbed query) and returns
the tensors by their names; `observe_kv` is the same observer for a layer-by-layer driver.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator, Mapping

import torch
from torch import nn

from cvt.convert.arch import arch_for, text_config
from cvt.convert.arch.attention import LayerAttention, kv_sites
from cvt.errors import CvtError
from cvt.qtensor.indexer_c8 import ROT_RE as INDEXER_ROT_RE
from cvt.qtensor.kv_tensors import (
    CT_NAME_RE, NAME_RE, KV_CONVENTION, QMAX, QMIN, SCALE_DIVISOR, SCALE_MIN, KVTensorSpec,
    kv_tensor_specs)

# ---------------------------------------------------------------------------------- math
CODECS = ("int8", "fp8")
FP8_MAX = 448.0
STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def scales_from_amax(amax: torch.Tensor, codec: str = "int8") -> torch.Tensor:
    """Scale (float32) from amax: int8 max(amax / 127, 2**-14); fp8 max(amax / 448, 2**-14)."""
    return (amax.float() / (FP8_MAX if codec == "fp8" else SCALE_DIVISOR)).clamp_min(SCALE_MIN)


def quantize(x: torch.Tensor, scale: torch.Tensor, codec: str = "int8") -> torch.Tensor:
    """int8: q = clamp(round_half_even(float32(x) / scale), -128, 127); fp8 (e4m3, vLLM's FP8 KV
    cache): q = e4m3(clamp(float32(x) / scale, -448, 448)). The scale broadcasts to x."""
    if codec == "fp8":
        return (x.float() / scale.float()).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return torch.round(x.float() / scale.float()).clamp_(QMIN, QMAX).to(torch.int8)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x = float32(q) * scale, cast to dtype."""
    return (q.float() * scale.float()).to(dtype)


def fake_quantize(x: torch.Tensor, scale: torch.Tensor, codec: str = "int8") -> torch.Tensor:
    """dequantize(quantize(x)) in x's dtype: what the quantized cache returns for x."""
    return dequantize(quantize(x, scale, codec), scale, x.dtype)


def codec_of_config(config: Mapping[str, Any], manifest: Any = None) -> str:
    """The cache codec a checkpoint's KV-cache scales are for: "fp8" for a compressed-tensors
    ``kv_cache_scheme`` of type float (vLLM's FP8 cache) or an Ascend output whose manifest records
    the fp8 FAKQuant cache (``quant.kv_cache.convention.dtype`` float8_e4m3fn, Ascend 950), else
    "int8" (Ascend C8 / FAKQuant, and older cvt compressed-tensors outputs with type int)."""
    from cvt.convert.config import quantization_config

    kv = (quantization_config(config) or {}).get("kv_cache_scheme") or {}
    quant = getattr(manifest, "quant", None)
    conv = ((getattr(quant, "kv_cache", None) or {}).get("convention") or {})
    return "fp8" if kv.get("type") == "float" or conv.get("dtype") == "float8_e4m3fn" else "int8"


def kv_codec(model: nn.Module) -> str | None:
    """The attached cache codec ("int8" or "fp8"), None when the model has no KV-cache scales."""
    if not has_kv_cache_scales(model):
        return None
    return getattr(_attentions(model)[0], "kv_codec", "int8")


def broadcast_scale(scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A flat scale shaped for x: per channel MLA [b, s, C] -> [C], GQA [b, K, s, D] -> [K, 1, D];
    a per-tensor [1] scale broadcasts as it is."""
    if x.dim() == 4 and scale.numel() > 1:
        return scale.view(x.shape[1], 1, x.shape[3])
    return scale


def _channel_amax(x: torch.Tensor) -> torch.Tensor:
    """float32 per-channel amax of a cache input (same layouts as `broadcast_scale`), flat."""
    a = x.detach().float().abs()
    if x.dim() == 4:                                       # [b, K, s, D] -> [K, D]
        return a.amax(dim=(0, 2)).flatten()
    return a.flatten(0, -2).amax(dim=0)                    # [..., C] -> [C]


# ---------------------------------------------------------------------------- convention
def _args(model_or_config: Any):
    if isinstance(model_or_config, nn.Module):
        return model_or_config.args
    if isinstance(model_or_config, Mapping):
        from cvt.runtime.models.families import family
        mod, cfg = family(model_or_config)
        return mod.Args.from_config(cfg)
    return model_or_config                                  # an Args object


def attention(model_or_config: Any) -> LayerAttention:
    """The family's attention declaration, as its architecture table holds it (`ArchTable.attention`;
    a runtime model or Args by its `family`, a config.json by its model_type)."""
    if isinstance(model_or_config, Mapping):
        return arch_for(model_or_config).table.attention
    return _args(model_or_config).arch_table().attention


def latent_cache(model_or_config: Any) -> bool:
    """Whether the family's cache quantizes one latent per token (`LayerAttention.latent`: MLA's
    FAKQuant, one scale per layer), rather than k / v per channel (GQA's C8)."""
    return attention(model_or_config).latent


def kv_cache_tensor_specs(model_or_config: Any) -> list[KVTensorSpec]:
    """Every KV-cache tensor of a model (runtime model, config.json dict or Args), in layer
    order: per layer, per role (MLA q, k, v; GQA k, v), scale then offset (`cvt.qtensor.kv_tensors`)."""
    if isinstance(model_or_config, Mapping):
        return kv_sites(text_config(model_or_config), attention(model_or_config).main)
    args = _args(model_or_config)
    mla = latent_cache(args)
    return kv_tensor_specs(args.num_hidden_layers, mla, args.num_attention_heads,
                           0 if mla else args.kv_heads * args.dim_head)


def kv_cache_tensor_names(model_or_config: Any) -> dict[str, tuple[int, ...]]:
    """{name: shape} of `kv_cache_tensor_specs`."""
    return {s.name: s.shape for s in kv_cache_tensor_specs(model_or_config)}


def is_kv_cache_tensor(name: str) -> bool:
    """True for a KV-cache tensor name of either format (Ascend C8 / FAKQuant names, or
    compressed-tensors ``self_attn.k_scale`` / ``v_scale`` / ``*_zero_point``); a loader routes
    these to `attach_kv_cache_scales` instead of a module parameter."""
    return bool(NAME_RE.match(name) or CT_NAME_RE.match(name) or INDEXER_ROT_RE.match(name))


# ------------------------------------------------------------------- model attachment
def _attentions(model: nn.Module) -> list[nn.Module]:
    layers = model.get_submodule("model.layers")
    return [layers[i].self_attn for i in range(model.args.num_hidden_layers)]


def has_kv_cache_scales(model: nn.Module) -> bool:
    """Whether the model is in C8 mode (scales attached to every attention layer)."""
    return all(getattr(a, "kv_scales", None) is not None for a in _attentions(model))


def layer_kv_scales(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor | None]] | None:
    """Per decoder layer the scales of the two cached tensors (MLA: latent [1], k_pe None =
    kept float; GQA: k, v flat [kv_heads*head_dim]), or None when the model has no KV-cache scales."""
    if not has_kv_cache_scales(model):
        return None
    return [a.kv_scales for a in _attentions(model)]


def _device_of(module: nn.Module) -> torch.device:
    for t in module.parameters():
        return t.device
    return torch.device("cpu")


def _runtime_scales(mla: bool, got: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The cache scales the runtime applies, from one layer's role -> scale tensors."""
    if mla:
        return got["k"].reshape(1), None
    return got["k"].reshape(-1), got["v"].reshape(-1)


def attach_kv_cache_scales(model: nn.Module, tensors: Mapping[str, torch.Tensor], codec: str = "int8") -> None:
    """Put the model in quantized-KV mode with `tensors` (name -> tensor), either the Ascend int8
    set (`kv_cache_tensor_specs`: MLA needs every layer's ``fa_k.scale``, GQA every
    ``kv_cache_scale``; other scales optional; offsets optional and zero) or the
    compressed-tensors set (``self_attn.k_scale`` / ``v_scale`` per layer; `codec` "fp8": vLLM's
    FP8 cache, per-tensor scales; "int8": shape [1] or [kv_heads, 1, 1], broadcast exactly to
    cvt's int8 channels). Anything else is a CvtError naming it. DeepSeek-V3.2's indexer C8
    rotations (``self_attn.indexer.q_rot`` / ``k_rot``, `cvt.qtensor.indexer_c8`) among them go
    to the model's `attach_indexer_rotations`."""
    rots = {n: t for n, t in tensors.items() if INDEXER_ROT_RE.match(n)}
    if rots:
        attach = getattr(model, "attach_indexer_rotations", None)
        if attach is None:
            raise CvtError(f"{sorted(rots)[0]}: the {model.args.family} runtime model has no lightning indexer")
        attach(rots)
        tensors = {n: t for n, t in tensors.items() if n not in rots}
        if not tensors:
            return
    args = model.args
    mla = latent_cache(args)
    if codec not in CODECS:
        raise CvtError(f"KV-cache codec {codec!r} is not supported (supported: {', '.join(CODECS)})")
    names = set(tensors)
    ct = {n for n in names if CT_NAME_RE.match(n)}
    if ct:
        if ct != names:
            raise CvtError(f"KV-cache tensors mix compressed-tensors names ({sorted(ct)[0]}) with others "
                           f"({sorted(names - ct)[0]})")
        if codec == "fp8":
            return _attach_fp8(model, tensors)
        tensors = from_compressed_tensors(tensors, model)
        names = set(tensors)
    elif codec != "int8" and not mla:
        raise CvtError("Ascend GQA KV-cache scales (C8) are int8; an fp8 cache takes compressed-tensors "
                       "self_attn.k_scale / v_scale, or FAKQuant (MLA) fa_k on Ascend 950")
    specs = {s.name: s for s in kv_cache_tensor_specs(args)}
    unknown = sorted(names - set(specs))
    if unknown:
        raise CvtError(f"KV-cache tensor {unknown[0]} has no place in the {args.num_hidden_layers}-layer "
                       f"{'MLA (FAKQuant)' if mla else 'GQA (C8)'} convention (expected e.g. {next(iter(specs))})")
    required = {"k"} if mla else {"k", "v"}
    per_layer: list[dict[str, torch.Tensor]] = [{} for _ in range(args.num_hidden_layers)]
    extra: list[dict[str, torch.Tensor]] = [{} for _ in range(args.num_hidden_layers)]
    for name, spec in specs.items():
        t = tensors.get(name)
        if t is None:
            if spec.kind == "scale" and spec.role in required:
                raise CvtError(f"the int8 KV cache needs {name} (shape {list(spec.shape)}): missing")
            continue
        if tuple(t.shape) != spec.shape:
            raise CvtError(f"KV-cache tensor {name}: shape {list(t.shape)}, expected {list(spec.shape)}")
        t = t.detach()
        if not torch.isfinite(t.float()).all():
            raise CvtError(f"KV-cache tensor {name} holds NaN or Inf")
        if spec.kind == "offset":
            if bool((t != 0).any()):
                raise CvtError(f"KV-cache tensor {name} is non-zero: only symmetric int8 KV caches "
                               "(offset 0) are supported")
            continue
        t = t.float()
        if bool((t <= 0).any()):
            raise CvtError(f"KV-cache scale {name} has non-positive entries")
        per_layer[spec.layer][spec.role] = t
        if spec.role not in required:
            extra[spec.layer][spec.role] = t
    for attn, got, ext in zip(_attentions(model), per_layer, extra):
        dev = _device_of(attn)
        a, b = _runtime_scales(mla, got)
        attn.kv_scales = (a.to(dev), None if b is None else b.to(dev))
        attn.kv_extra, attn.kv_codec, attn.kv_names = ext, codec, "c8"  # fp8: Ascend 950's FAKQuant


def _attach_fp8(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """vLLM's FP8 KV cache: per layer k_scale / v_scale [1] (MLA: k_scale for the whole
    [latent | rope key] entry, vLLM's reading; v_scale unused)."""
    args = model.args
    for i, attn in enumerate(_attentions(model)):
        got = {}
        for kv in ("k", "v"):
            name = f"model.layers.{i}.self_attn.{kv}_scale"
            t = tensors.get(name)
            if t is None:
                raise CvtError(f"the fp8 KV cache needs {name}: missing")
            t = t.detach().float()
            if t.numel() != 1 or not torch.isfinite(t).all() or bool((t <= 0).any()):
                raise CvtError(f"KV-cache scale {name}: {list(t.shape)} {t.flatten()[:2].tolist()}, expected one "
                               "positive finite value (per-tensor fp8)")
            got[kv] = t.reshape(1)
        zp = [n for n in tensors if n.endswith("_zero_point") and bool((tensors[n] != 0).any())]
        if zp:
            raise CvtError(f"{zp[0]}: asymmetric KV caches are not supported")
        dev = _device_of(attn)
        a, b = (got["k"], got["k"]) if latent_cache(args) else (got["k"], got["v"])
        attn.kv_scales, attn.kv_extra, attn.kv_codec = (a.to(dev), b.to(dev)), {}, "fp8"
        attn.kv_names = "ct"


def detach_kv_cache_scales(model: nn.Module) -> None:
    """Leave C8 mode (the model's caches and forward become float again)."""
    for attn in _attentions(model):
        attn.kv_scales = None
        attn.kv_extra = {}


def get_kv_cache_scales(model: nn.Module, offsets: bool = True) -> dict[str, torch.Tensor]:
    """The attached scales by their on-disk names (scales float32 on the CPU; offsets zeros of
    their dtype). int8: the Ascend names (MLA: fa_v defaults to fa_k's scale, fa_q to 1 when not
    attached); fp8: compressed-tensors ``self_attn.k_scale`` / ``v_scale`` [1]."""
    scales = layer_kv_scales(model)
    if scales is None:
        raise CvtError("the model has no KV-cache scales (not a C8 model; calibrate or load them first)")
    mla = latent_cache(model)
    if kv_codec(model) == "fp8" and getattr(_attentions(model)[0], "kv_names", "ct") != "c8":
        out = {}
        for i, (a, b) in enumerate(scales):
            out[f"model.layers.{i}.self_attn.k_scale"] = a.detach().float().cpu().reshape(1).clone()
            out[f"model.layers.{i}.self_attn.v_scale"] = (a if mla else b).detach().float().cpu().reshape(1).clone()
        return out
    out = {}
    for spec, attn in ((s, _attentions(model)[s.layer]) for s in kv_cache_tensor_specs(model)):
        if spec.kind == "offset":
            if offsets:
                out[spec.name] = torch.zeros(spec.shape, dtype=spec.dtype)
            continue
        a, b = scales[spec.layer]
        ext = getattr(attn, "kv_extra", None) or {}
        if mla:
            v = ext.get(spec.role, a if spec.role in ("k", "v") else torch.ones(spec.shape))
        else:
            v = a if spec.role == "k" else b
        out[spec.name] = v.detach().float().cpu().reshape(spec.shape).clone()
    return out


@contextlib.contextmanager
def float_kv(model: nn.Module) -> Iterator[None]:
    """Temporarily leave C8 mode (scales restored on exit)."""
    saved = [(getattr(a, "kv_scales", None), getattr(a, "kv_extra", {}), getattr(a, "kv_codec", "int8"))
             for a in _attentions(model)]
    try:
        detach_kv_cache_scales(model)
        yield
    finally:
        for a, (s_, e, c) in zip(_attentions(model), saved):
            a.kv_scales, a.kv_extra, a.kv_codec = s_, e, c


# ------------------------------------------------------------------- attention hook
def cache_input(attn: nn.Module, cached: bool, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Called by every attention on the two tensors it is about to cache (MLA: latent [b, s, C],
    k_pe [b, s, dr]; GQA: k, v [b, K, s, D]). Feeds a calibration observer when one is set;
    without a cache (``cached`` False) and in C8 mode returns them quantize-dequantized (a tensor
    whose scale is None stays as it is), so the full forward equals the int8-cache path;
    otherwise returns them unchanged."""
    obs = getattr(attn, "kv_observer", None)
    if obs is not None:
        obs(a, b)
    scales = getattr(attn, "kv_scales", None)
    if cached or scales is None:
        return a, b
    sa, sb = scales
    codec = getattr(attn, "kv_codec", "int8")
    return (fake_quantize(a, broadcast_scale(sa, a), codec),
            b if sb is None else fake_quantize(b, broadcast_scale(sb, b), codec))


def query_input(attn: nn.Module, q_abs: torch.Tensor) -> None:
    """Called by MLA on its absorbed query [b, s, H, C] (observed for fa_q while calibrating)."""
    obs = getattr(attn, "kv_observer", None)
    if obs is not None and hasattr(obs, "query"):
        obs.query(q_abs)


# ---------------------------------------------------------------------------- calibration
class KVObserver:
    """Running amax of every layer's cache inputs (attach with `observe_kv`): per channel for
    GQA; per layer for the MLA latent, per head for the MLA absorbed query."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.mla = latent_cache(model)
        self.amax: list[dict[str, torch.Tensor]] = [{} for _ in range(model.args.num_hidden_layers)]
        self.tokens = 0

    def _update(self, i: int, role: str, m: torch.Tensor) -> None:
        cur = self.amax[i].get(role)
        self.amax[i][role] = m if cur is None else torch.maximum(cur, m)

    def _observer(self, i: int):
        def observe(a: torch.Tensor, b: torch.Tensor) -> None:
            if self.mla:
                self._update(i, "k", a.detach().float().abs().amax().reshape(1).cpu())
                self._update(i, "pe", b.detach().float().abs().amax().reshape(1).cpu())
            else:
                self._update(i, "k", _channel_amax(a).cpu())
                self._update(i, "v", _channel_amax(b).cpu())

        def query(q_abs: torch.Tensor) -> None:  # [b, s, H, C] -> per head
            self._update(i, "q", q_abs.detach().float().abs().amax(dim=(0, 1, 3)).cpu())

        observe.query = query
        return observe

    def fp8_scales(self) -> dict[str, torch.Tensor]:
        """compressed-tensors ``self_attn.k_scale`` / ``v_scale`` [1] of vLLM's FP8 cache: amax / 448
        per tensor (MLA: one scale for the [latent | rope key] entry, k = v)."""
        out = {}
        for i, am in enumerate(self.amax):
            if "k" not in am:
                raise CvtError(f"no calibration data reached layer {i}'s attention")
            if self.mla:
                k = v = torch.maximum(am["k"].max(), am["pe"].max())
            else:
                k, v = am["k"].max(), am["v"].max()
            out[f"model.layers.{i}.self_attn.k_scale"] = scales_from_amax(k, "fp8").reshape(1)
            out[f"model.layers.{i}.self_attn.v_scale"] = scales_from_amax(v, "fp8").reshape(1)
        return out

    def scales(self, codec: str = "int8") -> dict[str, torch.Tensor]:
        """{name: tensor} of every Ascend scale (and zero offset) from the observed amax: int8
        (amax / 127), or "fp8" (amax / 448: FAKQuant's fp8 cache on Ascend 950)."""
        out = {}
        for spec in kv_cache_tensor_specs(self.model):
            role = "k" if self.mla and spec.role == "v" else spec.role  # the latent is K and V
            amax = self.amax[spec.layer].get(role)
            if amax is None:
                raise CvtError(f"no calibration data reached layer {spec.layer}'s attention")
            if spec.kind == "offset":
                out[spec.name] = torch.zeros(spec.shape, dtype=spec.dtype)
            else:
                out[spec.name] = scales_from_amax(amax, codec).reshape(spec.shape)
        return out


@contextlib.contextmanager
def observe_kv(model: nn.Module) -> Iterator[KVObserver]:
    """Observe the cache inputs of every decoder layer while the block runs; C8 is off inside
    (the statistics are those of the float model)."""
    obs = KVObserver(model)
    attns = _attentions(model)
    with float_kv(model):
        try:
            for i, a in enumerate(attns):
                a.kv_observer = obs._observer(i)
            yield obs
        finally:
            for a in attns:
                a.kv_observer = None


def _sequences(tokens: Any) -> Iterable[torch.Tensor]:
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() == 1:
            yield tokens[None]
        elif tokens.dim() == 2:
            yield tokens
        else:
            raise CvtError(f"calibration tokens must be [s] or [b, s], got shape {list(tokens.shape)}")
        return
    for seq in tokens:
        t = torch.as_tensor(seq, dtype=torch.long)
        yield from _sequences(t)


@torch.no_grad()
def calibrate_kv_scales(model: nn.Module, tokens: Any, max_len: int | None = None,
                        codec: str = "int8") -> dict[str, torch.Tensor]:
    """Static KV-cache scales from one float forward per batch of `tokens` ([b, s] or [s]
    tensor, or an iterable of sequences / batches); sequences longer than `max_len` (default
    the model's max_positions) are cut into windows. Returns {name: tensor} for every
    `kv_cache_tensor_specs` entry (scales from amax / 127, offsets zero), or with `codec` "fp8"
    the compressed-tensors k_scale / v_scale of vLLM's FP8 cache; the model is left as it was
    (attach the result with `attach_kv_cache_scales`).""" 
    limit = min(max_len or model.max_positions, model.max_positions)
    dev = _device_of(model)
    seen = 0
    with observe_kv(model) as obs:
        for batch in _sequences(tokens):
            for start in range(0, batch.shape[1], limit):
                chunk = batch[:, start:start + limit].to(dev)
                if chunk.numel():
                    model(chunk)
                    seen += chunk.numel()
        if not seen:
            raise CvtError("KV-cache calibration got no tokens")
        return obs.fp8_scales() if codec == "fp8" else obs.scales()


# -------------------------------------------------------------------- compressed-tensors
def compressed_tensors_kv_cache_scheme(strategy: str = "tensor") -> dict[str, Any]:
    """The config.json ``quantization_config.kv_cache_scheme`` for cvt's int8 KV cache."""
    if strategy not in ("tensor", "attn_head"):
        raise CvtError(f"kv cache strategy {strategy!r} is not supported (supported: tensor, attn_head)")
    return {"num_bits": 8, "type": "int", "strategy": strategy, "symmetric": True, "dynamic": False}


def _scale(scales: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in scales:
        raise CvtError(f"KV-cache scale {name} is missing")
    return scales[name].float()


def to_compressed_tensors(scales: Mapping[str, torch.Tensor], model_or_config: Any,
                          strategy: str = "tensor", dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Ascend scales -> ``model.layers.{i}.self_attn.k_scale`` / ``v_scale`` (lossy for GQA, see
    the module docstring): "tensor" [1] = max of the channels; "attn_head" [kv_heads, 1, 1] =
    max per head (GQA only). MLA: k_scale = v_scale = the latent's fa_k scale."""
    compressed_tensors_kv_cache_scheme(strategy)
    args = _args(model_or_config)
    mla = latent_cache(args)
    if mla and strategy != "tensor":
        raise CvtError("MLA's latent KV cache has no attention heads: only the 'tensor' kv cache strategy "
                       "can be written for compressed-tensors")
    out = {}
    for i in range(args.num_hidden_layers):
        p = f"model.layers.{i}.self_attn."
        if mla:
            ks = vs = _scale(scales, p + "fa_k.scale").reshape(1)
        elif strategy == "tensor":
            ks, vs = (_scale(scales, f"{p}{r}_proj.kv_cache_scale").max().reshape(1) for r in "kv")
        else:
            ks, vs = (_scale(scales, f"{p}{r}_proj.kv_cache_scale").view(args.kv_heads, args.dim_head)
                      .amax(dim=1).view(-1, 1, 1) for r in "kv")
        out[p + "k_scale"] = ks.to(dtype).clone()
        out[p + "v_scale"] = vs.to(dtype).clone()
    return out


def from_compressed_tensors(tensors: Mapping[str, torch.Tensor], model_or_config: Any) -> dict[str, torch.Tensor]:
    """compressed-tensors ``self_attn.k_scale`` / ``v_scale`` ([1] or [kv_heads, 1, 1]) -> Ascend
    scales (exact broadcast; offsets omitted = zero). MLA: k_scale is the latent's (fa_k),
    v_scale is not used (vLLM's MLA reading). A non-zero zero point is refused."""
    args = _args(model_or_config)
    mla = latent_cache(args)
    out = {}
    for name, t in tensors.items():
        m = CT_NAME_RE.match(name)
        if m is None:
            raise CvtError(f"{name} is not a compressed-tensors KV-cache scale")
        i, kv, kind = int(m.group(1)), m.group(2), m.group(3)
        if kind == "zero_point":
            if bool((t != 0).any()):
                raise CvtError(f"{name}: asymmetric KV caches are not supported (only symmetric int8)")
            continue
        if i >= args.num_hidden_layers:
            raise CvtError(f"{name}: layer {i} is not a decoder layer (num_hidden_layers {args.num_hidden_layers})")
        t = t.detach().float()
        p = f"model.layers.{i}.self_attn."
        if mla:
            if kv == "k":
                if t.numel() != 1:
                    raise CvtError(f"{name}: shape {list(t.shape)}, expected [1]")
                out[p + "fa_k.scale"] = t.reshape(1, 1).clone()
            continue
        n = args.kv_heads * args.dim_head
        if t.numel() == 1:
            s_ = t.reshape(1).expand(n)
        elif tuple(t.shape) == (args.kv_heads, 1, 1):
            s_ = t.view(args.kv_heads, 1).expand(args.kv_heads, args.dim_head).reshape(n)
        else:
            raise CvtError(f"{name}: shape {list(t.shape)}, expected [1] or [{args.kv_heads}, 1, 1]")
        out[f"{p}{kv}_proj.kv_cache_scale"] = s_.clone()
    return out
