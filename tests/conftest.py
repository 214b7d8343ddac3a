"""Shared fixtures: tiny synthetic checkpoints in tmp dirs, and running the real CLI.

Shapes are awkward on purpose (see cvt.testing.checkpoints): FP8 weights with partial edge
blocks (88x256 kv_a_proj like V3's 576x7168, 192-row q_b_proj, 72-column kv_b_proj), one
scale stored in a different shard from its weight, an MTP layer.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from cvt.testing.checkpoints import tiny_deepseek_config, write_fp8_release


@dataclass
class CliResult:
    rc: int
    out: str
    err: str


def run_cvt(*args, env: dict | None = None, preexec_fn=None, timeout: int = 300, subprocess_: bool = False) -> CliResult:
    """Run the CLI's entry point `cvt.cli.main(ARGS)` (exit codes and all): in this process when
    no env / preexec_fn is asked for (no interpreter and torch start-up, ~3 s a call on 2 cores),
    else - or with subprocess_=True - as `python -m cvt ARGS` in a subprocess."""
    if env is None and preexec_fn is None and not subprocess_:
        return _run_here([str(a) for a in args])
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("CVT_DEBUG", None)
    p = subprocess.run([sys.executable, "-m", "cvt", *map(str, args)], capture_output=True, text=True,
                       env=full_env, preexec_fn=preexec_fn, timeout=timeout)
    return CliResult(p.returncode, p.stdout, p.stderr)


def _run_here(argv: list[str]) -> CliResult:
    import contextlib
    import io

    from cvt.cli import main

    out, err = io.StringIO(), io.StringIO()
    rc = 0
    debug = os.environ.pop("CVT_DEBUG", None)  # as the subprocess runner: one-line errors
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(argv)
            except SystemExit as exc:
                rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        if debug is not None:
            os.environ["CVT_DEBUG"] = debug
    return CliResult(rc, out.getvalue(), err.getvalue())


@pytest.fixture(scope="session")
def fp8_release_session(tmp_path_factory) -> Path:
    """A read-only tiny FP8 release shared by the session (copy it before changing it)."""
    return write_fp8_release(tmp_path_factory.mktemp("release") / "fp8")


@pytest.fixture
def fp8_release(fp8_release_session, tmp_path) -> Path:
    """A private copy of the tiny FP8 release, free to corrupt."""
    dst = tmp_path / "src"
    shutil.copytree(fp8_release_session, dst)
    return dst


@pytest.fixture(scope="session", autouse=True)
def _temp_dir_inside_pytests(tmp_path_factory):
    """The temp directory of this process and of every process a test starts is a folder in
    pytest's own: a cvt a test kills (kill -9 mid-write) cannot remove its private ``cvt-*``
    scratch folder, and those piled up in the user's /tmp; pytest prunes its old basetemps."""
    import tempfile

    folder = str(tmp_path_factory.mktemp("TMPDIR"))
    saved_env, saved_cached = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"], tempfile.tempdir = folder, folder
    yield
    tempfile.tempdir = saved_cached
    if saved_env is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = saved_env


@pytest.fixture
def tiny_config() -> dict:
    return tiny_deepseek_config()


@pytest.fixture(scope="session")
def trained_fixture() -> Path:
    """The trained tiny DeepSeek-V3 checkpoint ../shared/fixtures/tiny-dsv3-trained (next to this
    checkout; read in place, never written). A test that asks for it is skipped when it is absent."""
    path = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "tiny-dsv3-trained"
    if not path.is_dir():
        pytest.skip(f"shared fixture {path} not present")
    return path


@pytest.fixture(scope="session")
def demo_weights():
    """(config, name -> float32 tensor, recipe key) of the demo's trained model (`cvt.demo_model`):
    trained once per machine (200 steps on one thread: ~2 minutes on a busy 2-core machine) into the
    user's cache, read from it after."""
    from cvt.demo_model import trained_weights

    return trained_weights()
