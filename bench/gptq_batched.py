"""Benchmark batched GPTQ: E same-shaped expert linears solved one by one against in one call.

Usage: .venv/bin/python bench/gptq_batched.py [--device cpu|cuda] [--experts 16] [--n 256]
       [--k 512] [--deepseek] [--scheme w4a16] [--group-size 128] [--act-order]
       [--scale-search hdiag] [--repeat 2]

Why: `gptq_quantize`'s column loop is a few tiny kernels per column; on a GPU it is bound by
launches (SM utilisation 18-34% on a MoE layer), and a MoE layer has many linears of one
shape. `gptq_quantize_batched` sweeps the columns once for all of them.

Fixture (not timed): E random weights [n, k] and Hessians 2/N X^T X of correlated inputs
(N = 2k rows), on --device. ``--deepseek``: DeepSeek-V3's routed gate / up_proj shape
[n 2048, k 7168] (16 experts: ~3.3 GB of float32 Hessians; meant for --device cuda).

Measured: wall time of E calls of `gptq_quantize` and of one `gptq_quantize_batched` (best of
--repeat, CUDA synchronized), the ratio, and the share of codes that agree between the two.
A report, not a test: exit 0 unless something crashes.
"""

from __future__ import annotations

import argparse
import time

import torch


def fixture(E: int, n: int, k: int, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    Ws, Hs = [], []
    for _ in range(E):
        mix = torch.randn(k, k, generator=g) / k ** 0.5
        x = torch.randn(2 * k, k, generator=g) @ mix + 0.1 * torch.randn(2 * k, k, generator=g)
        Ws.append(torch.randn(n, k, generator=g) * 0.05)
        Hs.append(2 * x.T @ x / x.shape[0])
    return torch.stack(Ws).to(device), torch.stack(Hs).to(device)


def timed(fn, device: str, repeat: int):
    best, out = float("inf"), None
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    from cvt.qtensor.schemes import get_scheme
    from cvt.quant.methods.gptq import gptq_quantize
    from cvt.quant.methods.gptq_batched import gptq_quantize_batched

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--k", type=int, default=512)
    ap.add_argument("--deepseek", action="store_true", help="n 2048, k 7168 (DeepSeek-V3 gate/up_proj)")
    ap.add_argument("--scheme", default="w4a16")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--act-order", action="store_true")
    ap.add_argument("--scale-search", choices=("mse", "hdiag"), default=None)
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    n, k = (2048, 7168) if a.deepseek else (a.n, a.k)
    opts = {"group_size": a.group_size} if a.scheme == "w4a16" else {}
    scheme = get_scheme(a.scheme, **opts)
    W, H = fixture(a.experts, n, k, a.device)
    kw = dict(act_order=a.act_order, scale_search=a.scale_search)
    where = torch.cuda.get_device_name() if a.device == "cuda" else f"{torch.get_num_threads()} threads"
    print(f"device {a.device} ({where}), "
          f"E {a.experts} x [{n}, {k}], scheme {a.scheme}, act_order {a.act_order}, scale_search {a.scale_search}")
    t1, ones = timed(lambda: [gptq_quantize(W[e], H[e], scheme, **kw) for e in range(a.experts)], a.device, a.repeat)
    tb, batch = timed(lambda: gptq_quantize_batched(W, H, scheme, **kw), a.device, a.repeat)
    part = next(p for p in ("weight", "weight_int4", "weight_fp4", "weight_fp8") if p in ones[0].qtensor.parts)
    same = sum((r.qtensor.parts[part] == b.qtensor.parts[part]).sum().item() for r, b in zip(ones, batch))
    print(f"one by one  {t1:8.3f} s")
    print(f"batched     {tb:8.3f} s")
    print(f"ratio       {t1 / tb:8.2f} x   codes equal {same / (a.experts * n * k):.6f}")


if __name__ == "__main__":
    main()
