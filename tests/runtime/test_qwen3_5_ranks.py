"""Qwen3.5 / Qwen3.5-MoE / Qwen3-Next shards run on two ranks (gloo) and give the single-process
logits and tokens.

The full-attention layers split their heads over tp (o_proj all-reduced); the Gated DeltaNet
layers split their key and value heads over tp as vLLM does (in_proj q | k | v rows, the conv,
A_log / dt_bias per rank; out_proj all-reduced; `cvt.convert.arch.qwen3_5` (2)); the routed
experts split over ep, the gated shared expert whole. The harness is test_distributed's.
"""

from __future__ import annotations

import pytest

from cvt.convert.placement import make_layout
from cvt.convert.shard import shard
from cvt.testing.checkpoints import write_bf16_checkpoint
from cvt.testing.checkpoints_qwen3_5 import tiny_qwen3_5_config, tiny_qwen3_next_config
from cvt.tests.runtime.test_distributed import _check_dumps, _reference, _spawn

PROMPTS = ["def __init__(self, config): return self.forward(x)", "MoE!"]
ARGV = [a for p in PROMPTS for a in ("--prompt", p)] + ["--max-new-tokens", "4", "--dtype", "fp32", "--device",
                                                        "cpu", "--quiet"]


@pytest.mark.slow  # a 2-rank gloo world of 4 cases, and the single-process reference: ~1 min on 2 cores
def test_two_ranks_match_one_process(tmp_path):
    moe = write_bf16_checkpoint(tmp_path / "moe", tiny_qwen3_5_config(vocab_size=300))
    dense = write_bf16_checkpoint(tmp_path / "dense", tiny_qwen3_5_config(moe=False, vocab_size=300))
    nxt = write_bf16_checkpoint(tmp_path / "next", tiny_qwen3_next_config(vocab_size=300))
    layouts = {
        # full-attention heads, KV heads and linear-attention heads / 2 (o_proj, out_proj all-reduced),
        # experts over 2 EP ranks
        "qwen35-moe-tp2-ep2": (moe, make_layout(2, tp=2, ep=2)),
        # attention replicated (dp 2), every expert and the shared expert split moe_tp 2 ways
        "qwen35-moe-moetp2": (moe, make_layout(2, tp=1, ep=1, moe_tp=2)),
        # ... the shared expert whole on rank 0
        "qwen35-moe-moetp2-replicated": (moe, make_layout(2, tp=1, ep=1, moe_tp=2, shared_experts="replicated")),
        "qwen35-dense-tp2": (dense, make_layout(2, tp=2)),
        "qwen3next-tp2-ep2": (nxt, make_layout(2, tp=2, ep=2)),
    }
    cases = {name: (src, shard(src, tmp_path / name, layout, quiet=True).dst) for name, (src, layout) in layouts.items()}
    codes = _spawn(2, [(n, dst) for n, (_, dst) in cases.items()], tmp_path, argv=ARGV)
    refs = {src: _reference(src, PROMPTS) for src in (moe, dense, nxt)}
    for name, (src, _) in cases.items():
        assert codes[name] == [0, 0], (name, codes[name])
        # 2e-5 of the largest logit (~7.5 here): the ranks sum each row-parallel product (o_proj, the
        # linear attention's out_proj, down_proj) in two halves; that reassociation alone moves these
        # logits by up to 7.6e-5 in one process (measured), 1.1e-4 after the greedy steps
        top = max(float(t.abs().max()) for t in refs[src][1])
        _check_dumps(tmp_path / "out-2", name, 2, refs[src], PROMPTS, atol=max(1e-4, 2e-5 * top))
