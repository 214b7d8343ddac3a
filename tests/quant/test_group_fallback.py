"""Group sizes on small models (issue 23, item 10): a linear whose in_features the group size does
not divide, and a group equal to in_features, through `cvt quantize`, `cvt plan` and the Ascend
description."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from safetensors import safe_open

from cvt.convert.placement import make_layout
from cvt.convert.memory_plan import memory_plan
from cvt.convert.safetensors_io import DTYPES
from cvt.testing.checkpoints import tiny_deepseek_config, write_bf16_checkpoint, write_fp8_release
from cvt.errors import CvtError
from cvt.quant.stage import quantize
from cvt.runtime.loader import load_model
from cvt.tests.conftest import run_cvt

Q_B = [f"model.layers.{i}.self_attn.q_b_proj" for i in range(4)]  # 3 decoder layers + the MTP layer


@pytest.fixture(scope="module")
def q96(tmp_path_factory):
    """A tiny DeepSeek-V3 BF16 checkpoint whose q LoRA rank is 96 (as the trained fixture's):
    q_b_proj's in_features, which group 128 does not divide."""
    return write_bf16_checkpoint(tmp_path_factory.mktemp("q96") / "src", tiny_deepseek_config(q_lora_rank=96))


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """The tiny FP8 release: routed experts' down_proj has in_features = moe_intermediate_size 128."""
    return write_fp8_release(tmp_path_factory.mktemp("rel") / "src")


def _tensor_bytes(folder) -> int:
    total = 0
    for f in folder.rglob("*.safetensors"):
        with safe_open(f, "pt") as h:
            for k in h.keys():
                sl = h.get_slice(k)
                total += math.prod(sl.get_shape()) * DTYPES[sl.get_dtype()][1]
    return total


def test_a_group_that_does_not_divide_is_per_channel_in_compressed_tensors(q96, tmp_path, caplog):
    """Was: "group size 128 does not divide in_features=96" and nothing written. Now q_b_proj is
    quantized per channel in its own config group (vLLM loads that; compressed-tensors' own ceil
    groups would leave a short last group), listed in the manifest's fallbacks, one log line."""
    dst = tmp_path / "out"
    with caplog.at_level(logging.WARNING, logger="cvt"):
        quantize(q96, dst, scheme="w4a16", quiet=True)
    lines = [r.getMessage() for r in caplog.records if "quantized per channel" in r.getMessage()]
    assert len(lines) == 1 and "4 linear(s)" in lines[0] and Q_B[0] in lines[0], lines
    quant = json.loads((dst / "cvt_manifest.json").read_text())["quant"]
    fb = {f["module"]: f["reason"] for f in quant["fallbacks"]}
    assert sorted(fb) == Q_B
    assert fb[Q_B[0]] == "group size 128 does not divide in_features=96: quantized per channel (its own config group)"
    assert {m for m, t in quant["tensors"].items() if t["group_size"] == 0} == set(Q_B)
    assert all(t["group_size"] == 128 for m, t in quant["tensors"].items() if m not in Q_B)
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    groups = {g["weights"]["strategy"]: g for g in qc["config_groups"].values()}
    assert sorted(groups["channel"]["targets"]) == Q_B and groups["channel"]["weights"]["group_size"] is None
    assert groups["group"]["weights"]["group_size"] == 128 and not set(Q_B) & set(groups["group"]["targets"])
    scales = {}
    for f in dst.glob("*.safetensors"):
        with safe_open(f, "pt") as h:
            scales.update({k: h.get_slice(k).get_shape() for k in h.keys() if k.endswith("q_b_proj.weight_scale")})
    assert scales[Q_B[0] + ".weight_scale"] == [4 * (32 + 16), 1]   # heads x qk_head_dim rows, one scale each
    # compressed-tensors' own dequantizer (by config group) gives the weights cvt's runtime uses
    from compressed_tensors.entrypoints.convert import convert_checkpoint
    from compressed_tensors.entrypoints.convert.converters import CompressedTensorsDequantizer
    from safetensors.torch import load_file

    deq = CompressedTensorsDequantizer(dst, dtype=torch.float32, ignore=[
        "re:.*embed_tokens$", "re:.*norm$", "re:.*head$", "lm_head", "re:.*mlp\\.gate$", "re:.*kv_b_proj$",
        "re:.*eh_proj$"])
    convert_checkpoint(dst, tmp_path / "deq", deq, device="cpu", max_workers=1)
    got = {}
    for f in (tmp_path / "deq").glob("*.safetensors"):
        got.update(load_file(str(f)))
    model = load_model(dst, dtype=torch.float32).model
    for module in (Q_B[0], "model.layers.1.self_attn.q_a_proj"):
        ours = model.get_submodule(module).dense_weight().bfloat16().float()
        assert torch.equal(got[module + ".weight"].float(), ours), module


def test_the_plan_counts_the_fallback_and_refuses_what_quantize_refuses(q96, tmp_path):
    """`cvt plan` / `cvt shard --dry-run` apply quantize's group rule (they once reported no
    problem where quantize refused): compressed-tensors counts q_b_proj per channel, byte for byte
    what quantize writes; the ascend format (one global group_size) is a violation, exit 3."""
    cfg = json.loads((q96 / "config.json").read_text())
    plan = memory_plan(cfg, make_layout(world_size=1), "w4a16")
    assert not plan.violations
    assert any("q_b_proj: group size 128 does not divide in_features=96: quantized per channel" in a
               for a in plan.assumptions), plan.assumptions
    quantize(q96, tmp_path / "ct", scheme="w4a16", quiet=True)
    assert plan.ranks[0].weight_bytes == _tensor_bytes(tmp_path / "ct")

    with pytest.raises(CvtError, match=r"q_b_proj.weight \[192, 96\]: group size 64 does not divide in_features=96"):
        quantize(q96, tmp_path / "mi", scheme="w4a16", fmt="ascend", target="mindie", quiet=True)
    assert not (tmp_path / "mi" / "cvt_manifest.json").exists()
    bad = memory_plan(cfg, make_layout(world_size=1), "w4a16", fmt="ascend", target="mindie").violations
    assert [str(v) for v in bad] == [
        "model.layers.0.self_attn.q_b_proj.weight [192, 96]: group size 64 does not divide in_features=96, and the "
        "ascend format's stacks read one global group_size, so this linear cannot be written per channel: give a "
        "--group-size that divides every grouped linear's in_features (a divisor of 96), or keep it float "
        "(--ignore, or a recipe rule) (and 3 more linears like it)"]
    r = run_cvt("shard", q96, "--dry-run", "--scheme", "w4a16", "--format", "ascend", "--target", "mindie")
    assert r.rc == 3 and "quantization violations (cvt quantize refuses this group size):" in r.out, (r.rc, r.out)


def test_a_group_equal_to_in_features_is_one_group_for_vllm_ascend(release, tmp_path):
    """Was refused ("vllm-ascend loads w4a16 only with grouped scales, not per channel ...
    group_size: 0"): the experts' down_proj has k = 128 = the group. vllm-ascend 0.23
    (vllm_ascend/quantization/methods/w4a16.py, AscendW4A16FusedMoEMethod) reads group_size from
    the description and declares w2_weight_scale [experts, hidden, intermediate // group_size]:
    the description says 128 and each down_proj holds one bf16 scale column, in the int32 layout."""
    dst = tmp_path / "asc"
    quantize(release, dst, scheme="w4a16", fmt="ascend", group_size=128, quiet=True)
    desc = json.loads((dst / "quant_model_description.json").read_text())
    assert desc["group_size"] == 128
    down = "model.layers.1.mlp.experts.0.down_proj"
    assert desc[down + ".weight_packed"] == "W4A16"
    shapes = {}
    for f in dst.glob("*.safetensors"):
        with safe_open(f, "pt") as h:
            shapes.update({k: (h.get_slice(k).get_shape(), h.get_slice(k).get_dtype()) for k in h.keys()
                           if k.startswith(down + ".")})
    assert shapes == {down + ".weight_packed": ([256, 128 // 8], "I32"), down + ".weight_scale": ([256, 1], "BF16"),
                      down + ".weight_shape": ([2], "I32")}
    tensors = json.loads((dst / "cvt_manifest.json").read_text())["quant"]["tensors"]
    assert tensors[down]["group_size"] == 128 and tensors[down]["layout"] == "ascend-w4a16-int32"
    assert torch.isfinite(load_model(dst, dtype=torch.float32).model(torch.tensor([[256, 72, 105]]))).all()
    cfg = json.loads((release / "config.json").read_text())
    lay = make_layout(world_size=1)
    plan = memory_plan(cfg, lay, "w4a16", 128, fmt="ascend")
    assert not plan.violations and plan.ranks[0].weight_bytes == _tensor_bytes(dst)


def test_mindie_gets_a_group_of_k_in_its_grouped_layout(release, tmp_path):
    """MindIE reads one global group_size too (config.json quantization_config): with group 128, a
    k = 128 linear is packed as the grouped W4A16 (two int4 per byte along n), not per channel."""
    dst = tmp_path / "mi"
    quantize(release, dst, scheme="w4a16", fmt="ascend", target="mindie", group_size=128, quiet=True)
    down = "model.layers.1.mlp.experts.0.down_proj"
    tensors = json.loads((dst / "cvt_manifest.json").read_text())["quant"]["tensors"]
    assert tensors[down]["layout"] == "ascend-w4a16-int8-grouped"
    for f in dst.glob("*.safetensors"):
        with safe_open(f, "pt") as h:
            if down + ".weight" in h.keys():
                assert h.get_slice(down + ".weight").get_shape() == [256 // 2, 128]
    assert json.loads((dst / "config.json").read_text())["quantization_config"]["group_size"] == 128
