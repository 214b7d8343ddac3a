"""The quantize stage on the fused RTN kernels (`cvt.quant.stage`, `cvt.qtensor.disk_specs`):
the C and torch kernels write the reference path's bytes and manifest, a non-finite FP8 weight is
refused with the reference's message, and the writer's layout plans (a probe of a few rows scaled
up, or the layout table alone) equal a probe of the module's full size.
"""

from __future__ import annotations

import pytest
import torch

from cvt.errors import TensorError
from cvt.quant import qkernel as QK
from cvt.qtensor.schemes import get_scheme
from cvt.tests.quant.test_qkernel import SQNR_TOL_DB

# ---- the stage uses the kernels, and writes the reference's bytes ----------------------------------

STAGE_CASES = [
    ("compressed-tensors", "w8a8", {}),
    ("compressed-tensors", "w4a16", {"asym": True, "group_size": 32}),
    ("compressed-tensors", "fp4", {}),  # nvfp4: fused groups share a global scale
    ("compressed-tensors", "fp4", {"fp4_format": "mxfp4"}),
    ("ascend", "w8a8", {}),
    ("ascend", "w4a16", {}),  # vllm-ascend int32 experts
    ("ascend", "w4a16", {"target": "mindie", "group_size": 64}),
    ("ascend", "w4a16", {"target": "mindie", "group_size": 0, "asym": True}),
]


def _files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.safetensors"))}


@pytest.mark.parametrize("fmt,scheme,opts", STAGE_CASES,
                         ids=[f"{f}-{s}" + "".join(f"-{k}={v}" for k, v in o.items()) for f, s, o in STAGE_CASES])
@pytest.mark.parametrize("impl", ["c", pytest.param("torch", marks=pytest.mark.slow)])  # torch kernels: the tests above
def test_stage_writes_the_reference_bytes(fp8_release_session, tmp_path, monkeypatch, fmt, scheme, opts, impl):
    from cvt.convert.reader import read_manifest
    from cvt.quant.stage import quantize

    if impl == "c" and (QK._c_kernel.cache_clear() or QK._c_kernel() is None):
        pytest.skip("C quantize kernel not built")
    calls = []
    real, real_pieces = QK.quantize_to_layout, QK.quantize_in_pieces
    monkeypatch.setattr(QK, "quantize_to_layout", lambda *a, **k: calls.append(a[2].name) or real(*a, **k))
    monkeypatch.setattr(QK, "quantize_in_pieces", lambda *a, **k: calls.append(a[2].name) or real_pieces(*a, **k))
    try:
        monkeypatch.setenv("CVT_QUANT_KERNEL", "reference")
        QK._c_kernel.cache_clear()
        quantize(fp8_release_session, tmp_path / "ref", scheme=scheme, fmt=fmt, quiet=True, **opts)
        assert calls == []
        monkeypatch.setenv("CVT_QUANT_KERNEL", "" if impl == "c" else "torch")
        QK._c_kernel.cache_clear()
        quantize(fp8_release_session, tmp_path / "fused", scheme=scheme, fmt=fmt, quiet=True, **opts)
    finally:
        QK._c_kernel.cache_clear()
    ref, fused = read_manifest(tmp_path / "ref"), read_manifest(tmp_path / "fused")
    assert len(calls) == len(fused.quant.tensors) > 0  # every quantized module went through the fused path
    assert _files(tmp_path / "ref") == _files(tmp_path / "fused")
    for m, info in ref.quant.tensors.items():
        got = fused.quant.tensors[m]
        assert got.model_dump(exclude={"sqnr_db"}) == info.model_dump(exclude={"sqnr_db"})
        if isinstance(info.sqnr_db, float):
            assert abs(got.sqnr_db - info.sqnr_db) < SQNR_TOL_DB
        else:
            assert got.sqnr_db == info.sqnr_db


@pytest.mark.parametrize("scheme", ["w8a8", "fp4"])
def test_stage_refuses_non_finite_weight_like_the_reference(fp8_release, tmp_path, monkeypatch, scheme):
    """A NaN code in an FP8 weight: the same one-line error on both paths, nothing written (fp4:
    nvfp4, whose global-scale pass need not read the NaN code's block; the quantize pass refuses)."""
    import json

    from cvt.quant.stage import quantize

    index = json.loads((fp8_release / "model.safetensors.index.json").read_text())
    name = next(n for n in index["weight_map"] if n.endswith("mlp.experts.1.up_proj.weight"))
    path = fp8_release / index["weight_map"][name]
    data = bytearray(path.read_bytes())
    hlen = int.from_bytes(data[:8], "little")
    header = json.loads(data[8: 8 + hlen])
    start, (n, k) = header[name]["data_offsets"][0], header[name]["shape"]
    scale = torch.frombuffer(bytearray(data[8 + hlen + header[name + "_scale_inv"]["data_offsets"][0]:
                                             8 + hlen + header[name + "_scale_inv"]["data_offsets"][1]]),
                             dtype=torch.float32).reshape(header[name + "_scale_inv"]["shape"])
    r, c = divmod(int(scale.abs().argmin()), scale.shape[1])  # the block least able to hold the max
    data[8 + hlen + start + r * 128 * k + c * 128 + 5] = 0x7F
    path.write_bytes(bytes(data))
    if scheme == "fp4" and QK._c_kernel() is not None:  # the C global-scale pass does not read that block
        codes = torch.frombuffer(bytearray(data[8 + hlen + start: 8 + hlen + start + n * k]), dtype=torch.uint8)
        src = QK.WeightSource(codes.view(torch.float8_e4m3fn).reshape(n, k), scale, (128, 128))
        assert QK.absmax(src) is not None
    errors = []
    for mode in ("reference", ""):
        monkeypatch.setenv("CVT_QUANT_KERNEL", mode)
        QK._c_kernel.cache_clear()
        with pytest.raises(TensorError) as exc:
            quantize(fp8_release, tmp_path / f"out{mode}", scheme=scheme, quiet=True)
        errors.append(str(exc.value))
        assert not (tmp_path / f"out{mode}" / "cvt_manifest.json").exists()
    QK._c_kernel.cache_clear()
    assert errors[0] == errors[1] and name in errors[0] and "non-finite" in errors[0]


@pytest.mark.parametrize("fmt,target", [pytest.param("compressed-tensors", None, marks=pytest.mark.slow),
                                        ("ascend", "vllm-ascend"),
                                        pytest.param("ascend", "mindie", marks=pytest.mark.slow)])
def test_stage_layout_probe_scaled_from_a_few_rows(monkeypatch, fmt, target):
    """The writer plans each module's tensors from a probe of 16 rows scaled by the layout's dims:
    the same specs as a probe of the module's full size (which costs a full quantization)."""
    from cvt.errors import CvtError
    from cvt.qtensor.disk_specs import DiskLayouts
    from cvt.qtensor.formats import get_format
    from cvt.qtensor.layouts import check_target

    form, target = get_format(fmt), check_target(fmt, target)
    schemes = [get_scheme("w8a8"), get_scheme("w8a8c8"), get_scheme("fp4"), get_scheme("fp4", fp4_format="mxfp4")]
    schemes += [get_scheme("w4a16", group_size=g, symmetric=s) for g in (0, 32, 64, 128, 256) for s in (True, False)]
    checked = 0
    for sch in schemes:
        for shape in [(48, 256), (576, 1024), (1040, 512), (16 * 9, 256)]:
            for expert, static in [(False, False), (True, False), (False, True)]:
                if static and sch.name != "w8a8":
                    continue
                try:
                    big = DiskLayouts(form, target)
                    monkeypatch.setattr(DiskLayouts, "PROBE_ROWS", 1 << 30)
                    want = big.get("m", sch, shape, static, (shape[0],), torch.bfloat16, expert)
                except CvtError:
                    continue  # no layout for this scheme / module / shape on this target
                finally:
                    monkeypatch.setattr(DiskLayouts, "PROBE_ROWS", 16)
                got = DiskLayouts(form, target).get("m", sch, shape, static, (shape[0],), torch.bfloat16, expert)
                assert got == want, (sch, shape, expert, static)
                checked += 1
    assert checked > 20


@pytest.mark.parametrize("fmt,target", [("compressed-tensors", None), ("ascend", "vllm-ascend"), ("ascend", "mindie")])
def test_stage_plans_fused_layouts_from_the_table(monkeypatch, fmt, target):
    """The fused RTN layouts are planned from the layout table alone (no probe, no torch:
    `cvt.qtensor.disk_specs.data_planned`): the same names, order, shapes, dtypes and tags as a
    probe of the module's full size through the format's own encoder."""
    from cvt.errors import CvtError
    from cvt.qtensor.disk_specs import DiskLayouts
    from cvt.qtensor.formats import get_format
    from cvt.qtensor.layouts import check_target

    form, target = get_format(fmt), check_target(fmt, target)
    schemes = [get_scheme("w8a8"), get_scheme("w8a8c8"), get_scheme("fp4"), get_scheme("fp4", fp4_format="mxfp4")]
    schemes += [get_scheme("w4a16", group_size=g, symmetric=s) for g in (0, 32, 64, 128, 256) for s in (True, False)]
    probes = []
    real = DiskLayouts._probed
    monkeypatch.setattr(DiskLayouts, "_probed", lambda self, *a: probes.append(a) or real(self, *a))
    from_table = 0
    for sch in schemes:
        for shape in [(48, 256), (576, 1024), (1040, 512), (16 * 9, 256)]:
            for expert in (False, True):
                try:
                    got = DiskLayouts(form, target).get("m.gate_proj", sch, shape, False, None, None, expert)
                except CvtError:
                    continue  # no layout for this scheme / module / shape on this target
                if probes:
                    probes.clear()
                    continue  # planned on a probe (asymmetric ct-int4): the probe tests cover it
                from_table += 1
                want = real(DiskLayouts(form, target), "probe.gate_proj", sch, shape, False, None, None, expert)
                want = ({"m.gate_proj" + k: v for k, v in want[0].items()},
                        {"m.gate_proj" + k: v for k, v in want[1].items()})
                assert list(got[0].items()) == list(want[0].items()), (sch, shape, expert)
                assert got[1] == want[1], (sch, shape, expert)
    assert from_table > 20
