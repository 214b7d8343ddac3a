"""Ascend msModelSlim "AscendV1" (FORMATS.md 2.2): ``quant_model_weights-*.safetensors`` +
``quant_model_description.json`` (every tensor name -> type tag, plus global keys).

====================  ===========  ===============================================================
kernel_fmt            tag          tensors of linear X (for w [n, k], group G)
====================  ===========  ===============================================================
w8a8_dynamic          W8A8_DYNAMIC X.weight int8 [n,k]; X.weight_scale f32 [n,1]; X.weight_offset f32
                                   zeros [n,1]
w8a8_static           W8A8         X.weight int8 [n,k]; X.input_scale f32 [1]; X.input_offset f32 [1];
                                   X.deq_scale f32 [n] (int64 float32 bits for fp16 models);
                                   X.quant_bias int32 [n]; X.weight_scale f32 [n,1] and
                                   X.weight_offset f32 zeros [n,1] (vllm-ascend's W8A8 method
                                   declares both; written when the tensor carries its weight scale)
w4a16                 W4A16        X.weight int8, int4 packed two per byte, even element low nibble:
                                   per group [n/2, k] (pairs of output channels), per channel
                                   [n, k/2] (along k); X.weight_scale f32 [n,k/G] ([n,1]);
                                   X.weight_offset f32 same shape (zeros when symmetric)
====================  ===========  ===============================================================

A float bias is tagged FLOAT. Offsets are the documented form ``w = (q - offset) * scale``.
There is no fp4 tag: fp4 is refused. `read` needs the tag (``meta``: the description dict,
or a tag string), because a per-channel W4A16 weight ``[n, k/2]`` looks like a W8A8 one.
Symmetry of a W4A16 weight is read back as "all offsets are zero".
"""

from __future__ import annotations

from collections import Counter

import torch

from cvt.errors import FormatError
from cvt.quant import primitives as P
from cvt.quant.formats import expect, register, scheme_name, take
from cvt.quant.schemes.base import QuantizedTensor

FLOAT = "FLOAT"
TAGS = {"w8a8_dynamic": "W8A8_DYNAMIC", "w8a8_static": "W8A8", "w4a16": "W4A16"}
SUPPORTED = ("w8a8", "w8a8c8", "w4a16")
VERSION = "1.0.0"
_DOMINANCE = ("W8A8_DYNAMIC", "W8A8", "W4A16", "W8A16")  # tie-break order for model_quant_type
_F = "ascend"


@register
class Ascend:
    name = "ascend"
    weights_prefix = "quant_model_weights"
    description_file = "quant_model_description.json"

    # ---- what this format can hold ----------------------------------------------------------------

    def supports(self, scheme) -> None:
        name = scheme_name(scheme)
        if name not in SUPPORTED:
            raise FormatError(f"the ascend format (msModelSlim AscendV1) has no type tag for scheme {name!r}"
                              + (" (there is no fp4 tag in AscendV1; write fp4 as compressed-tensors)"
                                 if name == "fp4" else "")
                              + f"; ascend supports: {', '.join(SUPPORTED)}")

    def check_shape(self, module: str, scheme, shape) -> None:
        self.supports(scheme)
        if not isinstance(scheme, str):
            scheme.check(f"{module}.weight", tuple(shape))
        n, k = shape
        if scheme_name(scheme) == "w4a16" and not isinstance(scheme, str):
            per_channel = scheme.group_size in (0, k)
            if per_channel and k % 2:
                raise FormatError(f"ascend W4A16: {module}.weight {list(shape)} is per channel and packs two int4 "
                                  f"along in_features, which must be even (got {k})")
            if not per_channel and n % 2:
                raise FormatError(f"ascend W4A16: {module}.weight {list(shape)} is grouped and packs pairs of "
                                  f"output channels, so out_features must be even (got {n})")

    # ---- write -----------------------------------------------------------------------------------

    def disk_tensors(self, module: str, q: QuantizedTensor, bias: torch.Tensor | None = None):
        self.supports(q.scheme)
        p, n = q.parts, q.shape[0]
        x = module + "."
        if q.kernel_fmt == "w8a8_dynamic":
            out = {x + "weight": p["weight"], x + "weight_scale": p["weight_scale"].to(torch.float32).reshape(n, 1),
                   x + "weight_offset": p["weight_offset"].to(torch.float32).reshape(n, 1)}
        elif q.kernel_fmt == "w8a8_static":
            out = {x + "weight": p["weight"], x + "input_scale": p["input_scale"].to(torch.float32).reshape(1),
                   x + "input_offset": p["input_offset"].to(torch.float32).reshape(1),
                   x + "deq_scale": p["deq_scale"], x + "quant_bias": p["quant_bias"]}
            if "weight_scale" in q.extra:
                ws = q.extra["weight_scale"].to(torch.float32).reshape(n, 1)
                out[x + "weight_scale"], out[x + "weight_offset"] = ws, torch.zeros_like(ws)
        elif q.kernel_fmt == "w4a16":
            sc = p["weight_scale"].to(torch.float32)
            dim = P.ascend_pack_dim(sc)
            if q.shape[dim] % 2:
                raise FormatError(f"ascend W4A16: cannot pack {module}.weight {list(q.shape)} along dim {dim} "
                                  f"({'pairs of output channels' if dim == 0 else 'in_features'} must be even)")
            out = {x + "weight": P.pack_int4_ascend(p["weight_int4"], dim), x + "weight_scale": sc,
                   x + "weight_offset": p["weight_offset"].to(torch.float32)}
        else:
            raise FormatError(f"ascend: no layout for kernel format {q.kernel_fmt!r} of {module!r}")
        if bias is not None:
            out[x + "bias"] = bias
        return {k: v.contiguous() for k, v in out.items()}

    def tags(self, module: str, q: QuantizedTensor, bias: bool = False) -> dict[str, str]:
        """``{disk name: tag}`` for the tensors `disk_tensors` writes for this linear (bias: FLOAT)."""
        self.supports(q.scheme)
        tag = TAGS[q.kernel_fmt]
        names = {"w8a8_dynamic": ("weight", "weight_scale", "weight_offset"),
                 "w8a8_static": ("weight", "input_scale", "input_offset", "deq_scale", "quant_bias")
                 + (("weight_scale", "weight_offset") if "weight_scale" in q.extra else ()),
                 "w4a16": ("weight", "weight_scale", "weight_offset")}[q.kernel_fmt]
        out = {f"{module}.{n}": tag for n in names}
        if bias:
            out[f"{module}.bias"] = FLOAT
        return out

    def description(self, tags: dict[str, str], kv_cache: str | None = None, group_size: int = 0) -> dict:
        """quant_model_description.json: `tags` (every tensor in the weights, FLOAT for float ones) +
        ``model_quant_type`` (the tag of most linear weights, FLOAT if none), ``version``,
        ``group_size`` and, for an int8 KV cache (``kv_cache`` "int8" or "C8"), ``kv_cache_type: "C8"``."""
        reserved = {"model_quant_type", "version", "group_size", "kv_cache_type"}
        clash = sorted(reserved & set(tags))
        if clash:
            raise FormatError(f"ascend description: tensor names {clash} collide with the description's global keys")
        counts = Counter(t for n, t in tags.items() if n.endswith(".weight") and t not in (FLOAT, "C8"))
        best = max(counts.values(), default=0)
        order = list(_DOMINANCE) + sorted(set(counts) - set(_DOMINANCE))
        dominant = next((t for t in order if counts.get(t) == best), FLOAT) if best else FLOAT
        desc = dict(tags)
        desc.update({"model_quant_type": dominant, "version": VERSION, "group_size": int(group_size)})
        if kv_cache not in (None, "int8", "C8"):
            raise FormatError(f"ascend description: kv_cache {kv_cache!r} is not supported (int8 / C8, or None)")
        if kv_cache:
            desc["kv_cache_type"] = "C8"
        return desc

    # ---- read ------------------------------------------------------------------------------------

    def read(self, module: str, disk: dict[str, torch.Tensor], meta=None) -> QuantizedTensor:
        """``meta``: the description dict (tag of ``{module}.weight``; kv_cache_type C8 makes the
        scheme w8a8c8) or a tag string."""
        desc = meta if isinstance(meta, dict) else {}
        tag = meta if isinstance(meta, str) else desc.get(f"{module}.weight")
        if tag is None:
            raise FormatError(f"ascend: no type tag for {module}.weight (pass the quant_model_description.json "
                              "dict as meta)")
        w8_scheme = "w8a8c8" if desc.get("kv_cache_type") == "C8" else "w8a8"
        x = module + "."
        if tag == "W8A8_DYNAMIC":
            t = take(_F, module, disk, ("weight", "weight_scale", "weight_offset"))
            n, k = expect(_F, x + "weight", t["weight"], (torch.int8,)).shape
            sc = expect(_F, x + "weight_scale", t["weight_scale"], (torch.float32, torch.bfloat16, torch.float16))
            off = expect(_F, x + "weight_offset", t["weight_offset"], (torch.float32, torch.bfloat16, torch.float16))
            parts = {"weight": t["weight"], "weight_scale": sc.to(torch.float32).reshape(n, 1),
                     "weight_offset": off.to(torch.float32).reshape(n, 1)}
            return QuantizedTensor(w8_scheme, "w8a8_dynamic", (n, k), parts)
        if tag == "W8A8":
            t = take(_F, module, disk, ("weight", "input_scale", "input_offset", "deq_scale", "quant_bias"))
            n, k = expect(_F, x + "weight", t["weight"], (torch.int8,)).shape
            expect(_F, x + "deq_scale", t["deq_scale"], (torch.float32, torch.int64), (n,))
            expect(_F, x + "quant_bias", t["quant_bias"], (torch.int32,), (n,))
            parts = {"weight": t["weight"], "input_scale": t["input_scale"].to(torch.float32).reshape(1),
                     "input_offset": t["input_offset"].to(torch.float32).reshape(1),
                     "deq_scale": t["deq_scale"], "quant_bias": t["quant_bias"]}
            extra = {}
            if x + "weight_scale" in disk:
                extra["weight_scale"] = disk[x + "weight_scale"].to(torch.float32).reshape(n, 1)
            return QuantizedTensor(w8_scheme, "w8a8_static", (n, k), parts, 0, True, extra)
        if tag == "W4A16":
            t = take(_F, module, disk, ("weight", "weight_scale", "weight_offset"))
            expect(_F, x + "weight", t["weight"], (torch.int8,))
            sc = t["weight_scale"].to(torch.float32)
            if sc.dim() != 2:
                raise FormatError(f"ascend: {x}weight_scale is {list(sc.shape)}: expected 2-D [n, k/G]")
            off = expect(_F, x + "weight_offset", t["weight_offset"].to(torch.float32), (torch.float32,),
                         tuple(sc.shape))
            dim = P.ascend_pack_dim(sc, t["weight"])  # by rows: TP shards may hold one group per row
            q = P.unpack_int4_ascend(t["weight"], dim)
            n, k = q.shape
            if sc.shape[0] != n or k % sc.shape[1]:
                raise FormatError(f"ascend: {x}weight_scale {list(sc.shape)} does not fit the unpacked weight "
                                  f"[{n}, {k}] (expected [{n}, k/G])")
            g = 0 if sc.shape[1] == 1 else k // sc.shape[1]
            parts = {"weight_int4": q, "weight_scale": sc, "weight_offset": off}
            return QuantizedTensor("w4a16", "w4a16", (n, k), parts, g, bool((off == 0).all()))
        raise FormatError(f"ascend: {module}.weight has tag {tag!r}; cvt reads W8A8_DYNAMIC, W8A8 and W4A16 "
                          "linears (FLOAT tensors are plain weights)")
