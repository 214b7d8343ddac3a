"""The later stages on a compressed-tensors release as stored (issue 40 item 2): `cvt run` /
`verify` (the runtime) compute with the package's own decompression of mxfp4 / nvfp4 / int8;
`cvt plan` plans it; the runtime refuses what it does not read with one line naming the stage
and the way through (`cvt shard` carries the release as stored: test_ct_shard.py)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_cvt
from tests.convert.ct_release import ct_decompressed, write_ct_release

pytest.importorskip("compressed_tensors")


@pytest.mark.parametrize("preset", ["MXFP4", "NVFP4", "W8A8"])
def test_the_runtime_reads_the_release_as_the_package_decompresses_it(tmp_path, preset):
    from cvt.runtime.loader import load_model

    src = write_ct_release(tmp_path / "src", preset)
    theirs = ct_decompressed(src, torch.bfloat16)
    modules = dict(load_model(src, dtype=torch.float32).model.named_modules())
    linears = [n[: -len(".weight")] for n in theirs if n.endswith("_proj.weight")]
    assert len(linears) == 21
    for m in linears:
        assert torch.equal(modules[m].dense_weight().bfloat16(), theirs[f"{m}.weight"]), m
    r = run_cvt("run", src, "--prompt", "hi", "--max-new-tokens", "2", "--quiet")
    assert r.rc == 0, r.err
    assert run_cvt("plan", src).rc == 0


@pytest.mark.parametrize("preset, verb, words", [
    ("FP8", "run", "cvt's runtime (run, verify, export) does not load compressed-tensors-fp8 (float-quantized) "
                   "checkpoints; dequantize it with cvt fp8-to-bf16 (or cvt quantize it) first"),
    ("FP8", "verify", "cvt's runtime (run, verify, export) does not load compressed-tensors-fp8"),
], ids=["fp8-run", "fp8-verify"])
def test_what_a_stage_does_not_read_is_one_line(tmp_path, preset, verb, words):
    src = write_ct_release(tmp_path / "src", preset)
    args = {"run": ("--prompt", "hi", "--max-new-tokens", "1"),
            "verify": ("--reference", src, "--report", tmp_path / "rep")}[verb]
    r = run_cvt(verb, src, *args)
    assert r.rc == 1 and r.err.startswith("cvt: error: ") and words in r.err, r.err
    assert len(r.err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
