"""`w4a4_mxfp4_flatquant`: MXFP4 weights behind an online Kronecker transform of the activations,
MXFP4 activations (Ascend 950 W4A4_MXFP4_FLATQUANT; the MX twin of `cvt.qtensor.schemes.flatquant`).

Pinned to vllm-ascend main (182b75ea84) ``quantization/methods/w4a4_mxfp4_flatquant.py``
AscendW4A4MXFP4FlatQuantDynamicLinearMethod: per linear ``[n, k]``::

    weight_fp4    uint8    [n, k]     E2M1 codes (unpacked; on disk two per byte) of W' = W T^-1
    weight_scale  uint8    [n, k/32]  E8M0 block exponents (+127)
    left_trans    bfloat16 [a, a]     L as stored (transposed on load: kronecker_p1)
    right_trans   bfloat16 [b, b]     R
    clip_ratio    float32  [1]        in (0, 1]

``(a, b)`` is the method's ``get_pertensor_param``: ``get_decompose_dim(k, 1)`` for a layer that is
not a RowParallelLinear; for one that is, ``b = get_decompose_dim(k / max_tp, max_tp)[1]`` and ``a
= k / b`` (max_tp = the description's ``max_supported_tp``, default 4, which cvt leaves unset) --
so the left factor splits into max_tp diagonal blocks, one per rank: process_weights_after_loading
keeps rank r's diagonal block ``left_trans[r a/tp : (r+1) a/tp, same]`` of the whole matrix and drops
the rest. The rank's slice of the tokens (columns ``r k/tp ...``, the row-parallel split) is exactly
rows ``r a/tp ...`` of ``X [a, b]``, so TP t computes the TP-1 layer only when L is block-diagonal
in t blocks; cvt writes a RowParallelLinear's L block-diagonal in max_tp blocks (`left_blocks`: the
start is one Hadamard block per rank, the fit keeps the other entries at zero), which serves TP 1, 2
and 4 alike; a dense L would be silently wrong at TP > 1.
Its ``get_decompose_dim(n, m)`` returns ``(256, m n / 256)`` when the closest pair's left factor
times m passes 256 and refuses factors summing past 256. Which linears are RowParallelLinear is the
architecture table's (`cvt.convert.arch`, a rule's ``Parallel.ROW``): the quantize plan asks the scheme
for its row twin (`for_parallel`) for those, which sizes, fits and writes the row transforms (and
its quantized tensors say ``extra["parallel"] = "row"``, which picks the row layout entry).

The transform and its fold are `cvt.qtensor.schemes.flatquant`'s (``X~ = L^T X R``, ``W' = W T^-1``);
the weight elements and exponents are msModelSlim's MXFP4 rules (`cvt.qtensor.mx`, the `w4a4_mxfp4`
scheme's) on W'. `quantize` writes the randomised Hadamard start and clip 1; ``--method flatquant``
fits L, R and the clip with this scheme's quantizer (`cvt.quant.methods.flatquant`).
"""

from __future__ import annotations

from cvt.lazy import torch

from cvt.errors import CvtError, ShapeError
from cvt.qtensor import kernel_formats as KF
from cvt.qtensor import mx as MX
from cvt.qtensor import primitives as P
from cvt.qtensor.schemes.base import QuantizedTensor, SchemeBase, refuse_fixed, register
from cvt.qtensor.schemes.flatquant import MAX_DIM, SEED, decompose_dim, fold, unfold

MAX_TP = 4  # vllm-ascend: quant_description.get("max_supported_tp", 4)
ROW = "row"  # QuantizedTensor.extra["parallel"] of a RowParallelLinear's tensors (`cvt.qtensor.layouts`)
PARTS = ("weight_fp4", "weight_scale", "left_trans", "right_trans", "clip_ratio")


def get_decompose_dim(n: int, m: int) -> tuple[int, int] | None:
    """vllm-ascend ``w4a4_mxfp4_flatquant.get_decompose_dim(n, m)``; None where it raises. Its
    search is the W4A4_FLATQUANT one (`decompose_dim`: n's factor pair closest to a square), then
    the caps at `MAX_DIM`."""
    if n < 1 or n % 4 == 2:  # vllm-ascend's search never ends there (`decompose_dim`)
        return None
    lo, hi = decompose_dim(n)
    if hi > MAX_DIM:
        return None
    if lo * m > MAX_DIM:
        return MAX_DIM, m * n // MAX_DIM
    return lo, hi


def trans_dims(k: int, row: bool, max_tp: int = MAX_TP) -> tuple[int, int] | None:
    """(left, right) factor sizes vllm-ascend declares for in_features k at TP 1 (module docstring)."""
    if not row:
        return get_decompose_dim(k, 1)
    if k % max_tp:
        return None
    d = get_decompose_dim(k // max_tp, max_tp)
    if d is None or k % d[1]:
        return None
    return k // d[1], d[1]


def left_blocks(row: bool) -> int:
    """Diagonal blocks of a linear's left transform: max_tp for a RowParallelLinear (module docstring)."""
    return MAX_TP if row else 1


def block_mask(a: int, blocks: int) -> torch.Tensor:
    """float32 [a, a]: 1 inside the `blocks` diagonal blocks, 0 elsewhere."""
    return torch.block_diag(*[torch.ones(a // blocks, a // blocks)] * blocks)


def off_block(left: torch.Tensor, blocks: int) -> bool:
    """Whether `left` has a non-zero entry outside its `blocks` diagonal blocks."""
    return blocks > 1 and bool((left.to(torch.float32) * (1 - block_mask(left.shape[0], blocks))).ne(0).any())


def init_transforms_mx(k: int, row: bool, seed: int = SEED) -> tuple[torch.Tensor, torch.Tensor]:
    """Randomised Hadamard (left, right) in bfloat16 for `trans_dims(k, row)`; a row layer's left
    is one Hadamard block repeated along the diagonal (`left_blocks`)."""
    from cvt.qtensor.hadamard import Orthogonal

    a, b = trans_dims(k, row)
    blocks = left_blocks(row)
    left = torch.block_diag(*[Orthogonal(a // blocks, seed, "flatquant-left").matrix()] * blocks)
    right = Orthogonal(b, seed, "flatquant-right").matrix()
    return left.to(torch.bfloat16), right.to(torch.bfloat16)


def quantize_activations_mx(xt: torch.Tensor, clip: float) -> torch.Tensor:
    """MXFP4 fake quantization of transformed tokens xt [m, k] (float32): per block of 32, the
    shared exponent of ``amax * clip`` and the E2M1 elements clamped to +-6 (`cvt.qtensor.mx`)."""
    g = xt.to(torch.float32).reshape(xt.shape[0], -1, MX.BLOCK)
    se = MX.shared_exponent(g.abs().amax(dim=-1) * clip, MX.FP4)
    vals = MX.quantize_elements(g / (2 ** se)[..., None], MX.FP4)
    return (vals * (2 ** se)[..., None]).reshape(xt.shape)


@register
class W4A4MXFP4FlatQuant(SchemeBase):
    """MXFP4 weights folded with an online Kronecker transform; MXFP4 activations."""

    name = "w4a4_mxfp4_flatquant"
    summary = ("E2M1 weights in blocks of 32 with E8M0 scales behind Hadamard-initialised Kronecker transforms "
               "applied online, MXFP4 activations (Ascend 950 W4A4_MXFP4_FLATQUANT, linears)")
    kv_cache = None
    static_activations = False
    options = ("group_size",)  # --group-size: 32 only
    kernel_formats = (KF.W4A4_MXFP4_FLATQUANT,)
    group_size = MX.BLOCK
    symmetric = True
    row_sensitive = True  # the plan takes `for_parallel(row)` for each module (the architecture table's role)

    def __init__(self, group_size=None, symmetric=None, fp4_format=None, static_activations=None, row: bool = False):
        refuse_fixed(self.name, group_size=group_size, groups=(MX.BLOCK,),
                     group_why=f"has a fixed block of {MX.BLOCK} along in_features (E8M0 scales)", symmetric=symmetric,
                     sym_why="E8M0 scales, no offsets", fp4_format=fp4_format, static_activations=static_activations,
                     act_why="per block")
        self.row = row
        self.left_blocks = left_blocks(row)  # the fit keeps L block-diagonal in these (module docstring)
        self._twin = None

    def __repr__(self) -> str:
        return "W4A4MXFP4FlatQuant(row=True)" if self.row else "W4A4MXFP4FlatQuant()"

    def for_parallel(self, row: bool) -> "W4A4MXFP4FlatQuant":
        """This scheme for a RowParallelLinear (`row`) or another linear: one twin per instance, so
        the plan's modules of one role share an instance (the plan groups by identity)."""
        if row == self.row:
            return self
        if self._twin is None:
            self._twin = W4A4MXFP4FlatQuant(row=row)
            self._twin._twin = self
        return self._twin

    def kernel_fmt(self, static: bool = False) -> str:
        return KF.W4A4_MXFP4_FLATQUANT

    def check(self, name: str, shape: tuple[int, int]) -> None:
        P.check_group(name, tuple(shape), MX.BLOCK, self.name)
        why = self.shape_problem(shape, name)
        if why is not None:
            raise ShapeError(f"{name} {list(shape)}: {why}")

    def shape_problem(self, shape: tuple[int, int], name: str | None = None) -> str | None:
        k = shape[1]
        if k % MX.BLOCK:
            return f"{self.name} needs in_features a multiple of {MX.BLOCK} (MX blocks), got {k}"
        if trans_dims(k, self.row) is None:
            return (f"in_features {k} has no Kronecker factors vllm-ascend's W4A4_MXFP4_FLATQUANT get_decompose_dim "
                    f"accepts (factors of at most {MAX_DIM}" + (f", a RowParallelLinear's sized for "
                                                                f"max_supported_tp {MAX_TP})" if self.row else ")"))
        return None

    def dims(self, k: int, name: str | None = None) -> tuple[int, int]:
        """The transforms' sizes vllm-ascend declares for this linear (`trans_dims` of its role)."""
        return trans_dims(k, self.row)

    def param_info(self, shape):
        n, k = shape
        a, b = self.dims(k)
        return {"weight_fp4": ((n, k), torch.uint8), "weight_scale": ((n, k // MX.BLOCK), torch.uint8),
                "left_trans": ((a, a), torch.bfloat16), "right_trans": ((b, b), torch.bfloat16),
                "clip_ratio": ((1,), torch.float32)}

    def init_transforms(self, k: int, name: str | None = None, seed: int = SEED):
        return init_transforms_mx(k, self.row, seed)

    def quantize(self, w: torch.Tensor, name: str | None = None) -> QuantizedTensor:
        w = self.checked_weight(w, name)
        return self._quantize(w, *self.init_transforms(w.shape[1], name), 1.0)

    def quantize_with(self, w: torch.Tensor, left: torch.Tensor, right: torch.Tensor, clip: float,
                      name: str | None = None, weight_clip: torch.Tensor | None = None) -> QuantizedTensor:
        """The parts of `w` behind the given transforms and clip ratio (`--method flatquant`);
        `weight_clip` must be None (E8M0 block exponents have no per-row clip), a row layer's left
        block-diagonal (`left_blocks`)."""
        w = self.checked_weight(w, name)
        a, b = left.shape[0], right.shape[0]
        if (a, b) != self.dims(w.shape[1], name) or tuple(left.shape) != (a, a) or tuple(right.shape) != (b, b) \
                or not 0 < clip <= 1 or weight_clip is not None:
            raise CvtError(f"{name or self.name}: transforms {list(left.shape)} / {list(right.shape)}, clip {clip} "
                           f"do not fit in_features {w.shape[1]} = {self.dims(w.shape[1], name)} with a clip in "
                           "(0, 1] and no weight clip")
        if off_block(left, self.left_blocks):
            raise CvtError(f"{name or self.name}: left_trans {list(left.shape)} of a RowParallelLinear must be "
                           f"block-diagonal in {self.left_blocks} blocks (vllm-ascend keeps only rank r's diagonal "
                           "block at TP > 1)")
        return self._quantize(w, left, right, clip)

    def _quantize(self, w: torch.Tensor, left: torch.Tensor, right: torch.Tensor, clip: float) -> QuantizedTensor:
        left, right = left.to(torch.bfloat16), right.to(torch.bfloat16)
        wf = fold(w, left, right)
        P.check_finite(wf, f"{self.name} folded weight (are the transforms invertible?)")
        vals, se = MX.mx_quantize(wf, MX.FP4)
        parts = {"weight_fp4": P.encode_e2m1(vals), "weight_scale": MX.e8m0_codes(se), "left_trans": left,
                 "right_trans": right, "clip_ratio": torch.tensor([clip], dtype=torch.float32)}
        return QuantizedTensor(self.name, KF.W4A4_MXFP4_FLATQUANT, tuple(w.shape), parts, MX.BLOCK, True,
                               {"parallel": ROW} if self.row else {})

    def dequantize(self, q: QuantizedTensor) -> torch.Tensor:
        p = q.parts
        wq = MX.mx_dequantize(P.decode_e2m1(p["weight_fp4"]), MX.e8m0_exponents(p["weight_scale"]))
        return unfold(wq, p["left_trans"], p["right_trans"])
