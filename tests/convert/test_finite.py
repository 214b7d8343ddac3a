"""No verb writes a NaN / Inf float tensor (issue 37): `cvt.convert.finite`'s count, and every
verb that writes weights under every scheme refusing a NaN planted in a tensor it keeps float.

Before the fix an FP8 release with one NaN code (e4m3 0x7F / 0xFF) in a tensor that stays float
(MLA's ``kv_b_proj`` under any scheme, an expert kept float by ``--ignore``) was written as a
BF16 NaN with exit 0 by ``cvt quantize`` and ``cvt fp8-to-bf16``, and ``cvt shard`` copied it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from cvt.convert import finite
from cvt.convert.finite import NONFINITE_MASKS, count_nonfinite
from cvt.dtypes import DTYPES
from cvt.qtensor.formats.compressed_tensors import SUPPORTED as CT_SCHEMES
from cvt.qtensor.schemes import scheme_names
from cvt.testing.checkpoints import write_safetensors
from cvt.tests.conftest import run_cvt

SPECIALS = [0.0, -0.0, 1.0, -2.5, 1e-40, 3e38, float("inf"), -float("inf"), float("nan")]


@pytest.mark.parametrize("dtype", sorted(NONFINITE_MASKS))
@pytest.mark.parametrize("kernel", ["c", "numpy"])
def test_count_agrees_with_torch_isfinite(dtype, kernel, monkeypatch):
    """Every bit pattern of the 1- and 2-byte float dtypes, and special values of the wider ones:
    the count over the stored bits is torch's count of non-finite values (float8: through the exact
    float32 upcast), in C and in the numpy fallback."""
    if kernel == "numpy":
        monkeypatch.setattr(finite, "_c_count", lambda: None)
    elif finite._c_count() is None:
        pytest.skip("C kernel not built")
    tdt = getattr(torch, DTYPES[dtype][0])
    size = DTYPES[dtype][1]
    if size <= 2:
        t = torch.arange(1 << (8 * size), dtype=torch.int32).to(torch.int16 if size == 2 else torch.uint8)
        t = t.view(tdt)
    else:
        t = torch.tensor(SPECIALS * 37, dtype=tdt)
    want = int((~torch.isfinite(t.float() if size == 1 else t)).sum())
    raw = t.view(torch.uint8).numpy()
    assert count_nonfinite(memoryview(raw), dtype) == want > 0
    assert count_nonfinite(memoryview(raw[: size * 3]), dtype) == int((~torch.isfinite(t[:3].float())).sum())


def test_other_dtypes_are_not_counted():
    raw = np.full(64, 0xFF, np.uint8)
    assert all(count_nonfinite(memoryview(raw), d) == 0 for d in DTYPES if d not in NONFINITE_MASKS)
    assert count_nonfinite(b"", "BF16") == 0


# ------------------------------------------------ every verb, every scheme: a NaN planted
KV_B = "model.layers.0.self_attn.kv_b_proj.weight"          # FP8 in the release, float under every scheme
EXPERT = "model.layers.1.mlp.experts.2.down_proj.weight"     # FP8, kept float by --ignore
NORM = "model.layers.1.post_attention_layernorm.weight"     # BF16, copied by every verb


def plant(src: Path, name: str, code: int | None = None) -> None:
    """Set element [0, 0] (a 1-D tensor: [0]) of `name` to FP8 code `code`, or to NaN (float)."""
    from safetensors.torch import load_file

    f = src / json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = {k: v.clone() for k, v in load_file(f).items()}
    t = tensors[name]
    if code is not None:
        t.view(torch.uint8).reshape(-1)[0] = code
    else:
        t.reshape(-1)[0] = float("nan")
    write_safetensors(f, tensors)


def _quantize(scheme: str, fmt: str) -> list[str]:
    extra = ["--calib-tokens", "256"] if scheme == "w8a8c8" else []  # its KV scales calibrate: keep it short
    if scheme == "fp4" and fmt == "ascend":
        extra = ["--fp4-format", "mxfp4"]  # (Ascend's fp4)
    return ["quantize", "--scheme", scheme, "--format", fmt, *extra]


VERBS = {"fp8-to-bf16": ["fp8-to-bf16"], "shard": ["shard", "--ep", "2"],
         **{f"quantize-{s}-ascend": _quantize(s, "ascend") for s in scheme_names()},
         **{f"quantize-{s}-ct": _quantize(s, "compressed-tensors") for s in scheme_names() if s in CT_SCHEMES}}
# planted tensor, FP8 code (None: a float NaN)
PLANTS = {"kv_b_proj-0x7f": (KV_B, 0x7F), "norm-nan": (NORM, None)}


@pytest.fixture(scope="module")
def planted(tmp_path_factory, fp8_release_session) -> dict[str, Path]:
    out = {}
    for key, (name, code) in PLANTS.items():
        src = tmp_path_factory.mktemp("planted") / key
        shutil.copytree(fp8_release_session, src)
        plant(src, name, code)
        out[key] = src
    src = tmp_path_factory.mktemp("planted") / "expert-0xff"
    shutil.copytree(fp8_release_session, src)
    plant(src, EXPERT, 0xFF)
    out["expert-0xff"] = src
    return out


def refused(argv: list, src: Path, dst: Path, culprit: str) -> None:
    """Exit 1, one ``cvt: error:`` line naming `culprit`, no file that makes DST look complete."""
    verb, *opts = argv
    r = run_cvt(*([verb, opts[0]] if verb == "export" else [verb]), src, dst,
                *(opts[1:] if verb == "export" else opts), "--quiet")
    assert r.rc == 1, (r.rc, r.err[-2000:])
    lines = [ln for ln in r.err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("cvt: error: "), r.err
    assert culprit in lines[0] and "NaN" in lines[0], lines[0]
    assert not [p for p in ("cvt_manifest.json", "model.safetensors.index.json", "config.json", "export_manifest.json")
                if (dst / p).exists()], sorted(p.name for p in dst.iterdir())


@pytest.mark.parametrize("plant_id", list(PLANTS))
@pytest.mark.parametrize("verb", [v if v == "fp8-to-bf16" else pytest.param(v, marks=pytest.mark.slow) for v in VERBS])
def test_every_verb_and_scheme_refuses_a_nan_it_would_write(verb, plant_id, planted, tmp_path):
    name, _ = PLANTS[plant_id]
    refused(VERBS[verb], planted[plant_id], tmp_path / "out", name)


@pytest.mark.slow
def test_an_expert_kept_float_by_ignore(planted, tmp_path):
    """A routed expert kept float (--ignore) with an e4m3 -NaN code (0xFF): named with its file."""
    refused(["quantize", "--scheme", "w4a16", "--ignore", r".*\.experts\.2\..*"], planted["expert-0xff"],
            tmp_path / "out", f"{EXPERT} (F8_E4M3 [256, 128], model-0000")


@pytest.mark.slow
def test_export_onnx_refuses_a_nan_weight(planted, tmp_path):
    refused(["export", "onnx"], planted["kv_b_proj-0x7f"], tmp_path / "onnx", "model.layers.0.self_attn.kv_b_proj")


def test_the_fp8_message_says_where(planted, tmp_path):
    """The kernel's count names the weight, its dtype, shape and file, and the rows of the piece."""
    r = run_cvt("fp8-to-bf16", planted["kv_b_proj-0x7f"], tmp_path / "out", "--quiet")
    assert f"{KV_B} (F8_E4M3 [256, 72], model-0000" in r.err and "rows 0..255 are NaN codes" in r.err, r.err

