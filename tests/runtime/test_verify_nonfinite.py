"""`verify()` end to end on a tiny dense Qwen3 where one weight of the candidate or of the reference
holds a NaN or an Inf: every gate fails, the report is written and names the first non-finite layer."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import jsonschema
import pytest
import torch
from safetensors.torch import load_file, save_file

from cvt.testing.checkpoints import tiny_qwen3_config, write_bf16_checkpoint
from cvt.errors import CvtError
from cvt.runtime.verify import verify
from cvt.schemas import load_schema
from cvt.schemas.report import Thresholds

GATES = {"min_cosine": 0.5, "max_ppl_ratio": 100.0, "max_mean_kl": 10.0, "min_top1": 0.0}
"""Loose enough that a clean comparison passes every one: only the NaN / Inf fails them."""

RUN = {"seq_len": 16, "max_sequences": 2}


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    return write_bf16_checkpoint(tmp_path_factory.mktemp("nonfinite") / "bf16", tiny_qwen3_config(moe=False))


def _poisoned(src: Path, dst: Path, tensor: str, value: float) -> Path:
    """A copy of checkpoint `src` with one element of `tensor` set to `value`."""
    shutil.copytree(src, dst)
    shard = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"][tensor]
    tensors = {k: v.clone() for k, v in load_file(dst / shard).items()}
    tensors[tensor][3, 5] = value
    save_file(tensors, dst / shard, metadata={"format": "pt"})
    return dst


def test_clean_comparison_passes_the_gates(clean, tmp_path):
    res = verify(clean, clean, tmp_path / "rep", thresholds=Thresholds(**GATES), **RUN)
    r = res.report
    assert r.passed and r.first_nonfinite_layer is None and r.nonfinite_layers == [] and r.nonfinite_weights == []
    assert "- Non-finite values: none found" in res.paths["md"].read_text()


CASES = [  # (side poisoned, tensor, value, first non-finite layer)
    ("candidate", "model.layers.1.self_attn.o_proj.weight", math.nan, "layer.1"),
    ("candidate", "model.layers.0.mlp.down_proj.weight", math.inf, "layer.0"),
    ("reference", "model.layers.0.mlp.down_proj.weight", math.nan, "layer.0"),
    ("reference", "model.layers.1.self_attn.o_proj.weight", math.inf, "layer.1"),
]


@pytest.mark.parametrize(("side", "tensor", "value", "first"), CASES,
                         ids=[f"{s}-{'nan' if math.isnan(v) else 'inf'}" for s, _, v, _ in CASES])
def test_non_finite_weight_fails_every_gate(clean, tmp_path, side, tensor, value, first):
    bad = _poisoned(clean, tmp_path / "bad", tensor, value)
    cand, ref = (bad, clean) if side == "candidate" else (clean, bad)
    res = verify(cand, ref, tmp_path / "rep", thresholds=Thresholds(**GATES), **RUN)  # no exception
    r = res.report
    assert not r.passed
    failed = {c.name: c.message for c in r.checks if not c.passed}
    assert set(failed) == set(GATES), failed
    assert failed["min_cosine"].startswith(f"Cosine is NaN (non-finite values) from layer {first}")
    assert f"{side} {first}:" in failed["min_cosine"]
    for name in ("max_ppl_ratio", "max_mean_kl", "min_top1"):
        assert "is NaN (non-finite logits)" in failed[name] and f"{side} logits:" in failed[name]
    assert r.violations == list(failed.values())

    # where: the first non-finite layer, its side, and the poisoned weight
    assert r.first_divergent_layer == first and r.first_nonfinite_layer == first
    assert r.nonfinite_layers[0].name == first and {n.side for n in r.nonfinite_layers} == {side}
    names = [row.name for row in r.layers]
    assert all(math.isfinite(row.cosine) for row in r.layers[: names.index(first)])
    assert [(w.name, w.side, w.nan, w.posinf + w.neginf) for w in r.nonfinite_weights] == \
        [(tensor, side, int(math.isnan(value)), int(math.isinf(value)))]
    if math.isinf(value) and side == "candidate":  # an Inf weight puts +-Inf (not NaN) into layer.0's output
        assert r.nonfinite_layers[0].posinf + r.nonfinite_layers[0].neginf > 0
    sqnr = {w.name: w.sqnr_db for w in r.weights}[tensor]
    assert sqnr == -math.inf if (side, math.isinf(value)) == ("candidate", True) else math.isnan(sqnr)

    # the files: schema-valid JSON saying where, and the same in md / html
    doc = json.loads(res.paths["json"].read_text())
    jsonschema.validate(doc, load_schema("report.schema.json"))
    assert doc["passed"] is False and doc["first_nonfinite_layer"] == first
    assert doc["logits"]["kl_mean"] == "NaN" and doc["logits"]["same_top1"] == "NaN"
    md = res.paths["md"].read_text()
    assert md.startswith("# cvt verify report: FAILED")
    assert f"- Non-finite values: first in layer {first} ({side} {first}:" in md
    assert f"| {tensor} | weight | {side} |" in md
    assert f"{side} {first}:" in res.paths["html"].read_text()


def test_invalid_thresholds_refused_before_loading(tmp_path):
    missing = tmp_path / "no-such-model"  # never loaded: the threshold is refused first
    for th, msg in (({"min_cosine": math.nan}, r"^--min-cosine nan: must be a finite number in \[-1, 1\]$"),
                    ({"max_ppl_ratio": -1.0}, r"^--max-ppl-ratio -1.0: must be a finite number > 0$"),
                    (Thresholds.model_construct(min_cosine=None, max_ppl_ratio=None, max_mean_kl=math.inf,
                                                min_top1=None),
                     r"^--max-mean-kl inf: must be a finite number >= 0$")):
        with pytest.raises(CvtError, match=msg):
            verify(missing, missing, tmp_path / "rep", thresholds=th)
    assert not (tmp_path / "rep").exists()


def test_verify_accepts_a_dict_of_limits(clean, tmp_path):
    res = verify(clean, clean, tmp_path / "rep", thresholds=dict(GATES), **RUN)
    assert res.report.passed and res.report.thresholds == Thresholds(**GATES)
    assert torch.isfinite(torch.tensor([row.cosine for row in res.report.layers])).all()
