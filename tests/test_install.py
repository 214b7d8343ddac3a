"""A plain, non-editable install works for a stranger (issue 23): every verb from a wheel.

Builds a wheel of this source tree, installs it (``pip install --no-deps --no-index``) into a
fresh venv and runs every verb once, from a directory outside the clone, on `cvt demo`'s
model. The venv gets exactly the closure of the wheel's own ``Requires-Dist`` (no extras),
linked from the environment running the tests, which has them installed: offline, seconds,
and a dependency the package imports but does not declare still fails here. The optional
``export`` extra (onnx, onnxruntime) is left out, as in a plain ``pip install cvt``: the verbs
that need it must refuse with one line naming the extra (exit 1), never crash (exit 70).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
import zipfile
from importlib import metadata
from pathlib import Path, PurePosixPath

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
# what pyproject.toml packages (package-dir) plus the files setuptools reads
SOURCES = ("cvt", "convert", "qtensor", "quant", "export", "runtime", "schemas", "tests", "pyproject.toml", "README.md")
EXPORT_EXTRA = "pip install 'cvt[export]'"


def _requires(dist_meta) -> list[str]:
    return list(dist_meta.get_all("Requires-Dist") or [])


def _closure(requirements: list[str]) -> list[metadata.Distribution]:
    """The installed distributions that REQUIREMENTS need, transitively (markers evaluated here,
    no extras)."""
    from packaging.requirements import Requirement

    seen: dict[str, metadata.Distribution] = {}
    todo = list(requirements)
    while todo:
        req = Requirement(todo.pop())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        key = req.name.lower().replace("_", "-")
        if key in seen:
            continue
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            pytest.fail(f"{req.name} (a dependency of the wheel) is not installed where the tests run")
        seen[key] = dist
        todo += _requires(dist.metadata)
    return list(seen.values())


def _link(dists: list[metadata.Distribution], site: Path) -> None:
    """Symlink each distribution's top-level files (packages, modules, dist-info) into SITE."""
    for dist in dists:
        tops = {PurePosixPath(str(f)).parts[0] for f in dist.files or ()}
        for top in sorted(tops - {"..", "__pycache__"}):
            target = Path(dist.locate_file(top))
            if target.exists() and not (site / top).exists():
                (site / top).symlink_to(target, target_is_directory=target.is_dir())


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """(the fresh venv's bin directory, the environment to run it in)."""
    if not (ROOT / "pyproject.toml").is_file():
        pytest.skip("needs the source tree (tests run from an installed cvt.tests)")
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    src.mkdir()
    junk = shutil.ignore_patterns("__pycache__", "*.so", "*.pyc", "build", "*.egg-info")
    for name in SOURCES:
        p = ROOT / name
        shutil.copytree(p, src / name, ignore=junk) if p.is_dir() else shutil.copy2(p, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-index", "--no-build-isolation", "-q", "-w", str(tmp / "dist"),
                    str(src)], check=True, capture_output=True, text=True, timeout=300)
    wheel = next((tmp / "dist").glob("cvt-*.whl"))
    env_dir = tmp / "venv"
    venv.create(env_dir, with_pip=False, symlinks=True)
    py = env_dir / "bin" / "python"
    subprocess.run([*pip, "--python", str(py), "install", "--no-deps", "--no-index", "-q", str(wheel)], check=True,
                   capture_output=True, text=True, timeout=300)
    with zipfile.ZipFile(wheel) as z:
        meta_name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        from email.parser import Parser

        requires = _requires(Parser().parsestr(z.read(meta_name).decode()))
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    _link(_closure([r for r in requires if "extra ==" not in r]), site)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "CVT_DEBUG")}
    env.update(PATH=f"{env_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    return env_dir / "bin", env


def test_every_verb_from_a_wheel_outside_the_clone(installed, tmp_path):
    bin_dir, env = installed
    here = tmp_path / "elsewhere"
    here.mkdir()

    def cvt(*args, rc: int = 0):
        r = subprocess.run([str(bin_dir / "cvt"), *map(str, args)], cwd=here, env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == rc, (args, r.returncode, r.stdout[-2000:], r.stderr[-2000:])
        return r

    # the wheel's cvt, not the clone's; and a plain install has no onnx / onnxruntime
    probe = subprocess.run([str(bin_dir / "python"), "-c", "import cvt, importlib.util as u; print(cvt.__file__); "
                            "print(u.find_spec('onnx'), u.find_spec('onnxruntime'))"],
                           cwd=here, env=env, capture_output=True, text=True, check=True).stdout.splitlines()
    assert Path(probe[0]).is_relative_to(bin_dir.parent), probe
    assert probe[1] == "None None", probe

    assert cvt("--version").stdout.strip().endswith(metadata.version("cvt"))
    demo = cvt("demo", "demo").stdout
    assert f"[8/13] skipped: cvt export onnx / om needs onnx, which a plain install of cvt leaves out: " \
           f"{EXPORT_EXTRA}" in demo, demo
    assert all(f"[{i}/13]" in demo for i in range(9, 14))
    d = here / "demo"
    cvt("fp8-to-bf16", d / "source-fp8", "bf16", "--quiet")
    cvt("inspect", "bf16")
    cvt("plan", "bf16", "--world-size", 2, "--ep", 2)
    cvt("quantize", "bf16", "w8a8", "--scheme", "w8a8", "--quiet")
    cvt("shard", "bf16", "shards", "--world-size", 2, "--ep", 2, "--quiet")
    run = ("--prompt", "Hi", "--max-new-tokens", 2, "--device", "cpu", "--dtype", "fp32", "--quiet")
    cvt("run", "w8a8", *run)
    cvt("run", "shards", "--procs", 2, *run)
    cvt("verify", "w8a8", "--reference", "bf16", "--report", "report", "--seq-len", 32, "--max-sequences", 2, "--quiet")

    # the verbs of the export extra: one line naming it, exit 1
    r = cvt("export", "onnx", "bf16", "onnx-out", rc=1)
    assert r.stderr == f"cvt: error: cvt export onnx needs onnx, which a plain install of cvt leaves out: " \
                       f"{EXPORT_EXTRA}\n"
    assert not (here / "onnx-out").exists()
    (here / "graph.onnx").write_bytes(b"not read: onnx is missing")
    r = cvt("export", "om", "graph.onnx", "om", "--soc-version", "Ascend910B3", "--dry-run", rc=1)
    assert r.stderr == f"cvt: error: reading an ONNX graph (cvt export om) needs onnx, which a plain install of " \
                       f"cvt leaves out: {EXPORT_EXTRA}\n"
    r = cvt("run", "--backend", "onnxruntime", "bf16", "--prompt", "Hi", rc=1)
    assert r.stderr == f"cvt: error: cvt run --backend onnxruntime needs onnxruntime, which a plain install of " \
                       f"cvt leaves out: {EXPORT_EXTRA}\n"
