"""Benchmark `cvt quantize`: RTN schemes against the IO floor, and the calibrated methods per layer.

Usage: .venv/bin/python bench/quantize.py [--size-gb 0.5] [--dir DIR] [--repeat 1]
       [--fixture DIR] [--keep] [--rtn-only] [--no-reference] [--kernel-only]

Why: RTN quantize is a streaming stage like fp8-to-bf16 (read FP8, dequantize, quantize,
write, hash), so its yardstick is the same IO floor and its memory must stay flat whatever the
model size; the calibrated methods run the model layer by layer, so their cost is seconds per
decoder layer (times 61 for DeepSeek-V3) and the peak RSS of one layer plus activations.

Fixture (setup, not timed): bench/fp8_to_bf16.py's synthetic DeepSeek-V3-shaped FP8 release
(real V3 shapes, hidden 7168, tiled random FP8 bytes; imported from its path), sized to the
closest of --size-gb; below one dense + one MoE layer (1.17 GB) it is one MoE layer and no
dense one (0.58 GB). Input page-cache warm for every run (just written and synced).

Measured, in this one run, best of --repeat:
  a. per RTN scheme (w8a8; w4a16 group 128; fp4 nvfp4; compressed-tensors; then mxfp8, w4a4_mxfp4
     and w8a8 in the ascend format):
     `python -m cvt quantize SRC DST --scheme S --quiet` in a child process: wall time
     (interpreter start and imports included) and its peak RSS (os.wait4), with the fused
     kernels (`cvt.quant.qkernel`: the C kernel when built) and, unless --no-reference, again
     with CVT_QUANT_KERNEL=reference (the unfused torch path: float32 copies of each weight);
     and its CPU seconds (user + sys of its process) per GB of input;
  b. the two IO floors for that scheme's output (bench/common.py): read every input byte,
     write as many bytes as cvt wrote in files of the same sizes, fsync; buffered (page cache,
     file after file) and O_DIRECT (aligned buffers, one thread per file; skipped with the
     reason where the filesystem refuses O_DIRECT, e.g. tmpfs);
     reported: GB/s of input, cvt's speed vs each floor, peak RSS vs the largest weight as
     float32 and vs the memory budget (2 x the largest tensor in its source dtype + 1 GB);
     with --repeat N every repeat's seconds too (the floor swings 2-3x between runs on a VM);
  f. the fixed costs inside cvt's time: a child that starts python and imports what an RTN
     run imports (the CLI and the quantize stage; not torch, which the C-kernel path never
     imports), and the checksum's (BLAKE3) GB/s on one core, from memory and on 2 MB chunks in cache (each
     output file is hashed in order, files in parallel; written with O_DIRECT chunk by chunk as
     staged);
  k. the kernels alone on one large FP8 weight (in this process, best of 3): the fused C
     kernel (all cores, and one thread), the blockwise torch fallback and the reference
     (dequantize to float32, scheme.quantize, layout encode, SQNR), each checked bit-identical
     to the reference (--kernel-only runs just this part).
  c. calibrated methods (gptq w4a16 g32, awq w4a16 g32, smoothquant w8a8) on the demo model
     (write_fp8_release) and a trained BF16 checkpoint (--fixture DIR; without it those rows are
     skipped, and the report says so): the same CLI
     in a child, the per-layer seconds from the manifest's quant.calibration; wall time,
     calibration time, s / decoder layer, peak RSS. (bench/calibrate.py: RSS vs layer count.)
A report, not a test: exit 0 unless something crashes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

from common import direct_floor, load_fp8_bench, row_progress, run_cvt_cpu, scratch_dir  # bench/common.py

GB = 1e9
HERE = Path(__file__).resolve().parent
RTN = (("w8a8", []), ("w4a16", ["--group-size", "128"]), ("fp4", ["--fp4-format", "nvfp4"]),
       # Ascend 950's MX schemes straight from the FP8 release (issue 40 item 4), against ascend w8a8
       ("mxfp8", ["--format", "ascend"]), ("w4a4_mxfp4", ["--format", "ascend"]), ("w8a8", ["--format", "ascend"]))
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


def plan(fb, size: float) -> dict:
    """fp8_to_bf16's plan_config, plus an all-MoE single layer for sizes below its minimum."""
    cfg = fb.plan_config(size)
    small = fb.ds_config(1, 8, cfg["vocab_size"], dense=0)
    return small if abs(fb.fp8_bytes(small) - size) < abs(fb.fp8_bytes(cfg) - size) else cfg


def largest_f32_weight(fb, cfg: dict) -> tuple[str, int]:
    w = max((s for s in fb.tensor_specs(cfg) if s.dtype == "F8_E4M3"), key=lambda s: math.prod(s.shape))
    return w.name, 4 * math.prod(w.shape)


def largest_source_tensor(fb, cfg: dict) -> tuple[str, int]:
    s = max(fb.tensor_specs(cfg), key=lambda s: s.nbytes)
    return s.name, s.nbytes


def _run_env(fb, cmd: list[str], kernel: str) -> tuple[float, int, float]:
    old = os.environ.get("CVT_QUANT_KERNEL")
    os.environ["CVT_QUANT_KERNEL"] = kernel
    try:
        return run_cvt_cpu(cmd)
    finally:
        if old is None:
            del os.environ["CVT_QUANT_KERNEL"]
        else:
            os.environ["CVT_QUANT_KERNEL"] = old


def rtn_rows(fb, src: Path, root: Path, cfg: dict, repeat: int, keep: bool, reference: bool,
             spread: dict[str, list[float]], out_files: dict[str, list[int]]) -> list[tuple]:
    """Per scheme: (scheme, cvt s, peak RSS, floor s, out bytes, cmd, reference s, reference RSS, same bytes,
    O_DIRECT floor s or why skipped, cvt CPU s); every repeat's cvt and floor seconds go to `spread`, the
    output's file sizes to `out_files`. The floors and CPU are each the best over the repeats."""
    import hashlib

    def digest(d: Path) -> list[str]:
        return [hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.glob("*.safetensors"))]

    src_files = sorted(src.glob("*.safetensors"))
    rows = []
    bar = row_progress(len(RTN) * repeat, "RTN rows")
    for scheme, extra in RTN:
        label = scheme + (" ascend" if "ascend" in extra else "")  # w8a8 in both formats
        best = None
        for r in range(repeat):
            with fb.scratch(root / f"{label}-{r}", keep) as dst:
                cmd = [sys.executable, "-m", "cvt", "quantize", str(src), str(dst), "--scheme", scheme, *extra,
                       "--quiet"]
                t, rss, cpu = _run_env(fb, cmd, "")
                sizes = [p.stat().st_size for p in sorted(dst.glob("*.safetensors"))]
                out_files[label] = sizes
                fused = digest(dst) if reference and r == 0 else None
            t_ref = rss_ref = same = None
            if reference and r == 0:
                with fb.scratch(root / f"{label}-ref", keep) as dst:
                    t_ref, rss_ref, _ = _run_env(fb, cmd[:5] + [str(dst)] + cmd[6:], "reference")
                    same = digest(dst) == fused
            with fb.scratch(root / f"floor-{label}-{r}", keep) as out:
                t_floor = sum(fb.io_floor(src_files, out, sizes))
            with fb.scratch(root / f"direct-{label}-{r}", keep) as out:
                d = direct_floor(src_files, out, sizes)
                t_direct = d if isinstance(d, str) else sum(d)
            if best is None:
                best = (label, t, rss, t_floor, sum(sizes), cmd, t_ref, rss_ref, same, t_direct, cpu)
            else:
                if t < best[1]:
                    best = (label, t, rss, best[3], sum(sizes), cmd) + best[6:]
                od = best[9]
                best = best[:3] + (min(best[3], t_floor),) + best[4:9] + (
                    t_direct if isinstance(od, str) else min(od, t_direct), min(best[10], cpu))
            spread.setdefault("cvt " + label, []).append(t)
            spread.setdefault("floor " + label, []).append(t_floor)
            if not isinstance(t_direct, str):
                spread.setdefault("O_DIRECT floor " + label, []).append(t_direct)
            bar.update(1)
        rows.append(best)
    bar.close()
    return rows


KERNEL_CASES = (("w8a8", {}, "ct-int8"), ("w4a16", {"group_size": 128}, "ct-int4"),
                ("w4a16", {"group_size": 128, "symmetric": False}, "ct-int4"), ("fp4", {}, "ct-nvfp4"),
                ("fp4", {"fp4_format": "mxfp4"}, "ct-mxfp4"))


def kernel_rows(n: int = 7168, k: int = 2048, n_rep: int = 3) -> list[tuple]:
    """The fused kernels alone on one FP8 [n, k] weight (a routed expert's by default)."""
    import torch

    from cvt.quant import qkernel as QK
    from cvt.qtensor.layouts import LAYOUTS
    from cvt.qtensor.schemes import get_scheme
    from cvt.runtime.metrics import sqnr_db

    g = torch.Generator().manual_seed(1)
    u = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g)
    u[(u & 0x7F) == 0x7F] -= 1
    s = torch.rand(math.ceil(n / 128), math.ceil(k / 128), generator=g) * 2e-3 + 1e-4
    src = QK.WeightSource.fp8(u.view(torch.float8_e4m3fn), s, (128, 128))

    def best(fn, reps):
        out, t = None, math.inf
        for _ in range(reps):
            t0 = time.perf_counter()
            out = fn()
            t = min(t, time.perf_counter() - t0)
        return out, t

    def reference(sch, lo):
        w = src.rows_float(0, n)
        q = sch.quantize(w, name="w")
        return lo.encode(q), sqnr_db(w, sch.dequantize(q))

    def torch_fallback(sch, lo):
        os.environ["CVT_QUANT_KERNEL"] = "torch"
        QK._c_kernel.cache_clear()
        try:
            return QK.quantize_to_layout(src, sch, lo, name="w")
        finally:
            del os.environ["CVT_QUANT_KERNEL"]
            QK._c_kernel.cache_clear()

    def same(a: dict, b: dict) -> bool:
        return list(a) == list(b) and all(
            a[x].dtype == b[x].dtype and torch.equal(a[x].reshape(-1).view(torch.uint8), b[x].reshape(-1).view(torch.uint8))
            for x in a)

    rows = []
    for name, opts, layout in KERNEL_CASES:
        sch, lo = get_scheme(name, **opts), LAYOUTS.get(layout)
        (want, sq), t_ref = best(lambda: reference(sch, lo), 1)
        label = f"{name} {layout}" + ("" if opts.get("symmetric", True) else " asym")
        rows.append((label, "reference", t_ref, True, 0.0))
        runs = {"torch blocks": (lambda: torch_fallback(sch, lo), 1)}
        if QK.kernel_name() == "c":
            runs = {f"c ({os.cpu_count()} thr)": (lambda: QK.quantize_to_layout(src, sch, lo, name="w"), n_rep),
                    "c (1 thr)": (lambda: QK.quantize_to_layout(src, sch, lo, name="w", threads=1), n_rep), **runs}
        for kname, (fn, reps) in runs.items():
            res, t = best(fn, reps)
            rows.append((label, kname, t, same(res.tensors, want), abs(res.sqnr_db - sq)))
    return rows


def print_kernel_rows(rows, n: int, k: int) -> None:
    print(f"\nkernels alone, one FP8 [{n}, {k}] weight (in process, best of 3; GB/s of FP8 input)")
    print(f"  {'scheme / layout':26}{'kernel':14}{'s':>8}{'GB/s':>8}{'vs ref':>8}  {'bits':6}{'|dSQNR| dB':>11}")
    ref = {}
    for label, kname, t, ok, dsq in rows:
        ref.setdefault(label, t)
        print(f"  {label:26}{kname:14}{t:8.3f}{n * k / t / GB:8.2f}{ref[label] / t:7.1f}x  "
              f"{'same' if ok else 'DIFF':6}{dsq:11.1e}")


def calib_rows(models: dict[str, Path], root: Path) -> list[tuple]:
    rows = []
    bar = row_progress(len(models) * len(CALIBRATED), "calibrated rows")
    for model, src in models.items():
        for method, scheme, extra in CALIBRATED:
            dst, rec = root / f"calib-{model}-{method}", root / f"calib-{model}-{method}.json"
            argv = ["quantize", str(src), str(dst), "--scheme", scheme, *extra, "--method", method, "--quiet"]
            cmd = [sys.executable, str(Path(__file__).resolve()), "--calib-child", str(rec), *argv]
            wall, rss = load_fp8_bench().run_cvt(cmd)
            info = json.loads(rec.read_text())
            rows.append((model, method, scheme, wall, info["calibrate_s"], info["seconds_per_layer"], rss, argv))
            bar.update(1)
    bar.close()
    return rows


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--calib-child":
        return calib_child(sys.argv[2], sys.argv[3:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=0.5, help="FP8 bytes of the synthetic release (GB)")
    ap.add_argument("--dir", type=scratch_dir, help="where temp dirs go (default: the system temp dir); same disk as a real run")
    ap.add_argument("--repeat", type=int, default=1, help="best of N for the RTN runs and their floors")
    ap.add_argument("--fixture", help="a trained BF16 checkpoint directory: adds its calibrated rows (without it "
                                      "they are skipped, and the report says so)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dirs")
    ap.add_argument("--rtn-only", action="store_true", help="skip the calibrated methods")
    ap.add_argument("--no-reference", action="store_true", help="skip the unfused reference runs of the RTN schemes")
    ap.add_argument("--kernel-only", action="store_true", help="only the kernels on one large weight")
    ap.add_argument("--kernel-shape", default="7168x2048", help="that weight's [n, k] (default: a routed expert)")
    args = ap.parse_args()
    if args.fixture is not None and not (Path(args.fixture) / "config.json").is_file():
        ap.error(f"--fixture {args.fixture}: no config.json (a BF16 checkpoint directory is expected)")

    import shutil

    import torch

    from cvt.testing.checkpoints import write_fp8_release
    from cvt.quant.qkernel import kernel_name

    kn, kk = (int(x) for x in args.kernel_shape.lower().split("x"))
    if args.kernel_only:
        print(f"cvt quantize kernels (torch {torch.__version__}, {os.cpu_count()} CPUs, kernel {kernel_name()}; "
              f"load average {os.getloadavg()[0]:.2f})")
        print(f"command:  {shlex.join([sys.executable, *sys.argv])}")
        print_kernel_rows(kernel_rows(kn, kk), kn, kk)
        return
    fb = load_fp8_bench()
    bytecode = fb.compile_bytecode()
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
        src_name, src_big = largest_source_tensor(fb, cfg)
        spread: dict[str, list[float]] = {}
        out_files: dict[str, list[int]] = {}
        rows = rtn_rows(fb, src, root, cfg, args.repeat, args.keep, not args.no_reference, spread, out_files)
        # fixed costs no pipelining hides on a small release: start + imports, and hashing in order
        t_start, sha_gbs = fb.import_seconds("cvt.cli, cvt.quant.stage"), fb.checksum_rate() / GB
        sha_hot = fb.checksum_rate(2 << 20) / GB
        shutil.rmtree(src, ignore_errors=True)
        crows = []
        if not args.rtn_only:
            models = {"demo": write_fp8_release(root / "demo")}
            if args.fixture is not None:
                models["trained"] = Path(args.fixture)
            crows = calib_rows(models, root)
        krows = kernel_rows(kn, kk)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)

    n_moe = cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    print(f"\ncvt quantize benchmark  (torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{os.cpu_count()} CPUs; quantize kernel: {kernel_name()})")
    print(f"command:  {shlex.join([sys.executable, *sys.argv])}  ({bytecode})")
    print(f"input:    {cfg['num_hidden_layers']} layers ({cfg['first_k_dense_replace']} dense + {n_moe} MoE), "
          f"{cfg['n_routed_experts']} routed experts + 1 shared, vocab {cfg['vocab_size']}, "
          f"hidden {cfg['hidden_size']}: "
          f"{fp8_total / GB:.2f} GB FP8, {in_total / GB:.2f} GB on disk, {len(specs)} tensors "
          f"(written + synced in {t_build:.1f} s); page-cache warm; best of {args.repeat}")
    budget = 2 * src_big + GB
    print(f"largest weight as float32: {big_name} {big / GB:.2f} GB; largest tensor as stored: {src_name} "
          f"{src_big / GB:.2f} GB -> RSS budget 2 x {src_big / GB:.2f} + 1 = {budget / GB:.2f} GB")
    print(f"\n{'RTN, compressed-tensors':24}{'out GB':>8}{'cvt s':>8}{'buf floor':>10}{'vs buf':>8}"
          f"{'O_DIRECT floor':>15}{'vs O_DIRECT':>12}{'GB/s in':>9}{'CPU-s/GB in':>12}"
          f"{'peak RSS':>10}{'RSS/largest':>13}{'/budget':>9}"
          + ("" if args.no_reference else f"{'ref s':>8}{'ref RSS':>10}{'ref vs floor':>14}{'same bytes':>12}"))
    skipped = None
    for scheme, t, rss, t_floor, out, _, t_ref, rss_ref, same, t_direct, cpu in rows:
        if isinstance(t_direct, str):
            skipped, dcells = t_direct, f"{'skipped':>15}{'-':>12}"
        else:
            dcells = f"{t_direct:15.2f}{t_direct / t:11.2f}x"
        line = (f"  {scheme:22}{out / GB:8.2f}{t:8.2f}{t_floor:10.2f}{t_floor / t:7.2f}x{dcells}"
                f"{in_total / t / GB:9.3f}{cpu / (in_total / GB):12.2f}"
                f"{rss / GB:8.2f} GB{rss / big:12.1f}x{rss / budget:8.2f}x")
        if t_ref is not None:
            line += f"{t_ref:8.2f}{rss_ref / GB:7.2f} GB{t_floor / t_ref:13.2f}x{'yes' if same else 'NO':>12}"
        print(line)
    print("  (vs = cvt's speed as a multiple of that floor's, floor s / cvt s; both floors read the input and write "
          "the same output bytes + fsync, no compute, no hashing: buffered = through the page cache, file after "
          "file; O_DIRECT = the disk itself, aligned buffers, one thread per output file; CPU-s/GB in = cvt's "
          "user + sys seconds per GB of input"
          + (f"; O_DIRECT floor skipped: {skipped}" if skipped else "")
          + ("" if args.no_reference else "; ref: the same command with CVT_QUANT_KERNEL=reference, the unfused "
             "torch path; same bytes: every output .safetensors identical") + ")")
    for *_, cmd, _t, _r, _s, _d, _c in rows:
        print(f"  cvt run: {shlex.join(cmd[:4] + ['SRC', 'DST'] + cmd[6:])}")
    if args.repeat > 1:
        print("  every repeat, seconds: " + "; ".join(f"{k} {' '.join(f'{x:.2f}' for x in v)}" for k, v in spread.items()))
    print(f"  fixed costs inside cvt's time: python + cvt imports (no torch) {t_start:.2f} s; checksum (BLAKE3) on one core "
          f"{sha_gbs:.2f} GB/s from memory, {sha_hot:.2f} GB/s on 2 MB chunks in cache (how cvt hashes what it "
          f"stages for O_DIRECT), i.e. {max(max(v) for v in out_files.values()) / GB / sha_hot:.2f} s for the "
          f"largest output file (each file hashed in order on one thread; files per output: "
          f"{', '.join(f'{k} {len(v)}' for k, v in out_files.items())})")
    print_kernel_rows(krows, kn, kk)

    if crows:
        print_calib_rows(crows)
        if args.fixture is None:
            print("  (trained-model rows skipped: no --fixture DIR given)")
    elif args.rtn_only:
        print("\ncalibrated rows skipped: --rtn-only")
    print(f"  (load average 1 min: {load0:.2f} before, {os.getloadavg()[0]:.2f} after; other work on the "
          "machine skews all rows)")
    if args.keep:
        print(f"\nkept: {root}")


def print_calib_rows(crows) -> None:
    print(f"\n{'calibrated (built-in sample)':30}{'wall s':>8}{'calib s':>9}{'s/layer':>9}{'per layer s':>24}"
          f"{'peak RSS':>10}")
    for model, method, scheme, wall, cal, spl, rss, _ in crows:
        per = " ".join(f"{x:.2f}" for x in spl)
        print(f"  {model + ' ' + method + ' ' + scheme:28}{wall:8.2f}{cal:9.2f}{sum(spl) / len(spl):9.2f}"
              f"{per:>24}{rss / GB:7.2f} GB")
    print("  (demo = write_fp8_release, trained = --fixture; wall includes interpreter start, "
          "layer loads and writing; s/layer = mean of the manifest's quant.calibration.seconds_per_layer)")
    for model, method, scheme, *_, argv in crows[:len(CALIBRATED)]:
        print(f"  cvt run: {shlex.join([sys.executable, '-m', 'cvt', argv[0], 'SRC', 'DST', *argv[3:]])}")
    print(f"  (run through {shlex.join([sys.executable, 'bench/quantize.py', '--calib-child', 'JSON'])} + the "
          "same arguments: the CLI with calibrate() timed)")


if __name__ == "__main__":
    main()
