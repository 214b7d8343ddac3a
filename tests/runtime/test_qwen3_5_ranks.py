"""Qwen3.5 / Qwen3.5-MoE shards run on two ranks (gloo) and give the single-process logits and tokens.

The full-attention layers split their heads over tp (o_proj all-reduced); the Gated DeltaNet
layers' projections, conv, decays and norm are replicated as the architecture table says (each
rank runs the whole linear attention); the routed experts split over ep, the gated shared expert
whole. The harness is test_distributed's.
"""

from __future__ import annotations

import pytest

from cvt.convert.placement import make_layout
from cvt.convert.shard import shard
from cvt.testing.checkpoints import write_bf16_checkpoint
from cvt.testing.checkpoints_qwen3_5 import tiny_qwen3_5_config
from cvt.tests.runtime.test_distributed import _check_dumps, _reference, _spawn

PROMPTS = ["def __init__(self, config): return self.forward(x)", "MoE!"]
ARGV = [a for p in PROMPTS for a in ("--prompt", p)] + ["--max-new-tokens", "4", "--dtype", "fp32", "--device",
                                                        "cpu", "--quiet"]


@pytest.mark.slow  # a 2-rank gloo world of 4 cases, and the single-process reference: ~1 min on 2 cores
def test_two_ranks_match_one_process(tmp_path):
    moe = write_bf16_checkpoint(tmp_path / "moe", tiny_qwen3_5_config(vocab_size=300))
    dense = write_bf16_checkpoint(tmp_path / "dense", tiny_qwen3_5_config(moe=False, vocab_size=300))
    layouts = {
        # full-attention heads and KV heads / 2 (o_proj all-reduced), experts over 2 EP ranks
        "qwen35-moe-tp2-ep2": (moe, make_layout(2, tp=2, ep=2)),
        # attention replicated (dp 2), every expert and the shared expert split moe_tp 2 ways
        "qwen35-moe-moetp2": (moe, make_layout(2, tp=1, ep=1, moe_tp=2)),
        # ... the shared expert whole on rank 0
        "qwen35-moe-moetp2-replicated": (moe, make_layout(2, tp=1, ep=1, moe_tp=2, shared_experts="replicated")),
        "qwen35-dense-tp2": (dense, make_layout(2, tp=2)),
    }
    cases = {name: (src, shard(src, tmp_path / name, layout, quiet=True).dst) for name, (src, layout) in layouts.items()}
    codes = _spawn(2, [(n, dst) for n, (_, dst) in cases.items()], tmp_path, argv=ARGV)
    refs = {src: _reference(src, PROMPTS) for src in (moe, dense)}
    for name, (src, _) in cases.items():
        assert codes[name] == [0, 0], (name, codes[name])
        _check_dumps(tmp_path / "out-2", name, 2, refs[src], PROMPTS)
