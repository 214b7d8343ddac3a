"""Benchmark the per-file checksum candidates on this machine: sha256, BLAKE3, xxh3-128.

Usage: .venv/bin/python bench/checksum.py [--mb 256] [--repeat 3]

Why: every byte cvt writes is hashed for its manifest (`cvt.convert.checksum`), as it is
written (2 MB chunks still in cache, `cvt.convert.durable.DirectFile`) and again on resume /
``--verify-files`` (16 MB reads from memory). Measured, GB/s on one core unless said, best of
--repeat, over --mb MiB of random bytes:
  memory:  one pass over the whole buffer in 16 MB updates (verification);
  cache:   the same 2 MB chunk hashed again and again (hashing as written: the chunk was just
           copied into the staging buffer);
  blake3 also with max_threads=AUTO on the whole buffer (verification of one large file).
xxh3-128 (the ``xxhash`` package) is not collision resistant and only shown for scale; it is
skipped when not installed. A report, not a test.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import time


def rate(nbytes: int, fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    import numpy as np

    buf = memoryview(np.random.default_rng(0).integers(0, 256, a.mb << 20, dtype=np.uint8)).cast("B")
    hot = buf[:2 << 20]
    algos: dict[str, object] = {"sha256": hashlib.sha256}
    try:
        import blake3

        algos["blake3"] = blake3.blake3
    except ImportError:
        print("blake3: not installed")
    try:
        import xxhash

        algos["xxh3-128 (not collision resistant)"] = xxhash.xxh3_128
    except ImportError:
        print("xxh3-128: xxhash not installed, skipped")

    def memory(new):
        h = new()
        for i in range(0, len(buf), 16 << 20):
            h.update(buf[i:i + (16 << 20)])
        h.hexdigest()

    def cache(new):
        h = new()
        for _ in range(len(buf) // len(hot)):
            h.update(hot)
        h.hexdigest()

    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            words = next((ln for ln in f if ln.startswith(("flags", "Features"))), "").split()
        flags = " ".join(w for w in ("sha_ni", "avx2", "avx512f", "sha2", "asimd") if w in words)
    except OSError:
        pass
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, flags: {flags or '?'}; "
          f"{a.mb} MiB, best of {a.repeat}")
    print(f"{'algorithm':38s} {'memory GB/s':>12s} {'cache GB/s':>11s}")
    for name, new in algos.items():
        print(f"{name:38s} {rate(len(buf), lambda: memory(new), a.repeat):12.2f} "
              f"{rate(len(buf), lambda: cache(new), a.repeat):11.2f}")
    if "blake3" in algos:
        import blake3

        r = rate(len(buf), lambda: blake3.blake3(buf, max_threads=blake3.blake3.AUTO).hexdigest(), a.repeat)
        print(f"{'blake3, all cores (one buffer)':38s} {r:12.2f}")


if __name__ == "__main__":
    main()
