"""`w4a16`: int4 weights, float activations (Ascend W4A16, compressed-tensors pack-quantized).

Canonical in-memory parts (what `from_parts` takes):

* ``weight_int4`` int8 ``[n, k]``, one int4 value per element, range -8..7 (unpacked: the
  name differs from the on-disk ``weight`` on purpose -- W8A8_DYNAMIC stores ``weight`` +
  ``weight_scale`` + ``weight_offset`` too, so `for_parts` could not tell them apart);
* ``weight_scale`` float ``[n, k/G]`` (``[n, 1]`` per channel);
* ``weight_offset`` float, same shape (zeros when symmetric).

Dequant is the documented form ``w = (q - offset) * scale`` per group (FORMATS.md 2.2), in
float32; forward casts it to x.dtype and multiplies. The Ascend op computes ``(w + offset) *
scale`` instead, so `npu.py` passes ``-offset``.

On-disk layouts (read into these parts by `cvt.qtensor.layouts`; the loader goes through it):

* Ascend (msModelSlim W4A16): two's-complement int4, two per int8, even element in the low
  nibble. Per-group weights pack pairs of OUTPUT channels (``[n/2, k]``, row 2j low, 2j+1
  high); per-channel weights (scale last dim 1) pack along k (``[n, k/2]``). Checked against
  consumers of these files: a vllm-ascend W4A16 linear scheme for msModelSlim weights
  ("Weight: [output_size // 2, input_size] (packed along output dim)"; low nibble ->
  ``unpacked[0::2]``, high -> ``unpacked[1::2]``, nibbles >= 8 minus 16) and vllm-ascend's
  older ``AscendW4A16LinearMethod`` (per-channel ``weight`` ``[output_size, input_size //
  2]`` int8). The same nibble order is what vllm-ascend's ``pack_to_int32`` relies on when it
  views such int8 pairs as int32 instead of calling ``npu_convert_weight_to_int4pack``.
* compressed-tensors ``pack-quantized``: int32 ``[n, ceil(k/8)]``, value + 8 (unsigned),
  element i of each run of 8 along k at bits 4i (vllm-ascend ``unpack_from_int32``:
  ``(w >> 4i) & 0xF`` then ``- 8``); the asymmetric zero point is packed the same way along dim 0.
"""

from __future__ import annotations


import torch

from cvt.qtensor import kernel_formats as KF
from cvt.errors import TensorError
# The pack helpers (bit layouts, worked examples) live in cvt.qtensor.primitives; re-exported here.
from cvt.qtensor.primitives import (  # noqa: F401
    ascend_pack_dim, pack_int4_ascend, pack_int4_ct, unpack_int4_ascend, unpack_int4_ct)
from cvt.runtime.kernels._common import FusedOrReference, FLOATS, check, check_2d, check_finite, desc, new_module, take
from cvt.runtime.kernels.linear import Linear, register


@register
class W4A16Linear(FusedOrReference, Linear):
    fmt = KF.W4A16
    parts = ("weight_int4", "weight_scale", "weight_offset")

    @classmethod
    def from_parts(cls, parts, bias=None) -> "W4A16Linear":
        p = take(cls.fmt, cls.parts, parts)
        q, sc, off = p["weight_int4"], p["weight_scale"], p["weight_offset"]
        n, k = check_2d(cls.fmt, "weight_int4", q, (torch.int8,))
        if bool(((q < -8) | (q > 7)).any()):
            raise TensorError(f"{cls.fmt} part 'weight_int4' ({desc(q)}) holds values outside the int4 range -8..7 "
                              "(pass unpacked values; cvt.qtensor.layouts reads packed ones)")
        check(cls.fmt, "weight_scale", sc, FLOATS)
        if sc.dim() != 2 or sc.shape[0] != n or sc.shape[1] == 0 or k % sc.shape[1]:
            raise TensorError(f"{cls.fmt} part 'weight_scale' is {desc(sc)}: expected [{n}, k/G] with G dividing "
                              f"k={k} ([{n}, 1] per channel)")
        check_finite(cls.fmt, "weight_scale", sc)
        check(cls.fmt, "weight_offset", off, FLOATS, tuple(sc.shape), "same shape as weight_scale")
        check_finite(cls.fmt, "weight_offset", off)
        mod = new_module(cls, n, k, bias)
        mod.register_buffer("weight_int4", q)
        mod.register_buffer("weight_scale", sc)
        mod.register_buffer("weight_offset", off)
        return mod

    @property
    def group_size(self) -> int:
        return self.in_features // self.weight_scale.shape[1]

    def dense_weight(self) -> torch.Tensor:
        g = self.group_size
        n, k = self.weight_int4.shape
        q = self.weight_int4.to(torch.float32).reshape(n, k // g, g)
        w = (q - self.weight_offset.to(torch.float32)[:, :, None]) * self.weight_scale.to(torch.float32)[:, :, None]
        return w.reshape(n, k)
