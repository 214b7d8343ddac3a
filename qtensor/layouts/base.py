"""The layout table's data types and registry: `DiskTensor` (one on-disk tensor and its dims),
`Layout` (one on-disk form of a kernel format), `LAYOUTS` / `register`, the output formats and
serving targets the entries are keyed by, and the helpers the entries' encoders and decoders
share. Imports no entry: `cvt.qtensor.layouts` (the package) registers them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from cvt.lazy import torch

from cvt.errors import FormatError
from cvt.qtensor.schemes.base import QuantizedTensor
from cvt.registry import Registry

# The output formats (implemented by `cvt.qtensor.formats`) and their serving targets are
# named here, once: the layout entries below are keyed by them. A format's first target is its default.
ASCEND, COMPRESSED_TENSORS = "ascend", "compressed-tensors"
VLLM_ASCEND, MINDIE = "vllm-ascend", "mindie"
ASCEND_TARGETS = (VLLM_ASCEND, MINDIE)
DEFAULT_TARGET = VLLM_ASCEND
CT_TARGET = "vllm"  # compressed-tensors: vLLM and transformers
FORMAT_TARGETS = {ASCEND: ASCEND_TARGETS, COMPRESSED_TENSORS: (CT_TARGET,)}
CONFIG_KEY_TARGETS = (MINDIE,)  # read their quantization keys from config.json (MindIE's atb_llm)
# target -> the serving stacks that load its outputs (the docs' support matrix, `cvt.support`)
STACKS = {VLLM_ASCEND: "vllm-ascend", MINDIE: "MindIE", CT_TARGET: "vLLM, transformers"}
# what `--target` says of each ascend target (the entries are what each loads)
TARGET_SUMMARIES = {
    VLLM_ASCEND: "loads W4A16 (int32 packed) and MXFP4 only for MoE experts (other linears stay float), MLA C8 as "
                 "FAKQuant",
    MINDIE: "takes the int8 two-per-byte W4A16 for every linear, and gets its quantize keys in config.json",
}


@dataclass(frozen=True)
class DiskTensor:
    suffix: str
    dtype: str                # safetensors dtype code as written
    dims: tuple               # per dim: ("n" | "k", unit), a fixed int, or KL / KR (a factor of k); unit an int or "G"
    optional: bool = False    # written only for some tensors (asymmetric zero points, ...)
    k_split: str = ""         # a square tensor without a k dim that a TP split along k still spreads:
                              # DIAGONAL = holder i gets its i-th diagonal block (a row layer's left_trans)

    def shape(self, n: int, k: int, g: int) -> tuple[int, ...]:
        out = []
        for d in self.dims:
            if isinstance(d, int):
                out.append(d)
                continue
            if d in (RKL, RKR):  # a RowParallelLinear's factors (W4A4_MXFP4_FLATQUANT, max_supported_tp)
                from cvt.qtensor.schemes.flatquant_mx import trans_dims

                out.append((trans_dims(k, True) or (0, 0))[d == RKR])
                continue
            if isinstance(d, str):  # KL / KR: a factor of k's Kronecker decomposition (FlatQuant)
                from cvt.qtensor.schemes.flatquant import decompose_dim

                out.append(decompose_dim(k)[d == KR])
                continue
            axis, unit = d
            u = _unit(unit, g, k)
            out.append(-(-(n if axis == "n" else k) // u))
        return tuple(out)

    def multiple(self, axis: str, g: int, k: int) -> tuple[int, str] | None:
        """(the multiple the logical `axis` size must be, the rule in words) for this tensor to be
        written, or None: a unit packs that many elements; ``K/16`` sums k in 16 runs, so k must be
        a multiple of 16 (not of k/16, the split unit `along` gives)."""
        for d in self.dims:
            if isinstance(d, tuple) and d[0] == axis:
                if d[1] == K16:
                    return 16, f"sums {'out' if axis == 'n' else 'in'}_features in 16 runs"
                u = _unit(d[1], g, k)
                return u, f"packs {u} along {'out' if axis == 'n' else 'in'}_features"
        return None

    def along(self, axis: str, g: int, k: int) -> tuple[int, int] | None:
        """(on-disk dim, logical unit) of the dim that follows `axis` ("n" / "k"), or None."""
        for i, d in enumerate(self.dims):
            if isinstance(d, tuple) and d[0] == axis:
                return i, _unit(d[1], g, k)
        return None


KL, KR = "KL", "KR"  # a whole dim: the left / right factor of k (FlatQuant's get_decompose_dim)
RKL, RKR = "RKL", "RKR"  # ... of a RowParallelLinear's k (`cvt.qtensor.schemes.flatquant_mx.trans_dims`)
DIAGONAL = "diagonal"  # `DiskTensor.k_split`: rank i holds diagonal block i of [x, x] (`cvt.convert.shard`)
K16 = "K/16"  # a dim unit: one on-disk element per k/16 logical ones, i.e. 16 elements along k


def _unit(unit, g: int, k: int) -> int:
    if unit == "G":
        return g or k
    if unit == K16:
        return max(k // 16, 1)
    return unit


@dataclass(frozen=True)
class Layout:
    name: str
    kernel_fmt: str
    format: str
    targets: tuple[str, ...]
    tag: str | None
    tensors: tuple[DiskTensor, ...]
    encode: Callable[[QuantizedTensor], dict[str, torch.Tensor]] = field(repr=False)
    decode: Callable[[str, dict[str, torch.Tensor]], QuantizedTensor] = field(repr=False)
    experts_only: bool = False      # the stack loads this layout for routed experts only
    grouping: str = "any"           # "any" | "grouped" | "channel": which group sizes this entry holds
    groups: tuple[int, ...] = ()    # the group sizes the stack accepts (empty: any)
    parallel: str = "any"           # "any" | "column" | "row": the modules it holds (`scale_bias_role`, or
                                    # the quantized tensor's extra["parallel"] where its scheme knows the role)
    pack: str | None = None         # how the fused RTN kernel (`cvt.quant.qkernel`) packs it; None: not fused
    expert_k: int = 0               # routed experts' in_features must be a multiple of this (0: any; MX: 64)
    device: str = ""                # the only hardware whose kernels run it ("": every device of the target)
    linears_only: bool = False      # the stack loads this layout for linears only, not routed experts
    splits_k: bool = True           # False: a TP split along in_features cannot be loaded (FlatQuant's transforms)
    max_tp: int = 0                 # a TP split along in_features must divide this (0: any): the consumer's
                                    # max_supported_tp (W4A4_MXFP4_FLATQUANT's row transforms' diagonal blocks)

    def holds(self, group_size: int, k: int) -> bool:
        # a group of k is one group, not per channel: the stacks read one global group_size, and a
        # linear whose k equals it must be in the grouped layout (vllm-ascend methods/w4a16.py:
        # weight_scale [n, k // group_size] with group_size from the description)
        per_channel = group_size == 0
        if self.groups and not per_channel and group_size not in self.groups:
            return False
        return self.grouping == "any" or (self.grouping == "channel") == per_channel

    def shapes(self, n: int, k: int, group_size: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """{suffix: (shape, dtype code)} of a linear [n, k] (optional tensors left out)."""
        g = 0 if group_size in (0, k) else group_size
        return {t.suffix: (t.shape(n, k, g), t.dtype) for t in self.tensors if not t.optional}

    def split_units(self, axis: str, group_size: int, k: int, *, expert: bool = False) -> int:
        """The logical unit a TP split along `axis` must keep whole (lcm over the tensors; a routed
        expert's in_features also `expert_k`, which every rank's part must be a multiple of)."""
        g = 0 if group_size in (0, k) else group_size
        unit = self.expert_k if expert and axis == "k" and self.expert_k else 1
        for t in self.tensors:
            a = t.along(axis, g, k)
            if a is not None:
                unit = math.lcm(unit, a[1])
        return unit

    def k_split_problem(self, axis: str, degree: int) -> str | None:
        """Why a TP split of this layout's modules `degree` ways along in_features cannot be
        loaded (`splits_k`, `max_tp`), or None."""
        what = f"{self.tag or self.name} ({self.name})"
        if degree > 1 and not self.splits_k:
            return (f"{what} cannot be split along in_features ({axis} {degree}): its transforms are sized for the "
                    f"whole k and the consumer loads them whole on every rank; shard with {axis} 1")
        if degree > 1 and self.max_tp and self.max_tp % degree:
            valid = ", ".join(str(d) for d in range(1, self.max_tp + 1) if self.max_tp % d == 0)
            return (f"{what} cannot be split along in_features {axis} {degree} ways: its transforms hold "
                    f"{self.max_tp} diagonal blocks (max_supported_tp), one per rank; valid {axis}: {valid}")
        return None

    def k_shard(self, suffix: str, shape: tuple[int, ...], degree: int) -> tuple[int, ...]:
        """The part of on-disk tensor `suffix` (whole: `shape`) one rank holds when its module is
        split `degree` ways along in_features, as `cvt shard` writes it: its run of the dim along
        k, its diagonal block (`DiskTensor.k_split`), else the whole tensor."""
        t = self.tensor(suffix)
        if t is None or degree == 1:
            return tuple(shape)
        if t.k_split == DIAGONAL:
            return tuple(d // degree for d in shape)
        along = t.along("k", 0, 0)
        return tuple(d // degree if along is not None and i == along[0] else d for i, d in enumerate(shape))

    def tensor(self, suffix: str) -> DiskTensor | None:
        return next((t for t in self.tensors if t.suffix == suffix), None)

    def tags(self, module: str, suffixes) -> dict[str, str]:
        return {f"{module}.{s}": self.tag for s in suffixes}


LAYOUTS: Registry[Layout] = Registry("quantized layout", FormatError)


def register(layout: Layout) -> Layout:
    return LAYOUTS.add(layout.name, layout)


def _expect(name: str, t: torch.Tensor, dtypes, shape=None) -> torch.Tensor:
    """`t` after checking its dtype (one of `dtypes`: torch dtypes or their names) and shape."""
    names = [str(d).replace("torch.", "") for d in dtypes]
    have = str(t.dtype).replace("torch.", "")
    if have not in names or (shape is not None and tuple(t.shape) != tuple(shape)):
        want = " or ".join(names)
        raise FormatError(f"tensor {name!r} is {have} {list(t.shape)}: expected "
                          f"{want}" + (f" {list(shape)}" if shape is not None else ""))
    return t


def _take(module: str, disk: dict, suffixes) -> dict[str, torch.Tensor]:
    missing = [f"{module}.{s}" for s in suffixes if s not in disk]
    if missing:
        raise FormatError(f"module {module!r} lacks tensor(s) {missing}")
    return {s: disk[s] for s in suffixes}


FLOATS = ("float32", "bfloat16", "float16")  # names: torch is imported on first use (`cvt.lazy`)
N, K, G = ("n", 1), ("k", 1), ("k", "G")


# ---- W4A8_DYNAMIC's scale_bias, by the module's role (`Layout.parallel`; `select` reads it) -----------
# msModelSlim 26.1 save/utils/pack.py process_scale: which modules' scale_bias is summed whole along k
# ([n, 1]) and which in 16 runs of k/16 ([n, 16], so that each of up to 16 TP ranks splitting k gets
# the sum over its own slice). vllm-ascend agrees: w13 (gate / up) [E, 2I, 1], w2 (down) [E, H, 16 //
# tp] (methods/w4a8.py get_dynamic_quant_param_modelslim); linears: RowParallelLinear -> 16.
SCALE_BIAS_COLUMN = ("up_proj", "gate_proj", "q_proj", "k_proj", "v_proj", "w1", "w3")
SCALE_BIAS_ROW = ("down_proj", "o_proj", "w2")
SCALE_BIAS_RUNS = 16


def scale_bias_role(module: str) -> str:
    """"column" ([n, 1] scale_bias) or "row" ([n, 16]) for a W4A8_DYNAMIC module, by msModelSlim's
    name rule (`SCALE_BIAS_COLUMN` first, then `SCALE_BIAS_ROW`, on the module's own name); FormatError
    for a name in neither list (msModelSlim would write the unsummed [n, k] product there)."""
    own = module.rsplit(".", 1)[-1]
    if any(s in own for s in SCALE_BIAS_COLUMN):
        return "column"
    if any(s in own for s in SCALE_BIAS_ROW):
        return "row"
    raise FormatError(f"{module}: W4A8_DYNAMIC's scale_bias is [n, 1] for {', '.join(SCALE_BIAS_COLUMN)} and "
                      f"[n, {SCALE_BIAS_RUNS}] for {', '.join(SCALE_BIAS_ROW)} (msModelSlim's process_scale, by the "
                      f"module name); {own!r} is neither, so its scale_bias shape is unknown")
