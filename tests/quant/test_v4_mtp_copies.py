"""DeepSeek-V4 outputs for the serving stacks (`ArchTable.ascend_copies`, cvt.convert.arch.deepseek_v4).

The MTP draft reads its own embed / head copies (``mtp.0.emb.tok_emb``, ``mtp.0.head``):
vllm-ascend's DeepSeekV4MTP.load_weights (vllm_ascend/models/deepseek_v4/mtp.py @ 182b75e) reads
only ``mtp.0.*`` tensors (``.emb.tok_emb.`` -> the draft's ``model.embed_tokens``, ``.head.`` ->
``shared_head.head``) and its SharedHead asks AscendModelSlimConfig.get_quant_method for prefix
``mtp.0.head``, which needs ``mtp.0.head.weight`` in the description; the release's top-level
``embed`` / ``head`` are aliased to them only under ``deepseek_v4_fp8``. DeepSeek-V4-Flash-Base ships
the two copies, V4-Flash does not: cvt's ascend output of either has them, equal to embed / head,
and cvt reads a release that has them (carried: its runtime uses embed / head).

``--format compressed-tensors`` is refused for V4 before DST exists (vLLM's V4 model fuses modules
a compressed-tensors config under the release's names cannot address).
"""

from __future__ import annotations

import json

import pytest
import torch

from cvt.testing.checkpoints_v4 import tiny_deepseek_v4_config, v4_release_tensors
from cvt.testing.checkpoints import write_release
from cvt.tests.conftest import run_cvt
from cvt.tests.convert.test_shard import read_all

COPIES = {"mtp.0.emb.tok_emb.weight": "embed.weight", "mtp.0.head.weight": "head.weight"}


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    root = tmp_path_factory.mktemp("v4-mtp")
    cfg = tiny_deepseek_v4_config()
    t = v4_release_tensors(cfg)
    flash = write_release(root / "flash", cfg, dict(t), 2, move_scale=False)
    # V4-Flash-Base: the copies as separate tensors (other values than embed / head: carried as they are)
    base = dict(t, **{c: t[n] + 1 for c, n in COPIES.items()})
    return flash, write_release(root / "base", cfg, base, 2, move_scale=False)


@pytest.mark.slow
def test_the_ascend_output_has_the_drafts_copies(releases, tmp_path):
    flash, _ = releases
    dst = tmp_path / "w8a8"
    r = run_cvt("quantize", flash, dst, "--scheme", "w8a8", "--format", "ascend", "--quiet")
    assert r.rc == 0, r.err
    out, desc = read_all(dst), json.loads((dst / "quant_model_description.json").read_text())
    for copy, name in COPIES.items():
        assert out[copy].dtype == torch.bfloat16 and torch.equal(out[copy], out[name]), copy
        assert desc[copy] == "FLOAT"
    manifest = json.loads((dst / "cvt_manifest.json").read_text())
    assert manifest["carried"] == sorted(COPIES)
    # cvt's own runtime loads the output (the copies are carried, not run) and runs its MTP layer
    from cvt.runtime.loader import load_model

    model = load_model(dst, dtype=torch.float32).model
    assert len(model.mtp) == 1
    tokens = torch.tensor([[3, 5, 7, 11]])
    assert torch.isfinite(model(tokens)).all()


@pytest.mark.slow
def test_a_release_with_the_copies_is_read_and_carried(releases, tmp_path):
    _, base = releases
    src = read_all(base)
    r = run_cvt("inspect", base)
    assert r.rc == 0 and "problems        none" in r.out, r.out + r.err
    dst = tmp_path / "w4a8"
    r = run_cvt("quantize", base, dst, "--scheme", "w4a8", "--format", "ascend", "--quiet")
    assert r.rc == 0, r.err
    out = read_all(dst)
    for copy in COPIES:
        assert torch.equal(out[copy], src[copy]), copy  # the release's own, byte for byte, not replaced
    bf16 = tmp_path / "bf16"
    assert run_cvt("fp8-to-bf16", base, bf16, "--quiet").rc == 0
    assert all(torch.equal(read_all(bf16)[c], src[c]) for c in COPIES)


@pytest.mark.parametrize("args", [("--scheme", "w8a8"), ("--scheme", "fp4", "--fp4-format", "mxfp4")])
def test_compressed_tensors_is_refused_before_dst_exists(releases, tmp_path, args):
    """vLLM's compressed-tensors MoE lookup (vllm/model_executor/layers/quantization/compressed_tensors/
    compressed_tensors_moe.py, get_compressed_tensors_moe_method) finds the experts' scheme from a "Linear"
    target or targets matching gate_proj / up_proj / down_proj, and DeepseekV4ForCausalLM
    (vllm/models/deepseek_v4/nvidia/model.py) fuses attn.wq_a + attn.wkv with no packed_modules_mapping:
    V4's w1 / w2 / w3 release names are neither. One line, nothing written."""
    from cvt.qtensor.layouts import COMPRESSED_TENSORS

    flash, _ = releases
    dst = tmp_path / "ct"
    r = run_cvt("quantize", flash, dst, *args, "--format", COMPRESSED_TENSORS, "--quiet")
    assert r.rc != 0 and not dst.exists()
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cvt: error: deepseek_v4: --format compressed-tensors is refused")
    assert "w1 / w2 / w3" in lines[0] and "--format ascend" in lines[0]


def test_shard_splits_the_copies_by_vocab_as_embed_and_head(releases, tmp_path):
    """`cvt shard` splits the draft's copies as embed / head are split (embed_tp / lmhead_tp, dim 0:
    vllm-ascend's DeepSeekV4MTP holds them in a VocabParallelEmbedding and a ParallelLMHead,
    vllm_ascend/models/deepseek_v4/mtp.py), and the rank files put the release back together byte
    for byte (tests/convert/test_shard.py's reassembly)."""
    from cvt.convert.placement import make_layout
    from cvt.convert.shard import shard
    from cvt.tests.convert.test_shard import assert_reproduces

    _, base = releases
    layout = make_layout(world_size=4, tp=1, ep=4, embed_tp=4, lmhead_tp=2)
    m = assert_reproduces(base, shard(base, tmp_path / "out", layout, quiet=True).dst)
    t = m["shard"]["tensors"]
    for copy, name in COPIES.items():
        assert (t[copy]["axis"], t[copy]["dim"], t[copy]["degree"]) == (t[name]["axis"], 0, t[name]["degree"]), copy
    assert (t["mtp.0.emb.tok_emb.weight"]["degree"], t["mtp.0.head.weight"]["degree"]) == (4, 2)


@pytest.mark.skipif(not __import__("os").environ.get("CVT_VLLM_ASCEND_SRC"),
                    reason="set CVT_VLLM_ASCEND_SRC to a local vllm-ascend source tree to read its V4 draft")
def test_vllm_ascend_draft_holds_the_copies_vocab_parallel():
    """The split `cvt shard` gives the copies is vllm-ascend's own: its DeepSeekV4MTP builds the
    draft's ``embed_tokens`` as a VocabParallelEmbedding and its ``head`` as a ParallelLMHead
    (vllm_ascend/models/deepseek_v4/mtp.py on main, models/deepseek_v4_mtp.py in v0.23), read
    from the tree's source."""
    import ast
    import os
    from pathlib import Path

    models = Path(os.environ["CVT_VLLM_ASCEND_SRC"]) / "vllm_ascend" / "models"
    path = next((p for p in (models / "deepseek_v4" / "mtp.py", models / "deepseek_v4_mtp.py") if p.is_file()), None)
    if path is None:
        pytest.skip(f"{models}: no DeepSeek-V4 MTP model in this vllm-ascend")
    built: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name):
            for target in node.targets:
                if isinstance(target, ast.Attribute):
                    built.setdefault(target.attr, set()).add(node.value.func.id)
    assert built.get("embed_tokens") == {"VocabParallelEmbedding"}, path
    assert built.get("head") == {"ParallelLMHead"}, path
