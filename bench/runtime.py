"""Benchmark cvt's runtime: generation speed per weight format, and what `verify` costs.

Usage: .venv/bin/python bench/runtime.py [--repeat 3] [--fixture DIR] [--dir DIR] [--keep]

Why: `cvt run` / `cvt verify` execute every format cvt writes with its own CPU kernels
(quantized linears dequantize or run int8 matmuls on the fly), so a format that is much slower
than BF16 makes checking a conversion expensive; and `verify` should cost little more than the
two forward passes it cannot avoid (reference and candidate on the same tokens).

Models (setup, not timed): the demo model (`cvt.testing.checkpoints.write_fp8_release`: a tiny
DeepSeek-V3, 3 layers incl. MoE, hidden 256, random weights) in five formats:
  bf16    `fp8_to_bf16` output            fp8     the FP8 block release, dequantized on load
  w8a8    quantize RTN, compressed-tensors  w4a16 quantize RTN, group 128
  fp4     quantize RTN, nvfp4
plus a trained checkpoint (plain HF BF16, --fixture DIR) when given; without it its rows are
skipped, and the report says so.

Measured, all in this one run, torch's default thread count, CPU:
  a. `generate(model, prompts, 32)` with bf16 activations (`load_model(dtype=bfloat16)`) on
     random 64-token prompts (byte ids < 256), batch 1 and 4, greedy; one warm-up call, then best of --repeat
     for prefill tokens/s (batch x 64 tokens / first forward) and decode tokens/s; rounds
     interleave the formats so that bursts of other load hit them alike.
  b. `verify(candidate, reference=bf16)` end to end (loads both models in float32, two
     forwards with hidden states, metrics, report.json/md/html) vs the bare cost: the same two
     models, freshly loaded in float32, each running `model(tokens)` once on the exact token
     batch verify uses (seq_len 64, 4 sequences; no warm-up, like verify's). The ratio is
     verify's overhead; model loading is timed separately to show where it goes. Best of
     --repeat interleaved rounds each.
A report, not a test: exit 0 unless something crashes.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from cvt.convert.fp8_to_bf16 import fp8_to_bf16
from cvt.testing.checkpoints import write_fp8_release
from cvt.quant.stage import quantize
from cvt.runtime.generate import generate
from cvt.runtime.loader import load_model
from cvt.runtime.tokenizer import load_tokenizer
from cvt.runtime.verify import _batches, verify

from common import row_progress, scratch_dir  # bench/common.py
PROMPT, NEW, BATCHES = 64, 32, (1, 4)
VERIFY_SEQ, VERIFY_SEQS = 64, 4


def build_formats(root: Path) -> dict[str, tuple[Path, str]]:
    """name -> (checkpoint dir, how it was made)."""
    ct = "compressed-tensors"
    quants = (("w8a8", {"scheme": "w8a8"}, f"quantize w8a8 rtn, {ct}"),
              ("w4a16", {"scheme": "w4a16"}, f"quantize w4a16 rtn g128, {ct}"),
              ("fp4", {"scheme": "fp4", "fp4_format": "nvfp4"}, f"quantize fp4 rtn nvfp4, {ct}"))
    with row_progress(2 + len(quants), "build formats") as bar:
        src = write_fp8_release(root / "fp8")
        bar.update(1)
        out = {"bf16": (root / "bf16", "fp8_to_bf16"), "fp8": (src, "FP8 block release, dequantized on load")}
        fp8_to_bf16(src, root / "bf16", quiet=True)
        bar.update(1)
        for name, kw, how in quants:
            quantize(src, root / name, fmt=ct, method="rtn", quiet=True, **kw)
            out[name] = (root / name, how)
            bar.update(1)
    return out


def gen_speeds(models: dict[str, Path], repeat: int) -> dict[str, dict[int, tuple[float, float]]]:
    """name -> batch -> (best prefill tokens/s, best decode tokens/s). Rounds interleave the
    formats, so a burst of other load on the machine hits them all alike."""
    with row_progress(len(models) * (1 + len(BATCHES) * (1 + repeat)), "generate: load, warm-up, rounds") as bar:
        loaded = {}
        for name, path in models.items():
            loaded[name] = load_model(path, dtype=torch.bfloat16).model
            bar.update(1)
        g = torch.Generator().manual_seed(0)
        prompts = {b: torch.randint(0, 256, (b, PROMPT), generator=g).tolist() for b in BATCHES}
        for model in loaded.values():
            for b in BATCHES:
                generate(model, prompts[b], 4)  # warm-up: first-call allocations and kernel selection
                bar.update(1)
        res = {name: {b: (0.0, 0.0) for b in BATCHES} for name in models}
        for _ in range(repeat):
            for name, model in loaded.items():
                for b in BATCHES:
                    r = generate(model, prompts[b], NEW)
                    old = res[name][b]
                    res[name][b] = (max(old[0], r.prefill_tokens_per_s), max(old[1], r.decode_tokens_per_s))
                    bar.update(1)
    return res


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def verify_costs(pairs: dict[str, tuple[Path, Path]], reports: Path, repeat: int) -> dict[str, list[float]]:
    """name -> [verify s, 2 bare forwards s, load both s], each the best of `repeat` interleaved rounds."""
    best = {name: [float("inf")] * 3 for name in pairs}
    bar = row_progress(repeat * len(pairs), "verify vs bare forwards")
    for _ in range(repeat):
        for name, (cand, ref) in pairs.items():
            t_verify = timed(lambda: verify(cand, ref, reports / name.replace(" ", "-"), seq_len=VERIFY_SEQ,
                                            max_sequences=VERIFY_SEQS))
            t0 = time.perf_counter()
            r, c = load_model(ref, dtype=torch.float32), load_model(cand, dtype=torch.float32)
            t_load = time.perf_counter() - t0
            tokens, _ = _batches(load_tokenizer(r.checkpoint_path, r.config), None, VERIFY_SEQ, VERIFY_SEQS,
                                 r.model.max_positions)
            with torch.no_grad():
                t_fwd = timed(lambda: (r.model(tokens), c.model(tokens)))  # cold, as verify's own are
            best[name] = [min(a, b) for a, b in zip(best[name], (t_verify, t_fwd, t_load))]
            bar.update(1)
    bar.close()
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="best of N for every timed row")
    ap.add_argument("--fixture", help="a trained BF16 checkpoint directory: adds its rows (without it they are "
                                      "skipped, and the report says so)")
    ap.add_argument("--dir", type=scratch_dir, help="where the temp dir goes (default: the system temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (checkpoints and verify reports)")
    args = ap.parse_args()
    if args.fixture is not None and not (Path(args.fixture) / "config.json").is_file():
        ap.error(f"--fixture {args.fixture}: no config.json (a BF16 checkpoint directory is expected)")

    load0 = os.getloadavg()[0]
    root = Path(tempfile.mkdtemp(prefix="cvt-bench-runtime-", dir=args.dir))
    try:
        t0 = time.perf_counter()
        models = build_formats(root)
        t_build = time.perf_counter() - t0
        if args.fixture is not None:
            models["trained bf16"] = (Path(args.fixture), f"{args.fixture} (plain HF BF16)")
        speeds = gen_speeds({name: path for name, (path, _) in models.items()}, args.repeat)
        ref = models["bf16"][0]  # the trained fixture is checked against itself
        pairs = {name: (path, path if name == "trained bf16" else ref) for name, (path, _) in models.items()}
        costs = verify_costs(pairs, root / "reports", args.repeat)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)

    print(f"\ncvt runtime benchmark  (torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{os.cpu_count()} CPUs; best of {args.repeat})")
    print(f"command:  {shlex.join([sys.executable, *sys.argv])}")
    print(f"models:   the demo DeepSeek-V3 (write_fp8_release, random weights; built in {t_build:.1f} s)"
          + (" and the trained checkpoint of --fixture:" if args.fixture else ":"))
    for name, (path, how) in models.items():
        print(f"  {name:13} {how}")
    if args.fixture is None:
        print("  (trained bf16 rows skipped: no --fixture DIR given)")
    print(f"\ngenerate: {PROMPT}-token random prompts, {NEW} new tokens, greedy, bf16 activations, CPU")
    head = "".join(f"{f'b{b} prefill':>12}{f'b{b} decode':>11}" for b in BATCHES)
    print(f"  {'format':14}{head}{'decode b1 vs bf16':>19}   (tokens/s)")
    base = speeds["bf16"][1][1]
    for name, sp in speeds.items():
        cells = "".join(f"{sp[b][0]:12.0f}{sp[b][1]:11.1f}" for b in BATCHES)
        print(f"  {name:14}{cells}{sp[1][1] / base:18.2f}x")
    print(f"\nverify vs two bare forward passes ({VERIFY_SEQS} x {VERIFY_SEQ} tokens of the built-in sample, float32; "
          "reference: demo bf16)")
    print(f"  {'candidate':14}{'verify s':>10}{'2 forwards s':>14}{'ratio':>9}{'load both s':>13}{'rest s':>9}")
    for name, (tv, tf, tl) in costs.items():
        print(f"  {name:14}{tv:10.3f}{tf:14.3f}{tv / tf:8.1f}x{tl:13.3f}{max(0.0, tv - tf - tl):9.3f}")
    print("  (rest = verify - forwards - loads: hidden-state capture, metrics, weight SQNR, report files; "
          "trained bf16 is verified against itself)")
    print(f"  (load average 1 min: {load0:.2f} before, {os.getloadavg()[0]:.2f} after; other work on the "
          "machine skews all rows)")
    if args.keep:
        print(f"\nkept: {root}")


if __name__ == "__main__":
    main()
