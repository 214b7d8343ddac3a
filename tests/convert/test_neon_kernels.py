"""The C kernels' aarch64 NEON paths, run for real on any machine: tests/kernels/neon_harness.c
built with aarch64-linux-gnu-gcc (static, the flags pyproject.toml builds the kernels with) and
run under qemu-aarch64 (user mode) at SIMD level 0 (scalar) and 1 (NEON). Both are compared with
the references the x86 tests use: tests/convert/fp8_reference.py's numpy dequantizer (every FP8
code, edge scales, partial blocks) and tests/quant/test_qkernel.py's `reference` (`scheme.quantize`
+ `layout.encode`) on tests/quant/test_qkernel_simd.py's hand-built FP8 edge cases. Skipped where
the cross compiler, qemu or the kernel sources are absent (`apt-get install gcc-aarch64-linux-gnu
qemu-user`)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from cvt.tests.convert.fp8_reference import dequant, same_bits_nan_aware

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ROOT / "tests" / "kernels" / "neon_harness.c"
SOURCES = [ROOT / "convert" / "_fp8kernel.c", ROOT / "quant" / "_qkernel.c", ROOT / "convert" / "_cvt_kernel.h",
           ROOT / "quant" / "_qkernel_neon.h", ROOT / "quant" / "_qkernel_amax.h"]
CC, QEMU = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
FLAGS = {"FP8": ["-O3", "-fno-strict-aliasing"], "QUANT": ["-O3", "-fno-strict-aliasing", "-ffp-contract=off"]}


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> dict[str, Path]:
    if CC is None or QEMU is None:
        pytest.skip("no aarch64-linux-gnu-gcc / qemu-aarch64 (apt-get install gcc-aarch64-linux-gnu qemu-user)")
    if not HARNESS.exists() or not all(p.exists() for p in SOURCES):
        pytest.skip("kernel sources not in this tree (an installed wheel)")
    out = tmp_path_factory.mktemp("neon")
    bins = {}
    for kind, flags in FLAGS.items():
        bins[kind] = out / f"harness-{kind.lower()}"
        r = subprocess.run([CC, *flags, "-Wall", "-Werror", "-static", "-pthread", f"-DHARNESS_{kind}", "-o",
                            str(bins[kind]), str(HARNESS), "-lm"], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    return bins


def _run(binary: Path, *args) -> str:
    r = subprocess.run([QEMU, str(binary), *map(str, args)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


# ---- FP8 -> BF16 (convert/_fp8kernel.c) --------------------------------------------------------------

def _fp8(harness, tmp_path, codes: np.ndarray, s: np.ndarray, block, level: int) -> np.ndarray:
    n, k = codes.shape
    (tmp_path / "w").write_bytes(np.ascontiguousarray(codes, np.uint8).tobytes())
    (tmp_path / "s").write_bytes(np.ascontiguousarray(s, np.float32).tobytes())
    said = _run(harness["FP8"], n, k, *block, level, tmp_path / "w", tmp_path / "s", tmp_path / "o")
    out = np.frombuffer((tmp_path / "o").read_bytes(), dtype=np.uint16).reshape(n, k)
    # the NEON loop is the one asked for (level 1), and the kernel counts every NaN / Inf output
    assert said.split() == ["level", str(level), "nonfinite", str(int(((out & 0x7F80) == 0x7F80).sum()))]
    return out


EVERY_CODE_SCALES = {
    "moderate": [[1.0, 3.0e-41], [0.1, 1e-38], [1.0 / 3.0, 2.5e-3], [7.0, 1.0]],  # NEON (all < 2**100)
    "huge": [[1.0, 3.0e-41], [0.1, 1.7e38], [1.0 / 3.0, 1e-38], [7.0, 2.5e-3]],  # 1.7e38: the scalar loop
}


@pytest.mark.parametrize("scales", list(EVERY_CODE_SCALES))
def test_fp8_neon_every_code_matches_scalar_and_the_reference(harness, tmp_path, scales):
    """All 256 e4m3 codes (subnormals, +-0, NaN) times subnormal-producing, ordinary and (huge)
    overflowing scales, as tests/convert/test_fp8_kernel.py::test_every_code_* on x86."""
    s = np.array(EVERY_CODE_SCALES[scales], dtype=np.float32)
    codes = np.tile(np.arange(256, dtype=np.uint8), (s.shape[0], 1))
    want = dequant(codes, s, (1, 128))
    for level in (0, 1):
        assert same_bits_nan_aware(_fp8(harness, tmp_path, codes, s, (1, 128), level), want), level


@pytest.mark.parametrize("shape,block", [((88, 203), (128, 128)), ((150, 260), (64, 32)), ((3, 7), (128, 128))])
def test_fp8_neon_partial_blocks_match_the_reference(harness, tmp_path, shape, block):
    g = np.random.default_rng(11)
    codes = g.integers(0, 256, shape, dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C
    codes[0, 5] = 0x7F  # one NaN code: its span is redone in scalar
    s = (g.random((-(-shape[0] // block[0]), -(-shape[1] // block[1])), dtype=np.float32) * 0.02 + 1e-4)
    want = dequant(codes, s, block)
    for level in (0, 1):
        assert same_bits_nan_aware(_fp8(harness, tmp_path, codes, s, block, level), want), level


# ---- fused RTN quantize (quant/_qkernel.c) -------------------------------------------------------------

QUANT_CASES = [("ascend-w8a8-dynamic", "w8a8", {}), ("ct-int8", "w8a8", {}),
               ("ascend-w4a16-int8-grouped", "w4a16", {"group_size": 128}),
               ("ascend-w4a16-int8-grouped", "w4a16", {"group_size": 32, "symmetric": False}),
               ("ct-int4", "w4a16", {"group_size": 8, "symmetric": False}), ("ct-int4", "w4a16", {"group_size": 6}),
               ("ct-nvfp4", "fp4", {}), ("ct-mxfp4", "fp4", {"fp4_format": "mxfp4"})]


def _quantize(harness, tmp_path, src, scheme, layout, level: int, gs: float | None):
    """The harness's raw outputs at `level`, assembled into the layout's tensors as
    `cvt.quant.qkernel` assembles the x86 kernel's (zero points by the reference packer)."""
    from cvt.quant import qkernel as QK
    from cvt.qtensor import primitives as P
    from cvt.runtime.metrics import sqnr_from_sums

    n, k = src.shape
    cfg = QK._config(layout, scheme, k)
    pack = QK._PACK[layout.pack]
    fp8_src = src.is_fp8
    w = src.w.view(torch.uint8) if fp8_src else src.w.view(torch.int16)
    (tmp_path / "w").write_bytes(w.contiguous().numpy().tobytes())
    (tmp_path / "s").write_bytes(src.scale.numpy().tobytes() if fp8_src else b"")
    bn, bk = src.block if fp8_src else (1, 1)
    said = _run(harness["QUANT"], n, k, int(fp8_src), bn, bk, cfg["mode"], cfg["group"], cfg["qmin"], cfg["qmax"],
                pack, repr(float(cfg["qdiv"])), repr(float(gs or 0.0)), level, tmp_path / "w", tmp_path / "s",
                tmp_path / "o").split()
    assert said[0] == "nonfinite" and said[2:4] == ["level", str(level)]
    out = {s: np.frombuffer(bytearray((tmp_path / f"o.{s}").read_bytes()), dtype=d)
           for s, d in [("q", np.uint8), ("scale", np.float32), ("offset", np.float32), ("scale8", np.uint8),
                        ("scale_bf16", np.uint16), ("sums", np.float64)]}
    ng = k // cfg["group"]
    shapes = QK._outputs(layout, (n, k), cfg, c=True)
    raw = {"q": out["q"].view(shapes["q"].dtype).reshape(shapes["q"].shape)}
    if cfg["mode"] in (QK.MODE_SYM, QK.MODE_ASYM):
        raw["scale"], raw["offset"] = out["scale"].reshape(n, ng), out["offset"].reshape(n, ng)
        raw["scale_bf16"] = out["scale_bf16"].reshape(n, ng)
        if cfg["mode"] == QK.MODE_ASYM and pack == QK.PACK_CT32:
            raw["zero_point"] = P.pack_int4_ct(torch.from_numpy(raw["offset"].copy()).to(torch.int8), 0).numpy()
    else:
        raw["scale8"] = out["scale8"].reshape(n, ng)
    tensors = QK._as_torch(QK._assemble(layout, scheme, (n, k), raw, gs), layout)
    return int(said[1]), QK.Fused(tensors, sqnr_from_sums(*out["sums"]), "neon-harness")


@pytest.mark.parametrize("layout,scheme,opts", QUANT_CASES,
                         ids=[f"{c[0]}-{c[2].get('group_size', '')}{'' if c[2].get('symmetric', True) else 'asym'}"
                              for c in QUANT_CASES])
def test_quantize_neon_matches_scalar_and_the_reference(harness, tmp_path, layout, scheme, opts):
    """FP8 edge cases (all-zero blocks, -0.0 rows, +-448, the smallest subnormal, subnormal and zero
    block scales; test_qkernel_simd.edge_fp8) and a BF16 weight, at NEON and scalar: the
    reference's tensors, the SQNR within the x86 tests' tolerance."""
    from cvt.qtensor import primitives as P
    from cvt.qtensor.layouts import LAYOUTS
    from cvt.qtensor.schemes import get_scheme
    from cvt.tests.quant.test_qkernel import assert_same, bf16_weight, reference
    from cvt.tests.quant.test_qkernel_simd import edge_fp8

    sch, lo = get_scheme(scheme, **opts), LAYOUTS.get(layout)
    for src in (edge_fp8(k=768), bf16_weight((64, 264 if opts.get("group_size") == 6 else 256))):
        w = src.rows_float(0, src.shape[0])
        gs = float(P.nvfp4_global_scale_of(float(w.abs().amax()))) if lo.name == "ct-nvfp4" else None
        want = reference(src, sch, lo, **({"global_scale": torch.tensor([gs])} if gs is not None else {}))
        for level in (0, 1):
            bad, got = _quantize(harness, tmp_path, src, sch, lo, level, gs)
            assert bad == 0
            assert_same(got, want)


def test_quantize_neon_counts_non_finite_values(harness, tmp_path):
    """A NaN code amid a NEON-sized run: counted (the caller refuses the weight), at both levels."""
    from cvt.qtensor.layouts import LAYOUTS
    from cvt.qtensor.schemes import get_scheme
    from cvt.quant import qkernel as QK
    from cvt.tests.quant.test_qkernel_simd import edge_fp8

    src = edge_fp8()
    w = src.w.view(torch.uint8).clone()
    w[200, 301] = 0xFF
    src = QK.WeightSource.fp8(w.view(torch.float8_e4m3fn), src.scale, src.block)
    for level in (0, 1):
        assert _quantize(harness, tmp_path, src, get_scheme("w8a8"), LAYOUTS.get("ct-int8"), level, None)[0] == 1


@pytest.mark.parametrize("case", ["nvfp4-1024", "nvfp4-1536", "nvfp4-1234.5678", "nvfp4-3e38", "mxfp4"])
def test_fp4_neon_at_and_beside_every_threshold(harness, tmp_path, case):
    """fp4_neon's multiply-first codes (quant/_qkernel_neon.h) on tests/quant/test_qkernel_fp4.py's
    weights: quotients at and 1-2 ulps beside every E2M1 threshold after non-power-of-two nvfp4
    multipliers (some of which only the fallback division gets right), tiny multipliers, and
    mxfp4's extreme E8M0 scales: the reference's tensors at NEON and scalar."""
    from cvt.quant import qkernel as QK
    from cvt.qtensor.layouts import LAYOUTS
    from cvt.qtensor.schemes import get_scheme
    from cvt.tests.quant.test_qkernel import assert_same, reference, same_bytes
    from cvt.tests.quant.test_qkernel_fp4 import mxfp4_case, nvfp4_case

    if case == "mxfp4":
        src, gs = QK.WeightSource(mxfp4_case()), None
        sch, lo = get_scheme("fp4", fp4_format="mxfp4"), LAYOUTS.get("ct-mxfp4")
        want = reference(src, sch, lo)
    else:
        gs = float(case.split("-")[1])
        src, sch, lo = QK.WeightSource(nvfp4_case(gs)[0]), get_scheme("fp4"), LAYOUTS.get("ct-nvfp4")
        want = reference(src, sch, lo, global_scale=torch.tensor([gs], dtype=torch.float32))
    for level in (0, 1):
        bad, got = _quantize(harness, tmp_path, src, sch, lo, level, gs)
        assert bad == 0
        if case == "mxfp4":  # float32 squares of 2**127 overflow: the harness has no float64 retry
            assert list(got.tensors) == list(want[0]) and all(same_bytes(got.tensors[x], want[0][x]) for x in want[0])
        else:
            assert_same(got, want)


TAIL_CASES = [("ct-int8", "w8a8", {}), ("ct-int4", "w4a16", {"group_size": 6, "symmetric": False}),
              ("ct-int4", "w4a16", {"group_size": 2, "symmetric": False}), ("ct-int4", "w4a16", {"group_size": 30})]


@pytest.mark.parametrize("layout,scheme,opts", TAIL_CASES,
                         ids=[f"{c[0]}-{c[2].get('group_size', '')}{'' if c[2].get('symmetric', True) else 'asym'}"
                              for c in TAIL_CASES])
def test_quantize_neon_tails_match_the_reference(harness, tmp_path, layout, scheme, opts):
    """The NEON loops' scalar tails: k = 210 (not a multiple of 4), FP8 blocks 16 x 50 (every block
    span leaves 2 elements past the 4-lane steps), BF16 rows of 210, asymmetric groups of 6 (a tail
    of 2) and of 2 (shorter than one vector): the reference's tensors at NEON and scalar."""
    from cvt.quant import qkernel as QK
    from cvt.qtensor.layouts import LAYOUTS
    from cvt.qtensor.schemes import get_scheme
    from cvt.tests.quant.test_qkernel import assert_same, bf16_weight, reference

    g = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 256, (40, 210), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C
    fp8 = QK.WeightSource.fp8(codes.view(torch.float8_e4m3fn), torch.rand(3, 5, generator=g) * 0.02 + 1e-4, (16, 50))
    sch, lo = get_scheme(scheme, **opts), LAYOUTS.get(layout)
    for src in (fp8, bf16_weight((16, 210))):
        want = reference(src, sch, lo)
        for level in (0, 1):
            bad, got = _quantize(harness, tmp_path, src, sch, lo, level, None)
            assert bad == 0
            assert_same(got, want)


@pytest.mark.parametrize("where", [[(3, 48)], [(0, 5), (3, 48)], [(1, 49), (7, 209)]],
                         ids=["tail", "lanes-and-tail", "two-tails"])
def test_quantize_neon_counts_nan_codes_in_block_tails(harness, tmp_path, where):
    """NaN codes in the 2-element tails of 50-wide FP8 blocks (and in the 4-lane part): each counted
    once at both levels (tests/quant/test_qkernel_simd.py has the x86 levels)."""
    from cvt.quant import qkernel as QK
    from cvt.qtensor.layouts import LAYOUTS
    from cvt.qtensor.schemes import get_scheme

    codes = torch.full((8, 210), 0x38, dtype=torch.uint8)
    for r, c in where:
        codes[r, c] = 0xFF
    src = QK.WeightSource.fp8(codes.view(torch.float8_e4m3fn), torch.ones(1, 5), (16, 50))
    for level in (0, 1):
        bad, _ = _quantize(harness, tmp_path, src, get_scheme("w8a8"), LAYOUTS.get("ct-int8"), level, None)
        assert bad == len(where), level


@pytest.mark.parametrize("case", ["fp8", "fp8-nan", "fp8-max-in-tail", "bf16"])
def test_global_scale_pass_neon_matches_the_decoded_max(harness, tmp_path, case):
    """MODE 0 (nvfp4's global-scale pass, each block's largest code without decoding) at NEON and
    scalar: the decoded weight's max |w| exactly, or a non-finite count for a NaN code."""
    from cvt.quant import qkernel as QK

    g = torch.Generator().manual_seed(9)
    if case == "bf16":
        src = QK.WeightSource((torch.randn(12, 210, generator=g) * 5).to(torch.bfloat16))
    else:
        codes = torch.randint(0, 256, (40, 210), generator=g, dtype=torch.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x3C
        if case == "fp8-max-in-tail":
            codes &= 0x3F
            codes[20, 149] = 0xF6  # the largest magnitude, negative, in a block's 2-element tail
        scale = torch.ones(3, 5) if case == "fp8-max-in-tail" else torch.rand(3, 5, generator=g) * 0.02 + 1e-4
        if case == "fp8-nan":  # in the block of the largest scale: the first the pass reads (it stops there)
            r, c = divmod(int(scale.argmax()), 5)
            codes[16 * r + 1, min(50 * c + 47, 209)] = 0x7F  # (the last block is 10 wide)
        src = QK.WeightSource.fp8(codes.view(torch.float8_e4m3fn), scale, (16, 50))
    n, k = src.shape
    w = src.w.view(torch.uint8) if src.is_fp8 else src.w.view(torch.int16)
    (tmp_path / "w").write_bytes(w.contiguous().numpy().tobytes())
    (tmp_path / "s").write_bytes(src.scale.numpy().tobytes() if src.is_fp8 else b"")
    bn, bk = src.block if src.is_fp8 else (1, 1)
    dec = src.rows_float(0, n)
    for level in (0, 1):
        said = _run(harness["QUANT"], n, k, int(src.is_fp8), bn, bk, QK.MODE_AMAX, k, 0, 0, 0, "1.0", "0.0", level,
                    tmp_path / "w", tmp_path / "s", tmp_path / "o").split()
        assert said[2:4] == ["level", str(level)] and said[4] == "amax"
        if case == "fp8-nan":
            assert int(said[1]) > 0
        else:
            assert int(said[1]) == 0 and float.fromhex(said[5]) == float(dec.abs().amax())
