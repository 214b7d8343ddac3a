"""Shared fixtures: tiny synthetic checkpoints in tmp dirs, and running the real CLI.

Shapes are awkward on purpose (see cvt.convert.synthetic): FP8 weights with partial edge
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

from cvt.convert.synthetic import tiny_deepseek_config, write_fp8_release


@dataclass
class CliResult:
    rc: int
    out: str
    err: str


def run_cvt(*args, env: dict | None = None, preexec_fn=None, timeout: int = 300) -> CliResult:
    """Run `python -m cvt ARGS` in a subprocess (the real entry point, exit codes and all)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("CVT_DEBUG", None)
    p = subprocess.run([sys.executable, "-m", "cvt", *map(str, args)], capture_output=True, text=True,
                       env=full_env, preexec_fn=preexec_fn, timeout=timeout)
    return CliResult(p.returncode, p.stdout, p.stderr)


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


@pytest.fixture
def tiny_config() -> dict:
    return tiny_deepseek_config()
