"""Benchmark `cvt fp8-to-bf16` against the IO floor and the naive reference, in one run.

Usage: .venv/bin/python bench/fp8_to_bf16.py [--size-gb 2] [--dir DIR] [--workers N]
       [--max-shard-size 5GB] [--repeat 1] [--skip-reference-e2e] [--keep]

Fixture (setup, not timed): a synthetic DeepSeek-V3-shaped FP8 release of about --size-gb GB
of FP8 weights, built from cvt's own DeepSeek-V3 table so every name is real and consistent
with config.json: hidden 7168, real MLA shapes (kv_a_proj_with_mqa 576x7168 has partial edge
blocks), one dense layer, MoE layers with 2048-wide routed + shared experts, BF16 norms,
router and embeddings, F32 e_score_correction_bias. Layer and expert counts are chosen to
hit the size; the vocab is scaled down for small sizes but the embedding (and lm_head) stay
the largest tensors. Input shards of 1-4 GB with an index. FP8 bytes are a tiled random pool
with the NaN codes 0x7F/0xFF removed; scales are random positive float32.

Measured, on the same files, with the input page-cache warm for all three (it was just
written and synced; nothing is dropped), best of --repeat:
  a. cvt end to end: `python -m cvt fp8-to-bf16 SRC DST --quiet` in a child process; wall
     time (interpreter start and imports included) and the child's peak RSS (os.wait4).
  b. the two IO floors (bench/common.py), each: read every input byte (readinto one buffer),
     then write as many bytes as cvt wrote, in files of the same sizes, fsync. No hashing, no
     compute. Buffered: through the page cache, file after file. O_DIRECT (the disk itself):
     page-aligned mmap buffers, one thread per output file; skipped, with the reason printed,
     where the filesystem refuses O_DIRECT (tmpfs). Also cvt's CPU seconds (user + sys of its
     process) per GB of input.
  c. reference end to end: per input shard safetensors load_file, the textbook dequant
     (full-size scale expansion), save_file per shard, fsync.
  d. kernels in memory on 7168x2048 and 576x7168: cvt's C kernel and torch fallback vs the
     reference expression; best of 5; outputs must be bit-identical.
Targets (a report, not a test; exit 0 unless something crashes): cvt >= 0.8x a floor's
speed, kernel >= 5x the reference, cvt peak RSS <= 2 x largest tensor + 1 GB.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import shlex
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from cvt.convert.arch import arch_for
from cvt.convert.fp8 import _dequant_torch, dequant_fp8_block, kernel_name
from cvt.convert.safetensors_io import TensorSpec, encode_header
from cvt.testing.checkpoints import tiny_deepseek_config, write_side_files

from common import direct_floor, floor_cells, io_floor, row_progress, run_cvt_cpu, scratch_dir  # bench/common.py

GB = 1e9
H, REAL_VOCAB = 7168, 129280
POOL = 64 << 20  # random bytes tiled into every FP8 / BF16 tensor


def ds_config(moe_layers: int, experts: int, vocab: int, dense: int = 1) -> dict:
    # cvt refuses n_group that leaves < 2 experts per group: 8 experts get 4 groups
    return tiny_deepseek_config(
        hidden_size=H, intermediate_size=18432, moe_intermediate_size=2048, num_attention_heads=128,
        num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, first_k_dense_replace=dense, num_hidden_layers=dense + moe_layers, n_routed_experts=experts,
        n_shared_experts=1, n_group=8 if experts >= 16 else 4, topk_group=4, num_experts_per_tok=8,
        num_nextn_predict_layers=0, vocab_size=vocab, max_position_embeddings=163840)


def tensor_specs(cfg: dict) -> list[TensorSpec]:
    """Every tensor of the release in file order: FP8 weight followed by its F32 scale."""
    arch = arch_for(cfg)
    out = []
    for name, shape in arch.table.param_shapes(arch.config).items():
        info = arch.classify(name)
        if info.rule.quantizable and info.param == "weight":
            out += [TensorSpec(name, "F8_E4M3", shape),
                    TensorSpec(name + "_scale_inv", "F32", tuple(math.ceil(d / 128) for d in shape))]
        else:
            out.append(TensorSpec(name, "F32" if info.param == "e_score_correction_bias" else "BF16", shape))
    return out


def fp8_bytes(cfg: dict) -> int:
    return sum(s.nbytes for s in tensor_specs(cfg) if s.dtype == "F8_E4M3")


def plan_config(size: float) -> dict:
    """(MoE layers, experts) whose FP8 total is closest to `size`; vocab so the embedding is largest."""
    dense = fp8_bytes(ds_config(0, 8, 128))
    best = None
    for experts in range(8, 257, 8):
        per_layer = fp8_bytes(ds_config(1, experts, 128)) - dense
        layers = min(60, max(1, round((size - dense) / per_layer)))
        err = abs(dense + layers * per_layer - size)
        if best is None or err < best[0]:
            best = (err, layers, experts)
    others = max(s.nbytes * (2 if s.dtype == "F8_E4M3" else 1) for s in tensor_specs(ds_config(1, 8, 128)))
    vocab = min(REAL_VOCAB, 128 * math.ceil(max(1.25 * others, 0.0029 * size) / (2 * H) / 128))
    return ds_config(best[1], best[2], vocab)


def build_checkpoint(dst: Path, cfg: dict) -> list[TensorSpec]:
    """Write the release fast: tensors streamed from a tiled random pool, no big allocations."""
    rng = np.random.default_rng(0)
    fp8 = rng.integers(0, 256, POOL, dtype=np.uint8)
    fp8 -= ((fp8 & 0x7F) == 0x7F).view(np.uint8)  # 0x7F/0xFF (NaN) -> 0x7E/0xFE
    bf16 = rng.integers(0, 256, POOL, dtype=np.uint8)
    bf16.view(np.int16)[:] &= np.int16(~0x4000)  # exponent < 128: finite, |x| < 2
    specs = tensor_specs(cfg)
    total = sum(s.nbytes for s in specs)
    target = min(4 * GB, max(1 * GB, total / 4))
    groups: list[list[TensorSpec]] = [[]]
    for s in specs:  # greedy, keeping each scale with its weight
        if groups[-1] and sum(x.nbytes for x in groups[-1]) + s.nbytes > target and s.dtype != "F32":
            groups.append([])
        groups[-1].append(s)
    weight_map = {}
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        with open(dst / fname, "wb") as f:
            f.write(encode_header(group, {"format": "pt"}))
            for s in group:
                if s.dtype == "F32":
                    f.write((rng.random(s.shape, dtype=np.float32) * 2e-3 + 1e-4).tobytes())
                    continue
                pool, left = (fp8 if s.dtype == "F8_E4M3" else bf16), s.nbytes
                while left:
                    left -= f.write(memoryview(pool[: min(left, POOL)]))
            os.fsync(f.fileno())
        weight_map.update({s.name: fname for s in group})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    write_side_files(dst, cfg)
    os.sync()  # no dirty fixture pages left to disturb the timed runs
    return specs


def ref_dequant(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    return (w.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]).to(torch.bfloat16)


def run_cvt(cmd: list[str]) -> tuple[float, int]:
    """Wall time and peak RSS (bytes) of this one child (common.run_cvt_cpu without the CPU time)."""
    return run_cvt_cpu(cmd)[:2]


def reference_e2e(src: Path, out: Path) -> float:
    weight_map = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    files = sorted(set(weight_map.values()))
    t0 = time.perf_counter()
    for i, fname in enumerate(files):
        sd, res = load_file(src / fname), {}
        for name, t in sd.items():
            if name.endswith("_scale_inv"):
                continue
            if t.dtype == torch.float8_e4m3fn:
                sname = name + "_scale_inv"
                if sname in sd:
                    s = sd[sname]
                else:
                    with safe_open(src / weight_map[sname], "pt") as g:
                        s = g.get_tensor(sname)
                t = ref_dequant(t, s)
            res[name] = t
        path = out / f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        save_file(res, path, metadata={"format": "pt"})
        del sd, res
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
    return time.perf_counter() - t0


@contextmanager
def scratch(path: Path, keep: bool):
    """An empty output dir, removed afterwards (outside the timed region) unless --keep."""
    path.mkdir()
    try:
        yield path
    finally:
        if not keep:
            shutil.rmtree(path, ignore_errors=True)


def import_seconds(modules: str) -> float:
    """Wall seconds of a child python that imports `modules` (comma-separated) and exits: the
    part of a cvt run spent before its first byte (shared with bench/quantize.py)."""
    t0 = time.perf_counter()
    os.spawnv(os.P_WAIT, sys.executable, [sys.executable, "-c", f"import {modules}"])
    return time.perf_counter() - t0


def compile_bytecode() -> str:
    """Compile cvt's modules to bytecode, as a wheel install has them (pip compiles at install).
    An editable install where PYTHONDONTWRITEBYTECODE is set (as on the bench machine) would
    otherwise compile ~50 modules from source in every timed run (~0.08 s). Returns a line for
    the report."""
    import compileall

    import cvt

    dirs = sorted({Path(p) for name in ("cvt", "cvt.convert", "cvt.quant", "cvt.export", "cvt.runtime", "cvt.schemas")
                   for p in importlib.import_module(name).__path__})
    ok = all(compileall.compile_dir(d, quiet=1) for d in dirs)
    cap = os.environ.get("OPENSSL_ia32cap")  # e.g. ":~0x20000000" masks the SHA extensions (a CPU without them)
    return (f"cvt {cvt.__version__}: bytecode {'compiled' if ok else 'NOT compiled'} ({len(dirs)} package dirs)"
            + (f"; OPENSSL_ia32cap={cap} (OpenSSL's CPU features masked, sha256 rate below)" if cap else ""))


def checksum_rate(chunk: int = 64 << 20) -> float:
    """Bytes/s on one core of cvt's per-file checksum (`cvt.convert.checksum.ALGORITHM`), best of
    2 over 256 MB hashed as one stream of `chunk`-byte updates of the same buffer: 64 MB, bytes
    read from memory (what a separate hasher costs); 2 MB, bytes already in cache (how
    `DirectFile` hashes each chunk it has just staged)."""
    from cvt.convert.checksum import hasher

    buf = memoryview(os.urandom(chunk))
    reps = max(1, (256 << 20) // chunk)

    def run():
        h = hasher()
        for _ in range(reps):
            h.update(buf)
        return h.digest()

    return chunk * reps / best_of(run, 2)


def best_of(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def kernel_rows(n_rep: int = 5) -> list[tuple]:
    g = torch.Generator().manual_seed(1)
    rows = []
    for n, k in ((7168, 2048), (576, 7168)):
        u = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g)
        u[(u & 0x7F) == 0x7F] -= 1
        w = u.view(torch.float8_e4m3fn)
        s = torch.rand(math.ceil(n / 128), math.ceil(k / 128), generator=g) * 2e-3 + 1e-4
        want = ref_dequant(w, s).view(torch.int16)
        t_ref = best_of(lambda: ref_dequant(w, s), n_rep)
        kernels = {"torch": lambda: _dequant_torch(w, s, (128, 128), torch.empty(n, k, dtype=torch.bfloat16))}
        if kernel_name() == "c":
            kernels = {"c": lambda: dequant_fp8_block(w, s), **kernels}
        rows.append((f"{n}x{k}", "reference", t_ref, 1.0, True, n * k * 2))
        for kname, fn in kernels.items():
            same = torch.equal(fn().view(torch.int16), want)
            t = best_of(fn, n_rep)
            rows.append((f"{n}x{k}", kname, t, t_ref / t, same, n * k * 2))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=2.0, help="FP8 bytes of the synthetic checkpoint (GB)")
    ap.add_argument("--dir", type=scratch_dir, help="where temp dirs go (default: the system temp dir); same disk as a real run")
    ap.add_argument("--workers", type=int, help="passed to cvt --workers")
    ap.add_argument("--max-shard-size", help="passed to cvt --max-shard-size (default: cvt's 5GB)")
    ap.add_argument("--repeat", type=int, default=1, help="best of N for the end-to-end runs")
    ap.add_argument("--skip-reference-e2e", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the temp dirs (fixture and all outputs)")
    args = ap.parse_args()

    bytecode = compile_bytecode()
    load0 = os.getloadavg()[0]
    root = Path(tempfile.mkdtemp(prefix="cvt-bench-fp8-", dir=args.dir))
    try:
        src = root / "src"
        src.mkdir()
        cfg = plan_config(args.size_gb * GB)
        t0 = time.perf_counter()
        specs = build_checkpoint(src, cfg)
        t_build = time.perf_counter() - t0
        src_files = sorted(src.glob("*.safetensors"))
        out_sizes = {s.name: s.nbytes * (2 if s.dtype == "F8_E4M3" else 1) for s in specs if not s.name.endswith("_scale_inv")}
        big_name = max(out_sizes, key=out_sizes.get)
        big = out_sizes[big_name]
        fp8_total = sum(s.nbytes for s in specs if s.dtype == "F8_E4M3")
        in_total = sum(p.stat().st_size for p in src_files)

        passthrough = (["--workers", str(args.workers)] if args.workers else []) + (
            ["--max-shard-size", args.max_shard_size] if args.max_shard_size else [])
        cvt_runs, floor_runs, direct_runs, ref_runs = [], [], [], []
        bar = row_progress(args.repeat, "end-to-end rounds")
        for r in range(args.repeat):
            with scratch(root / f"cvt-{r}", args.keep) as dst:
                cmd = [sys.executable, "-m", "cvt", "fp8-to-bf16", str(src), str(dst), "--quiet", *passthrough]
                cvt_runs.append(run_cvt_cpu(cmd))
                sizes = [p.stat().st_size for p in sorted(dst.glob("*.safetensors"))]
            with scratch(root / f"floor-{r}", args.keep) as out:
                floor_runs.append(io_floor(src_files, out, sizes))
            with scratch(root / f"direct-{r}", args.keep) as out:
                direct_runs.append(direct_floor(src_files, out, sizes))
            if not args.skip_reference_e2e:
                with scratch(root / f"reference-{r}", args.keep) as out:
                    ref_runs.append(reference_e2e(src, out))
            bar.update(1)
        bar.close()
        # what the stage's process imports (numpy and the C kernel; torch only without the kernel)
        t_start = import_seconds("cvt.cli, cvt.convert.fp8_to_bf16, numpy" + ("" if kernel_name() == "c" else ", torch"))
        krows = kernel_rows()
        sha_rate = checksum_rate()
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)

    out_total = sum(sizes)
    t_cvt, rss = min(t for t, _, _ in cvt_runs), max(m for _, m, _ in cvt_runs)
    cpu = min(c for _, _, c in cvt_runs)
    t_rd, t_wr = min(floor_runs, key=sum)
    t_floor = t_rd + t_wr
    directs = [sum(d) for d in direct_runs if not isinstance(d, str)]
    t_direct = min(directs) if directs else direct_runs[0]  # a float, or why O_DIRECT was skipped
    t_ref = min(ref_runs) if ref_runs else None
    budget = 2 * big + GB
    n_moe = cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]

    print(f"\ncvt fp8-to-bf16 benchmark  (cvt kernel: {kernel_name()}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {os.cpu_count()} CPUs)")
    print(f"command:  {shlex.join([sys.executable, *sys.argv])}")
    print(f"cvt run:  {shlex.join(cmd[:4] + ['SRC', 'DST'] + cmd[6:])}  ({bytecode})")
    print(f"input:    {cfg['num_hidden_layers']} layers ({cfg['first_k_dense_replace']} dense + {n_moe} MoE), "
          f"{cfg['n_routed_experts']} routed experts + 1 shared, vocab {cfg['vocab_size']}, hidden {H}: "
          f"{fp8_total / GB:.2f} GB FP8, {in_total / GB:.2f} GB in {len(src_files)} files, {len(specs)} tensors "
          f"(fixture written + synced in {t_build:.1f} s)")
    print(f"output:   {out_total / GB:.2f} GB BF16 in {len(sizes)} files (--max-shard-size "
          f"{args.max_shard_size or '5GB (default)'}); largest tensor {big_name} {big / GB:.2f} GB")
    print(f"input is page-cache warm for all three end-to-end runs (nothing dropped); best of {args.repeat}")
    print(f"\n{'end to end':34}{'seconds':>9}{'GB/s out':>10}{'vs buffered floor':>19}{'peak RSS':>11}")
    e2e = [("buffered floor (read+write+fsync)", t_floor, ""), ("cvt fp8-to-bf16 (subprocess)", t_cvt, f"{rss / GB:.2f} GB")]
    if t_ref is not None:
        e2e.append(("reference (load_file/save_file)", t_ref, ""))
    for label, t, mem in e2e:
        print(f"  {label:32}{t:9.2f}{out_total / t / GB:10.3f}{t_floor / t:18.2f}x{mem:>11}")
    if isinstance(t_direct, float):
        print(f"  {'O_DIRECT floor (1 thread/file)':32}{t_direct:9.2f}{out_total / t_direct / GB:10.3f}"
              f"   (cvt speed vs O_DIRECT floor: {t_direct / t_cvt:.2f}x)")
    else:
        print(f"  O_DIRECT floor skipped: {t_direct}")
    print(f"  cvt: {floor_cells(t_cvt, t_floor, t_direct)}; CPU {cpu:.2f} s user+sys = "
          f"{cpu / (in_total / GB):.2f} CPU-s per GB of input; peak RSS {rss / GB:.2f} GB")
    print(f"  {'floor: read input (page cache)':32}{t_rd:9.2f}{in_total / t_rd / GB:10.3f}  (GB/s in)")
    print(f"  {'floor: write + fsync output':32}{t_wr:9.2f}{out_total / t_wr / GB:10.3f}")
    print(f"  {'checksum of the output, 1 core':32}{out_total / sha_rate:9.2f}{sha_rate / GB:10.3f}  (estimated; cvt hashes every file)")
    imports = "python + cvt imports (no torch)" if kernel_name() == "c" else "python + torch + cvt imports"
    print(f"  {imports:32}{t_start:9.2f}   (part of cvt's time)")
    if t_ref is not None:
        print(f"  cvt speed vs reference end to end: {t_ref / t_cvt:.2f}x (reference writes one file per input shard)")
    print(f"\n{'kernel in memory (best of 5)':34}{'ms':>9}{'GB/s out':>10}{'vs reference':>14}{'bit-identical':>15}")
    for shape, kname, t, sp, same, nbytes in krows:
        print(f"  {shape + ' ' + kname:32}{t * 1e3:9.2f}{nbytes / t / GB:10.2f}{sp:13.2f}x{str(same):>15}")

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "MISS"

    print("\ntargets (a report, not a test)")
    ratio = t_floor / t_cvt
    print(f"  {'cvt e2e >= 0.8x buffered floor speed':40}{ratio:6.2f}x            {verdict(ratio >= 0.8)}")
    if isinstance(t_direct, float):
        r = t_direct / t_cvt
        print(f"  {'cvt e2e >= 0.8x O_DIRECT floor speed':40}{r:6.2f}x            {verdict(r >= 0.8)}")
    for kname in ("c", "torch"):
        sps = [sp for _, kn, _, sp, _, _ in krows if kn == kname]
        if sps:
            label = f"kernel {kname}{' (active)' if kname == kernel_name() else ''} >= 5x reference (min)"
            print(f"  {label:40}{min(sps):6.2f}x            {verdict(min(sps) >= 5)}")
    print(f"  {'peak RSS <= 2 x largest tensor + 1 GB':40}{rss / GB:6.2f} of {budget / GB:.2f} GB  {verdict(rss <= budget)}")
    print(f"  (load average 1 min: {load0:.2f} before, {os.getloadavg()[0]:.2f} after; other work on the machine skews all rows)")
    if not all(same for *_, same, _ in krows):
        print("  WARNING: a kernel output differs from the reference bits")
    if args.keep:
        print(f"\nkept: {root}")


if __name__ == "__main__":
    main()
