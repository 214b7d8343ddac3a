"""The int8 KV cache ("C8" of w8a8c8): convention, quantization math, scales, calibration.

Runtime (the int8 cache classes in ``models/deepseek_v3.py`` / ``models/qwen3.py``), the
quantize stage and the format writers all take the convention from here (`KV_CONVENTION`,
`kv_cache_tensor_specs`), so there is one definition.

Convention (``KV_CONVENTION``, version 1)
-----------------------------------------
What is cached, per decoder layer i (MTP layers have no scales: the runtime never runs them):

* MLA (DeepSeek-V3 / R1 / V3.1, Kimi-K2), absorbed cache:
    - latent ``c_kv = kv_a_layernorm(kv_a_proj_with_mqa(x)[..., :C])``, C = kv_lora_rank;
    - rope key ``k_pe = rope(kv_a_proj_with_mqa(x)[..., C:])``, dr = qk_rope_head_dim, after RoPE,
      in the official / vLLM channel layout (rope_interleave: pairs (2j, 2j+1); transformers'
      de-interleaved layout is a permutation of it).
  Tensors: ``model.layers.{i}.self_attn.kv_a_layernorm.kv_cache_scale``  f32 [C]
           ``model.layers.{i}.self_attn.kv_a_layernorm.kv_cache_offset`` f32 [C]  (zeros)
           ``model.layers.{i}.self_attn.k_pe.kv_cache_scale``            f32 [dr]
           ``model.layers.{i}.self_attn.k_pe.kv_cache_offset``           f32 [dr] (zeros)
  Pattern: ``<cached tensor>.kv_cache_{scale,offset}`` where the cached tensor is named by the
  module producing it (kv_a_layernorm) or, having none, by the reference code's name (k_pe).
* GQA (Qwen3 / Qwen3-MoE / Qwen2 / Llama): k after k_norm and RoPE, v as projected, channel
  index = head * head_dim + d (the k_proj / v_proj output layout). The msModelSlim C8 names:
           ``model.layers.{i}.self_attn.k_proj.kv_cache_scale``  f32 [kv_heads * head_dim]
           ``model.layers.{i}.self_attn.k_proj.kv_cache_offset`` f32 [kv_heads * head_dim] (zeros)
           ``model.layers.{i}.self_attn.v_proj.kv_cache_scale`` / ``.kv_cache_offset`` (same)

Math (int8, symmetric, static, per channel c; x in float32):
    amax_c = max |x_c| over all calibration tokens
    scale_c = max(amax_c / 127, 2**-14)        (the floor keeps dead channels finite and every
                                                scale a normal fp16 number)
    q = clamp(round_half_to_even(x / scale), -128, 127) -> int8
    x^ = q * scale, cast to the compute dtype   (documented dequant (q - offset) * scale, offset 0)
The cache stores q (int8) and dequantizes on read; scales / offsets are float32.

compressed-tensors (`to_compressed_tensors`): ``self_attn.k_scale`` / ``self_attn.v_scale``
with ``kv_cache_scheme = {num_bits 8, type int, symmetric, dynamic false, strategy}``:
strategy "tensor" -> shape [1] = max over the per-channel scales; "attn_head" (GQA only) ->
[kv_heads, 1, 1] = max over each head's channels. Lossy direction: per-channel -> per-tensor /
per-head: channels with a smaller range get the larger step (never clipped); per-tensor /
per-head -> per-channel (`from_compressed_tensors`, used on load) is an exact broadcast. For
MLA only "tensor" exists: k_scale = v_scale = max over latent and k_pe scales, the vLLM MLA
reading (one scale for the [c_kv | k_pe] cache entry); transformers' own (non-absorbed)
DeepSeek attention would apply k_scale to the decompressed per-head k instead.
(compressed-tensors' own calibrator divides amax by 127.5; the scale's meaning, x = q * scale,
is the same, so cvt's amax / 127 scales are valid there.)

Run-time behaviour
------------------
A model is "in C8 mode" once scales are attached (`attach_kv_cache_scales`; each attention
module then holds ``kv_scales``, a plain attribute like ``inv_freq``, not in the state_dict).
Then ``new_cache()`` (``quant="auto"``) and ``new_cache(quant="int8")`` give int8 caches,
``new_cache(quant=None)`` a float cache (the model without C8, for comparisons), and the
forward without a cache quantize-dequantizes the same tensors, so a full forward equals
prefill + incremental decode through the int8 cache (``cvt verify`` and ``cvt run`` see the
same model). ``new_cache(quant="int8")`` without scales is a CvtError.

Calibration: `calibrate_kv_scales(model, tokens)` runs float forwards (C8 switched off while
it runs) with an observer on every cache input and returns the tensors by their names;
`observe_kv` is the same observer for a layer-by-layer driver.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import Any, Iterable, Iterator, Mapping

import torch
from torch import nn

from cvt.errors import CvtError

QMIN, QMAX = -128, 127
SCALE_DIVISOR = 127.0
SCALE_MIN = 2.0 ** -14

KV_CONVENTION: dict[str, Any] = {
    "name": "cvt-kv-int8",
    "version": 1,
    "dtype": "int8",
    "symmetric": True,
    "dynamic": False,
    "granularity": "channel",
    "scale_dtype": "float32",
    "offset_dtype": "float32",
    "qmin": QMIN,
    "qmax": QMAX,
    "scale": f"max(amax_per_channel / {SCALE_DIVISOR:g}, 2**-14)",
    "quantize": "q = clamp(round_half_to_even(x / scale), -128, 127)",
    "dequantize": "x = (q - offset) * scale, offset = 0",
    "mla": {
        "cached": {
            "latent": "kv_a_layernorm(kv_a_proj_with_mqa(x)[..., :kv_lora_rank])",
            "k_pe": "rope(kv_a_proj_with_mqa(x)[..., kv_lora_rank:]), official interleaved layout",
        },
        "tensors": {
            "latent": "model.layers.{i}.self_attn.kv_a_layernorm.kv_cache_{scale,offset} [kv_lora_rank]",
            "k_pe": "model.layers.{i}.self_attn.k_pe.kv_cache_{scale,offset} [qk_rope_head_dim]",
        },
    },
    "gqa": {
        "cached": {"k": "rope(k_norm(k_proj(x))) per head", "v": "v_proj(x)"},
        "tensors": {
            "k": "model.layers.{i}.self_attn.k_proj.kv_cache_{scale,offset} [kv_heads*head_dim]",
            "v": "model.layers.{i}.self_attn.v_proj.kv_cache_{scale,offset} [kv_heads*head_dim]",
        },
        "channel": "head * head_dim + d",
    },
    "layers": "decoder layers 0 .. num_hidden_layers-1 (no MTP layers)",
}

_NAME_RE = re.compile(r"^model\.layers\.(\d+)\.self_attn\."
                      r"(kv_a_layernorm|k_pe|k_proj|v_proj)\.kv_cache_(scale|offset)$")
_CT_NAME_RE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([kv])_(scale|zero_point)$")


@dataclasses.dataclass(frozen=True)
class KVTensorSpec:
    """One stored KV-cache tensor: on-disk name, layer, cache role, scale or offset, shape."""

    name: str
    layer: int
    role: str          # "latent" | "k_pe" (MLA), "k" | "v" (GQA)
    kind: str          # "scale" | "offset"
    shape: tuple[int, ...]


# ---------------------------------------------------------------------------------- math
def scales_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """Per-channel scale (float32) from per-channel amax: max(amax / 127, 2**-14)."""
    return (amax.float() / SCALE_DIVISOR).clamp_min(SCALE_MIN)


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 q = clamp(round_half_even(float32(x) / scale), -128, 127); scale broadcasts to x."""
    return torch.round(x.float() / scale.float()).clamp_(QMIN, QMAX).to(torch.int8)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x = float32(q) * scale, cast to dtype."""
    return (q.float() * scale.float()).to(dtype)


def fake_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """dequantize(quantize(x)) in x's dtype: what the int8 cache returns for x."""
    return dequantize(quantize(x, scale), scale, x.dtype)


def broadcast_scale(scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A flat per-channel scale shaped for x: MLA [b, s, C] -> [C]; GQA [b, K, s, D] -> [K, 1, D]."""
    if x.dim() == 4:
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
        from cvt.runtime.models import family
        mod, cfg = family(model_or_config)
        return mod.Args.from_config(cfg)
    return model_or_config                                  # an Args object


def is_mla(model_or_config: Any) -> bool:
    return hasattr(_args(model_or_config), "kv_lora_rank")


def _roles(args) -> dict[str, tuple[str, int]]:
    """role -> (tensor prefix under self_attn, channels)."""
    if hasattr(args, "kv_lora_rank"):
        return {"latent": ("kv_a_layernorm", args.kv_lora_rank), "k_pe": ("k_pe", args.qk_rope_head_dim)}
    n = args.kv_heads * args.dim_head
    return {"k": ("k_proj", n), "v": ("v_proj", n)}


def kv_cache_tensor_specs(model_or_config: Any) -> list[KVTensorSpec]:
    """Every KV-cache tensor of a model (runtime model, config.json dict or Args), in layer
    order: per layer, per role (MLA latent, k_pe; GQA k, v), scale then offset."""
    args = _args(model_or_config)
    specs = []
    for i in range(args.num_hidden_layers):
        for role, (prefix, n) in _roles(args).items():
            for kind in ("scale", "offset"):
                specs.append(KVTensorSpec(f"model.layers.{i}.self_attn.{prefix}.kv_cache_{kind}", i, role, kind, (n,)))
    return specs


def kv_cache_tensor_names(model_or_config: Any) -> dict[str, tuple[int, ...]]:
    """{name: shape} of `kv_cache_tensor_specs`."""
    return {s.name: s.shape for s in kv_cache_tensor_specs(model_or_config)}


def is_kv_cache_tensor(name: str) -> bool:
    """True for a KV-cache tensor name of either format (cvt/Ascend per-channel names, or
    compressed-tensors ``self_attn.k_scale`` / ``v_scale`` / ``*_zero_point``); a loader routes
    these to `attach_kv_cache_scales` instead of a module parameter."""
    return bool(_NAME_RE.match(name) or _CT_NAME_RE.match(name))


# ------------------------------------------------------------------- model attachment
def _attentions(model: nn.Module) -> list[nn.Module]:
    layers = model.get_submodule("model.layers")
    return [layers[i].self_attn for i in range(model.args.num_hidden_layers)]


def has_kv_cache_scales(model: nn.Module) -> bool:
    """Whether the model is in C8 mode (scales attached to every attention layer)."""
    return all(getattr(a, "kv_scales", None) is not None for a in _attentions(model))


def layer_kv_scales(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Per decoder layer the two flat float32 scales in cache order (MLA: latent, k_pe; GQA:
    k, v), or None when the model has no KV-cache scales."""
    if not has_kv_cache_scales(model):
        return None
    return [a.kv_scales for a in _attentions(model)]


def _device_of(module: nn.Module) -> torch.device:
    for t in module.parameters():
        return t.device
    return torch.device("cpu")


def attach_kv_cache_scales(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Put the model in C8 mode with `tensors` (name -> tensor), either the cvt per-channel set
    (`kv_cache_tensor_specs`: every scale required, offsets optional and must be zero) or the
    compressed-tensors set (``self_attn.k_scale`` / ``v_scale`` per layer, shape [1] or
    [kv_heads, 1, 1], broadcast exactly to channels). Anything else is a CvtError naming it."""
    args = model.args
    roles = _roles(args)
    names = set(tensors)
    ct = {n for n in names if _CT_NAME_RE.match(n)}
    if ct:
        if ct != names:
            raise CvtError(f"KV-cache tensors mix compressed-tensors names ({sorted(ct)[0]}) with others "
                           f"({sorted(names - ct)[0]})")
        tensors = from_compressed_tensors(tensors, model)
        names = set(tensors)
    specs = {s.name: s for s in kv_cache_tensor_specs(args)}
    unknown = sorted(names - set(specs))
    if unknown:
        raise CvtError(f"KV-cache tensor {unknown[0]} has no place in the {len(specs) // 4}-layer "
                       f"{'MLA' if is_mla(args) else 'GQA'} convention (expected e.g. {next(iter(specs))})")
    per_layer: list[dict[str, torch.Tensor]] = [{} for _ in range(args.num_hidden_layers)]
    for name, spec in specs.items():
        t = tensors.get(name)
        if t is None:
            if spec.kind == "scale":
                raise CvtError(f"the int8 KV cache needs {name} (shape {list(spec.shape)}): missing")
            continue
        if tuple(t.shape) != spec.shape:
            raise CvtError(f"KV-cache tensor {name}: shape {list(t.shape)}, expected {list(spec.shape)}")
        t = t.detach().float()
        if not torch.isfinite(t).all():
            raise CvtError(f"KV-cache tensor {name} holds NaN or Inf")
        if spec.kind == "offset":
            if bool((t != 0).any()):
                raise CvtError(f"KV-cache tensor {name} is non-zero: only symmetric int8 KV caches "
                               "(offset 0) are supported")
            continue
        if bool((t <= 0).any()):
            raise CvtError(f"KV-cache scale {name} has non-positive entries")
        per_layer[spec.layer][spec.role] = t
    for attn, scales in zip(_attentions(model), per_layer):
        dev = _device_of(attn)
        attn.kv_scales = tuple(scales[r].to(dev) for r in roles)


def detach_kv_cache_scales(model: nn.Module) -> None:
    """Leave C8 mode (the model's caches and forward become float again)."""
    for attn in _attentions(model):
        attn.kv_scales = None


def get_kv_cache_scales(model: nn.Module, offsets: bool = True) -> dict[str, torch.Tensor]:
    """The attached scales by their on-disk names (float32, CPU), offsets (zeros) included."""
    scales = layer_kv_scales(model)
    if scales is None:
        raise CvtError("the model has no KV-cache scales (not a C8 model; calibrate or load them first)")
    out = {}
    for spec in kv_cache_tensor_specs(model):
        s = scales[spec.layer][list(_roles(model.args)).index(spec.role)].detach().float().cpu()
        if spec.kind == "scale":
            out[spec.name] = s.clone()
        elif offsets:
            out[spec.name] = torch.zeros_like(s)
    return out


@contextlib.contextmanager
def float_kv(model: nn.Module) -> Iterator[None]:
    """Temporarily leave C8 mode (scales restored on exit)."""
    saved = [getattr(a, "kv_scales", None) for a in _attentions(model)]
    try:
        detach_kv_cache_scales(model)
        yield
    finally:
        for a, s in zip(_attentions(model), saved):
            a.kv_scales = s


# ------------------------------------------------------------------- attention hook
def cache_input(attn: nn.Module, cached: bool, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Called by every attention on the two tensors it is about to cache (MLA: latent [b, s, C],
    k_pe [b, s, dr]; GQA: k, v [b, K, s, D]). Feeds a calibration observer when one is set;
    without a cache (``cached`` False) and in C8 mode returns them quantize-dequantized, so the
    full forward equals the int8-cache path; otherwise returns them unchanged."""
    obs = getattr(attn, "kv_observer", None)
    if obs is not None:
        obs(a, b)
    scales = getattr(attn, "kv_scales", None)
    if cached or scales is None:
        return a, b
    return fake_quantize(a, broadcast_scale(scales[0], a)), fake_quantize(b, broadcast_scale(scales[1], b))


# ---------------------------------------------------------------------------- calibration
class KVObserver:
    """Running per-channel amax of every layer's cache inputs (attach with `observe_kv`)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.amax: list[list[torch.Tensor | None]] = [[None, None] for _ in range(model.args.num_hidden_layers)]
        self.tokens = 0

    def _observer(self, i: int):
        def observe(a: torch.Tensor, b: torch.Tensor) -> None:
            for j, x in enumerate((a, b)):
                m = _channel_amax(x).cpu()
                cur = self.amax[i][j]
                self.amax[i][j] = m if cur is None else torch.maximum(cur, m)
        return observe

    def scales(self) -> dict[str, torch.Tensor]:
        """{name: tensor} of every scale (and zero offset) from the observed amax."""
        roles = list(_roles(self.model.args))
        out = {}
        for spec in kv_cache_tensor_specs(self.model):
            amax = self.amax[spec.layer][roles.index(spec.role)]
            if amax is None:
                raise CvtError(f"no calibration data reached layer {spec.layer}'s attention")
            out[spec.name] = scales_from_amax(amax) if spec.kind == "scale" else torch.zeros_like(amax)
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
def calibrate_kv_scales(model: nn.Module, tokens: Any, max_len: int | None = None) -> dict[str, torch.Tensor]:
    """Static KV-cache scales from one float forward per batch of `tokens` ([b, s] or [s]
    tensor, or an iterable of sequences / batches); sequences longer than `max_len` (default
    the model's max_positions) are cut into windows. Returns {name: float32 tensor} for every
    `kv_cache_tensor_specs` entry (scales from amax / 127, offsets zero); the model is left as
    it was (attach the result with `attach_kv_cache_scales`)."""
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
        return obs.scales()


# -------------------------------------------------------------------- compressed-tensors
def compressed_tensors_kv_cache_scheme(strategy: str = "tensor") -> dict[str, Any]:
    """The config.json ``quantization_config.kv_cache_scheme`` for cvt's int8 KV cache."""
    if strategy not in ("tensor", "attn_head"):
        raise CvtError(f"kv cache strategy {strategy!r} is not supported (supported: tensor, attn_head)")
    return {"num_bits": 8, "type": "int", "strategy": strategy, "symmetric": True, "dynamic": False}


def to_compressed_tensors(scales: Mapping[str, torch.Tensor], model_or_config: Any,
                          strategy: str = "tensor", dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """cvt per-channel scales -> ``model.layers.{i}.self_attn.k_scale`` / ``v_scale`` (lossy, see
    the module docstring): "tensor" [1] = max of the channels; "attn_head" [kv_heads, 1, 1] =
    max per head (GQA only). MLA: k_scale = v_scale = max over latent and k_pe."""
    compressed_tensors_kv_cache_scheme(strategy)
    args = _args(model_or_config)
    mla = hasattr(args, "kv_lora_rank")
    if mla and strategy != "tensor":
        raise CvtError("MLA's latent KV cache has no attention heads: only the 'tensor' kv cache strategy "
                       "can be written for compressed-tensors")
    roles = _roles(args)
    out = {}
    for i in range(args.num_hidden_layers):
        def scale(role):
            name = f"model.layers.{i}.self_attn.{roles[role][0]}.kv_cache_scale"
            if name not in scales:
                raise CvtError(f"KV-cache scale {name} is missing")
            return scales[name].float()

        if mla:
            s = torch.maximum(scale("latent").max(), scale("k_pe").max()).reshape(1)
            ks = vs = s
        elif strategy == "tensor":
            ks, vs = scale("k").max().reshape(1), scale("v").max().reshape(1)
        else:
            ks, vs = (scale(r).view(args.kv_heads, args.dim_head).amax(dim=1).view(-1, 1, 1) for r in ("k", "v"))
        out[f"model.layers.{i}.self_attn.k_scale"] = ks.to(dtype).clone()
        out[f"model.layers.{i}.self_attn.v_scale"] = vs.to(dtype).clone()
    return out


def from_compressed_tensors(tensors: Mapping[str, torch.Tensor], model_or_config: Any) -> dict[str, torch.Tensor]:
    """compressed-tensors ``self_attn.k_scale`` / ``v_scale`` ([1] or [kv_heads, 1, 1]) -> cvt
    per-channel scales (exact broadcast; offsets omitted = zero). MLA: k_scale serves latent and
    k_pe, v_scale is not used (vLLM's MLA reading). A non-zero zero point is refused."""
    args = _args(model_or_config)
    roles = _roles(args)
    mla = hasattr(args, "kv_lora_rank")
    out = {}
    for name, t in tensors.items():
        m = _CT_NAME_RE.match(name)
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
        targets = ((["latent", "k_pe"] if kv == "k" else []) if mla else [kv])
        for role in targets:
            prefix, n = roles[role]
            if t.numel() == 1:
                s = t.reshape(1).expand(n)
            elif not mla and tuple(t.shape) == (args.kv_heads, 1, 1):
                s = t.view(args.kv_heads, 1).expand(args.kv_heads, args.dim_head).reshape(n)
            else:
                raise CvtError(f"{name}: shape {list(t.shape)}, expected [1]"
                               + ("" if mla else f" or [{args.kv_heads}, 1, 1]"))
            out[f"model.layers.{i}.self_attn.{prefix}.kv_cache_scale"] = s.clone()
    return out
