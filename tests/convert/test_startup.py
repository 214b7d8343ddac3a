"""The streaming verbs that need no torch never import it: `import torch` is ~0.8 s of a
process's start on a 2-core machine, as much as the IO floor of a whole small conversion
(docs/performance.md). fp8-to-bf16 (with the C kernel built), shard and RTN quantize (with the C
kernels built) read, dequantize, quantize or slice through numpy and the mmap; a module-level
`import torch` (or ``torch.<attr>`` on a `cvt.lazy` stand-in) anywhere on their path would fail
this test. Run in a subprocess: this test process has torch loaded already."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cvt.convert import fp8
from cvt.quant import qkernel
from cvt.tests.convert.test_shard import _bf16_config
from cvt.testing.checkpoints import write_bf16_checkpoint

PROBE = """
import json, sys
from cvt.cli import main
rc = 0
try:
    main(sys.argv[1:])
except SystemExit as e:
    rc = e.code or 0
print(json.dumps({"rc": rc, "torch": "torch" in sys.modules}))
"""


def _run(*args) -> dict:
    p = subprocess.run([sys.executable, "-c", PROBE, *map(str, args)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_fp8_to_bf16_never_imports_torch(fp8_release_session, tmp_path):
    if fp8._c_kernel() is None:
        pytest.skip("C kernel not built: the torch fallback is the dequantizer then")
    r = _run("fp8-to-bf16", fp8_release_session, tmp_path / "out", "--quiet")
    assert r == {"rc": 0, "torch": False}
    assert (tmp_path / "out" / "cvt_manifest.json").is_file()


def test_shard_never_imports_torch(tmp_path):
    src = write_bf16_checkpoint(tmp_path / "src", _bf16_config())
    r = _run("shard", src, tmp_path / "out", "--tp", "2", "--ep", "4", "--quiet")  # dim-0 and dim-1 runs
    assert r == {"rc": 0, "torch": False}
    assert (tmp_path / "out" / "cvt_manifest.json").is_file()


# every fused RTN layout family, FP8 and BF16 sources; nvfp4's fused groups share a global scale
RTN_CASES = [
    ("compressed-tensors", "w8a8", []),
    ("compressed-tensors", "w4a16", ["--group-size", "32"]),
    ("compressed-tensors", "fp4", []),
    ("ascend", "w8a8", []),
    ("ascend", "w4a16", []),
    ("ascend", "w4a16", ["--target", "mindie", "--group-size", "0", "--asym"]),
    ("ascend", "fp4", ["--fp4-format", "mxfp4"]),
]


# one case fast: each runs a subprocess
@pytest.mark.parametrize("fmt,scheme,opts", [RTN_CASES[0], *(pytest.param(*c, marks=pytest.mark.slow)
                                                              for c in RTN_CASES[1:])],
                         ids=[f"{f}-{s}-{len(o)}" for f, s, o in RTN_CASES])
def test_rtn_quantize_never_imports_torch(fp8_release_session, tmp_path, fmt, scheme, opts):
    if qkernel._c_kernel() is None or fp8._c_kernel() is None:
        pytest.skip("C kernels not built: the torch fallbacks quantize then")
    r = _run("quantize", fp8_release_session, tmp_path / "out", "--scheme", scheme, "--format", fmt, *opts, "--quiet")
    assert r == {"rc": 0, "torch": False}
    assert (tmp_path / "out" / "cvt_manifest.json").is_file()


@pytest.mark.slow
def test_rtn_quantize_of_a_bf16_checkpoint_never_imports_torch(tmp_path):
    if qkernel._c_kernel() is None:
        pytest.skip("C quantize kernel not built")
    src = write_bf16_checkpoint(tmp_path / "src", _bf16_config())
    r = _run("quantize", src, tmp_path / "out", "--scheme", "w8a8", "--quiet")
    assert r == {"rc": 0, "torch": False}


@pytest.mark.slow
def test_what_needs_torch_still_imports_it(fp8_release_session, tmp_path):
    """The probe sees a torch import: compressed-tensors asymmetric int4 plans its zero points on
    a probe (`cvt.qtensor.disk_specs.data_planned`)."""
    r = _run("quantize", fp8_release_session, tmp_path / "out", "--scheme", "w4a16", "--group-size", "32", "--asym",
             "--quiet")
    assert r == {"rc": 0, "torch": True}


def test_lazy_module_imports_on_first_use_only():
    """`cvt.lazy.LazyModule`: nothing is imported until an attribute is read; threads racing to
    the first read get the same module; copy / pickle probes (dunder lookups) fail cleanly
    instead of importing or recursing."""
    import copy
    import threading

    from cvt.lazy import LazyModule

    name = "cvt.tests.convert.fp8_reference"  # a module this test process has not imported yet
    sys.modules.pop(name, None)
    lazy = LazyModule(name)
    assert name not in sys.modules and "(imported)" not in repr(lazy)
    got = []
    threads = [threading.Thread(target=lambda: got.append(lazy.__getattr__("decode_e4m3"))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert name in sys.modules and len(got) == 8 and len({id(g) for g in got}) == 1
    with pytest.raises(AttributeError):
        lazy.__deepcopy__  # noqa: B018
    copy.copy(lazy)  # a shallow copy of the proxy, no recursion
