"""gpt-oss's MXFP4 experts (quantization_config ``quant_method: "mxfp4"``) read as BF16, one fused
tensor at a time: the `cvt.convert.sources` entry ``gpt-oss-mxfp4``.

Per MoE layer and projection X (``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj``) the
release stores every expert in one tensor pair:

    X_blocks  u8 [E, N, K/32, 16]   two E2M1 codes per byte, element 2j of a 32-group in the low nibble
    X_scales  u8 [E, N, K/32]       E8M0: 2**(s - 127)

(N rows, K inputs of each expert's linear). The float weight is transformers' own
(integrations/mxfp4.py ``convert_moe_packed_tensors``, transformers 5.24, which the tests run as
the referee), transposed to the layout its GptOssExperts holds and a dequantized save writes:

    X[e, k, n] = rne_bf16(e2m1(code[e, n, k]) * 2**(s[e, n, k // 32] - 127))      bf16 [E, K, N]

e2m1: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives (code 8 is -0.0, as transformers' table).
The product is exact in float32 (3 significant bits times a power of two), so the one rounding
to BF16 is transformers' own. Before anything is written every pair is checked from the headers
(both present, u8, the shapes above against config.json) and every scale read: 0xFF (E8M0's
NaN) or a scale whose largest code overflows bfloat16 (s >= 254) is a TensorError naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from cvt.errors import TensorError

GROUP = 32
PARTS = ("_blocks", "_scales")
BF16_MAX = 3.3895313892515355e38
TOP_SCALE = 253  # 6 * 2**(254 - 127) overflows bfloat16: the largest scale every code survives


@dataclass(frozen=True)
class Mxfp4Pair:
    """One fused MXFP4 experts tensor: X (its BF16 name), its parts, E / N (rows) / K (inputs)."""

    name: str
    blocks: str
    scales: str
    experts: int
    rows: int
    cols: int

    @property
    def out_shape(self) -> tuple[int, int, int]:
        """transformers' layout of the dequantized X: [E, K, N]."""
        return (self.experts, self.cols, self.rows)


def mxfp4_pairs(tensors: Mapping[str, object], expected: Mapping[str, tuple[int, ...]] | None = None
                ) -> dict[str, Mxfp4Pair]:
    """X -> its pair, from the headers alone (`tensors`: name -> TensorRef); `expected`: the
    BF16 shapes config.json describes (`ArchSpec.shapes`). TensorError naming the first part that
    is missing, of the wrong dtype or shape."""
    out: dict[str, Mxfp4Pair] = {}
    for name, ref in tensors.items():
        for part, other in (PARTS, PARTS[::-1]):
            if name.endswith(part) and name[: -len(part)] + other not in tensors:
                raise TensorError(f"{ref.describe()}: its {name[: -len(part)] + other} is missing (gpt-oss MXFP4 "
                                  "stores each experts tensor as _blocks + _scales)")
        if not name.endswith(PARTS[0]):
            continue
        x = name[: -len(PARTS[0])]
        s = tensors[x + PARTS[1]]
        if ref.dtype != "U8" or len(ref.shape) != 4 or ref.shape[3] != GROUP // 2:
            raise TensorError(f"{ref.describe()}: MXFP4 blocks are u8 [experts, rows, inputs/32, 16]")
        e, n, g, _ = ref.shape
        if s.dtype not in ("U8", "F8_E8M0") or tuple(s.shape) != (e, n, g):
            raise TensorError(f"scale {s.describe()}: expected u8 (E8M0) {[e, n, g]} for blocks {list(ref.shape)}")
        pair = Mxfp4Pair(x, name, x + PARTS[1], e, n, g * GROUP)
        want = (expected or {}).get(x)
        if want is not None and tuple(want) != pair.out_shape:
            raise TensorError(f"{ref.describe()}: dequantizes to {list(pair.out_shape)}, config.json describes "
                              f"{x} as {list(want)}")
        out[x] = pair
    return out


def check_mxfp4_scales(ckpt, pairs: Mapping[str, Mxfp4Pair]) -> None:
    """Read every scale (the blocks stay unread): TensorError naming the first 0xFF (NaN) or a scale
    past `TOP_SCALE` (6 times it overflows bfloat16: the weight would dequantize to Inf)."""
    from cvt.lazy import torch

    for p in pairs.values():
        s = ckpt.read(p.scales).view(torch.uint8).reshape(-1)
        bad = s > TOP_SCALE
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            v = int(s[i])
            what = "0xFF, E8M0's NaN" if v == 255 else f"2**{v - 127}, times 6 (the largest e2m1) overflows bfloat16"
            raise TensorError(f"scale {ckpt.tensors[p.scales].describe()}: {int(bad.sum())} bad value(s), first {v} "
                              f"({what}) at flat index {i}")
        ckpt.release(p.scales)


def dequant_mxfp4(blocks, scales):
    """u8 blocks [E, N, K/32, 16] + u8 scales [E, N, K/32] -> bfloat16 [E, K, N] (module docstring),
    one expert at a time (a float32 expert at most in flight)."""
    from cvt.lazy import torch
    from cvt.qtensor.primitives import decode_e2m1, e8m0_to_f32

    e, n, g, b = blocks.shape
    out = torch.empty((e, g * b * 2, n), dtype=torch.bfloat16)
    for x in range(e):
        u = blocks[x].view(torch.uint8)
        codes = torch.stack((u & 0x0F, u >> 4), dim=-1).reshape(n, g, 2 * b)
        v = decode_e2m1(codes) * e8m0_to_f32(scales[x].contiguous())[:, :, None]
        out[x] = v.reshape(n, g * 2 * b).to(torch.bfloat16).t()
    return out


def dequantize_pair(ckpt, pair: Mxfp4Pair):
    """bfloat16 [E, K, N] of one pair; its pages released after."""
    try:
        return dequant_mxfp4(ckpt.read(pair.blocks), ckpt.read(pair.scales))
    finally:
        ckpt.release(pair.blocks)
        ckpt.release(pair.scales)
