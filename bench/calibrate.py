"""Benchmark calibrated `cvt quantize`: peak memory against the number of decoder layers.

Usage: .venv/bin/python bench/calibrate.py [--layers 2] [--hidden 2048] [--experts 16]
       [--preset v3-widths] [--device cpu|cuda|npu] [--method gptq] [--calib-tokens 512]
       [--dir DIR] [--keep] [--procs N]

Why: the calibrated methods must run on checkpoints larger than RAM (DeepSeek-R1: 61 layers,
641 GB), so the streaming driver holds one decoder layer at a time: its peak RSS must not grow
with the layer count, and its cost is seconds per decoder layer (times 61 for R1).

Fixture (setup, not timed): two DeepSeek-V3-shaped FP8 releases written by
`cvt.testing.checkpoints.write_fp8_release` with the same shapes (hidden --hidden, MLA with
q_lora 1536 / kv_lora 512 / 128-dim heads scaled to the hidden size, --experts routed experts
of moe_intermediate hidden/4, one shared; the first layer dense), one with --layers decoder
layers and one with twice as many.

Measured, in this one run: `python -m cvt quantize SRC DST --scheme w4a16 --group-size 128
--method M --calib-tokens N --quiet` in a child process per release: wall time, its peak RSS
(a small wrapper process's RUSAGE_CHILDREN), and the per-layer seconds the manifest records (quant.calibration). Printed: both
rows, the RSS ratio (target: within 20% when the layers double) and the mean s/layer, then per
layer the seconds of its forward passes (statistics, replays, its output), its solve (GPTQ / AWQ
/ RTN and the exchange between ranks) and its reads (the manifest's quant.calibration
.phase_seconds), and with ``--device cuda`` where nvidia-smi exists the GPU utilisation sampled
every 0.2 s while each row ran (mean and max of the samples).
``--preset v3-widths``: DeepSeek-V3's real widths (hidden 7168, 128 heads, q_lora 1536,
kv_lora 512, dense intermediate 18432, expert width 2048) with --experts routed experts (8 by
default there, so that a layer fits a GPU's memory in float32), one layer dense and one MoE.
With ``--procs N``: one release (--layers), quantized by one process (torch's default
threads, and again with OMP_NUM_THREADS=1: the share each rank gets of the CPUs) and by ``cvt
quantize --procs N`` (N ranks of torchrun, gloo); printed: wall time of each and the ratios, each
rank's peak RSS (the manifest's quant.calibration), and the mean KL of each output's logits to
the source's (`cvt verify`, 4 sequences of 64 tokens).
A report, not a test: exit 0 unless something crashes.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

from common import load_fp8_bench, row_progress, scratch_dir  # bench/common.py

GB = 1e9


def config(layers: int, hidden: int, experts: int, preset: str | None = None) -> dict:
    from cvt.testing.checkpoints import tiny_deepseek_config

    if preset == "v3-widths":  # DeepSeek-V3's config.json widths, fewer routed experts
        return tiny_deepseek_config(
            hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=experts,
            n_group=2, topk_group=1, num_experts_per_tok=min(8, experts), num_hidden_layers=layers,
            num_nextn_predict_layers=0, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
            kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=1,
            vocab_size=2048)
    heads = max(4, hidden // 128)
    return tiny_deepseek_config(
        hidden_size=hidden, intermediate_size=hidden * 2, moe_intermediate_size=hidden // 4, n_routed_experts=experts,
        n_group=2, topk_group=1, num_experts_per_tok=2, num_hidden_layers=layers, num_nextn_predict_layers=0,
        num_attention_heads=heads, num_key_value_heads=heads, q_lora_rank=min(1536, hidden // 2),
        kv_lora_rank=min(512, hidden // 4), qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        first_k_dense_replace=1, vocab_size=2048)


DEVICE: list[str] = ["cpu"]  # --device, for every run


def run(src: Path, dst: Path, method: str, tokens: int, extra: tuple[str, ...] = ()
        ) -> tuple[float, int, list[float], list[str]]:
    argv = ["quantize", str(src), str(dst), "--scheme", "w4a16", "--group-size", "128", "--method", method,
            "--calib-tokens", str(tokens), "--device", DEVICE[0], "--quiet", *extra]
    with GpuUtil() as util:
        wall, rss = load_fp8_bench().run_cvt([sys.executable, "-m", "cvt", *argv])  # a clean peak RSS (see there)
    cal = json.loads((dst / "cvt_manifest.json").read_text())["quant"]["calibration"]
    PHASES[str(dst)] = (cal.get("phase_seconds", {}), util.summary())
    return wall, rss, cal["seconds_per_layer"], argv


PHASES: dict[str, tuple[dict, str]] = {}  # output dir -> (phase seconds per layer, GPU utilisation)


class GpuUtil:
    """nvidia-smi's utilization.gpu sampled every 0.2 s while a row runs (nothing without
    nvidia-smi or off CUDA); the sampler is stopped when the row ends."""

    def __enter__(self):
        import subprocess

        self.proc = None
        if DEVICE[0] == "cuda" and shutil.which("nvidia-smi"):
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                          "-lms", "200"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc):
        self.samples = []
        if self.proc is not None:
            self.proc.terminate()
            out, _ = self.proc.communicate(timeout=10)
            self.samples = [int(x) for x in out.split() if x.isdigit()]

    def summary(self) -> str:
        if not self.samples:
            return ""
        return f"GPU util mean {sum(self.samples) / len(self.samples):.0f}%, max {max(self.samples)}% " \
               f"({len(self.samples)} samples)"


def print_phases(dst: Path) -> None:
    """Per layer: forward / solve / IO seconds (the manifest's phase_seconds) and the GPU line."""
    phases, util = PHASES.get(str(dst), ({}, ""))
    if phases:
        print(f"  {'layer':>5}{'forward s':>11}{'solve s':>9}{'io s':>7}")
        for i, (f, sv, io) in enumerate(zip(phases["forward"], phases["solve"], phases["io"])):
            print(f"  {i:5d}{f:11.2f}{sv:9.2f}{io:7.2f}")
    if util:
        print(f"  {util}")


def weights_digest(d: Path) -> list[str]:
    import hashlib

    return [hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.glob("*.safetensors"))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2, help="decoder layers of the smaller release (doubled for the other)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--method", default="gptq", choices=["gptq", "awq"])
    ap.add_argument("--calib-tokens", type=int, default=512)
    ap.add_argument("--dir", type=scratch_dir, help="where temp dirs go (default: the system temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dirs")
    ap.add_argument("--expert-memory", help="also run the larger release with cvt quantize --expert-memory SIZE "
                    "(each MoE layer's experts read a chunk at a time) and compare time, RSS and output bytes")
    ap.add_argument("--procs", type=int, help="compare one process with N ranks on one release (module doc)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda", "npu"], help="where calibration computes")
    ap.add_argument("--preset", choices=["v3-widths"], help="DeepSeek-V3's real widths (module doc); --experts 8 "
                    "unless given")
    args = ap.parse_args()
    DEVICE[0] = args.device
    if args.preset and "--experts" not in sys.argv:
        args.experts = 8
    if args.procs:
        return ranks(args)

    import torch

    from cvt.testing.checkpoints import write_fp8_release

    root = Path(tempfile.mkdtemp(prefix="cvt-bench-calibrate-", dir=args.dir))
    rows = []
    streamed = None
    try:
        bar = row_progress(2 + bool(args.expert_memory), "rows")
        for layers in (args.layers, 2 * args.layers):
            t0 = time.perf_counter()
            src = write_fp8_release(root / f"src-{layers}", config(layers, args.hidden, args.experts, args.preset),
                                    n_shards=4)
            t_build = time.perf_counter() - t0
            size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
            wall, rss, spl, argv = run(src, root / f"out-{layers}", args.method, args.calib_tokens)
            rows.append((layers, size, t_build, wall, rss, spl, argv))
            bar.update(1)
            if args.expert_memory and layers == 2 * args.layers:
                out2 = root / f"out-{layers}-streamed"
                w2, r2, spl2, _ = run(src, out2, args.method, args.calib_tokens, ("--expert-memory", args.expert_memory))
                streamed = (w2, r2, spl2, weights_digest(out2) == weights_digest(root / f"out-{layers}"))
                bar.update(1)
            shutil.rmtree(src, ignore_errors=True)
        bar.close()
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)

    print(f"\ncvt calibrated quantize: peak RSS vs decoder layers  (torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {os.cpu_count()} CPUs)")
    print(f"command:  {shlex.join([sys.executable, *sys.argv])}")
    print(f"release:  DeepSeek-V3-shaped FP8, hidden {args.hidden}, {args.experts} routed experts + 1 shared, "
          f"first layer dense; w4a16 g128, --method {args.method}, {args.calib_tokens} calibration tokens")
    print(f"device:   {args.device}" + (f", preset {args.preset}" if args.preset else ""))
    print(f"\n{'layers':>7}{'FP8 GB':>9}{'wall s':>9}{'s/layer':>9}{'peak RSS':>11}   per-layer s")
    for layers, size, _, wall, rss, spl, _ in rows:
        print(f"{layers:7d}{size / GB:9.2f}{wall:9.1f}{sum(spl) / len(spl):9.2f}{rss / GB:8.2f} GB   "
              + " ".join(f"{x:.1f}" for x in spl))
        print_phases(root / f"out-{layers}")
    print(f"\npeak RSS {rows[1][0]} layers / {rows[0][0]} layers: {rows[1][4] / rows[0][4]:.2f}x "
          "(target: within 1.20x)")
    print(f"cvt run: {shlex.join([sys.executable, '-m', 'cvt', *rows[0][6][:1], 'SRC', 'DST', *rows[0][6][3:]])}")
    if streamed is not None:
        w2, r2, spl2, same = streamed
        per_layer = 4 * 3 * args.hidden * (args.hidden // 4) * args.experts
        print(f"\n{rows[1][0]} layers with --expert-memory {args.expert_memory} (routed experts {per_layer / GB:.2f} GB "
              f"per MoE layer in float32, read a chunk at a time): wall {w2:.1f} s ({w2 / rows[1][3]:.2f}x), "
              f"peak RSS {r2 / GB:.2f} GB ({r2 / rows[1][4]:.2f}x), s/layer "
              + " ".join(f"{x:.1f}" for x in spl2) + f"; weight files {'byte-identical' if same else 'DIFFER'}")


def ranks(args) -> None:
    """`--procs N`: one process against N ranks on the same release (module doc)."""
    import torch

    from cvt.testing.checkpoints import write_fp8_release
    from cvt.runtime.verify import verify

    root = Path(tempfile.mkdtemp(prefix="cvt-bench-calibrate-", dir=args.dir))
    try:
        src = write_fp8_release(root / "src", config(args.layers, args.hidden, args.experts, args.preset), n_shards=4)
        rows = []
        # one process as a user runs it (torch's threads on every CPU), one process on one thread
        # (what each rank gets when N ranks share the CPUs: the scaling of the split itself), N ranks
        for label, n, threads in (("1 process", 1, None), ("1 process, 1 thread", 1, "1"),
                                  (f"{args.procs} ranks", args.procs, None)):
            dst = root / f"out-{len(rows)}"
            saved = os.environ.get("OMP_NUM_THREADS")
            if threads:
                os.environ["OMP_NUM_THREADS"] = threads
            try:
                wall, rss, spl, argv = run(src, dst, args.method, args.calib_tokens,
                                           ("--procs", str(n)) if n > 1 else ())
            finally:
                if saved is None:
                    os.environ.pop("OMP_NUM_THREADS", None)
                else:
                    os.environ["OMP_NUM_THREADS"] = saved
            cal = json.loads((dst / "cvt_manifest.json").read_text())["quant"]["calibration"]
            kl = verify(dst, src, root / f"report-{len(rows)}", seq_len=64, max_sequences=4).report.logits.kl_mean
            rows.append((label, wall, cal.get("peak_rss_per_rank", [cal["peak_rss_bytes"]]), spl, kl, argv))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(f"\ncvt calibrated quantize: one process vs {args.procs} ranks  (torch {torch.__version__}; "
          f"{os.cpu_count()} CPUs)")
    print(f"command:  {shlex.join([sys.executable, *sys.argv])}")
    print(f"release:  DeepSeek-V3-shaped FP8, {args.layers} layers, hidden {args.hidden}, {args.experts} routed experts; "
          f"w4a16 g128, --method {args.method}, {args.calib_tokens} calibration tokens")
    print(f"\n{'':<22}{'wall s':>8}{'s/layer':>9}   {'peak RSS per rank':<24}{'KL to source':>13}")
    for label, wall, rss, spl, kl, argv in rows:
        print(f"{label:<22}{wall:8.1f}{sum(spl) / len(spl):9.2f}   {' '.join(f'{r / GB:.2f}' for r in rss) + ' GB':<24}"
              f"{kl:13.5f}")
        print_phases(Path(argv[2]))
    print(f"\nwall time {args.procs} ranks / 1 process: {rows[2][1] / rows[0][1]:.2f}x (target: 0.65x or less); "
          f"/ 1 process on 1 thread: {rows[2][1] / rows[1][1]:.2f}x")


if __name__ == "__main__":
    main()
