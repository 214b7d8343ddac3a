"""Optional dependencies (cvt.extras): a missing one is one line naming the extra, exit 1.

tests/test_install.py runs the verbs of a real plain install (no onnx, no onnxruntime); here,
in this process, a module is made unimportable the way Python itself allows (``None`` in
sys.modules: ``import`` raises ModuleNotFoundError), for the cases that install cannot show:
onnx present but onnxruntime missing, and a missing module no `require` checked.
"""

from __future__ import annotations

import sys

import click
import pytest

from cvt.extras import MissingDependencyError, extra_of, missing, require
from cvt.tests.conftest import run_cvt

EXTRA = "pip install 'cvt[export]'"


def test_extra_of_and_missing(monkeypatch):
    assert extra_of("onnx") == extra_of("onnxruntime") == extra_of("onnx.helper") == "export"
    assert extra_of("torch") is None and extra_of(None) is None
    assert missing("export") == []  # the test environment has the extra
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(MissingDependencyError) as exc:
        require("onnxruntime", "X")
    assert str(exc.value) == f"X needs onnxruntime, which a plain install of cvt leaves out: {EXTRA}"
    assert exc.value.exit_code == 1


def test_export_verify_without_onnxruntime_refuses_before_exporting(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    r = run_cvt("export", "onnx", tmp_path / "no-such-src", tmp_path / "out", "--verify")
    assert r.rc == 1
    assert r.err == f"cvt: error: cvt export onnx --verify needs onnxruntime, which a plain install of cvt " \
                    f"leaves out: {EXTRA}\n"
    assert not (tmp_path / "out").exists()


def test_export_om_verify_without_onnxruntime(monkeypatch):
    from cvt.export import om

    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(MissingDependencyError, match=r"^cvt export om --verify needs onnxruntime, .*cvt\[export\]"):
        om.verify_om(None, None, None)  # refused before either file is read


def test_unchecked_import_of_an_extra_is_one_line(monkeypatch):
    """A ModuleNotFoundError of an extra's module that no `require` caught: the CLI's last
    resort says the same line (exit 1), not `internal error` (exit 70)."""
    from cvt.cli import cli

    @click.command("probe")
    def probe():
        import onnx  # noqa: F401

    monkeypatch.setitem(cli.commands, "probe", probe)
    monkeypatch.setitem(sys.modules, "onnx", None)
    r = run_cvt("probe")
    assert (r.rc, r.err) == (1, f"cvt: error: this command needs onnx, which a plain install of cvt leaves out: "
                                f"{EXTRA}\n")
