"""gpt-oss shards run on two ranks (gloo) and give the single-process logits and tokens.

The split is vLLM's (vllm/model_executor/models/gpt_oss.py, ``GptOssModel.load_weights``;
`cvt.convert.arch.gpt_oss`): attention heads, KV heads and the per-head sinks over tp (o_proj
all-reduced, its bias added once), the router replicated, every fused experts tensor ``[E, ...]``
over ep by contiguous expert id ranges (each rank runs its experts on the tokens routed to them,
the world all-reduce sums them). The harness is test_distributed's.
"""

from __future__ import annotations

import pytest

from cvt.convert.placement import make_layout
from cvt.convert.shard import shard
from cvt.testing.checkpoints import write_bf16_checkpoint
from cvt.testing.checkpoints_gpt_oss import tiny_gpt_oss_config
from cvt.tests.runtime.test_distributed import _check_dumps, _reference, _spawn

PROMPTS = ["def __init__(self, config): return self.forward(x)", "MoE!"]  # 51 positions: past the window of 5
ARGV = [a for p in PROMPTS for a in ("--prompt", p)] + ["--max-new-tokens", "4", "--dtype", "fp32", "--device",
                                                        "cpu", "--quiet"]


@pytest.mark.slow  # a 2-rank gloo world of 3 cases, a w4a16 quantize and the references: ~40 s on 2 cores
def test_two_ranks_match_one_process(tmp_path):
    from cvt.quant.stage import quantize

    src = write_bf16_checkpoint(tmp_path / "bf16", tiny_gpt_oss_config(vocab_size=300))
    w4 = tmp_path / "w4a16"    # attention weight-only int4 (exact per rank), the fused experts float
    quantize(src, w4, scheme="w4a16", fmt="compressed-tensors", group_size=16, quiet=True)
    layouts = {
        # heads 4 -> 2, KV heads 2 -> 1, sinks 4 -> 2 per rank; experts 0-2 on rank 0, 3-5 on rank 1
        "gptoss-tp2-ep2": (src, make_layout(2, tp=2, ep=2)),
        # attention replicated (dp 2), experts split
        "gptoss-dp2-ep2": (src, make_layout(2, tp=1, ep=2)),
        "gptoss-w4a16-tp2-ep2": (w4, make_layout(2, tp=2, ep=2)),
    }
    cases = {name: (s, shard(s, tmp_path / name, layout, quiet=True).dst) for name, (s, layout) in layouts.items()}
    codes = _spawn(2, [(n, dst) for n, (_, dst) in cases.items()], tmp_path, argv=ARGV)
    refs = {s: _reference(s, PROMPTS) for s in (src, w4)}
    for name, (s, _) in cases.items():
        assert codes[name] == [0, 0], (name, codes[name])
        # 1e-5 of the largest logit (~3.7 here): the ranks sum o_proj's product and the MoE output
        # in two halves (all-reduce), a reassociation of float32 sums and nothing else; measured up
        # to 2.5e-6 (6.7e-7 of the largest logit) over the greedy steps
        top = max(float(t.abs().max()) for t in refs[s][1])
        _check_dumps(tmp_path / "out-2", name, 2, refs[s], PROMPTS, atol=1e-5 * top)
