"""`cvt shard` of a `w4a4_mxfp4_flatquant` output along a RowParallelLinear's in_features: each rank
gets what vllm-ascend's rank holds after loading (``w4a4_mxfp4_flatquant.py``
process_weights_after_loading, `cvt.qtensor.schemes.flatquant_mx`): its columns of the packed E2M1
codes and E8M0 exponents, its diagonal block of ``left_trans``, ``right_trans`` and ``clip_ratio``
whole; column-parallel layers as before. The ranks put back together give the output byte for byte,
2 ranks give the single process's tokens and logits, and a TP degree not dividing
max_supported_tp (4) or a dense ``left_trans`` (an older cvt's) are refused in one line naming the
tensor, before anything is written."""

from __future__ import annotations

import json

import pytest
import torch

from cvt.convert.memory_plan import memory_plan
from cvt.convert.placement import make_layout
from cvt.convert.shard import shard
from cvt.quant.stage import quantize
from cvt.testing.checkpoints import tiny_qwen3_config, write_bf16_checkpoint
from tests.conftest import run_cvt
from tests.convert.test_shard import assert_reproduces, raw, read_all

SCHEME = "w4a4_mxfp4_flatquant"
O, D, Q = "model.layers.0.self_attn.o_proj", "model.layers.1.mlp.down_proj", "model.layers.0.self_attn.q_proj"
# o_proj's k = 4 heads x 32 = 128, down_proj's 384: whole MX blocks per rank at tp 2, and down_proj's
# rank transforms (16, 12) are neither pair of a whole layer of k 192 (the decoder reads them as a rank's)
SIZES = dict(moe=False, hidden_size=128, head_dim=32, intermediate_size=384, num_hidden_layers=2)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("mxfq")
    src = write_bf16_checkpoint(root / "src", tiny_qwen3_config(**SIZES))
    quantize(src, root / "q", scheme=SCHEME, fmt="ascend", quiet=True)
    return src, root / "q", shard(root / "q", root / "tp2", make_layout(world_size=2, tp=2), quiet=True).dst


def test_row_layers_shard_as_vllm_ascends_ranks_hold_them(sources):
    _, q, dst = sources
    whole = read_all(q)
    m = assert_reproduces(q, dst)  # the block-diagonal left_trans put back from its blocks too
    assert m["shard"]["tensors"][f"{O}.left_trans"]["diagonal"] is True
    assert "diagonal" not in m["shard"]["tensors"][f"{Q}.left_trans"]
    ranks = [read_all(dst / f"rank-0000{r}") for r in range(2)]
    for mod in (O, D):
        n, half = whole[f"{mod}.weight"].shape  # packed: k / 2 bytes a row
        a = whole[f"{mod}.left_trans"].shape[0]
        for r, held in enumerate(ranks):
            cols, scales, block = slice(r * half // 2, (r + 1) * half // 2), whole[f"{mod}.weight_scale"].shape[1] // 2, \
                slice(r * a // 2, (r + 1) * a // 2)
            want = {"weight": whole[f"{mod}.weight"][:, cols],
                    "weight_scale": whole[f"{mod}.weight_scale"][:, r * scales:(r + 1) * scales],
                    "left_trans": whole[f"{mod}.left_trans"][block, block],
                    "right_trans": whole[f"{mod}.right_trans"], "clip_ratio": whole[f"{mod}.clip_ratio"]}
            for part, t in want.items():
                got = held[f"{mod}.{part}"]
                assert got.dtype == t.dtype and got.shape == t.shape and raw(got) == raw(t.contiguous()), (mod, r, part)
    for r, held in enumerate(ranks):  # a column-parallel layer: its rows, its transforms whole
        rows = whole[f"{Q}.weight"].shape[0] // 2
        assert raw(held[f"{Q}.weight"]) == raw(whole[f"{Q}.weight"][r * rows:(r + 1) * rows])
        assert raw(held[f"{Q}.left_trans"]) == raw(whole[f"{Q}.left_trans"])


@pytest.mark.slow
def test_two_ranks_match_one_process(sources, tmp_path):
    """Each rank runs its diagonal block on its columns of the tokens, whose MX blocks are the
    single process's: the same tokens and float32 logits up to the all-reduce's reassociation."""
    from cvt.tests.runtime.test_distributed import _check_dumps, _reference, _spawn

    _, q, dst = sources
    codes = _spawn(2, [("mxfq", dst)], tmp_path)
    assert codes["mxfq"] == [0, 0], codes
    _check_dumps(tmp_path / "out-2", "mxfq", 2, _reference(q))


def _one_line(r, *words):
    assert r.rc == 1, (r.rc, r.err)
    line, = r.err.strip().splitlines()
    assert line.startswith("cvt: error: ") and all(w in line for w in words), line


def test_a_tp_not_dividing_max_supported_tp_is_refused(tmp_path):
    # 6 heads of 32 (o_proj k 192: 64 a rank), 3 KV heads, intermediate 384: only the transforms refuse tp 3
    src = write_bf16_checkpoint(tmp_path / "src", tiny_qwen3_config(**dict(
        SIZES, hidden_size=192, num_attention_heads=6, num_key_value_heads=3)))
    quantize(src, tmp_path / "q", scheme=SCHEME, fmt="ascend", quiet=True)
    r = run_cvt("shard", tmp_path / "q", tmp_path / "out", "--world-size", "3", "--tp", "3", "--quiet")
    _one_line(r, f"{O}.", "W4A4_MXFP4_FLATQUANT", "tp 3", "max_supported_tp", "valid tp: 1, 2, 4")
    assert not (tmp_path / "out").exists()
    # the memory plan (`cvt plan`, `cvt shard --dry-run`) names the same problem
    plan = memory_plan(json.loads((src / "config.json").read_text()), make_layout(3, tp=3), SCHEME, fmt="ascend")
    assert any(O in str(v) and "max_supported_tp" in str(v) for v in plan.violations), plan.violations


def test_a_dense_left_trans_is_refused(tmp_path, monkeypatch):
    """An older cvt wrote a row layer's left_trans dense: its ranks would drop the off-diagonal
    blocks, so sharding it along k is refused; tp 1 still writes it."""
    from cvt.qtensor.schemes.flatquant_mx import W4A4MXFP4FlatQuant

    start = W4A4MXFP4FlatQuant.init_transforms

    def dense(self, k, name=None, seed=0):
        left, right = start(self, k, name)
        if self.row:  # what `_quantize` wrote from cvt's earlier dense row start
            left = torch.linalg.qr(torch.randn(left.shape, generator=torch.Generator().manual_seed(k)))[0]
        return left.to(torch.bfloat16), right

    monkeypatch.setattr(W4A4MXFP4FlatQuant, "init_transforms", dense)
    src = write_bf16_checkpoint(tmp_path / "src", tiny_qwen3_config(**SIZES))
    quantize(src, tmp_path / "q", scheme=SCHEME, fmt="ascend", quiet=True)
    r = run_cvt("shard", tmp_path / "q", tmp_path / "out", "--world-size", "2", "--tp", "2", "--quiet")
    _one_line(r, f"{O}.left_trans", "not block-diagonal in 2 blocks")
    assert not (tmp_path / "out").exists()
    assert run_cvt("shard", tmp_path / "q", tmp_path / "tp1", "--world-size", "2", "--tp", "1", "--dense-tp", "1",
                   "--quiet").rc == 0
