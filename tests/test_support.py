"""The support matrix (`cvt.support`) against the quantize stage itself: for tiny checkpoints of
several families, `cvt quantize` refuses before writing anything exactly where the matrix has no
cell, and writes an output where it has one. The matrix reads the stage's checks; this runs them
on real checkpoints, so a check the matrix does not read (or reads wrong) fails here."""

from __future__ import annotations

import pytest

from cvt import support
from cvt.errors import CvtError

# Quantized by RTN only (a cell that would calibrate, an accepted w8a8c8, is left to the stage's own
# tests). Not w4a16: the ascend stacks' group sizes (MindIE: 64 / 128 / 256) divide no tiny model's
# awkward widths, so the stage refuses it for the shapes, not the family.
SCHEMES = ("w8a8", "w4a8", "fp4 mxfp4", "w8a8c8")


def _checkpoint(model_type: str, root):
    from cvt.testing.checkpoints import (tiny_deepseek_config, tiny_glm_moe_dsa_config, tiny_qwen3_config,
                                       write_bf16_checkpoint, write_fp8_release)
    from cvt.testing.checkpoints_v4 import write_v4_release

    path = root / model_type
    if model_type in ("qwen3", "qwen3_moe"):
        # widths that fp4's groups of 32 divide (the default expert width, 48, is awkward on purpose)
        return write_bf16_checkpoint(path, tiny_qwen3_config(moe=model_type == "qwen3_moe", moe_intermediate_size=64))
    if model_type == "deepseek_v3":
        return write_fp8_release(path, tiny_deepseek_config())
    if model_type == "glm_moe_dsa":
        return write_fp8_release(path, tiny_glm_moe_dsa_config())
    return write_v4_release(path)


def _cells(model_type: str) -> dict[str, tuple]:
    row = next(r for r in support.matrix() if model_type in r.model_types)
    return {c.label: cells for c, cells in zip(support.columns(), row.cells)}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe", "deepseek_v3", "glm_moe_dsa", "deepseek_v4"])
def test_the_stage_refuses_exactly_where_the_matrix_has_no_cell(model_type, tmp_path):
    from cvt.quant.stage import quantize
    from cvt.qtensor.formats import format_names
    from cvt.qtensor.layouts import targets_for

    src = _checkpoint(model_type, tmp_path)
    cells, checked = _cells(model_type), 0
    for label in SCHEMES:
        scheme, _, fp4 = label.partition(" ")
        for fmt in format_names():
            for target in targets_for(fmt):
                listed = any(c.fmt == fmt and c.target == target for c in cells[label])
                if listed and scheme == "w8a8c8":
                    continue  # the stage would calibrate KV-cache scales: slow, and tested on its own
                dst = tmp_path / f"out-{scheme}-{fp4}-{fmt}-{target}"
                try:
                    quantize(src, dst, scheme=scheme, fmt=fmt, target=target if fmt == "ascend" else None,
                             fp4_format=fp4 or None, quiet=True)
                    wrote = True
                except CvtError:
                    wrote = False
                    assert not (dst / "cvt_manifest.json").exists()
                assert wrote == listed, f"{model_type} {label} --format {fmt} --target {target}: " + \
                    ("the stage writes it, the matrix has no cell" if wrote else "the matrix lists it, the stage refuses")
                checked += 1
    assert checked >= 8  # the loops ran
