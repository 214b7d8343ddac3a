"""DeepSeek-V4 shards run on several ranks (gloo) and give the single-process logits and tokens.

V4 names its parts its own way (``embed``, ``layers.{i}.attn.wo_b``, ``ffn``, ``head``;
`runtime.models.deepseek_v4.Model.parallel`), keeps one KV head whole under tp, splits o_groups
and the indexer's heads (DeepSeek's V4 ``inference/convert.py`` split), and its hash layers route
by token id. One prompt longer than index_topk x 4 makes the CSA layers' indexer choose among
compressed entries, past the sliding window; the harness is test_distributed's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cvt.convert.placement import make_layout
from cvt.convert.shard import shard
from cvt.tests.runtime.test_distributed import _check_dumps, _reference, _spawn

PROMPTS = ["def __init__(self, config): return self.forward(x)", "MoE!"]  # 51 tokens: > index_topk * 4 + window
ARGV = [a for p in PROMPTS for a in ("--prompt", p)] + ["--max-new-tokens", "4", "--dtype", "fp32", "--device",
                                                        "cpu", "--quiet"]


@pytest.fixture(scope="module")
def v4_bf16(tmp_path_factory) -> Path:
    from cvt.convert.fp8_to_bf16 import fp8_to_bf16
    from cvt.testing.checkpoints_v4 import write_v4_release

    root = tmp_path_factory.mktemp("v4-ranks")
    return fp8_to_bf16(write_v4_release(root / "release"), root / "bf16", quiet=True).dst


@pytest.mark.slow
def test_v4_shards_on_two_ranks_match_one_process(v4_bf16, tmp_path):
    cases = {
        # heads, o_groups and index heads / 2 (wo_b all-reduced, the indexer's projections gathered),
        # experts over 2 EP ranks, embedding and head vocab-parallel
        "v4-tp2-ep2": make_layout(2, tp=2, ep=2),
        # attention replicated (dp 2), every expert split moe_tp 2 ways, the shared expert whole on rank 0
        "v4-moetp2-replicated": make_layout(2, tp=1, ep=1, moe_tp=2, shared_experts="replicated"),
    }
    runs = [(name, shard(v4_bf16, tmp_path / name, layout, quiet=True).dst) for name, layout in cases.items()]
    codes = _spawn(2, runs, tmp_path, argv=ARGV)
    ref = _reference(v4_bf16, PROMPTS)
    assert len(ref[0][0]) > 4 * 4 + 8  # the long prompt reaches past the indexer's top-k and the window
    for name in cases:
        assert codes[name] == [0, 0], (name, codes[name])
        _check_dumps(tmp_path / "out-2", name, 2, ref, PROMPTS)
