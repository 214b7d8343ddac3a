"""Per-byte cost of cvt's streaming stages: marginal throughput and CPU against the O_DIRECT floor.

Usage: .venv/bin/python bench/marginal.py [--dir DIR] [--repeat 2] [--layers 2 4]
       [--stages w8a8 w4a16 fp4 fp8-to-bf16 shard] [--base DIR]

Why: a whole run's time holds fixed costs that a 1 TB release never sees in proportion
(interpreter start and imports, ~0.4 s; planning; the embedding and head passed through), so on
a bench-sized release they hide the per-byte cost that decides a real conversion. Issue 29
measures it as the marginal throughput between two releases: here two synthetic DeepSeek-V3-
shaped FP8 releases (bench/fp8_to_bf16.py's `ds_config` / `build_checkpoint`: real V3 layer
shapes, 8 routed experts + 1 shared, a small vocab) that differ only in their number of MoE
layers (--layers A B). Every stage runs on both, and the differences are reported:

  marginal s    = best cvt seconds on B - best on A (the same for the O_DIRECT floor: read the
                  input once from the page cache, write the bytes cvt wrote, in files of the same
                  sizes, with O_DIRECT from aligned buffers, one thread per file, fsync; no
                  compute, no hashing: bench/common.py `direct_floor`);
  vs O_DIRECT   = floor's marginal s / cvt's (1x: cvt keeps up with the disk);
  CPU-s/GB in   = (cvt's user + sys seconds on B - on A) / (B's input bytes - A's), best of
                  --repeat each: the cost that carries to a machine with more cores and disks;
  peak RSS      = cvt's on B.

--base DIR runs the same commands with another checkout's cvt (PYTHONPATH=DIR), interleaved with
this tree's runs in the same minutes, and says whether its output safetensors are byte-identical
to this tree's. Make one with its C kernels built in place, e.g. for commit c1e4111:
  git worktree add --detach ../cvt-base c1e4111
  (cd ../cvt-base && "$OLDPWD/.venv/bin/python" -c 'from setuptools import setup; setup()' build_ext --inplace)
Every release is written and synced before the clock starts, page-cache warm for every run.
A report, not a test: exit 0 unless something crashes.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from common import direct_floor, load_fp8_bench, row_progress, run_cvt_cpu, scratch_dir  # bench/common.py

GB = 1e9
HERE = Path(__file__).resolve().parent
VOCAB = 4096  # the embedding and head are fixed costs here: small, so the releases are mostly layers
STAGES = {
    "w8a8": ["quantize", "--scheme", "w8a8"],
    "w4a16": ["quantize", "--scheme", "w4a16", "--group-size", "128"],
    "fp4": ["quantize", "--scheme", "fp4", "--fp4-format", "nvfp4"],
    "fp8-to-bf16": ["fp8-to-bf16"],
    "shard": ["shard", "--world-size", "4", "--tp", "4", "--ep", "4"],
}


def describe(tree: Path) -> str:
    out = subprocess.run(["git", "-C", str(tree), "describe", "--always", "--dirty"], capture_output=True, text=True)
    return out.stdout.strip() or "?"


def run_stage(stage: str, src: Path, dst: Path, tree: Path | None) -> tuple[float, float, int, list[int]]:
    """(wall s, CPU s, peak RSS, output .safetensors sizes) of one cvt run; `tree`: another
    checkout's cvt (PYTHONPATH) instead of this environment's."""
    verb, *opts = STAGES[stage]
    cmd = [sys.executable, "-m", "cvt", verb, str(src), str(dst), *opts, "--quiet"]
    old = os.environ.get("PYTHONPATH")
    if tree is not None:  # that checkout first, whatever else the path holds (its dependencies)
        os.environ["PYTHONPATH"] = os.pathsep.join([str(tree), *([old] if old else [])])
    try:
        t, rss, cpu = run_cvt_cpu(cmd, cwd=dst.parent)  # not the repo: `-m cvt` would import this tree's cvt
    finally:
        if tree is not None:
            if old is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = old
    return t, cpu, rss, [p.stat().st_size for p in sorted(dst.rglob("*.safetensors"))]


def digest(d: Path) -> list[tuple[str, str]]:
    out = []
    for p in sorted(d.rglob("*.safetensors")):
        h = hashlib.blake2b()
        with open(p, "rb") as f:
            while chunk := f.read(16 << 20):
                h.update(chunk)
        out.append((str(p.relative_to(d)), h.hexdigest()))
    return out


def kernels(tree: Path | None) -> str:
    """Which quantize / FP8 kernels that tree's cvt runs ("c" when its C kernels are built), and
    from where (so that a wrong tree on the path shows)."""
    code = ("from cvt.quant import qkernel; from cvt.convert import fp8; "
            "import os; print(qkernel.kernel_name(), fp8.kernel_name(), os.path.realpath(qkernel.__file__))")
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(tree), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd="/")
    if out.returncode != 0:
        return "?"
    q, f, where = out.stdout.strip().split(maxsplit=2)
    return f"{q} / {f}, from {where}"


def measure(stage: str, rels: dict[str, Path], root: Path, trees: dict[str, Path | None], repeat: int,
            bar) -> dict:
    """Best-of-`repeat` seconds / CPU per release for each tree and the floor, interleaved (the
    trees' order reversed every other repeat, so neither always runs first); peak RSS on B."""
    best: dict[tuple[str, str], list[float]] = {}
    rss: dict[str, int] = {}
    same: dict[str, bool] = {}
    for r in range(repeat):
        for rel, src in rels.items():
            src_files = sorted(src.glob("*.safetensors"))
            sizes = None
            outs: dict[str, Path] = {}
            for label, tree in (list(trees.items()) if r % 2 == 0 else list(trees.items())[::-1]):
                dst = root / f"out-{label}"
                t, cpu, peak, sizes_here = run_stage(stage, src, dst, tree)
                if label == "this":  # the floor writes this tree's output sizes
                    sizes = sizes_here
                for key, v in (("s", t), ("cpu", cpu)):
                    cur = best.setdefault((label, rel + key), [v])
                    cur[0] = min(cur[0], v)
                if rel == "B":
                    rss[label] = max(rss.get(label, 0), peak)
                outs[label] = dst
                bar.update(1)
            if r == 0 and rel == "B" and len(outs) > 1:
                mine = digest(outs["this"])
                same.update({label: digest(d) == mine for label, d in outs.items() if label != "this"})
            for d in outs.values():
                shutil.rmtree(d, ignore_errors=True)
            floor_dir = root / "floor"
            floor_dir.mkdir()
            d = direct_floor(src_files, floor_dir, sizes)
            shutil.rmtree(floor_dir, ignore_errors=True)
            if isinstance(d, str):
                raise SystemExit(f"bench/marginal.py: the O_DIRECT floor is the yardstick here, and {d}")
            cur = best.setdefault(("floor", rel + "s"), [sum(d)])
            cur[0] = min(cur[0], sum(d))
            bar.update(1)
    return {"best": {k: v[0] for k, v in best.items()}, "rss": rss, "same": same}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=scratch_dir, default=None, help="where the releases go (default: the system temp "
                    "dir); the disk a real run writes to")
    ap.add_argument("--repeat", type=int, default=2, help="best of N for every run and floor")
    ap.add_argument("--layers", type=int, nargs=2, default=[2, 4], metavar=("A", "B"),
                    help="MoE layers of the two releases (each ~0.58 GB of FP8)")
    ap.add_argument("--stages", nargs="+", choices=list(STAGES), default=list(STAGES))
    ap.add_argument("--base", type=Path, default=None, help="another checkout: its cvt runs the same commands")
    ap.add_argument("--keep", action="store_true", help="keep the releases")
    a = ap.parse_args()
    if a.layers[1] <= a.layers[0] or a.layers[0] < 1:
        raise SystemExit("bench/marginal.py: --layers A B needs 1 <= A < B")
    if a.repeat < 1:
        raise SystemExit("bench/marginal.py: --repeat must be at least 1")
    trees: dict[str, Path | None] = {"this": None}
    if a.base is not None:
        if not (a.base / "cvt" / "__init__.py").is_file():
            raise SystemExit(f"bench/marginal.py: --base {a.base}: not a cvt checkout (no cvt/__init__.py)")
        trees["base"] = a.base.resolve()
    fb = load_fp8_bench()
    print(fb.compile_bytecode())
    root = Path(tempfile.mkdtemp(prefix="cvt-bench-marginal-", dir=a.dir))
    try:
        rels, inb = {}, {}
        for rel, layers in zip("AB", a.layers):
            rels[rel] = root / f"src{rel}"
            rels[rel].mkdir()
            fb.build_checkpoint(rels[rel], fb.ds_config(layers, 8, VOCAB, dense=0))
            inb[rel] = sum(p.stat().st_size for p in rels[rel].glob("*.safetensors"))
        d_in = (inb["B"] - inb["A"]) / GB
        load0 = os.getloadavg()[0]
        bar = row_progress(len(a.stages) * a.repeat * 2 * (len(trees) + 1), "runs")
        res = {stage: measure(stage, rels, root, trees, a.repeat, bar) for stage in a.stages}
        bar.close()
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(f"\ncvt marginal cost per byte  ({os.cpu_count()} CPUs; this bench's checkout {describe(HERE.parent)}; "
          f"the cvt run (\"this\"): kernels "
          f"(quantize / fp8) {kernels(None)}" + (f"; base {a.base} at {describe(a.base)}, kernels {kernels(trees['base'])}"
                                               if a.base else "") + ")")
    print(f"releases: A {a.layers[0]} MoE layers, {inb['A'] / GB:.2f} GB; B {a.layers[1]} MoE layers, "
          f"{inb['B'] / GB:.2f} GB (8 routed experts + 1 shared, hidden 7168, vocab {VOCAB}); marginal input "
          f"{d_in:.2f} GB; best of {a.repeat}; page cache warm")
    head = f"{'stage':14}{'tree':6}{'cvt A s':>9}{'cvt B s':>9}{'marginal s':>11}{'O_DIRECT marg s':>16}" \
           f"{'vs O_DIRECT':>12}{'GB/s in':>9}{'CPU-s/GB in':>12}{'peak RSS':>10}{'same bytes':>11}"
    print(head)
    for stage, r in res.items():
        b = r["best"]
        floor = b[("floor", "Bs")] - b[("floor", "As")]
        for label in trees:
            m = b[(label, "Bs")] - b[(label, "As")]
            cpu = (b[(label, "Bcpu")] - b[(label, "Acpu")]) / d_in
            same = "" if label == "this" else ("yes" if r["same"].get(label) else "NO")
            # B no slower than A (or a floor that did not grow) is noise: more --layers or --repeat
            ratio, speed = (f"{floor / m:11.2f}x", f"{d_in / m:9.2f}") if m > 0 and floor > 0 else (f"{'noise':>12}", f"{'-':>9}")
            print(f"{stage:14}{label:6}{b[(label, 'As')]:9.2f}{b[(label, 'Bs')]:9.2f}{m:11.2f}{floor:16.2f}"
                  f"{ratio}{speed}{cpu:12.2f}{r['rss'][label] / GB:7.2f} GB{same:>11}")
    print("(marginal = B - A, the fixed costs cancelled; vs O_DIRECT = the floor's marginal s / cvt's; "
          "CPU-s/GB in = marginal user + sys seconds per marginal GB of input; same bytes: every output "
          ".safetensors of B identical to this tree's)")
    for stage in a.stages:
        verb, *opts = STAGES[stage]
        print(f"  {stage}: {sys.executable} -m cvt {verb} SRC DST {' '.join(opts)} --quiet")
    print(f"  (load average 1 min: {load0:.2f} before, {os.getloadavg()[0]:.2f} after; other work on the machine "
          "skews all rows)")


if __name__ == "__main__":
    main()
