"""Benchmark `cvt quantize`: RTN schemes against the IO floor, and the calibrated methods per layer.

Usage: .venv/bin/python bench/quantize.py [--size-gb 0.5] [--dir DIR] [--repeat 1]
       [--fixture DIR] [--keep]

Why: RTN quantize is a streaming stage like fp8-to-bf16 (read FP8, dequantize, quantize,
write, hash), so its yardstick is the same IO floor and its memory must stay flat whatever the
model size; the calibrated methods run the model layer by layer, so their cost is seconds per
decoder layer (times 61 for DeepSeek-V3) and the peak RSS of one layer plus activations.

Fixture (setup, not timed): bench/fp8_to_bf16.py's synthetic DeepSeek-V3-shaped FP8 release
(real V3 shapes, hidden 7168, tiled random FP8 bytes; imported from its path), sized to the
closest of --size-gb; below one dense + one MoE layer (1.17 GB) it is one MoE layer and no
dense one (0.58 GB). Input page-cache warm for every run (just written and synced).

Measured, in this one run, best of --repeat:
  a. per RTN scheme (w8a8; w4a16 group 128; fp4 nvfp4; compressed-tensors):
     `python -m cvt quantize SRC DST --scheme S --quiet` in a child process: wall time
     (interpreter start and imports included) and its peak RSS (os.wait4);
  b. the IO floor for that scheme's output: read every input byte, write as many bytes as
     cvt wrote in files of the same sizes, fsync per file (bench/fp8_to_bf16.py's io_floor);
     reported: GB/s of input, cvt's speed vs the floor, RSS vs the largest weight as float32
     (quantize materializes each weight as float32 [n, k] before quantizing it).
  c. calibrated methods (gptq w4a16 g32, awq w4a16 g32, smoothquant w8a8) on the demo model
     (write_fp8_release) and the trained fixture (--fixture, BF16, when present): the same CLI
     in a child, the per-layer seconds from the manifest's quant.calibration; wall time,
     calibration time, s / decoder layer, peak RSS. (bench/calibrate.py: RSS vs layer count.)
A report, not a test: exit 0 unless something crashes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

GB = 1e9
HERE = Path(__file__).resolve().parent
FIXTURE = Path("/work/shared/fixtures/tiny-dsv3-trained")
RTN = (("w8a8", []), ("w4a16", ["--group-size", "128"]), ("fp4", ["--fp4-format", "nvfp4"]))
# w4a16 group 32: the trained fixture's q_b_proj input is its q_lora_rank, 96
CALIBRATED = (("gptq", "w4a16", ["--group-size", "32"]), ("awq", "w4a16", ["--group-size", "32"]),
              ("smoothquant", "w8a8", []))


def calib_child(out: str, argv: list[str]) -> None:
    """Child mode: run the CLI, then record the calibration the manifest reports (the stage's
    streaming driver times every decoder layer: `quant.calibration.seconds_per_layer`)."""
    from cvt.cli import main as cli_main

    t0 = time.perf_counter()
    try:
        cli_main(argv)
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
    wall = time.perf_counter() - t0
    cal = json.loads((Path(argv[2]) / "cvt_manifest.json").read_text())["quant"]["calibration"]
    Path(out).write_text(json.dumps({"calibrate_s": sum(cal["seconds_per_layer"]), "wall_s": wall,
                                     "seconds_per_layer": cal["seconds_per_layer"]}))


def load_fp8_bench():
    spec = importlib.util.spec_from_file_location("bench_fp8_to_bf16", HERE / "fp8_to_bf16.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def plan(fb, size: float) -> dict:
    """fp8_to_bf16's plan_config, plus an all-MoE single layer for sizes below its minimum."""
    cfg = fb.plan_config(size)
    small = fb.ds_config(1, 8, cfg["vocab_size"], dense=0)
    return small if abs(fb.fp8_bytes(small) - size) < abs(fb.fp8_bytes(cfg) - size) else cfg


def largest_f32_weight(fb, cfg: dict) -> tuple[str, int]:
    w = max((s for s in fb.tensor_specs(cfg) if s.dtype == "F8_E4M3"), key=lambda s: math.prod(s.shape))
    return w.name, 4 * math.prod(w.shape)


def rtn_rows(fb, src: Path, root: Path, cfg: dict, repeat: int, keep: bool) -> list[tuple]:
    src_files = sorted(src.glob("*.safetensors"))
    rows = []
    for scheme, extra in RTN:
        best = None
        for r in range(repeat):
            with fb.scratch(root / f"{scheme}-{r}", keep) as dst:
                cmd = [sys.executable, "-m", "cvt", "quantize", str(src), str(dst), "--scheme", scheme, *extra,
                       "--quiet"]
                t, rss = fb.run_cvt(cmd)
                sizes = [p.stat().st_size for p in sorted(dst.glob("*.safetensors"))]
            with fb.scratch(root / f"floor-{scheme}-{r}", keep) as out:
                t_floor = sum(fb.io_floor(src_files, out, sizes))
            if best is None or t < best[1]:
                best = (scheme, t, rss, t_floor, sum(sizes), cmd)
            else:
                best = best[:3] + (min(best[3], t_floor),) + best[4:]
        rows.append(best)
    return rows


def calib_rows(models: dict[str, Path], root: Path) -> list[tuple]:
    rows = []
    for model, src in models.items():
        for method, scheme, extra in CALIBRATED:
            dst, rec = root / f"calib-{model}-{method}", root / f"calib-{model}-{method}.json"
            argv = ["quantize", str(src), str(dst), "--scheme", scheme, *extra, "--method", method, "--quiet"]
            cmd = [sys.executable, str(Path(__file__).resolve()), "--calib-child", str(rec), *argv]
            wall, rss = load_fp8_bench().run_cvt(cmd)
            info = json.loads(rec.read_text())
            rows.append((model, method, scheme, wall, info["calibrate_s"], info["seconds_per_layer"], rss, argv))
    return rows


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--calib-child":
        return calib_child(sys.argv[2], sys.argv[3:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=0.5, help="FP8 bytes of the synthetic release (GB)")
    ap.add_argument("--dir", help="where temp dirs go (default: the system temp dir); same disk as a real run")
    ap.add_argument("--repeat", type=int, default=1, help="best of N for the RTN runs and their floors")
    ap.add_argument("--fixture", default=str(FIXTURE), help="trained BF16 fixture (skipped when absent)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dirs")
    args = ap.parse_args()

    import shutil

    import torch

    from cvt.convert.synthetic import write_fp8_release

    fb = load_fp8_bench()
    load0 = os.getloadavg()[0]
    root = Path(tempfile.mkdtemp(prefix="cvt-bench-quantize-", dir=args.dir))
    try:
        src = root / "src"
        src.mkdir()
        cfg = plan(fb, args.size_gb * GB)
        t0 = time.perf_counter()
        specs = fb.build_checkpoint(src, cfg)
        t_build = time.perf_counter() - t0
        in_total = sum(p.stat().st_size for p in src.glob("*.safetensors"))
        fp8_total = sum(s.nbytes for s in specs if s.dtype == "F8_E4M3")
        big_name, big = largest_f32_weight(fb, cfg)
        rows = rtn_rows(fb, src, root, cfg, args.repeat, args.keep)
        shutil.rmtree(src, ignore_errors=True)
        models = {"demo": write_fp8_release(root / "demo")}
        fixture = Path(args.fixture)
        if (fixture / "config.json").is_file():
            models["trained"] = fixture
        crows = calib_rows(models, root)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)

    n_moe = cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    print(f"\ncvt quantize benchmark  (torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{os.cpu_count()} CPUs)")
    print(f"command:  {shlex.join([sys.executable, *sys.argv])}")
    print(f"input:    {cfg['num_hidden_layers']} layers ({cfg['first_k_dense_replace']} dense + {n_moe} MoE), "
          f"{cfg['n_routed_experts']} routed experts + 1 shared, vocab {cfg['vocab_size']}, "
          f"hidden {cfg['hidden_size']}: "
          f"{fp8_total / GB:.2f} GB FP8, {in_total / GB:.2f} GB on disk, {len(specs)} tensors "
          f"(written + synced in {t_build:.1f} s); page-cache warm; best of {args.repeat}")
    print(f"largest weight as float32: {big_name} {big / GB:.2f} GB")
    print(f"\n{'RTN, compressed-tensors':24}{'out GB':>8}{'cvt s':>8}{'floor s':>9}{'GB/s in':>9}"
          f"{'vs floor':>10}{'peak RSS':>10}{'RSS/largest':>13}")
    for scheme, t, rss, t_floor, out, _ in rows:
        print(f"  {scheme:22}{out / GB:8.2f}{t:8.2f}{t_floor:9.2f}{in_total / t / GB:9.3f}{t_floor / t:9.2f}x"
              f"{rss / GB:8.2f} GB{rss / big:12.1f}x")
    print("  (floor: read the input + write the same output bytes + fsync, no compute)")
    for *_, cmd in rows:
        print(f"  cvt run: {shlex.join(cmd[:4] + ['SRC', 'DST'] + cmd[6:])}")

    print(f"\n{'calibrated (built-in sample)':30}{'wall s':>8}{'calib s':>9}{'s/layer':>9}{'per layer s':>24}"
          f"{'peak RSS':>10}")
    for model, method, scheme, wall, cal, spl, rss, _ in crows:
        per = " ".join(f"{x:.2f}" for x in spl)
        print(f"  {model + ' ' + method + ' ' + scheme:28}{wall:8.2f}{cal:9.2f}{sum(spl) / len(spl):9.2f}"
              f"{per:>24}{rss / GB:7.2f} GB")
    print(f"  (demo = write_fp8_release, {FIXTURE.name} = --fixture; wall includes interpreter start, "
          "layer loads and writing; s/layer = mean of the manifest's quant.calibration.seconds_per_layer)")
    for model, method, scheme, *_, argv in crows[:len(CALIBRATED)]:
        print(f"  cvt run: {shlex.join([sys.executable, '-m', 'cvt', argv[0], 'SRC', 'DST', *argv[3:]])}")
    print(f"  (run through {shlex.join([sys.executable, 'bench/quantize.py', '--calib-child', 'JSON'])} + the "
          "same arguments: the CLI with calibrate() timed)")
    print(f"  (load average 1 min: {load0:.2f} before, {os.getloadavg()[0]:.2f} after; other work on the "
          "machine skews all rows)")
    if args.keep:
        print(f"\nkept: {root}")


if __name__ == "__main__":
    main()
