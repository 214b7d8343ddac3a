"""FP8 block dequant kernels: bit-exact against an independent reference, on awkward shapes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cvt.convert import fp8
from cvt.dtypes import dtype_code
from cvt.errors import TensorError

from cvt.tests.convert.fp8_reference import decode_e4m3, decode_scale, dequant, same_bits_nan_aware

SHAPES = [
    pytest.param((80, 256), id="80x256"),
    pytest.param((192, 128), id="192x128"),
    pytest.param((88, 200), id="88x200-partial-both"),  # 576x7168-like: edge blocks in both dims
    pytest.param((576, 384), id="576x384-kv_a-like"),
    pytest.param((128, 128), id="128x128-one-block"),
    pytest.param((3, 7), id="3x7-smaller-than-block"),
    pytest.param((1, 1), id="1x1"),
]


def _kernels():
    """Every implementation: torch, and the C kernel at every SIMD level (the best the CPU has --
    AVX-512 where present --, AVX2 or NEON, scalar) and through its numpy entry."""
    return [pytest.param("torch", id="torch-kernel"), pytest.param("c", id="c-kernel-simd"),
            pytest.param("c-avx2", id="c-kernel-avx2-or-neon"),
            pytest.param("c-scalar", id="c-kernel-scalar"), pytest.param("c-numpy", id="c-kernel-numpy-entry")]


LEVEL = {"c": True, "c-avx2": 1, "c-scalar": False}


def run_kernel(kind: str, w, s, block, threads=2):
    if kind == "torch":
        out = torch.empty(w.shape, dtype=torch.bfloat16)
        return fp8._dequant_torch(w.contiguous(), fp8.scale_to_f32(s).contiguous(), block, out)
    if fp8._c_kernel() is None:
        pytest.skip("C kernel not built (no C compiler at install time)")
    if kind == "c-numpy":  # fp8-to-bf16's torch-free entry: raw bytes in, uint16 bf16 bits out
        s32 = fp8.scale_to_f32_np(memoryview(s.contiguous().view(torch.uint8).numpy()), dtype_code(s.dtype),
                                  tuple(s.shape))
        out = fp8.dequant_fp8_block_np(memoryview(w.contiguous().view(torch.uint8).numpy()).cast("B"),
                                       tuple(w.shape), s32, block, threads=threads)
        return torch.from_numpy(out.view(np.int16)).view(torch.bfloat16)
    return fp8.dequant_fp8_block(w, s, block, threads=threads, simd=LEVEL[kind])


def random_case(shape, block, scale_dtype, seed=0, nan=False):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    if not nan:
        codes[(codes & 0x7F) == 0x7F] = 0x3C
    sshape = (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
    s = torch.rand(sshape, generator=g) * 0.02 + 1e-4
    if scale_dtype == "BF16":
        s = s.to(torch.bfloat16)
    elif scale_dtype == "F8_E8M0":
        s = torch.randint(100, 135, sshape, generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    return codes.view(torch.float8_e4m3fn), s


def reference_bits(w, s, scale_dtype, block):
    codes = w.view(torch.uint8).numpy()
    raw = s.contiguous().view(torch.uint8).numpy() if s.dtype != torch.float32 else s.numpy()
    return dequant(codes, decode_scale(raw, scale_dtype), block)


def bits(t) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16)


@pytest.mark.parametrize("kind", _kernels())
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("scale_dtype", ["F32", "BF16", "F8_E8M0"])
def test_bit_exact_against_independent_reference(kind, shape, scale_dtype):
    block = (128, 128)
    w, s = random_case(shape, block, scale_dtype)
    got = run_kernel(kind, w, s, block)
    assert got.dtype == torch.bfloat16 and tuple(got.shape) == shape
    assert np.array_equal(bits(got), reference_bits(w, s, scale_dtype, block))


@pytest.mark.parametrize("kind", _kernels())
@pytest.mark.parametrize("block", [(128, 128), (64, 32), (1, 128), (128, 1)], ids=lambda b: f"block{b[0]}x{b[1]}")
def test_other_block_sizes(kind, block):
    w, s = random_case((150, 260), block, "F32", seed=3)
    assert np.array_equal(bits(run_kernel(kind, w, s, block)), reference_bits(w, s, "F32", block))


@pytest.mark.parametrize("kind", _kernels())
def test_every_code_including_subnormals_and_nan(kind):
    """All 256 e4m3 codes (subnormals, +-0, NaN) times scales that produce bf16 subnormals,
    halfway cases and overflow to inf."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(6, 1)  # [6, 256]
    w = codes.view(torch.float8_e4m3fn)
    s = torch.tensor([[1.0, 3.0e-41], [0.1, 1.7e38], [1.0 / 3.0, 1e-38], [7.0, 2.5e-3], [1.0, 1.0], [1.0, 1.0]])
    block = (1, 128)
    got = run_kernel(kind, w, s, block)
    want = dequant(codes.numpy(), s.numpy(), block)
    assert same_bits_nan_aware(bits(got), want)
    assert torch.isnan(got[:, [0x7F, 0xFF]]).all()
    assert torch.isinf(got[1, 128 + 0x7E]).item()  # 448 * 1.7e38 overflows float32


@pytest.mark.parametrize("kind", _kernels())
def test_every_code_with_moderate_scales(kind):
    """Scales below 2**100 keep the C kernel on its SIMD path: NaN codes, subnormal inputs and
    subnormal results must still match (a separate call from the huge-scale case above)."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(4, 1)
    w = codes.view(torch.float8_e4m3fn)
    s = torch.tensor([[1.0, 3.0e-41], [0.1, 1e-38], [1.0 / 3.0, 2.5e-3], [7.0, 1.0]])
    got = run_kernel(kind, w, s, (1, 128))
    assert same_bits_nan_aware(bits(got), dequant(codes.numpy(), s.numpy(), (1, 128)))
    assert torch.isnan(got[:, [0x7F, 0xFF]]).all()


def test_the_levels_are_what_they_say(monkeypatch):
    """`simd` and CVT_KERNEL_SIMD choose the FP8 kernel's loops, as the quantize kernel's: AVX-512
    where the CPU has it (tests/quant/test_qkernel_simd.py::test_the_levels_are_what_they_say)."""
    import os
    import platform

    if fp8._c_kernel() is None:
        pytest.skip("C kernel not built")
    flags = open("/proc/cpuinfo").read().split() if os.path.exists("/proc/cpuinfo") else []
    best = ("neon" if platform.machine() in ("aarch64", "arm64") else
            "avx512" if "avx512f" in flags and "avx2" in flags else ("avx2" if "avx2" in flags else None))
    if best is not None:
        assert fp8.simd_in_use() == best
    assert fp8.simd_in_use(False) == "scalar"
    monkeypatch.setenv("CVT_KERNEL_SIMD", "avx2")
    assert fp8.simd_in_use() == ("avx2" if best == "avx512" else best)
    monkeypatch.setenv("CVT_KERNEL_SIMD", "scalar")
    assert fp8.simd_in_use() == "scalar"


def test_thread_counts_give_identical_bits():
    if fp8._c_kernel() is None:
        pytest.skip("C kernel not built")
    w, s = random_case((300, 260), (128, 128), "F32", seed=5)
    outs = [bits(fp8.dequant_fp8_block(w, s, threads=t)) for t in (1, 2, 3, 7)]
    assert all(np.array_equal(outs[0], o) for o in outs[1:])


def test_matches_the_straightforward_torch_algorithm():
    """cvt's kernels equal the official expression (fp32 multiply, one RNE) for finite inputs."""
    w, s = random_case((200, 300), (128, 128), "F32", seed=7)
    full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300]
    expected = (w.float() * full).to(torch.bfloat16)
    assert torch.equal(fp8.dequant_fp8_block(w, s).view(torch.int16), expected.view(torch.int16))


def test_scale_cast_to_bf16_first_is_a_different_result():
    """Guard for the documented pitfall: casting the f32 scale to bf16 before multiplying is wrong."""
    w, s = random_case((128, 256), (128, 128), "F32", seed=9)
    right = fp8.dequant_fp8_block(w, s)
    wrong = fp8.dequant_fp8_block(w, s.to(torch.bfloat16))
    assert not torch.equal(right.view(torch.int16), wrong.view(torch.int16))


def test_e8m0_scale_decoding_matches_formula():
    e = torch.arange(256, dtype=torch.uint8)
    got = fp8.scale_to_f32(e.view(torch.float8_e8m0fnu)).numpy()
    want = decode_scale(e.numpy(), "F8_E8M0")
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(got[:255], want[:255])


def test_decode_table_is_exact():
    codes = np.arange(256, dtype=np.uint8)
    ours = decode_e4m3(codes)
    torchs = torch.from_numpy(codes).view(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(np.isnan(ours), np.isnan(torchs))
    assert np.array_equal(ours[~np.isnan(ours)], torchs[~np.isnan(torchs)])


def test_rejects_wrong_scale_shape_and_dtype():
    w, s = random_case((80, 256), (128, 128), "F32")
    with pytest.raises(TensorError, match=r"expected \[1, 2\]"):
        fp8.dequant_fp8_block(w, s[:, :1])
    with pytest.raises(TensorError, match="float8_e4m3fn"):
        fp8.dequant_fp8_block(w.view(torch.uint8), s)
    with pytest.raises(TensorError, match="scale dtype"):
        fp8.dequant_fp8_block(w, s.to(torch.float64))


def test_empty_tensor():
    w = torch.empty((0, 256), dtype=torch.float8_e4m3fn)
    assert fp8.dequant_fp8_block(w, torch.empty((0, 2))).shape == (0, 256)


@pytest.mark.parametrize("dtype", ["F32", "BF16", "F16", "F8_E8M0"])
def test_numpy_scale_decoding_matches_torch_on_every_pattern(dtype):
    """`scale_to_f32_np` (fp8-to-bf16 without torch) gives `scale_to_f32`'s float32 bits for every
    16-bit pattern of BF16/F16, every E8M0 code (0: 2^-127, 255: NaN) and F32 specials."""
    if dtype == "F32":
        t = torch.tensor([0.0, -0.0, 1e-45, 3.4e38, float("inf"), -float("inf"), float("nan"), 0.0078125])
    elif dtype == "F8_E8M0":
        t = torch.arange(256, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    else:
        t = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(
            torch.bfloat16 if dtype == "BF16" else torch.float16)
    t = t.reshape(-1, 4 if dtype == "F32" else 256)
    got = fp8.scale_to_f32_np(memoryview(t.contiguous().view(torch.uint8).numpy()), dtype, tuple(t.shape))
    want = fp8.scale_to_f32(t).numpy()
    assert got.shape == want.shape and got.dtype == np.float32
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(got.view(np.uint32)[~np.isnan(got)], want.view(np.uint32)[~np.isnan(want)])
    if dtype == "F8_E8M0":  # and the independent formula
        assert np.array_equal(got[0, :255], decode_scale(np.arange(255, dtype=np.uint8), dtype))


def test_numpy_entry_refuses_a_misshaped_scale():
    if fp8._c_kernel() is None:
        pytest.skip("C kernel not built (no C compiler at install time)")
    w = memoryview(bytes(80 * 256))
    with pytest.raises(TensorError, match=r"\[1, 2\] scale"):
        fp8.dequant_fp8_block_np(w, (80, 256), np.ones((1, 1), np.float32))
    with pytest.raises(TensorError, match="20480 bytes"):
        fp8.dequant_fp8_block_np(w[:100], (80, 256), np.ones((1, 2), np.float32))


def test_the_c_kernels_share_one_header_that_ships_with_them():
    """convert/_fp8kernel.c and quant/_qkernel.c include one header (the e4m3 table, bf16 rounding,
    the thread fan-out): both extensions list it in `depends` and the package data holds it, so an
    sdist can build either kernel; likewise every other file a kernel includes (quant/_qkernel.c's
    AVX2, AVX-512 and NEON parts, its global-scale pass)."""
    import re
    from pathlib import Path

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    root = Path(__file__).resolve().parents[2]
    if not (root / "pyproject.toml").is_file():
        pytest.skip("not a source checkout")
    cfg = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    header = "convert/_cvt_kernel.h"
    assert (root / header).is_file()
    assert "*.h" in cfg["package-data"]["cvt.convert"]
    for ext in cfg["ext-modules"]:  # the shared header first; the quantize kernel's SIMD parts beside it
        src = root / ext["sources"][0]
        included = re.findall(r'^#include "([^"]+)"', src.read_text(), flags=re.M)
        included = [str((src.parent / i).resolve().relative_to(root)) for i in included]
        assert included[0] == header and ext["depends"] == included, ext["name"]
        for h in included:  # package data of the package whose folder holds it
            assert "*.h" in cfg["package-data"][f"cvt.{Path(h).parts[0]}"], h
    assert {e["name"] for e in cfg["ext-modules"]} == {"cvt.convert._fp8kernel", "cvt.quant._qkernel"}


@pytest.mark.parametrize("level", ["avx512", "avx2", "scalar"])
@pytest.mark.parametrize("scales", ["moderate", "huge"])
def test_the_kernel_counts_its_nonfinite_outputs(level, scales, monkeypatch):
    """The count `dequant_fp8_counted_np` returns (what fp8-to-bf16 and quantize refuse a float
    tensor by, issue 37) is the number of NaN / Inf outputs of the independent reference, at every
    SIMD level: NaN codes in the vector part and in the tails of 100-wide blocks, and (huge scales:
    the scalar loop) products that overflow to Inf."""
    if fp8._c_kernel() is None:
        pytest.skip("C kernel not built")
    monkeypatch.setenv("CVT_KERNEL_SIMD", level)
    codes = torch.arange(256, dtype=torch.uint8).repeat(6, 2)[:, :500].contiguous()  # 0x7F / 0xFF in both parts
    codes[2, 499] = 0xFF  # in a block's 4-element tail
    s = torch.tensor([[1.0, 3.0e-41, 0.1, 2.0, 0.5], [0.1, 1.7e38 if scales == "huge" else 1e30, 1.0, 1.0, 1.0]] * 3)
    block = (1, 100)
    out, bad = fp8.dequant_fp8_counted_np(memoryview(codes.numpy()).cast("B"), (6, 500), s.numpy(), block)
    want = dequant(codes.numpy(), s.numpy(), block)
    assert same_bits_nan_aware(out, want)
    assert bad == int(((want & 0x7F80) == 0x7F80).sum()) > 0
    if scales == "huge":
        assert bad > int(((codes & 0x7F) == 0x7F).sum())  # Inf products counted too


def test_the_count_is_zero_for_finite_codes():
    if fp8._c_kernel() is None:
        pytest.skip("C kernel not built")
    w, s = random_case((300, 260), (128, 128), "F32", seed=11)
    _, bad = fp8.dequant_fp8_counted_np(memoryview(w.view(torch.uint8).numpy()).cast("B"), (300, 260), s.numpy())
    assert bad == 0
