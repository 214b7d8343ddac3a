"""FP8 -> Ascend 950 MX throughput against w8a8 (issue 40 item 4's bar: MXFP8 within 10%).

Usage: .venv/bin/python bench/mx_ratio.py [--size-gb 0.5] [--rounds 7] [--one-core] [--dir DIR]

Why a bench of its own: the gap to measure (a few %) is smaller than the swings of a shared VM
between runs minutes apart, so bench/quantize.py's best-of-N per scheme, one scheme after the
other, cannot show it. Here the schemes alternate within each round (w8a8, mxfp8, w4a4_mxfp4,
then again), so a busy minute slows all of them alike, and the report is the median of each
with its range.

Fixture (not timed): bench/quantize.py's synthetic DeepSeek-V3-shaped FP8 block release (its
`plan`: 1.24 GB at the default size). Each run: `python -m cvt quantize SRC DST --scheme S
--format ascend --quiet` in a child (bench/common.py `run_cvt_cpu`): wall seconds and user + sys
CPU seconds. --one-core pins the children to one CPU (taskset -c 0): their wall time is then
their single-threaded cost, CPU-bound work and the disk no longer overlapping on other cores.
Reported: per scheme, median and range of both, and the throughput ratio to w8a8 (w8a8's median
over the scheme's). A report, not a test: exit 0 unless something crashes.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from common import load_fp8_bench, run_cvt_cpu, scratch_dir  # bench/common.py
from quantize import plan  # bench/quantize.py: the release's shape for a size

GB = 1e9
SCHEMES = ("w8a8", "mxfp8", "w4a4_mxfp4")


def rounds(src: Path, root: Path, n: int, one_core: bool) -> dict[str, list[tuple[float, float]]]:
    """Every scheme once per round, in SCHEMES order: (wall s, CPU s) per run."""
    out: dict[str, list[tuple[float, float]]] = {s: [] for s in SCHEMES}
    pin = ["taskset", "-c", str(min(os.sched_getaffinity(0)))] if one_core else []
    for _ in range(n):
        for s in SCHEMES:
            dst = root / f"out-{s}"
            cmd = pin + [sys.executable, "-m", "cvt", "quantize", str(src), str(dst), "--scheme", s,
                         "--format", "ascend", "--quiet"]
            wall, _, cpu = run_cvt_cpu(cmd)
            out[s].append((wall, cpu))
            shutil.rmtree(dst, ignore_errors=True)
    return out


def report(res: dict[str, list[tuple[float, float]]], gb_in: float) -> None:
    med = {s: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for s, v in res.items()}
    w0, c0 = med["w8a8"]
    print(f"  {'scheme (ascend)':18}{'wall median [range]':>24}{'CPU median [range]':>24}{'CPU-s/GB':>10}"
          f"{'vs w8a8 wall':>14}{'vs w8a8 CPU':>13}")
    for s, v in res.items():
        w, c = (sorted(x[i] for x in v) for i in (0, 1))
        print(f"  {s:18}{f'{med[s][0]:.2f} s [{w[0]:.2f}-{w[-1]:.2f}]':>24}{f'{med[s][1]:.2f} s [{c[0]:.2f}-{c[-1]:.2f}]':>24}"
              f"{med[s][1] / gb_in:>10.2f}{w0 / med[s][0]:>13.2f}x{c0 / med[s][1]:>12.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=0.5, help="FP8 bytes of the synthetic release (GB)")
    ap.add_argument("--rounds", type=int, default=7, help="rounds of every scheme, alternating")
    ap.add_argument("--one-core", action="store_true", help="pin the cvt runs to one CPU (single-threaded cost)")
    ap.add_argument("--dir", type=scratch_dir, help="where temp dirs go (default: the system temp dir)")
    args = ap.parse_args()
    fb = load_fp8_bench()
    load0 = os.getloadavg()[0]
    root = Path(tempfile.mkdtemp(prefix="cvt-bench-mx-", dir=args.dir))
    try:
        src = root / "src"
        src.mkdir()
        fb.build_checkpoint(src, plan(fb, args.size_gb * GB))
        gb_in = sum(p.stat().st_size for p in src.glob("*.safetensors")) / GB
        res = rounds(src, root, args.rounds, args.one_core)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"cvt quantize, FP8 release -> ascend MX vs w8a8: {gb_in:.2f} GB in, {args.rounds} alternating rounds, "
          f"{'one core' if args.one_core else f'{len(os.sched_getaffinity(0))} CPUs'}; "
          f"load average {load0:.2f} -> {os.getloadavg()[0]:.2f}")
    print(f"command:  {shlex.join([sys.executable, *sys.argv])}")
    report(res, gb_in)


if __name__ == "__main__":
    main()
