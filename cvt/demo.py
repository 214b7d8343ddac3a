"""`cvt demo`: every stage that exists, on a tiny DeepSeek-V3-style FP8 checkpoint.

Builds the checkpoint with `cvt.convert.synthetic` (random weights; one dense layer, two
MoE layers, an MTP layer, dims that are not multiples of 128, scales split across shards),
then runs the stages in pipeline order. Grows as stages land.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

from cvt.errors import OutputError


def run_demo(directory, quiet: bool = False, echo: Callable[[str], None] = print) -> dict[str, Path]:
    from cvt.convert.fp8_to_bf16 import fp8_to_bf16
    from cvt.convert.inspect import inspect_checkpoint
    from cvt.convert.synthetic import write_fp8_release

    root = Path(directory)
    if root.exists() and any(root.iterdir()) and not (root / ".cvt-demo").exists():
        raise OutputError(f"{root}: exists and is not a cvt demo directory; choose another DIR")
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    (root / ".cvt-demo").write_text("written by cvt demo; safe to delete\n")
    out = {"fp8": root / "source-fp8", "bf16": root / "bf16"}

    say = (lambda s: None) if quiet else echo
    say(f"[1/6] writing a tiny DeepSeek-V3-style FP8 release to {out['fp8']}")
    write_fp8_release(out["fp8"])
    say(inspect_checkpoint(out["fp8"]).render())

    say(f"\n[2/6] cvt fp8-to-bf16 {out['fp8']} {out['bf16']}")
    r = fp8_to_bf16(out["fp8"], out["bf16"], quiet=True)
    say(f"dequantized {r.extra['dequantized']} tensors, passed {r.extra['passed_through']} through, "
        f"{r.bytes_out} bytes in {len(r.files)} files")
    say(inspect_checkpoint(out["bf16"]).render())

    say(f"\n[3/6] cvt run {out['bf16']} --prompt 'Hello' --max-new-tokens 8   (random weights: the text is noise)")
    import torch

    from cvt.runtime.generate import generate
    from cvt.runtime.loader import load_model
    from cvt.runtime.tokenizer import load_tokenizer
    from cvt.runtime.verify import verify

    loaded = load_model(out["bf16"], dtype=torch.float32)
    tok = load_tokenizer(loaded.checkpoint_path, loaded.config)
    gen = generate(loaded.model, [tok.encode("Hello")], 8)
    say(f"generated ids {gen.outputs[0]}, decode {gen.decode_tokens_per_s:.1f} tokens/s")
    del loaded

    out["report"] = root / "verify-report"
    say(f"\n[4/6] cvt verify {out['fp8']} --reference {out['bf16']} --report {out['report']}")
    v = verify(out["fp8"], out["bf16"], out["report"], seq_len=32, max_sequences=2).report
    worst = min(row.cosine for row in v.layers)
    say(f"FP8 dequantized on load vs the BF16 output: min layer cosine {worst:.6f}, mean KL {v.logits.kl_mean:.3g}, "
        f"same top-1 {v.logits.same_top1:.0%} -> {'identical' if v.logits.kl_mean == 0 else 'differs'}")

    from cvt.quant.stage import quantize

    out["w4a16"] = root / "w4a16-compressed-tensors"
    say(f"\n[5/6] cvt quantize {out['fp8']} {out['w4a16']} --scheme w4a16 --format compressed-tensors")
    q = quantize(out["fp8"], out["w4a16"], scheme="w4a16", fmt="compressed-tensors", quiet=True)
    say(f"quantized {q.extra['quantized']} linears from the FP8 release (dequantized on the fly), "
        f"{q.extra['float_modules']} kept float; worst SQNR {q.extra['min_sqnr_db']}")
    out["w8a8"] = root / "w8a8-ascend"
    q = quantize(out["bf16"], out["w8a8"], scheme="w8a8", fmt="ascend", quiet=True)
    say(f"cvt quantize {out['bf16']} {out['w8a8']} --scheme w8a8 --format ascend: {q.extra['quantized']} linears, "
        f"worst SQNR {q.extra['min_sqnr_db']}")

    say(f"\n[6/6] cvt verify, each quantized model against {out['bf16']} (random weights: a smoke test)")
    for key in ("w4a16", "w8a8"):
        out[f"report-{key}"] = root / f"verify-{key}"
        v = verify(out[key], out["bf16"], out[f"report-{key}"], seq_len=32, max_sequences=2).report
        say(f"{key}: min layer cosine {min(row.cosine for row in v.layers):.4f}, PPL ratio {v.logits.ppl_ratio:.3f}, "
            f"mean KL {v.logits.kl_mean:.3g}, same top-1 {v.logits.same_top1:.0%}  ({out[f'report-{key}']}/report.html)")

    say("\noutputs:")
    for key, path in out.items():
        say(f"  {key:<13} {path}")
    return out
