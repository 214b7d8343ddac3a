"""The benches' shared floors and child runner (bench/common.py): the O_DIRECT floor writes
exactly the sizes asked for (unaligned tails included) and the runner reports cvt's CPU time."""

import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _common():
    spec = importlib.util.spec_from_file_location("bench_common", ROOT / "bench" / "common.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_direct_floor_writes_exact_sizes(tmp_path):
    c = _common()
    src = tmp_path / "in.bin"
    src.write_bytes(b"\1" * 10000)
    out = tmp_path / "out"
    out.mkdir()
    sizes = [c.CHUNK + 4096 + 1, 4096, 123, 0]
    res = c.direct_floor([src], out, sizes)
    if isinstance(res, str):  # a filesystem that refuses O_DIRECT: the reason, never a fake time
        assert c.direct_refused(out) == res
        return
    assert len(res) == 2 and all(t >= 0 for t in res)
    assert [(out / f"direct-{i:05d}.bin").stat().st_size for i in range(len(sizes))] == sizes
    assert (out / "direct-00002.bin").read_bytes() == b"\x5a" * 123


def test_run_cvt_cpu_reports_the_childs_cpu_seconds():
    c = _common()
    burn = "import time; t = time.process_time()\nwhile time.process_time() - t < 0.3: pass"
    wall, rss, cpu = c.run_cvt_cpu([sys.executable, "-c", burn])
    assert cpu >= 0.3 and wall >= 0.3 and rss > 0
