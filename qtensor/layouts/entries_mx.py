"""The Ascend 950 MX layout entries of `cvt.qtensor.layouts` (registered on import, after `entries`):
W8A8_MXFP8 and W4A4_MXFP4 (linears and MoE experts), W4A8_MXFP (MoE experts).

On disk, pinned to vllm-ascend main (``quantization/methods/w8a8_mxfp8.py``
AscendW8A8MXFP8DynamicLinearMethod.get_weight / get_pergroup_param and the FusedMoE method's
get_weight / get_dynamic_quant_param; ``w4a4_mxfp4.py`` and ``w4a8_mxfp4.py`` the same) and
msModelSlim's saver (``save/ascendv1.py`` on_*_mx_dynamic_per_block), for a linear ``[n, k]``:

=============  ==========  ==========================  ====================================
tag            weight      weight_scale                note
=============  ==========  ==========================  ====================================
W8A8_MXFP8     F8_E4M3     U8 [n, k/32] (E8M0, +127)   weight [n, k]
W4A4_MXFP4     U8 [n,k/2]  U8 [n, k/32]                E2M1, element 2j in the low nibble
W4A8_MXFP      U8 [n,k/2]  U8 [n, k/32]                experts only (issue 28's scope)
=============  ==========  ==========================  ====================================

No offsets, no bias tensors of their own; the description's ``group_size`` is 32 (every method
reads ``quant_description.get("group_size", 32)`` and divides by it). The MoE methods reshape a
scale row ``[k/32]`` into ``[k/64, 2]`` (process_weights_after_loading) and so need k a multiple
of 64 for experts; the linear methods pad an odd count.
"""

from __future__ import annotations

from cvt.lazy import torch

from cvt.errors import FormatError
from cvt.qtensor import kernel_formats as KF
from cvt.qtensor import mx as MX
from cvt.qtensor import primitives as P
from cvt.qtensor.layouts.base import ASCEND, VLLM_ASCEND, DiskTensor, Layout, N, K, _expect, _take, register
from cvt.qtensor.schemes.base import QuantizedTensor
from cvt.qtensor.schemes.mx import MXFP8, W4A4MXFP4, W4A8MXFP

SCALE = DiskTensor("weight_scale", "U8", (N, ("k", MX.BLOCK)))
EXPERT_K = 2 * MX.BLOCK  # the MoE methods view each scale row as pairs
DEVICE = "Ascend 950"  # the MX methods' kernels (A5); A2 / A3 have none


def _encoder(scheme):
    def enc(q: QuantizedTensor) -> dict[str, torch.Tensor]:
        sc = q.parts["weight_scale"].view(torch.uint8)
        if scheme.elem == MX.FP8:
            return {"weight": q.parts[scheme.code_part].to(torch.float8_e4m3fn), "weight_scale": sc}
        return {"weight": P.pack_fp4(q.parts[scheme.code_part]), "weight_scale": sc}
    return enc


def _decoder(scheme):
    def dec(module: str, d: dict) -> QuantizedTensor:
        t = _take(module, d, ("weight", "weight_scale"))
        if scheme.elem == MX.FP8:
            w = _expect(f"{module}.weight", t["weight"], (torch.float8_e4m3fn,))
            codes = w
        else:
            codes = P.unpack_fp4(_expect(f"{module}.weight", t["weight"], (torch.uint8,)))
        if codes.dim() != 2:
            raise FormatError(f"{module}.weight is {list(codes.shape)}: expected 2-D")
        n, k = codes.shape
        sc = _expect(f"{module}.weight_scale", t["weight_scale"], (torch.uint8, torch.float8_e8m0fnu),
                     (n, k // MX.BLOCK))
        return QuantizedTensor(scheme.name, scheme.kernel_formats[0], (n, k),
                               {scheme.code_part: codes, "weight_scale": sc.view(torch.uint8)}, MX.BLOCK, True)
    return dec


def _layout(name: str, scheme, tag: str, weight: DiskTensor, experts_only: bool) -> Layout:
    return register(Layout(name, scheme.kernel_formats[0], ASCEND, (VLLM_ASCEND,), tag, (weight, SCALE),
                           _encoder(scheme), _decoder(scheme), experts_only=experts_only,
                           expert_k=EXPERT_K, device=DEVICE, pack="e4m3" if scheme.elem == MX.FP8 else "e2m1"))


FP4_WEIGHT = DiskTensor("weight", "U8", (N, ("k", 2)))
MXFP8_LAYOUT = _layout("ascend-w8a8-mxfp8", MXFP8, "W8A8_MXFP8", DiskTensor("weight", "F8_E4M3", (N, K)), False)
W4A4_LAYOUT = _layout("ascend-w4a4-mxfp4", W4A4MXFP4, "W4A4_MXFP4", FP4_WEIGHT, False)
W4A8_MXFP_LAYOUT = _layout("ascend-w4a8-mxfp", W4A8MXFP, "W4A8_MXFP", FP4_WEIGHT, True)
MX_KERNELS = (KF.MXFP8, KF.W4A4_MXFP4, KF.W4A8_MXFP)
