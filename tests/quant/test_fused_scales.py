"""NVFP4 fused groups share one global scale, so the weights vLLM computes with are cvt's.

vLLM fuses q/k/v (qkv_proj), gate/up (gate_up_proj), MLA's q_a_proj + kv_a_proj_with_mqa
(fused_qkv_a_proj) and each expert's w1/w3 into one GEMM and keeps ONE per-tensor scale per
fused layer: the largest ``weight_global_scale`` of the members for dense layers (vLLM
``model_executor/layers/quantization/compressed_tensors/schemes/compressed_tensors_w4a4_nvfp4.py``
process_weights_after_loading: ``layer.weight_global_scale.max()``) and w1's for experts
(``compressed_tensors_moe/compressed_tensors_moe_w4a4_nvfp4.py``: ``w13_weight_global_scale[:, 0]``;
seen in vLLM 0.23's source and, per the issue, 0.32's behaviour). This test
reads a cvt NVFP4 output the way that reader does and checks every member's weight equals what
cvt's runtime computes with, exactly.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from cvt.convert.arch import arch_for
from cvt.testing.checkpoints import tiny_qwen3_config, write_bf16_checkpoint
from cvt.qtensor.primitives import decode_e2m1, groups, ungroup, unpack_fp4
from cvt.quant.stage import quantize
from cvt.runtime.loader import load_model


def read(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("model-*.safetensors")):
        with safe_open(f, framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def vllm_weight(disk, module, global_scale) -> torch.Tensor:
    """A fused reader's weight: codes x E4M3 block scale / the group's one global scale."""
    codes = unpack_fp4(disk[module + ".weight_packed"])
    v = groups(decode_e2m1(codes), 16) * (disk[module + ".weight_scale"].float() / global_scale)[:, :, None]
    return ungroup(v)


@pytest.fixture(scope="module")
def sources(fp8_release_session, tmp_path_factory):
    root = tmp_path_factory.mktemp("fused")
    return {"ds": fp8_release_session,
            "qwen3": write_bf16_checkpoint(root / "qwen3", tiny_qwen3_config(moe=False, hidden_size=128, head_dim=32,
                                                                             intermediate_size=256)),
            "qwen3-moe": write_bf16_checkpoint(root / "qmoe", tiny_qwen3_config(moe=True, hidden_size=128, head_dim=32,
                                                                                intermediate_size=256,
                                                                                moe_intermediate_size=64)),
            "root": root}


@pytest.mark.parametrize("name", ["ds", "qwen3", "qwen3-moe"])
def test_every_fused_group_reads_back_as_the_runtime_computes(sources, name):
    dst = sources["root"] / f"{name}-nvfp4"
    quantize(sources[name], dst, scheme="fp4", fp4_format="nvfp4", fmt="compressed-tensors", quiet=True)
    disk = read(dst)
    cfg = json.loads((dst / "config.json").read_text())
    arch = arch_for(cfg)
    model = load_model(dst, dtype=torch.float32).model
    groups_seen = set()
    for n in disk:
        if not n.endswith(".weight_global_scale"):
            continue
        group = arch.fused_group(n.rsplit(".", 1)[0])
        if group is None or group in groups_seen or not all(m + ".weight_global_scale" in disk for m in group):
            continue
        groups_seen.add(group)
        scales = [disk[m + ".weight_global_scale"] for m in group]
        assert all(torch.equal(s, scales[0]) for s in scales), group  # one scale per fused group
        expert = ".experts." in group[0]
        gs = scales[0] if expert else torch.stack(scales).max()  # vLLM: w1's / the largest
        for m in group:
            assert torch.equal(vllm_weight(disk, m, gs), model.get_submodule(m).dense_weight()), m
    kinds = {tuple(g.split(".")[-1] for g in grp) for grp in groups_seen}
    want = {"ds": {("q_a_proj", "kv_a_proj_with_mqa"), ("gate_proj", "up_proj")},
            "qwen3": {("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")},
            "qwen3-moe": {("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")}}[name]
    assert kinds == want, kinds
    if name != "qwen3":
        assert any(".experts." in g[0] for g in groups_seen)
