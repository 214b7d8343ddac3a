"""Benchmark `cvt shard` against the IO floor and a straightforward per-rank reference, in one run.

Usage: .venv/bin/python bench/shard.py [--experts 64] [--moe-inter 512] [--dir DIR] [--keep]
       [--layouts "4:tp=4,ep=4" "64:tp=8,ep=64"]

Fixture (setup, not timed): bench/fp8_to_bf16.py's synthetic DeepSeek-V3-shaped FP8 release
(real V3 attention shapes, hidden 7168, 128 heads; one MoE layer with --experts routed experts
of width --moe-inter, a shared expert, a 16K-row embedding and lm_head), imported from its path.
Input page-cache warm for every run (just written and synced).

Measured per layout, in this one run:
  a. cvt: `python -m cvt shard SRC DST --tp T --ep E --quiet` in a child process: wall time
     (interpreter start and imports included) and its peak RSS (os.wait4);
     and its CPU seconds (user + sys of its process) per GB of input;
  b. the two IO floors (bench/common.py): read every input byte once, then write as many bytes
     as cvt wrote, in files of the same sizes, fsync; buffered (page cache, file after file)
     and O_DIRECT (aligned buffers, one thread per file; skipped with the reason where the
     filesystem refuses O_DIRECT, e.g. tmpfs). Replicated tensors
     make the output larger than the input (attention under DP is on every rank);
  c. reference: the textbook loop - for each rank, for each tensor it holds, safetensors
     `get_slice` of its run, then `save_file` of the rank's dict, fsync. It re-reads the source
     once per rank (from the warm page cache here) and holds a whole rank in RAM.
Target (a report, not a test): cvt >= 0.8x a floor's speed, peak RSS a few tensors
whatever the world size. Exit 0 unless something crashes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from common import direct_floor, load_fp8_bench, run_cvt_cpu  # bench/common.py

HERE = Path(__file__).resolve().parent


def parse_layout(text: str) -> tuple[int, dict[str, int]]:
    world, _, rest = text.partition(":")
    kw = {k: int(v) for k, v in (p.split("=") for p in rest.split(",") if p)}
    return int(world), kw


def reference(src: Path, manifest: dict, out: Path) -> float:
    """Per rank: every held tensor's run via get_slice, one save_file per rank (module doc c)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    weight_map = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    sh = manifest["shard"]
    t0 = time.perf_counter()
    for r in sh["ranks"]:
        res = {}
        idx = json.loads((out.parent / "cvt" / r["dir"] / "model.safetensors.index.json").read_text())["weight_map"]
        for name in idx:
            ts = sh["tensors"][name]
            with safe_open(src / weight_map[name], "pt") as f:
                sl = f.get_slice(name)
                if ts["dim"] is None:
                    t = sl[:]
                else:
                    n = ts["shape"][ts["dim"]] // ts["degree"]
                    i = r["coords"][f"{ts['axis']}_rank"]
                    t = sl[i * n:(i + 1) * n] if ts["dim"] == 0 else sl[:, i * n:(i + 1) * n]
            res[name] = t.contiguous() if isinstance(t, torch.Tensor) else t
        path = out / f"rank-{r['rank']:05d}.safetensors"
        save_file(res, path, metadata={"format": "pt"})
        del res
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--moe-inter", type=int, default=512)
    ap.add_argument("--dir", type=Path, default=None, help="scratch folder (default: a temp dir)")
    ap.add_argument("--layouts", nargs="+", default=["4:tp=4,ep=4", "64:tp=8,ep=64"])
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    fb = load_fp8_bench()
    print(fb.compile_bytecode())
    from cvt.testing.checkpoints import tiny_deepseek_config

    cfg = tiny_deepseek_config(
        hidden_size=fb.H, intermediate_size=18432, moe_intermediate_size=a.moe_inter, num_attention_heads=128,
        num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, first_k_dense_replace=0, num_hidden_layers=1, n_routed_experts=a.experts,
        n_shared_experts=1, n_group=8, topk_group=4, num_experts_per_tok=8, num_nextn_predict_layers=0,
        vocab_size=16384, max_position_embeddings=163840)
    if a.dir is not None:
        a.dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="cvt-bench-shard-", dir=a.dir))
    try:
        src = root / "src"
        src.mkdir()
        fb.build_checkpoint(src, cfg)
        src_files = sorted(src.glob("*.safetensors"))
        in_bytes = sum(p.stat().st_size for p in src_files)
        print(f"fixture: {len(src_files)} files, {in_bytes / 1e9:.2f} GB "
              f"({a.experts} experts x {a.moe_inter} wide, 128 heads, hidden {fb.H})")
        print(f"{'layout':<22}{'out GB':>8}{'cvt s':>8}{'buf floor':>10}{'vs buf':>8}{'O_DIRECT floor':>15}"
              f"{'vs O_DIRECT':>12}{'ref s':>8}{'vs ref':>8}{'CPU-s/GB in':>12}{'RSS GB':>8}")
        skipped = None
        for text in a.layouts:
            world, kw = parse_layout(text)
            case = root / f"w{world}"
            case.mkdir()
            cmd = [sys.executable, "-m", "cvt", "shard", str(src), str(case / "cvt"), "--world-size", str(world),
                   *[x for k, v in kw.items() for x in (f"--{k.replace('_', '-')}", str(v))], "--quiet"]
            dt, rss, cpu = run_cvt_cpu(cmd)
            manifest = json.loads((case / "cvt" / "cvt_manifest.json").read_text())
            sizes = [f["size"] for f in manifest["files"] if f["path"].endswith(".safetensors")]
            floor_dir = case / "floor"
            floor_dir.mkdir()
            rd, wr = fb.io_floor(src_files, floor_dir, sizes)
            shutil.rmtree(floor_dir)
            floor_dir.mkdir()
            d = direct_floor(src_files, floor_dir, sizes)
            shutil.rmtree(floor_dir)
            ref_dir = case / "ref"
            ref_dir.mkdir()
            ref = reference(src, manifest, ref_dir)
            shutil.rmtree(ref_dir)
            floor = rd + wr
            if isinstance(d, str):
                skipped, dcells = d, f"{'skipped':>15}{'-':>12}"
            else:
                dcells = f"{sum(d):>15.2f}{sum(d) / dt:>11.2f}x"
            print(f"{text:<22}{sum(sizes) / 1e9:>8.2f}{dt:>8.2f}{floor:>10.2f}{floor / dt:>7.2f}x{dcells}"
                  f"{ref:>8.2f}{ref / dt:>7.2f}x{cpu / (in_bytes / 1e9):>12.2f}{rss / 1e9:>8.2f}")
            if not a.keep:
                shutil.rmtree(case)
        print("(vs = cvt's speed as a multiple of that floor's or the reference's, their s / cvt s; buffered floor ="
              " read input + write the same bytes through the page cache + fsync; O_DIRECT floor = the disk itself,"
              " aligned buffers, one thread per output file; CPU-s/GB in = cvt's user + sys per GB of input"
              + (f"; O_DIRECT floor skipped: {skipped}" if skipped else "") + ")")
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
