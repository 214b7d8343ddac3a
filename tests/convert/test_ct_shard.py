"""`cvt shard` of a compressed-tensors or ModelOpt release as stored (issue 40 item 2): one rule
for every source, the one FP8 block releases and cvt's own quantized outputs follow: the shards
carry what the source stores, split per rank (`cvt.convert.release_split`). Codes, group scales
and zero points split along the arch table's dim with their weight, per-channel scales with the
output channels, global / per-tensor scales and ``weight_shape`` whole; the ranks' runs put back
together give the release byte for byte; 2 ranks give the single process's tokens and logits;
a layout that would cut a group or an int32 of packed codes, and a corrupt scale, are refused
in one line naming the tensor before anything is written. ModelOpt FP8_PB_WO's 4-D block scale
[ceil(n/128), 1, ceil(k/128), 1] splits along dim 0 with out_features and dim 2 with in_features
(vLLM's ``ModelOptFp8PbWoLinearMethod``: output_dim=0, input_dim=2); cvt's runtime refuses the
ModelOpt shards in one line (it has no kernel for them)."""

from __future__ import annotations

import pytest
import torch

from cvt.convert.placement import make_layout
from cvt.convert.shard import shard
from tests.conftest import run_cvt
from tests.convert.ct_release import assert_corrupt_refused, write_ct_release
from tests.convert.modelopt_release import MIXED, write_modelopt_release
from tests.convert.test_shard import assert_reproduces

pytest.importorskip("compressed_tensors")
pytestmark = pytest.mark.slow  # each case writes a release with the compressed-tensors library (~1-3 s)

Q, O = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj"  # column / row parallel
GO = "model.layers.0.mlp.experts"
X = "model.layers.1.self_attn.o_proj"
ED, EG = "model.layers.1.mlp.experts.0.down_proj", "model.layers.1.mlp.experts.0.gate_proj"  # row / column
PB_WIDE = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, head_dim=64, num_key_value_heads=4)


def write_gpt_oss_mxfp4(dst):
    """A tiny gpt-oss MXFP4 release (its experts as the release's X_blocks / X_scales)."""
    from cvt.testing.checkpoints import random_weights, write_release
    from cvt.testing.checkpoints_gpt_oss import mxfp4_release_tensors, tiny_gpt_oss_config

    tensors = mxfp4_release_tensors(random_weights(tiny_gpt_oss_config(vocab_size=300)))
    return write_release(dst, tiny_gpt_oss_config(mxfp4=True, vocab_size=300), tensors, 2, move_scale=False)


# (release, its format, layout degrees, tensor -> the split dim the manifest must record)
CASES = {
    "ct-int4": (lambda d: write_ct_release(d, "W4A16", group_size=16), "compressed-tensors-int4", dict(tp=2, ep=2), {
        f"{O}.weight_packed": 1, f"{O}.weight_scale": 1, f"{O}.weight_shape": None,
        f"{Q}.weight_packed": 0, f"{Q}.weight_scale": 0}),
    "ct-nvfp4": (lambda d: write_ct_release(d, "NVFP4"), "compressed-tensors-nvfp4", dict(tp=2, ep=2), {
        f"{O}.weight_packed": 1, f"{O}.weight_scale": 1, f"{O}.weight_global_scale": None,
        f"{Q}.weight_packed": 0, f"{Q}.weight_scale": 0, f"{Q}.weight_global_scale": None}),
    "ct-fp8-channel": (lambda d: write_ct_release(d, "FP8_DYNAMIC"), "compressed-tensors-fp8", dict(tp=2, ep=2), {
        f"{O}.weight": 1, f"{O}.weight_scale": None, f"{Q}.weight": 0, f"{Q}.weight_scale": 0}),
    "modelopt-nvfp4": (lambda d: write_modelopt_release(d, "NVFP4"), "modelopt-nvfp4", dict(tp=2, ep=2), {
        f"{O}.weight": 1, f"{O}.weight_scale": 1, f"{O}.weight_scale_2": None, f"{O}.input_scale": None,
        f"{Q}.weight": 0, f"{Q}.weight_scale": 0}),
    "modelopt-fp8": (lambda d: write_modelopt_release(d, "FP8"), "modelopt-fp8", dict(tp=2, ep=2), {
        f"{O}.weight": 1, f"{O}.weight_scale": None, f"{Q}.weight": 0, f"{Q}.weight_scale": None}),
    # FP8_PB_WO, every linear a whole number of 128-blocks per rank (256 wide): the scale
    # [ceil(n/128), 1, ceil(k/128), 1] splits along dim 0 with n and along dim 2 with k, as vLLM's
    # ModelOptFp8PbWoLinearMethod creates it per rank (output_dim=0, input_dim=2)
    "modelopt-fp8-pb-wo": (lambda d: write_modelopt_release(d, "FP8_PB_WO", **PB_WIDE), "modelopt-fp8-pb-wo",
                           dict(tp=2, ep=1, moe_tp=2), {
        f"{O}.weight": 1, f"{O}.weight_scale": 2, f"{O}.input_scale": None, f"{Q}.weight": 0, f"{Q}.weight_scale": 0,
        f"{ED}.weight": 1, f"{ED}.weight_scale": 2, f"{EG}.weight": 0, f"{EG}.weight_scale": 0}),
    # MIXED_PRECISION: layer 1's attention FP8 (per-tensor scale whole), its experts NVFP4 (block
    # scales with their codes, weight_scale_2 whole), layer 0's o_proj float
    "modelopt-mixed": (lambda d: write_modelopt_release(d, MIXED), "modelopt-mixed", dict(tp=2, ep=1, moe_tp=2), {
        f"{X}.weight": 1, f"{X}.weight_scale": None, f"{X}.input_scale": None, f"{O}.weight": 1,
        f"{ED}.weight": 1, f"{ED}.weight_scale": 1, f"{ED}.weight_scale_2": None,
        f"{EG}.weight": 0, f"{EG}.weight_scale": 0, f"{EG}.weight_scale_2": None}),
    # the fused experts [E, ...]: over ep along E, as their BF16 form (vLLM's gpt_oss.py EP split)
    "gpt-oss-mxfp4": (write_gpt_oss_mxfp4, "gpt-oss-mxfp4", dict(tp=2, ep=2), {
        f"{GO}.gate_up_proj_blocks": 0, f"{GO}.gate_up_proj_scales": 0, f"{GO}.down_proj_blocks": 0,
        "model.layers.0.mlp.router.weight": None}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_release_shards_carry_its_parts_and_reassemble_byte_for_byte(tmp_path, case):
    write, fmt, degrees, dims = CASES[case]
    src = write(tmp_path / "src")
    m = assert_reproduces(src, shard(src, tmp_path / "out", make_layout(2, **degrees), quiet=True).dst)
    assert (m["format"], m["source"]["format"], m["quant"]) == (f"sharded-{fmt}", fmt, None)
    t = m["shard"]["tensors"]
    assert {n: t[n]["dim"] for n in dims} == dims
    assert all(t[n]["degree"] == 2 for n in dims if dims[n] is not None)


def test_two_ranks_match_one_process(tmp_path):
    """A c-t INT4 (group 16), a c-t NVFP4 MoE and a gpt-oss MXFP4 release, sharded tp 2 / ep 2 as
    stored, run on two ranks (gloo): the single process's tokens and float32 logits (weight-only:
    exact per rank; the all-reduce's float32 reassociation only, as for cvt's own W4A16 shards)."""
    from cvt.tests.runtime.test_distributed import _check_dumps, _reference, _spawn

    srcs = {"ct-int4": write_ct_release(tmp_path / "int4", "W4A16", moe=True, group_size=16),
            "ct-nvfp4": write_ct_release(tmp_path / "nvfp4", "NVFP4", moe=True),
            "gpt-oss-mxfp4": write_gpt_oss_mxfp4(tmp_path / "gpt-oss")}
    cases = {name: (src, shard(src, tmp_path / name, make_layout(2, tp=2, ep=2), quiet=True).dst)
             for name, src in srcs.items()}
    codes = _spawn(2, [(n, dst) for n, (_, dst) in cases.items()], tmp_path)
    for name, (src, _) in cases.items():
        assert codes[name] == [0, 0], (name, codes[name])
        _check_dumps(tmp_path / "out-2", name, 2, _reference(src))


@pytest.mark.parametrize("preset, overrides, degrees, tensor, words", [
    # per-channel int4, k = 140: ceil(140 / 8) = 18 int32 split 9 + 9, but 70 inputs per rank
    ("W4A16", dict(group_size=0, intermediate_size=140), ("--dense-tp", "2"), "model.layers.0.mlp.down_proj.weight_packed",
     "(packed int4, 8 per int32): dense_tp 2 gives each rank 70 of its 140 in_features, not whole units of 8: "
     "one would straddle two ranks; valid dense_tp: 1"),
    ("MXFP4", {}, ("--tp", "2"), f"{O}.weight_scale",
     "(scale per group of 32): tp 2 gives each rank 48 of its 96 in_features, not whole units of 32"),
], ids=["int4-packed-straddles", "mxfp4-group-straddles"])
def test_a_cut_unit_is_refused_in_one_line(tmp_path, preset, overrides, degrees, tensor, words):
    src = write_ct_release(tmp_path / "src", preset, **overrides)
    r = run_cvt("shard", src, tmp_path / "out", "--world-size", "2", *degrees, "--quiet")
    assert r.rc == 1, r.err
    line, = r.err.strip().splitlines()
    assert line.startswith("cvt: error: ") and "cannot shard this" in line and tensor in line and words in line, line
    assert not (tmp_path / "out").exists()


def test_a_straddling_block_is_refused_in_one_line(tmp_path):
    """FP8_PB_WO at the tiny sizes: dense_tp 2 gives gate_proj / up_proj 80 of their 160 rows and
    down_proj 80 of its 160 columns (its scale's dim 2), not whole 128-blocks."""
    src = write_modelopt_release(tmp_path / "src", "FP8_PB_WO")
    r = run_cvt("shard", src, tmp_path / "out", "--world-size", "2", "--tp", "2", "--quiet")
    assert r.rc == 1, r.err
    line, = r.err.strip().splitlines()
    assert line.startswith("cvt: error: ") and "cannot shard this modelopt-fp8-pb-wo release as stored" in line, line
    assert ("model.layers.0.mlp.gate_proj.weight_scale (F32 [2, 1, 1, 1], " in line and "(scale per 128x128 block): "
            "dense_tp 2 gives each rank 80 of its 160 out_features, not whole units of 128: one would straddle two "
            "ranks; valid dense_tp: 1 (and 2 more tensors)" in line), line
    assert not (tmp_path / "out").exists()



@pytest.mark.parametrize("write, name, fn, why", [
    (lambda d: write_ct_release(d, "MXFP4"), f"{X}.weight_scale", lambda t: t.index_fill(1, torch.tensor([0]), 0xFF),
     "non-finite"),  # E8M0 NaN
    (lambda d: write_ct_release(d, "NVFP4"), f"{X}.weight_global_scale", torch.zeros_like, "expected > 0"),
    (lambda d: write_modelopt_release(d, "NVFP4"), f"{X}.weight_scale_2", lambda t: torch.full_like(t, float("inf")),
     "non-finite"),
    (write_gpt_oss_mxfp4, "model.layers.1.mlp.experts.down_proj_scales",
     lambda t: t.view(-1).index_fill(0, torch.tensor([5]), 0xFF).view(t.shape), "0xFF"),
], ids=["ct-mxfp4-e8m0-nan", "ct-nvfp4-global-zero", "modelopt-nvfp4-inf", "gpt-oss-e8m0-nan"])
def test_corrupt_scale_refused(tmp_path, write, name, fn, why):
    assert_corrupt_refused(write(tmp_path / "src"), tmp_path / "dst", "shard", name, fn, why)


@pytest.mark.parametrize("algo, fmt, sizes", [("FP8", "modelopt-fp8", {}), (MIXED, "modelopt-mixed", {}),
                                              ("FP8_PB_WO", "modelopt-fp8-pb-wo", PB_WIDE)],
                         ids=["fp8", "mixed", "fp8-pb-wo"])
def test_the_runtime_refuses_shards_it_has_no_kernel_for(tmp_path, algo, fmt, sizes):
    src = write_modelopt_release(tmp_path / "src", algo, **sizes)
    shard(src, tmp_path / "out", make_layout(2, tp=2, ep=2), quiet=True)
    r = run_cvt("run", tmp_path / "out", "--procs", "2", "--input-ids", "1,2", "--max-new-tokens", "1",
                "--device", "cpu", "--quiet", subprocess_=True)
    line, = r.err.strip().splitlines()
    assert r.rc == 1 and line.startswith("cvt: error: ") and f"does not load {fmt} (ModelOpt) shards; dequantize " \
        "the release with cvt fp8-to-bf16 (or cvt quantize it) and shard that" in line, r.err
