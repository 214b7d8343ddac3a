"""The bad-input catalog's harness (tests/test_catalog*.py): each case runs the real CLI entry
point and `_check` asserts the same contract:

* the exit code (1 for refused input, 3 for `inspect` / `plan` problems, 4 for a failed
  `verify` gate);
* one line on stderr, ``cvt: error: ...``, naming the culprit (file, tensor, field or option);
  no traceback (`inspect` and `plan` print their report on stdout instead, the culprit in it);
* DST not complete-looking: no manifest, index or config appeared in it;
* SRC untouched: every file under it has the same bytes before and after;
* nothing outside the checkpoint opened: an audit hook records every file the run opens,
  and none lies in the ``outside/`` folder the case's symlinks and paths point at;
* nothing written outside DST: the same hook records every path opened for writing, made,
  renamed or deleted, and each must resolve (symlinks followed) inside DST (for `verify`: its
  --report folder) or the command's private temp folder (`cvt.scratch`); ``outside/`` keeps
  its bytes.

Here: the audit hook, `Ctx` (the sources a case copies and edits), `Case`, `_check`, the case
builders more than one catalog file uses, the module fixture `sources` (each file builds its own
once), and `run_bad_input`, the body of every file's `test_bad_input`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from cvt.testing.checkpoints import tiny_qwen3_config, write_bf16_checkpoint, write_safetensors
from cvt.tests.conftest import run_cvt


# ---------------------------------------------------------------------------------- harness
_OPENED: list[str] | None = None
_WRITTEN: list[str] = []
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
# path-changing events: the argument positions holding a path, and of its dir_fd (a path relative
# to an open directory, e.g. inside shutil.rmtree, is covered by the event naming the directory)
_CHANGES = {"os.remove": ((0,), 1), "os.rmdir": ((0,), 1), "os.mkdir": ((0,), 2), "os.rename": ((0, 1), 2),
            "os.symlink": ((1,), 2), "os.truncate": ((0,), None), "shutil.rmtree": ((0,), 1)}


def _audit(event: str, args) -> None:
    if _OPENED is None or not args:
        return
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.fsdecode(args[0])
        _OPENED.append(path)
        mode, flags = args[1], args[2]
        if (isinstance(mode, str) and set(mode) & set("wax+")) or (isinstance(flags, int) and flags & _WRITE_FLAGS):
            _WRITTEN.append(path)
    elif event in _CHANGES:
        where, fd_at = _CHANGES[event]
        if fd_at is not None and len(args) > fd_at and args[fd_at] not in (None, -1):
            return
        _WRITTEN.extend(os.fsdecode(args[i]) for i in where if isinstance(args[i], (str, bytes, os.PathLike)))


sys.addaudithook(_audit)  # audit hooks cannot be removed: it records only while _OPENED is a list


def _tree_hash(root: Path) -> dict[str, str]:
    """name -> sha256 of every file under root (symlinks as their target text, not followed)."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "link:" + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@dataclass
class Ctx:
    tmp: Path
    fp8: Path     # FP8 release (DeepSeek-V3 style: layers 0 dense, 1-2 MoE, MTP 3)
    bf16: Path    # cvt fp8-to-bf16 output of it (has a manifest)
    qwen: Path    # plain HF BF16 Qwen3-MoE
    outside: Path = field(init=False)

    def __post_init__(self):
        self.outside = self.tmp / "outside"
        self.outside.mkdir()
        (self.outside / "secret.json").write_text('{"model_type": "qwen3"}')

    def copy(self, which: str, name: str = "src") -> Path:
        dst = self.tmp / name
        shutil.copytree(getattr(self, which), dst, symlinks=True)
        return dst

    def edit_config(self, root: Path, **changes) -> None:
        cfg = json.loads((root / "config.json").read_text())
        cfg.update(changes)
        (root / "config.json").write_text(json.dumps(cfg))

    def link_out(self, root: Path, name: str) -> None:
        """Replace root/name by a symlink to a copy of it outside the checkpoint."""
        target = self.outside / name
        shutil.copy(root / name, target)
        (root / name).unlink()
        (root / name).symlink_to(target)


@dataclass(frozen=True)
class Case:
    id: str
    build: Callable[[Ctx], tuple[list, Path, Path | None]]  # -> (argv, SRC to keep intact, DST)
    culprit: str
    rc: int = 1
    form: str = "error"  # error: one stderr line; report: stdout report (inspect / plan)


def _written_outside(written: list[str], dst: Path | None) -> list[str]:
    """The paths of `written` that resolve outside DST and outside cvt's private temp folders."""
    import tempfile

    allowed = [os.path.join(os.path.realpath(tempfile.gettempdir()), "cvt-")]
    if dst is not None:
        allowed.append(os.path.realpath(dst))
    return [p for p in written if not os.path.realpath(p).startswith(tuple(allowed)) and not p.endswith(".pyc")]


def _report_dir(argv: list) -> Path | None:
    """verify's DST: its --report folder."""
    return next((Path(b) for a, b in zip(argv, argv[1:]) if a == "--report"), None)


def _check(ctx: Ctx, case: Case) -> None:
    global _OPENED
    argv, src, dst = case.build(ctx)
    before = _tree_hash(src)
    outside_before = _tree_hash(ctx.outside)
    dst_before = _tree_hash(dst) if dst is not None and dst.is_dir() else {}
    _OPENED = []
    _WRITTEN.clear()
    try:
        r = run_cvt(*argv)
    finally:
        opened, _OPENED = _OPENED, None
    assert r.rc == case.rc, (r.rc, r.out[-2000:], r.err[-2000:])
    assert "Traceback" not in r.err and "Traceback" not in r.out, r.err
    if case.form == "error":
        lines = [ln for ln in r.err.splitlines() if ln.strip()]
        assert lines and lines[-1].startswith("cvt: "), r.err
        err = [ln for ln in lines if ln.startswith("cvt:")]
        assert len(err) == 1 or case.rc == 4, r.err  # verify: one line per violated gate
        assert case.culprit in r.err, (case.culprit, r.err)
    else:
        assert case.culprit in r.out, (case.culprit, r.out)
    assert _tree_hash(src) == before, "SRC was modified"
    assert _tree_hash(ctx.outside) == outside_before, "a folder outside DST was modified"
    written = _written_outside(_WRITTEN, dst if dst is not None else _report_dir(argv))
    assert not written, f"written outside DST: {written}"
    if dst is not None and dst != src and dst.is_dir():
        after = _tree_hash(dst)
        kept = {k: v for k, v in dst_before.items() if not k.startswith(".")}
        assert {k: after.get(k) for k in kept} == kept, "a file DST held before was changed or deleted"
        new = set(after) - set(dst_before)
        looks_done = {"cvt_manifest.json", "export_manifest.json", "config.json", "model.safetensors.index.json",
                      "report.json", "report.md", "report.html"}
        assert not (new & looks_done), f"DST looks complete: {sorted(new)}"
    outside = str(ctx.outside.resolve())
    leaked = [p for p in opened if os.path.realpath(p).startswith(outside)]
    assert not leaked, f"opened outside the checkpoint: {leaked}"


# ------------------------------------------------------------------ case builders, shared
def _overlap(verb: list[str], which: str, sub: bool = False, overwrite: bool = True):
    def build(ctx: Ctx):
        src = ctx.copy(which)
        dst = src / "sub" if sub else src
        return [*verb, src, dst, *verb_opts(verb[0]), *(["--overwrite"] if overwrite else [])], src, dst
    return build


def verb_opts(verb: str) -> list[str]:
    return {"quantize": ["--scheme", "w8a8"], "shard": ["--ep", "2"], "fp8-to-bf16": [], "export": []}[verb]


def _quantize(which: str, prep: Callable[[Ctx, Path], None], *extra):
    def build(ctx: Ctx):
        src = ctx.copy(which)
        prep(ctx, src)
        dst = ctx.tmp / "out"
        return ["quantize", src, dst, "--scheme", "w8a8", *extra], src, dst
    return build


def _verb(verb: list[str], which: str, prep: Callable[[Ctx, Path], None], *extra, dst_name: str | None = "out"):
    def build(ctx: Ctx):
        src = ctx.copy(which)
        prep(ctx, src)
        dst = ctx.tmp / dst_name if dst_name else None
        return [*verb, src, *([dst] if dst is not None else []), *extra], src, dst
    return build


def _nothing(ctx, src):
    pass


def _edit_tensors(src, change) -> None:
    """Rewrite every shard whose tensors `change(name, tensor)` modifies in place (returns True)."""
    from safetensors.torch import load_file

    for f in sorted(src.glob("model-*.safetensors")):
        tensors = {k: v.clone() for k, v in load_file(f).items()}
        if [n for n, t in tensors.items() if change(n, t)]:
            write_safetensors(f, tensors)


def _verify(which_cand: str, prep, *extra, report_in: str | None = None):
    """`report_in`: put --report inside "cand", "ref", or inside cand through a symlink ("link")."""
    def build(ctx: Ctx):
        ref = ctx.copy(which_cand, "ref")
        cand = ctx.copy(which_cand, "cand-inf" if "inf" in extra else "cand")
        prep(ctx, cand)
        report = ctx.tmp / "report"
        if report_in == "link":
            (ctx.tmp / "link").symlink_to(cand)
            report = ctx.tmp / "link" / "rep"
        elif report_in is not None:
            report = {"cand": cand, "ref": ref}[report_in] / "rep"
        args = [a for a in extra if a != "inf"]
        return ["verify", cand, "--reference", ref, "--report", report, "--max-sequences", "1", "--seq-len", "32",
                *args], ref if report_in == "ref" else cand, None
    return build


_GPTQ = ("--scheme", "w4a16", "--group-size", "16", "--method", "gptq", "--calib-tokens", "256")
_CALIBRATING: dict[Path, subprocess.Popen] = {}


@pytest.fixture(scope="module")
def sources(tmp_path_factory, fp8_release_session):
    root = tmp_path_factory.mktemp("catalog-src")
    bf16 = root / "bf16"
    assert run_cvt("fp8-to-bf16", fp8_release_session, bf16, "--quiet").rc == 0
    qwen = write_bf16_checkpoint(root / "qwen", tiny_qwen3_config(moe=True))
    return fp8_release_session, bf16, qwen


# these calibrate, or wait on a run that does; the quantize-state-* cases resume a killed GPTQ run
SLOW = {"quantize-w8a8c8-bf16-max-fa-scales", "quantize-smoothquant-nan-norm", "quantize-while-another-calibrates",
        "quantize-state-truncated"}


def bad_input_params(cases: list[Case]) -> list:
    """`cases` as pytest params, the slow ones marked."""
    return [pytest.param(c, marks=pytest.mark.slow) if c.id in SLOW or c.id.startswith("quantize-state-") else c
            for c in cases]


def run_bad_input(case: Case, sources, tmp_path) -> None:
    fp8, bf16, qwen = sources
    ctx = Ctx(tmp_path, fp8, bf16, qwen)
    build = case.build

    names = {"RECIPE": "recipe.yaml", "CALIB": "calib.txt", "FIFO": "calib.fifo"}

    def with_recipe(c: Ctx):
        argv, src, dst = build(c)
        return [str(c.tmp / names[a]) if isinstance(a, str) and a in names else a for a in argv], src, dst

    try:
        _check(ctx, Case(case.id, with_recipe, case.culprit, case.rc, case.form))
    finally:
        held = tmp_path / ".held"
        if held.exists():
            os.close(int(held.read_text()))
        mounted = tmp_path / ".mounted"
        if mounted.exists():
            subprocess.run(["umount", mounted.read_text()], check=False)
        first = _CALIBRATING.pop(tmp_path, None)
        if first is not None:  # the run that held DST goes on and finishes its own output
            os.kill(first.pid, signal.SIGCONT)
            _, err = first.communicate(timeout=300)
            assert first.returncode == 0, err.decode()[-2000:]
