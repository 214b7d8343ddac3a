"""gpt-oss shards run on two ranks (gloo) and give the single-process logits and tokens.

The split is vLLM's (vllm/model_executor/models/gpt_oss.py, ``GptOssModel.load_weights``;
`cvt.convert.arch.gpt_oss`): attention heads, KV heads and the per-head sinks over tp (o_proj
all-reduced, its bias added once), the router replicated, every fused experts tensor ``[E, ...]``
over ep by contiguous expert id ranges (each rank runs its experts on the tokens routed to them,
the world all-reduce sums them). The harness is test_distributed's.
"""

from __future__ import annotations

import json

import pytest

from cvt.convert.placement import make_layout
from cvt.convert.shard import shard
from cvt.testing.checkpoints import write_bf16_checkpoint
from cvt.testing.checkpoints_gpt_oss import tiny_gpt_oss_config
from cvt.runtime.tokenizer import load_tokenizer
from cvt.tests.conftest import run_cvt
from cvt.tests.runtime.test_distributed import _check_dumps, _reference, _spawn

PROMPTS = ["def __init__(self, config): return self.forward(x)", "MoE!"]  # 51 positions: past the window of 5
ARGV = [a for p in PROMPTS for a in ("--prompt", p)] + ["--max-new-tokens", "4", "--dtype", "fp32", "--device",
                                                        "cpu", "--quiet"]


@pytest.mark.slow  # a 2-rank gloo world of 3 cases, a w4a16 quantize, the references, a torchrun: ~1 min
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
    # the command line: `cvt run --procs 2` (torchrun) prints the single process's text
    tok = load_tokenizer(src, json.loads((src / "config.json").read_text()))
    r = run_cvt("run", cases["gptoss-tp2-ep2"][1], "--procs", 2, "--prompt", PROMPTS[1], "--max-new-tokens", 4,
                "--dtype", "fp32", "--device", "cpu", "--quiet", subprocess_=True)  # the ranks print to fd 1
    assert r.rc == 0, r.err
    assert r.out == tok.decode(refs[src][0][1]) + "\n"


def test_a_rank_holds_one_contiguous_range_of_the_fused_experts():
    """The local model's fused tensors are the rank's id range (rows e - first); any other set of
    ids (what a non-contiguous placement would give) is refused in one line."""
    import torch

    from cvt.runtime.models.base import ConfigError
    from cvt.runtime.models.gpt_oss import Args, Model

    args = Args.from_config(tiny_gpt_oss_config())
    with torch.device("meta"):
        moe = Model(args, experts={i: [3, 4, 5] for i in range(4)}).model.layers[1].mlp
    assert moe.experts.down_proj.shape == (3, 32, 64) and moe.experts.keys() == ["3", "4", "5"]
    with pytest.raises(ConfigError, match=r"^gpt-oss's fused experts are held as one contiguous id range per "
                                          r"rank, not \[0, 2, 4\]$"):
        Model(args, experts={i: [0, 2, 4] for i in range(4)}, device="meta")
