"""Benchmark `cvt export onnx`: onnxruntime decode speed vs the torch runtime, same models, same run.

Usage: .venv/bin/python bench/export.py [--repeat 3] [--sizes demo,large] [--dir DIR] [--keep]

Why: ONNX is how CPU users run a converted model, and W4A16 through onnxruntime's
`MatMulNBits` is the CPU fast path the export exists for; the issue's target is ORT W4A16
decode >= 1.5x the torch runtime's BF16 decode on CPU.

Models (setup, not timed), DeepSeek-V3 architecture (MLA + MoE):
  demo   the demo model, trained (`cvt.demo_model.write_demo_release`: hidden 256, 3 layers,
         4 experts top-2, vocab 300; trained on the first use, then cached)
  large  random weights (`cvt.testing.checkpoints.write_fp8_release`) with hidden 1024, 4 layers (1 dense), 8 experts top-2 of width 512,
         8 heads, q_lora 384, kv_lora 256, vocab 8192 (~120 M parameters)
each as BF16 (`fp8_to_bf16`) and W4A16 (`quantize` RTN, group 128, compressed-tensors), then
exported with `export_onnx`: fp32 weights (from BF16), W4A16 as MatMulNBits accuracy_level 0
(float32 activations, exact) and 4 (int8 activations inside the op, approximate), and W4A16 as
int4 DequantizeLinear + MatMul (opset 21; onnxruntime fuses it into MatMulNBits).

Measured, all in this one run, CPU, each backend's default thread count: `generate(model,
prompt, 32)` from `cvt.runtime.generate` (the same loop for both backends: the ORT model sits
behind the runtime model contract), a random 64-token prompt, batch 1, greedy; one warm-up,
then best of --repeat rounds that interleave the contenders. Rows: prefill and decode tokens/s
and decode relative to torch BF16 (bf16 activations, as `cvt run` defaults to).
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
from cvt.testing.checkpoints import tiny_deepseek_config, write_fp8_release
from cvt.demo_model import write_demo_release
from cvt.export.onnx_export import export_onnx
from cvt.export.ort import OrtCausalLM
from cvt.quant.stage import quantize
from cvt.runtime.generate import generate
from cvt.runtime.loader import load_model

from common import row_progress, scratch_dir  # bench/common.py

PROMPT, NEW = 64, 32
SIZES = {
    "demo": {},
    "large": {"hidden_size": 1024, "intermediate_size": 2816, "moe_intermediate_size": 512, "num_hidden_layers": 4,
              "n_routed_experts": 8, "num_attention_heads": 8, "num_key_value_heads": 8, "q_lora_rank": 384,
              "kv_lora_rank": 256, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64,
              "vocab_size": 8192, "n_group": 2, "topk_group": 1},
}


def build(root: Path, size: str) -> dict[str, tuple[str, Path, str]]:
    """contender -> (backend, path, how it was made)."""
    src = (write_demo_release(root / "fp8", quiet=False) if size == "demo"
           else write_fp8_release(root / "fp8", tiny_deepseek_config(**SIZES[size])))
    fp8_to_bf16(src, root / "bf16", quiet=True)
    quantize(src, root / "w4a16", scheme="w4a16", fmt="compressed-tensors", method="rtn", quiet=True)
    out = {"torch bf16": ("torch", root / "bf16", "fp8_to_bf16, bf16 activations"),
           "torch w4a16": ("torch", root / "w4a16", "quantize w4a16 rtn g128, bf16 activations")}
    for name, path, kw, how in (
            ("ort fp32", root / "bf16", {}, "export of bf16, fp32 weights"),
            ("ort w4a16 nbits", root / "w4a16", {}, "MatMulNBits accuracy_level 0 (exact)"),
            ("ort w4a16 nbits-4", root / "w4a16", {"accuracy_level": 4}, "MatMulNBits accuracy_level 4 (int8 act.)"),
            ("ort w4a16 qdq", root / "w4a16", {"int4_op": "qdq"}, "int4 DequantizeLinear + MatMul, opset 21")):
        dst = root / ("onnx-" + name.replace(" ", "-"))
        export_onnx(path, dst, quiet=True, **kw)
        out[name] = ("onnxruntime", dst, how)
    return out


def speeds(models: dict, repeat: int) -> dict[str, tuple[float, float]]:
    loaded = {}
    for name, (backend, path, _) in models.items():
        loaded[name] = load_model(path, dtype=torch.bfloat16).model if backend == "torch" else OrtCausalLM(path)
    prompt = torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(0)).tolist()
    for m in loaded.values():
        generate(m, prompt, 4, device="cpu")  # warm-up
    best = {name: (0.0, 0.0) for name in loaded}
    for _ in range(repeat):
        for name, m in loaded.items():
            r = generate(m, prompt, NEW, device="cpu")
            best[name] = (max(best[name][0], r.prefill_tokens_per_s), max(best[name][1], r.decode_tokens_per_s))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="best of N for every timed row")
    ap.add_argument("--sizes", default="demo,large", help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument("--dir", type=scratch_dir, help="where the temp dir goes (default: the system temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir")
    args = ap.parse_args()
    import onnxruntime

    load0 = os.getloadavg()[0]
    results = {}
    root = Path(tempfile.mkdtemp(prefix="cvt-bench-export-", dir=args.dir))
    try:
        sizes = args.sizes.split(",")
        with row_progress(len(sizes), "model sizes (build, export, time)") as bar:
            for size in sizes:
                t0 = time.perf_counter()
                models = build(root / size, size)
                t_build = time.perf_counter() - t0
                results[size] = (models, speeds(models, args.repeat), t_build)
                bar.update(1)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)

    print(f"\ncvt export benchmark  (torch {torch.__version__}, {torch.get_num_threads()} threads; onnxruntime "
          f"{onnxruntime.__version__}; {os.cpu_count()} CPUs; best of {args.repeat})")
    print(f"command:  {shlex.join([sys.executable, *sys.argv])}")
    print(f"generate: {PROMPT}-token random prompt, {NEW} new tokens, batch 1, greedy, CPU")
    for size, (models, sp, t_build) in results.items():
        base = sp["torch bf16"][1]
        print(f"\n{size} model (random weights; built, quantized and exported in {t_build:.1f} s)")
        print(f"  {'contender':18}{'prefill tok/s':>14}{'decode tok/s':>14}{'decode vs torch bf16':>22}   how")
        for name, (pre, dec) in sp.items():
            print(f"  {name:18}{pre:14.0f}{dec:14.1f}{dec / base:21.2f}x   {models[name][2]}")
    print(f"\n(load average 1 min: {load0:.2f} before, {os.getloadavg()[0]:.2f} after; other work on the machine "
          "skews all rows)")
    if args.keep:
        print(f"kept: {root}")


if __name__ == "__main__":
    main()
