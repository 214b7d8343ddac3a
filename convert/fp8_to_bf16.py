"""The `cvt fp8-to-bf16` stage: a quantized release -> a BF16 Hugging Face checkpoint (the verb
keeps its first source's name; `cvt.convert.sources` lists what it reads). A compressed-tensors
release (mxfp4 / nvfp4 / float- / int-quantized) is read by `cvt.convert.ct_source`: each
quantized linear dequantized to BF16 as `X.weight`, its parts and activation scales dropped,
the rest copied. gpt-oss's MXFP4 release (`cvt.convert.mxfp4_source`): each fused experts pair
``X_blocks`` / ``X_scales`` written as transformers' BF16 ``X``. An FP8 block release:

Every FP8 weight `X.weight` (float8_e4m3fn) is paired with `X.weight_scale_inv` (found
through the index, in whatever shard it lives; DeepSeek-V4 names it `X.scale`, the
architecture table's `scale_param`), dequantized exactly (see `fp8.py`) and written as BF16
under the same name; a DeepSeek-V4 release's FP4 routed experts (int8 + `X.scale`, with
``expert_dtype: "fp4"``) likewise (see `fp4.py`); the scales are dropped; every other tensor
(norms, embeddings, router, F32 `e_score_correction_bias`, the MTP layer) is copied byte for byte.
Before anything is written, every tensor is mapped through the architecture table and
every scale is checked: present, of the expected shape and dtype, finite. As they are written,
the float tensors are checked finite (`cvt.convert.finite`): an FP8 weight's NaN codes (counted
by the kernel as it dequantizes) or a copied tensor's NaN / Inf refuse the run, naming the tensor
and its file, and leave no manifest.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from cvt.version import __version__
from cvt.convert.arch import arch_for
from cvt.convert.config import SourceFormat, bf16_config, fp8_config, quantization_config, source_format
from cvt.convert.sources import CT_STREAMED, word_of
from cvt.convert.fp4 import EXPERT_DTYPE_FP4, FP4_DTYPES, FP4_MAX, GROUP, dequant_fp4_experts, fp4_scale_shape
from cvt.convert.fp8 import (dequant_fp8_block, dequant_fp8_block_np, dequant_fp8_counted_np, expected_scale_shape,
                              kernel_name, scale_to_f32_np)
from cvt.convert.reader import Checkpoint, open_checkpoint
from cvt.convert.validate import check_weights
from cvt.convert.safetensors_io import TensorRef, TensorSpec
from cvt.convert.writer import DEFAULT_MAX_SHARD, OutTensor, WriteResult, default_workers, write_checkpoint
from cvt.errors import TensorError
from cvt.schemas.manifest import StageInfo
from cvt.world import SINGLE, World

SCALE_SUFFIX = "_scale_inv"
SCALE_DTYPES = ("F32", "BF16", "F16", "F8_E8M0")


@dataclass(frozen=True)
class Fp8Pair:
    weight: TensorRef
    scale: TensorRef
    fp4: bool = False  # a DeepSeek-V4 FP4 expert: int8 [n, k/2] + [n, k/32] scale (`cvt.convert.fp4`)


def _scale_name(weight: str, scale_param: str) -> str:
    """X.weight -> X.weight_scale_inv (or DeepSeek-V4's X.scale)."""
    return f"{weight.rpartition('.')[0]}.{scale_param}"


def pair_fp8_weights(ckpt: Checkpoint, block: tuple[int, int], scale_param: str = "weight" + SCALE_SUFFIX,
                     fp4_experts: bool = False) -> dict[str, Fp8Pair]:
    """FP8 weight name -> (weight, scale) refs (with `fp4_experts`, DeepSeek-V4's int8 FP4
    weights that have a scale too); TensorError on any inconsistency."""
    pairs: dict[str, Fp8Pair] = {}
    for name, ref in ckpt.tensors.items():
        module, _, param = name.rpartition(".")
        if param == scale_param:
            wname = f"{module}.weight"
            w = ckpt.tensors.get(wname)
            ok = w is not None and (w.dtype == "F8_E4M3" or (fp4_experts and w.dtype in FP4_DTYPES))
            if not ok:
                what = "is missing" if w is None else f"is {w.dtype}, not F8_E4M3" + (
                    f" (nor int8 FP4: config.json expert_dtype is not {EXPERT_DTYPE_FP4!r})" if w.dtype in FP4_DTYPES else "")
                raise TensorError(f"scale {ref.describe()}: its weight {wname} {what}")
            continue
        if ref.dtype == "F8_E5M2":
            raise TensorError(f"{ref.describe()}: float8_e5m2 weights are not supported (e4m3 only)")
        sname = _scale_name(name, scale_param)
        fp4 = fp4_experts and ref.dtype in FP4_DTYPES and sname in ckpt.tensors
        if ref.dtype != "F8_E4M3" and not fp4:
            continue
        scale = ckpt.tensors.get(sname)
        v4 = _scale_name(name, "scale")
        if scale is None and scale_param != "scale" and v4 in ckpt.tensors:
            raise TensorError(f"FP8 weight {ref.describe()} is scaled by {v4}, DeepSeek-V4's release format, which "
                              "only `cvt fp8-to-bf16` and `cvt quantize` read: convert (or quantize) the release first")
        if scale is None:
            raise TensorError(f"FP8 weight {ref.describe()} has no scale {sname} in any file of the checkpoint")
        if len(ref.shape) != 2:
            raise TensorError(f"{'FP4' if fp4 else 'FP8'} weight {ref.describe()} is not 2-D")
        if scale.dtype not in SCALE_DTYPES:
            raise TensorError(f"scale {scale.describe()}: dtype must be one of {', '.join(SCALE_DTYPES)}")
        if fp4:
            want = fp4_scale_shape(ref.shape)
            if (2 * ref.shape[1]) % GROUP or scale.shape != want:
                raise TensorError(
                    f"scale {scale.describe()}: shape {list(scale.shape)} does not fit FP4 weight {list(ref.shape)} "
                    f"(two codes per byte, one scale per {GROUP} inputs); expected {list(want)}")
            pairs[name] = Fp8Pair(ref, scale, fp4=True)
            continue
        want = expected_scale_shape(ref.shape, block)
        if scale.shape != want:
            raise TensorError(
                f"scale {scale.describe()}: shape {list(scale.shape)} does not fit weight {list(ref.shape)} "
                f"with {list(block)} blocks; expected {list(want)}"
            )
        pairs[name] = Fp8Pair(ref, scale)
    return pairs


E4M3_MAX = 448.0
BF16_MAX = 3.3895313892515355e38  # (2 - 2**-7) * 2**127


def check_scales_finite(ckpt: Checkpoint, pairs: dict[str, Fp8Pair]) -> None:
    """TensorError naming the first scale with a NaN/Inf (and where). numpy, not torch: this
    stage's process never imports torch when the C kernel is built."""
    import numpy as np

    for p in pairs.values():
        s = scale_to_f32_np(ckpt.view(p.scale.name), p.scale.dtype, p.scale.shape)
        bad = ~np.isfinite(s)
        if bad.any():
            idx = [int(i[0]) for i in bad.nonzero()]
            raise TensorError(
                f"scale {p.scale.describe()}: {int(bad.sum())} non-finite value(s), first {float(s[tuple(idx)])} at block {idx}"
            )
        # e4m3's largest value (448; E2M1's, 6, for an FP4 expert) times the scale must stay a
        # bfloat16: past that the finite inputs dequantize to Inf (quantize refuses the same weight)
        top = FP4_MAX if p.fp4 else E4M3_MAX
        big = np.abs(s.astype(np.float64)) * top > BF16_MAX
        if big.any():
            idx = [int(i[0]) for i in big.nonzero()]
            raise TensorError(
                f"scale {p.scale.describe()}: {float(s[tuple(idx)])} at block {idx} times {top:g} (the largest "
                f"{'e2m1' if p.fp4 else 'e4m3'} value) "
                f"overflows bfloat16 (max {BF16_MAX:.4g}): the weight would dequantize to Inf")
        ckpt.release(p.scale.name)


def fp8_to_bf16(
    src,
    dst,
    *,
    revision: str | None = None,
    workers: int | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD,
    resume: bool = True,
    overwrite: bool = False,
    quiet: bool = False,
    world: World = SINGLE,
) -> WriteResult:
    """Convert SRC (dir or hub id) to a BF16 checkpoint in DST. See the module docstring. `world`:
    the ranks that write it (`cvt.world`)."""
    ckpt = open_checkpoint(src, revision)
    try:
        fmt = source_format(ckpt.config)
        if fmt in CT_STREAMED:  # a compressed-tensors release (`cvt.convert.ct_source`)
            outs, n_deq, parameters = _ct_outputs(ckpt, fmt)
        elif fmt is SourceFormat.GPT_OSS_MXFP4:  # gpt-oss's experts (`cvt.convert.mxfp4_source`)
            outs, n_deq, parameters = _mxfp4_outputs(ckpt, fmt)
        else:
            outs, n_deq, parameters = _fp8_outputs(ckpt, src, workers)
        # FP8: one scale per weight; c-t: every part but the weight, and the activation scales
        streamed = fmt in CT_STREAMED or fmt is SourceFormat.GPT_OSS_MXFP4
        n_drop = len(ckpt.tensors) - len(outs) if streamed else n_deq
        result = write_checkpoint(
            ckpt,
            Path(dst),
            outs,
            stage=StageInfo(name="fp8-to-bf16", tool_version=__version__,
                            parameters={**parameters, "max_shard_size": max_shard_size}),
            source_format=fmt.value if streamed else SourceFormat.FP8_BLOCK.value,
            out_format="hf-bf16",
            config=bf16_config(ckpt.config),
            summary={"dequantized": n_deq, "passed_through": len(outs) - n_deq, "scales_dropped": n_drop},
            max_shard_size=max_shard_size,
            workers=default_workers(workers),
            resume=resume,
            overwrite=overwrite,
            quiet=quiet,
            world=world,
        )
        result.extra.update(dequantized=n_deq, passed_through=len(outs) - n_deq, scales_dropped=n_drop,
                            precision=word_of(fmt if streamed else SourceFormat.FP8_BLOCK))
        return result
    finally:
        ckpt.close()


def _fp8_outputs(ckpt: Checkpoint, src, workers: int | None) -> tuple[list[OutTensor], int, dict]:
    """An FP8 block release's output tensors (its weights dequantized, the rest copied), checked
    first; FormatError saying what the checkpoint is when it is no FP8 block release."""
    cfg = fp8_config(ckpt.config, where=str(src))
    block = cfg.block
    arch = arch_for(ckpt.config)
    for name in ckpt.tensors:
        arch.classify(name[: -len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else name)
    scale_param = arch.table.scale_param
    pairs = pair_fp8_weights(ckpt, block, scale_param, fp4_experts=arch.config.get("expert_dtype") == EXPERT_DTYPE_FP4)
    check_scales_finite(ckpt, pairs)
    check_weights(ckpt, arch, "fp8-to-bf16", block)

    threads = max(1, (os.cpu_count() or 1) // default_workers(workers))
    outs: list[OutTensor] = []
    for name, ref in ckpt.tensors.items():
        if name.rpartition(".")[2] == scale_param:
            continue
        pair = pairs.get(name)
        if pair is None:
            outs.append(_passthrough(ckpt, ref))
        elif pair.fp4:
            outs.append(_dequantized_fp4(ckpt, pair))
        else:
            outs.append(_dequantized(ckpt, pair, block, threads))
    return outs, len(pairs), {"weight_block_size": list(block), "scale_fmt": cfg.scale_fmt}


def _ct_outputs(ckpt: Checkpoint, fmt) -> tuple[list[OutTensor], int, dict]:
    """A compressed-tensors release's output tensors: each quantized linear's BF16 weight in its
    packed weight's place, its other parts and the activation / KV-cache scales dropped, every
    other tensor copied; every part and scale checked before anything is written."""
    from cvt.convert.ct_source import DROPPED, check_ct_scales, ct_linears, dequantize_ct

    qc = quantization_config(ckpt.config)
    arch = arch_for(ckpt.config)
    for name in ckpt.tensors:
        arch.classify(name)
    linears = ct_linears(ckpt.tensors, fmt, qc)
    check_ct_scales(ckpt, linears)
    check_weights(ckpt, arch, "fp8-to-bf16")
    anchors = {lin.anchor: lin for lin in linears.values()}
    parts = {n for lin in linears.values() for n in lin.parts.values()}
    outs: list[OutTensor] = []
    for name, ref in ckpt.tensors.items():
        lin = anchors.get(name)
        if lin is not None:
            outs.append(OutTensor(spec=TensorSpec(f"{lin.module}.weight", "BF16", lin.shape), source=ref.describe(),
                                  produce=lambda lin=lin: dequantize_ct(ckpt, lin).to(torch_bf16()),
                                  read_bytes=sum(ckpt.tensors[n].nbytes for n in lin.parts.values())))
        elif name not in parts and name.rpartition(".")[2] not in DROPPED:
            outs.append(_passthrough(ckpt, ref))
    return outs, len(linears), {"source_format": fmt.value}


def _mxfp4_outputs(ckpt: Checkpoint, fmt) -> tuple[list[OutTensor], int, dict]:
    """gpt-oss's MXFP4 release: each experts pair as transformers' BF16 ``X`` [E, K, N] in its
    blocks' place, the scales dropped, every other tensor copied; all checked before writing."""
    from cvt.convert.mxfp4_source import check_mxfp4_scales, dequantize_pair, mxfp4_pairs

    arch = arch_for(ckpt.config)
    for name in ckpt.tensors:
        arch.classify(name)
    pairs = mxfp4_pairs(ckpt.tensors, arch.shapes())
    check_mxfp4_scales(ckpt, pairs)
    check_weights(ckpt, arch, "fp8-to-bf16")
    by_blocks = {p.blocks: p for p in pairs.values()}
    scales = {p.scales for p in pairs.values()}
    outs: list[OutTensor] = []
    for name, ref in ckpt.tensors.items():
        p = by_blocks.get(name)
        if p is not None:  # finite: every E2M1 code is, and check_mxfp4_scales bounds the scales
            outs.append(OutTensor(spec=TensorSpec(p.name, "BF16", p.out_shape), source=ref.describe(), finite=True,
                                  produce=lambda p=p: dequantize_pair(ckpt, p),
                                  read_bytes=ref.nbytes + ckpt.tensors[p.scales].nbytes))
        elif name not in scales:
            outs.append(_passthrough(ckpt, ref))
    return outs, len(pairs), {"source_format": fmt.value}


def torch_bf16():
    from cvt.lazy import torch

    return torch.bfloat16


def _dequantized_fp4(ckpt: Checkpoint, pair: Fp8Pair) -> OutTensor:
    w, s = pair.weight, pair.scale

    def produce():
        out = dequant_fp4_experts(ckpt.read(w.name), ckpt.read(s.name))
        ckpt.release(w.name)
        ckpt.release(s.name)
        return out

    # finite: every E2M1 code is, and `check_scales_finite` bounds the scales (no second pass)
    return OutTensor(spec=TensorSpec(w.name, "BF16", (w.shape[0], 2 * w.shape[1])), produce=produce,
                     read_bytes=w.nbytes + s.nbytes, finite=True)


def _passthrough(ckpt: Checkpoint, ref: TensorRef) -> OutTensor:
    return OutTensor(
        spec=TensorSpec(ref.name, ref.dtype, ref.shape),
        produce=lambda: ckpt.view(ref.name),
        release=lambda: ckpt.release(ref.name),
        read_bytes=ref.nbytes,
        source=ref.describe(),
    )


def dequantize_stored(ckpt: Checkpoint, weight: str, scale: str, block: tuple[int, int], threads: int | None = None,
                      out=None):
    """A stored FP8 weight ``[n, k]`` as BF16: with the C kernel, a ``uint16 [n, k]`` ndarray of
    its bits, computed straight over the mmap through numpy pointers (into `out`, a buffer of
    2nk bytes, when given; torch is never imported), else a torch bfloat16 tensor."""
    w, s = ckpt.tensors[weight], ckpt.tensors[scale]
    if kernel_name() == "c":
        return dequant_fp8_block_np(ckpt.view(weight), w.shape, scale_to_f32_np(ckpt.view(scale), s.dtype, s.shape),
                                    block, threads=threads, out=out)
    return dequant_fp8_block(ckpt.read(weight), ckpt.read(scale), block, threads=threads)


PIECE_BYTES = 8 << 20  # BF16 bytes per piece of a dequantized weight (whole FP8 block rows)


def _dequantized(ckpt: Checkpoint, pair: Fp8Pair, block: tuple[int, int], threads: int) -> OutTensor:
    w, s = pair.weight, pair.scale
    if kernel_name() != "c":
        def produce():
            out = dequantize_stored(ckpt, w.name, s.name, block, threads)
            ckpt.release(w.name)
            ckpt.release(s.name)
            return out

        return OutTensor(spec=TensorSpec(w.name, "BF16", w.shape), produce=produce, read_bytes=w.nbytes + s.nbytes,
                         source=w.describe())

    return OutTensor(spec=TensorSpec(w.name, "BF16", w.shape), read_bytes=w.nbytes + s.nbytes, pieces=True,
                     produce=lambda: dequantized_pieces(ckpt, w.name, s.name, block, threads, verb="fp8-to-bf16"),
                     finite=True)


def dequantized_pieces(ckpt: Checkpoint, weight: str, scale: str, block: tuple[int, int], threads: int | None = None,
                       *, verb: str):
    """A stored FP8 weight ``[n, k]`` as BF16 bits, in pieces (``uint16 [rows, k]`` ndarrays, in
    order) of whole FP8 block rows, about `PIECE_BYTES` each: the C kernel (`dequant_fp8_counted_np`)
    into recycled page-aligned buffers placed where the writer's O_DIRECT takes them without a
    staging copy (`buffers.OUTPUTS`). The same bits as one call (rows are independent, each piece
    keeps its scale rows); bounded pieces, so that a 250 MB weight is not a fresh 250 MB to fault
    in and zero. Releases the weight's and scale's pages at the end. A NaN code (the kernel counts
    its NaN outputs) is a TensorError naming the weight, its file and the rows, `verb` refused:
    the writer takes these pieces as finite (`OutTensor.finite`) and scans them no more."""
    w, s = ckpt.tensors[weight], ckpt.tensors[scale]
    n, k = w.shape
    bn = block[0]
    codes = ckpt.view(weight)
    s32 = scale_to_f32_np(ckpt.view(scale), s.dtype, s.shape)
    rows = max(bn, PIECE_BYTES // max(2 * k, 1) // bn * bn)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        out, bad = dequant_fp8_counted_np(codes[r0 * k:r1 * k], (r1 - r0, k), s32[r0 // bn:-(-r1 // bn)], block,
                                          threads=threads)
        if bad:
            raise TensorError(f"{w.describe()}: {bad} of its values in rows {r0}..{r1 - 1} are NaN codes (e4m3 0x7F / "
                              f"0xFF); {verb} refused (cvt writes no non-finite float tensor)")
        yield out
    ckpt.release(weight)
    ckpt.release(scale)
