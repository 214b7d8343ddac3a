"""The bad-input catalog, verb by verb: what a hostile or careless user can hand cvt.

Every case runs the real CLI entry point and asserts the same contract:

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

Case classes (issue 13): DST overlapping SRC; symlinks and manifest paths leading out of the
checkpoint; config.json disagreeing with the weights; sizes that describe no model or would
allocate without bound; placement / recipe / manifest files that are invalid; NaN / Inf
weights; a second run on a locked DST. Issue 24: symlinks where cvt makes or clears its own
folders in DST (``.cvt-calib``, ``rank-*``), --overwrite beside files no cvt run recorded, a
verify report inside a checkpoint it reads (`test_overwrite_deletes_only_recorded_files` and
`test_no_temp_folders_left` cover the successful runs); a second run while the first
calibrates; a report on a full disk; numbers no option may hold (NaN, inf, 1e400, 0.5 bytes)
and options that do not apply (exit 2, naming the option); configs and calibration state files
that are garbage, truncated or of another kind (one line, never an internal error); a state
file changed since cvt wrote it (its recorded sha256), or a state of another SRC with the same
names, sizes and mtimes (refused, never consumed).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from cvt.testing.checkpoints import tiny_qwen3_config, write_bf16_checkpoint, write_safetensors
from cvt.qtensor.schemes import scheme_names
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


# --------------------------------------------------------------------------- the cases
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


def _link_tokenizer(ctx, src):
    ctx.link_out(src, "tokenizer.json")


def _link_config(ctx, src):
    ctx.link_out(src, "config.json")


def _link_weights(ctx, src):
    ctx.link_out(src, sorted(p.name for p in src.glob("model-*.safetensors"))[0])


def _experts_lie(ctx, src):
    ctx.edit_config(src, n_routed_experts=8)


def _heads_zero(ctx, src):
    ctx.edit_config(src, num_attention_heads=0)


def _hidden_negative(ctx, src):
    ctx.edit_config(src, hidden_size=-256)


def _config(**changes):
    def prep(ctx, src):
        ctx.edit_config(src, **changes)
    return prep


def _fifo_tokenizer(ctx, src):
    (src / "tokenizer.json").unlink()
    os.mkfifo(src / "tokenizer.json")


def _q_a_wrong_shape(ctx, src):
    """model.layers.0.self_attn.q_a_proj.weight stored with other rows than config.json says."""
    ctx.edit_config(src, q_lora_rank=64)


def _nan_weight(ctx, src):
    from safetensors.torch import load_file

    f = sorted(src.glob("model-*.safetensors"))[0]
    tensors = {k: v.clone() for k, v in load_file(f).items()}
    name = next(n for n in tensors if n.endswith("mlp.down_proj.weight") and tensors[n].is_floating_point())
    tensors[name][0, 0] = float("inf") if "inf" in src.name else float("nan")
    write_safetensors(f, tensors)


def _edit_tensors(src, change) -> None:
    """Rewrite every shard whose tensors `change(name, tensor)` modifies in place (returns True)."""
    from safetensors.torch import load_file

    for f in sorted(src.glob("model-*.safetensors")):
        tensors = {k: v.clone() for k, v in load_file(f).items()}
        if [n for n, t in tensors.items() if change(n, t)]:
            write_safetensors(f, tensors)


def _bf16_max_rows(ctx, src):
    """Finite weights at the top of bfloat16's range: row 0 of every float projection = bf16 max."""
    import torch

    def change(name, t):
        if name.endswith("proj.weight") and t.dtype == torch.bfloat16 and t.dim() == 2:
            t[0, :] = torch.finfo(torch.bfloat16).max
            return True
    _edit_tensors(src, change)


def _nan_norm(ctx, src):
    def change(name, t):
        if name.endswith("layers.0.post_attention_layernorm.weight"):
            t[0] = float("nan")
            return True
    _edit_tensors(src, change)


def _scale_3e38(ctx, src):
    def change(name, t):
        if name == "model.layers.0.mlp.down_proj.weight_scale_inv":
            t[0, 0] = 3e38
            return True
    _edit_tensors(src, change)


def _manifest_path(path: str):
    def prep(ctx, src):
        m = json.loads((src / "cvt_manifest.json").read_text())
        m["files"][0]["path"] = path
        (src / "cvt_manifest.json").write_text(json.dumps(m))
    return prep


def _manifest_invalid(ctx, src):
    m = json.loads((src / "cvt_manifest.json").read_text())
    m["files"][0]["blake3"] = "zz"
    m["tensor_count"] = -1
    (src / "cvt_manifest.json").write_text(json.dumps(m))


def _pickle_only(ctx, src):
    for p in list(src.glob("model*")):
        p.unlink()
    (src / "pytorch_model.bin").write_bytes(b"\x80\x04not really")


def _index_escape(ctx, src):
    idx = json.loads((src / "model.safetensors.index.json").read_text())
    name = next(iter(idx["weight_map"]))
    idx["weight_map"][name] = "../outside/x.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))


def _placement(layers: list[int], bad_id: int | None = None):
    def build(ctx: Ctx):
        src = ctx.copy("fp8")
        entries = []
        for i, L in enumerate(layers):
            devs = [[0, 1], [2, 3]] if bad_id is None else [[0, bad_id], [2, 3]]
            entries.append({"layer_id": L, "device_count": 2,
                            "device_list": [{"device_id": r, "device_expert": d} for r, d in enumerate(devs)]})
        p = ctx.tmp / "placement.json"
        p.write_text(json.dumps({"moe_layer_count": len(entries), "layer_list": entries}))
        dst = ctx.tmp / "out"
        return ["shard", src, dst, "--ep", "2", "--placement", p], src, dst
    return build


def _bad_recipe(ctx, src):
    (ctx.tmp / "recipe.yaml").write_text('rules:\n  - pattern: "x\n    scheme: [w4a16\n')


def _locked_export(ctx: Ctx):
    src = ctx.copy("qwen")
    dst = ctx.tmp / "onnx"
    dst.mkdir()
    fd = os.open(dst, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a first run holding DST; released when the test ends
    ctx.tmp.joinpath(".held").write_text(str(fd))
    return ["export", "onnx", src, dst], src, dst


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


# ------------------------------------------------------------------- issue 24, items 8-11
def _calibrating(ctx: Ctx):
    """A GPTQ quantize stopped (SIGSTOP) after its first calibrated layer, holding DST; the case's
    RTN quantize into the same DST must be refused. Continued when the case ends: it finishes."""
    src = ctx.copy("qwen")
    dst = ctx.tmp / "out"
    env = {**os.environ, "CVT_TEST_STOP_AFTER_LAYER": "0", "PYTHONUNBUFFERED": "1"}
    env.pop("CVT_DEBUG", None)
    p = subprocess.Popen([sys.executable, "-m", "cvt", "quantize", str(src), str(dst), *_GPTQ, "--quiet"], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while not _stopped(p.pid):
        assert p.poll() is None and time.monotonic() < deadline, p.stderr.read() if p.poll() is not None else "slow"
        time.sleep(0.05)
    assert (dst / ".cvt-calib").is_dir() and not (dst / ".cvt-state.json").exists()  # still calibrating
    _CALIBRATING[ctx.tmp] = p
    return ["quantize", src, dst, "--scheme", "w8a8"], src, dst


_GPTQ = ("--scheme", "w4a16", "--group-size", "16", "--method", "gptq", "--calib-tokens", "256")
_CALIBRATING: dict[Path, subprocess.Popen] = {}


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def _full_disk_report(ctx: Ctx):
    """verify --report into a 16 KiB tmpfs: the html and md fit, report.json does not."""
    mnt = ctx.tmp / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.decode().strip()}")
    (ctx.tmp / ".mounted").write_text(str(mnt))
    ref = ctx.copy("qwen", "ref")
    cand = ctx.copy("qwen", "cand")
    report = mnt / "report"
    return ["verify", cand, "--reference", ref, "--report", report, "--max-sequences", "1", "--seq-len", "32"], \
        cand, report


_KILLED: dict[str, Path] = {}


def _killed_state(ctx: Ctx) -> Path:
    """A GPTQ run's DST killed (kill -9) after layer 0 was calibrated: .cvt-calib holds layer 0."""
    if "qwen" not in _KILLED:
        dst = ctx.tmp.parent / "killed-gptq"
        r = run_cvt("quantize", ctx.qwen, dst, *_GPTQ, "--quiet", env={"CVT_TEST_KILL_AFTER_LAYER": "0"})
        assert r.rc == -signal.SIGKILL and (dst / ".cvt-calib" / "layer-0.json").is_file(), r.err
        _KILLED["qwen"] = dst
    return _KILLED["qwen"]


def _bad_state(edit: Callable[[Path], None], forge: bool = False, prep: Callable[[Ctx, Path], None] = None):
    """The killed GPTQ state, edited, resumed. `forge`: state.json's records (size, sha256 of
    every state file: the older records' algorithm, still read) rewritten to match the edited files, so that the readers' own checks are
    what refuses it; else the records catch the edit. `prep(ctx, src)`: SRC edited first."""
    def build(ctx: Ctx):
        src = ctx.copy("qwen")
        if prep is not None:
            prep(ctx, src)
        dst = ctx.tmp / "out"
        shutil.copytree(_killed_state(ctx), dst)
        edit(dst / ".cvt-calib")
        if forge:
            st = json.loads((dst / ".cvt-calib" / "state.json").read_text())
            st["files"] = {n: {"size": (dst / ".cvt-calib" / n).stat().st_size,
                               "sha256": hashlib.sha256((dst / ".cvt-calib" / n).read_bytes()).hexdigest()}
                           for n in st["files"]}
            (dst / ".cvt-calib" / "state.json").write_text(json.dumps(st))
        return ["quantize", src, dst, *_GPTQ], src, dst
    return build


def _scaled_x3(state: Path):
    """Layer 0's q_proj scales times 3: the same size, other bytes (a resume would consume them)."""
    from safetensors.torch import load_file

    p = state / "layer-0.safetensors"
    size = p.stat().st_size
    tensors = {k: v.clone() for k, v in load_file(p).items()}  # not views of the file rewritten below
    tensors["q/model.layers.0.self_attn.q_proj/weight_scale"] *= 3
    write_safetensors(p, tensors)
    assert p.stat().st_size == size


def _other_weights_same_mtimes(ctx, src):
    """SRC another checkpoint with the killed run's names, sizes and mtimes (a fine-tune, then
    ``touch -r`` from the original): every float weight scaled by 1.25."""
    import torch

    def change(name, t):
        if t.dtype == torch.bfloat16:
            t.mul_(1.25)
            return True
    _edit_tensors(src, change)
    for p in src.iterdir():
        st = (ctx.qwen / p.name).stat()
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert p.stat().st_size == st.st_size


def _truncate(name: str, size: int):
    def edit(state: Path):
        with open(state / name, "r+b") as f:
            f.truncate(size)
    return edit


def _garbage(name: str):
    def edit(state: Path):
        p = state / name
        p.write_bytes(os.urandom(p.stat().st_size))
    return edit


def _other_method(state: Path):
    p = state / "layer-0.json"
    p.write_text(p.read_text().replace('"gptq"', '"awq"'))


def _edit_config_with(**changes):
    def prep(ctx, src):
        ctx.edit_config(src, **changes)
    return prep


def _fp8_block(block):
    def prep(ctx, src):
        cfg = json.loads((src / "config.json").read_text())
        cfg["quantization_config"]["weight_block_size"] = block
        (src / "config.json").write_text(json.dumps(cfg))
    return prep


def _config_bytes(data: bytes):
    def prep(ctx, src):
        (src / "config.json").write_bytes(data)
    return prep


def _manifest_size(ctx, src):
    m = json.loads((src / "cvt_manifest.json").read_text())
    m["files"][0]["size"] += 1
    (src / "cvt_manifest.json").write_text(json.dumps(m))


def _rewrite_qwen(**overrides):
    """SRC replaced by a Qwen3-MoE with other sizes (weights and config agreeing)."""
    def prep(ctx, src):
        from cvt.testing.checkpoints import tiny_qwen3_config

        shutil.rmtree(src)
        write_bf16_checkpoint(src, tiny_qwen3_config(moe=True, **overrides))
    return prep


def _calib_file(ctx, src):
    (ctx.tmp / "calib.txt").write_text("some calibration text " * 20)


def _fifo(ctx, src):
    os.mkfifo(ctx.tmp / "calib.fifo")


def _calib_dir_is_file(ctx: Ctx):
    src = ctx.copy("qwen")
    dst = ctx.tmp / "out"
    dst.mkdir()
    (dst / ".cvt-calib").write_text("")
    return ["quantize", src, dst, "--scheme", "w8a8", "--method", "smoothquant"], src, dst


def _verify_other_model(ctx: Ctx):
    ref = ctx.copy("bf16", "ref")
    cand = ctx.copy("qwen", "cand")
    return ["verify", cand, "--reference", ref, "--report", ctx.tmp / "report", "--max-sequences", "1",
            "--seq-len", "16"], cand, ctx.tmp / "report"


def _sized(verb: list[str], which: str, option: str, value: str, *extra, dst_name: str | None = "out"):
    return _verb(verb, which, _nothing, option, value, *extra, dst_name=dst_name)


_NOT_FINITE = "is not a finite number"
_BAD_SIZE = "Invalid value for '{}': size '{}'"
ISSUE_24 = [
    # item 8: the lock covers calibration
    Case("quantize-while-another-calibrates", _calibrating, "another cvt run is writing to this directory"),
    # item 9: a full disk leaves no complete-looking report and names the file
    Case("verify-report-full-disk", _full_disk_report, "report.json: write failed"),
    # item 10/11: numbers, one click type each (exit 2, naming the option)
    *[Case(f"quantize-max-shard-size-{v}", _sized(["quantize"], "qwen", "--max-shard-size", v, "--scheme", "w8a8"),
           _BAD_SIZE.format("--max-shard-size", v), rc=2) for v in ("inf", "nan", "1e400", "0.5", "1e-30", "abc")],
    Case("quantize-expert-memory-nan", _sized(["quantize"], "qwen", "--expert-memory", "nan", "--scheme", "w8a8"),
         _BAD_SIZE.format("--expert-memory", "nan"), rc=2),
    Case("fp8-to-bf16-max-shard-size-zero", _sized(["fp8-to-bf16"], "fp8", "--max-shard-size", "1e-30GB"),
         "size '1e-30GB' is less than one byte", rc=2),
    Case("shard-max-shard-size-inf", _sized(["shard"], "fp8", "--max-shard-size", "inf", "--ep", "2"),
         _BAD_SIZE.format("--max-shard-size", "inf"), rc=2),
    Case("plan-hbm-1e400", _sized(["plan"], "fp8", "--hbm", "1e400", "--ep", "2", dst_name=None),
         _BAD_SIZE.format("--hbm", "1e400"), rc=2),
    Case("shard-dry-run-hbm-nan", _sized(["shard"], "fp8", "--hbm", "nan", "--ep", "2", "--dry-run", dst_name=None),
         _BAD_SIZE.format("--hbm", "nan"), rc=2),
    Case("run-temperature-nan", _verb(["run"], "qwen", _nothing, "--input-ids", "1,2", "--temperature", "nan",
                                      dst_name=None), f"Invalid value for '--temperature': 'nan' {_NOT_FINITE}", rc=2),
    Case("run-top-p-nan", _verb(["run"], "qwen", _nothing, "--input-ids", "1,2", "--top-p", "nan", dst_name=None),
         f"Invalid value for '--top-p': 'nan' {_NOT_FINITE}", rc=2),
    Case("run-seed-2-70", _verb(["run"], "qwen", _nothing, "--input-ids", "1,2", "--seed", str(2**70), dst_name=None),
         "Invalid value for '--seed'", rc=2),
    Case("run-prompt-not-utf8", _verb(["run"], "qwen", _nothing, "--prompt", "ab\udcff\udcfe", dst_name=None),
         "--prompt 'ab\\xff\\xfe': not UTF-8 text"),
    Case("verify-min-cosine-2", _verify("qwen", _nothing, "--min-cosine", "2"),
         "Invalid value for '--min-cosine': 2.0 is not in the range -1<=x<=1", rc=2),
    # item 10: configs
    *[Case(f"{v[0]}-quantization-config-string", _verb(v, "fp8", _edit_config_with(quantization_config="fp8"),
                                                       *{"shard": ["--ep", "2"], "plan": ["--ep", "2"], "quantize": ["--scheme", "w8a8"]}.get(v[0], []),
                                                       dst_name=None if v[0] in ("inspect", "plan") else "out"),
           "quantization_config is str 'fp8'; expected an object")
      for v in (["fp8-to-bf16"], ["quantize"], ["shard"], ["inspect"], ["plan"], ["export", "onnx"])],
    Case("shard-block-size-zero", _verb(["shard"], "fp8", _fp8_block([0, 0]), "--ep", "2"),
         "weight_block_size is [0, 0]"),
    Case("inspect-block-size-one-dim", _verb(["inspect"], "fp8", _fp8_block([128]), dst_name=None),
         "weight_block_size is [128]"),
    Case("plan-block-size-zero", _verb(["plan"], "fp8", _fp8_block([0, 0]), "--ep", "2", dst_name=None),
         "weight_block_size is [0, 0]"),
    Case("quantize-config-nested", _quantize("qwen", _config_bytes(b"[" * 100000 + b"]" * 100000)),
         "config.json: JSON nested too deeply"),
    Case("run-config-binary", _verb(["run"], "qwen", _config_bytes(b"\x83\xff" + bytes(range(256))), "--input-ids",
                                    "1,2", dst_name=None), "config.json: not UTF-8 JSON text"),
    Case("verify-qwen-against-deepseek", _verify_other_model, "is a qwen3 model and the reference"),
    # item 10: calibration state files (a GPTQ run killed after layer 0, then edited)
    # (forged: state.json's records rewritten to match, so each reader's own check is tested)
    Case("quantize-state-truncated", _bad_state(_truncate("layer-0.safetensors", 5000), forge=True),
         "layer-0.safetensors: calibration state unreadable"),
    Case("quantize-state-garbage-json", _bad_state(_garbage("layer-0.json"), forge=True),
         "layer-0.json: calibration state unreadable"),
    Case("quantize-state-short-input", _bad_state(_truncate("x-1.bin", 1000), forge=True),
         "x-1.bin: calibration state unreadable"),
    Case("quantize-state-other-method", _bad_state(_other_method, forge=True), "was calibrated by awq, this run uses gptq"),
    # item 6b: the state is checksummed (each file's size and sha256 recorded as it was written)
    # and keyed on SRC's content, not its names, sizes and mtimes
    Case("quantize-state-scaled-x3", _bad_state(_scaled_x3),
         "layer-0.safetensors: calibration state file changed since cvt wrote it (blake3 "),
    Case("quantize-state-truncated-unforged", _bad_state(_truncate("layer-0.safetensors", 5000)),
         "layer-0.safetensors: calibration state file changed since cvt wrote it (5000 bytes, 112896 recorded); "
         "re-run with --no-resume"),
    Case("quantize-state-other-json", _bad_state(_other_method),
         "layer-0.json: calibration state file changed since cvt wrote it"),
    Case("quantize-state-foreign-src", _bad_state(lambda state: None, prep=_other_weights_same_mtimes),
         ".cvt-calib/state.json: calibration state of another source (model-00001-of-00002.safetensors differs); "
         "re-run with --no-resume"),
    # item 11: options that do not apply, messages that name the right thing
    Case("quantize-asym-w4a8", _quantize("qwen", _nothing, "--asym"), "--asym applies to w4a16 only, not w8a8", rc=2),
    Case("quantize-asym-w4a8-ascend", _verb(["quantize"], "qwen", _nothing, "--scheme", "w4a8", "--format", "ascend",
                                            "--asym"), "--asym applies to w4a16 only, not w4a8", rc=2),
    Case("quantize-fp4-format-with-w8a8", _quantize("qwen", _nothing, "--fp4-format", "mxfp4"),
         "--fp4-format applies to --scheme fp4 (or a recipe rule with it), not w8a8", rc=2),
    Case("quantize-calib-with-rtn", _quantize("qwen", _calib_file, "--calib", "CALIB"),
         "nothing in this run calibrates", rc=2),
    Case("quantize-calib-dev-zero", _verb(["quantize"], "qwen", _nothing, "--scheme", "w8a8", "--method",
                                          "smoothquant", "--calib", "/dev/zero"), "/dev/zero: not a regular file"),
    Case("quantize-calib-fifo", _verb(["quantize"], "qwen", _fifo, "--scheme", "w8a8", "--method", "smoothquant",
                                      "--calib", "FIFO"), "calib.fifo: not a regular file"),
    Case("quantize-calib-dir-is-a-file", _calib_dir_is_file, ".cvt-calib: exists and is not a directory"),
    Case("quantize-missing-scheme", _verb(["quantize"], "qwen", _nothing),
         "Missing option '--scheme'. Choose from: " + ", ".join(scheme_names()), rc=2),  # the registry's, sorted
    Case("shard-ep-3", _verb(["shard"], "fp8", _nothing, "--ep", "3"), "cannot shard this model: config.n_routed_experts"),
    Case("export-onnx-dst-is-src-no-overwrite", _overlap(["export", "onnx"], "qwen", overwrite=False),
         "DST is the source directory"),
    Case("shard-manifest-size", _verb(["shard"], "bf16", _manifest_size, "--ep", "2"), "the manifest says"),
    Case("quantize-w4a8-k-not-16", _verb(["quantize"], "qwen", _rewrite_qwen(moe_intermediate_size=40), "--scheme",
                                         "w4a8", "--format", "ascend"),
         "mlp.experts.0.down_proj.weight [96, 40]: scale_bias sums in_features in 16 runs, which must be a multiple of 16"),
    Case("quantize-w4a8-rows-not-8", _verb(["quantize"], "qwen", _rewrite_qwen(hidden_size=84, head_dim=21),
                                           "--scheme", "w4a8", "--format", "ascend"),
         "model.layers.1.mlp.experts.0.down_proj.weight [84, 48]"),
    Case("plan-w4a8-k-not-16", _verb(["plan"], "qwen", _edit_config_with(moe_intermediate_size=40), "--scheme", "w4a8",
                                     "--format", "ascend", "--ep", "2", dst_name=None),
         "mlp.experts.0.down_proj.weight [96, 40]", rc=3, form="report"),
]


def _calib_link(*extra):
    """DST/.cvt-calib a symlink to a folder outside DST holding a file: the calibration state's
    clean-up deleted that file, and the run exited 0 (issue 24)."""
    def build(ctx: Ctx):
        src = ctx.copy("fp8")
        dst = ctx.tmp / "out"
        dst.mkdir()
        victim = ctx.outside / "somedir"
        victim.mkdir()
        (victim / "precious.txt").write_text("not cvt's")
        (dst / ".cvt-calib").symlink_to(victim)
        return ["quantize", src, dst, "--scheme", "w8a8c8", "--format", "ascend", "--calib-tokens", "256",
                "--quiet", *extra], src, dst
    return build


def _rank_link(resume: bool):
    """DST/rank-00000 a symlink to a folder outside DST: shard wrote rank 0's files through it."""
    def build(ctx: Ctx):
        src = ctx.copy("bf16")
        dst = ctx.tmp / "out"
        target = ctx.outside / "rank-00000"
        if resume:  # a killed run of the same command (its journal, no manifest), rank 0 moved out and linked
            assert run_cvt("shard", src, dst, "--ep", "2", "--quiet").rc == 0
            m = json.loads((dst / "cvt_manifest.json").read_text())
            files = {f["path"]: {"size": f["size"], "blake3": f["blake3"], "tensors": f["tensors"]} for f in m["files"]}
            (dst / ".cvt-state.json").write_text(json.dumps({"plan_id": m["plan_id"], "files": files}))
            (dst / "cvt_manifest.json").unlink()
            shutil.move(dst / "rank-00000", target)
        else:  # a DST no cvt run wrote, taken with --overwrite
            dst.mkdir()
            target.mkdir()
            (target / "notes.txt").write_text("not cvt's")
        (dst / "rank-00000").symlink_to(target)
        return ["shard", src, dst, "--ep", "2", "--quiet", *([] if resume else ["--overwrite"])], src, dst
    return build


def _convert_beside_foreign(ctx: Ctx):
    """fp8-to-bf16 --overwrite into a DST holding a config.json no cvt run wrote: it was replaced."""
    src = ctx.copy("fp8")
    dst = ctx.tmp / "out"
    dst.mkdir()
    (dst / "config.json").write_text('{"mine": true}')
    return ["fp8-to-bf16", src, dst, "--overwrite", "--quiet"], src, dst


def _export_beside_foreign(ctx: Ctx):
    """--overwrite into a DST holding files no cvt run wrote, one named like a file the export
    writes: the export removed the whole DST (issue 24); now nothing unrecorded is replaced."""
    src = ctx.copy("qwen")
    dst = ctx.tmp / "onnx"
    (dst / "data").mkdir(parents=True)
    (dst / "data" / "keep.bin").write_bytes(b"\x00mine")
    (dst / "config.json").write_text('{"mine": true}')
    return ["export", "onnx", src, dst, "--overwrite", "--quiet"], src, dst


CASES = [
    # --- DST overlapping SRC (every writing verb), --overwrite never deletes a source file
    Case("quantize-dst-is-cvt-src-overwrite", _overlap(["quantize"], "bf16"), "DST is the source directory"),
    Case("quantize-dst-is-hf-src-overwrite", _overlap(["quantize"], "qwen"), "DST is the source directory"),
    Case("quantize-dst-inside-src", _overlap(["quantize"], "qwen", sub=True, overwrite=False),
         "DST is inside the source directory"),
    Case("fp8-to-bf16-dst-is-src", _overlap(["fp8-to-bf16"], "fp8"), "DST is the source directory"),
    Case("shard-dst-is-src-overwrite", _overlap(["shard"], "bf16"), "DST is the source directory"),
    Case("shard-dst-inside-src", _overlap(["shard"], "bf16", sub=True), "DST is inside the source directory"),
    Case("export-onnx-dst-is-src", _overlap(["export", "onnx"], "qwen"), "DST is the source directory"),
    # --- reads outside the checkpoint
    Case("quantize-tokenizer-symlink-out", _quantize("qwen", _link_tokenizer), "tokenizer.json: symlink resolves to"),
    Case("shard-tokenizer-symlink-out", _verb(["shard"], "fp8", _link_tokenizer, "--ep", "2"),
         "tokenizer.json: symlink resolves to"),
    Case("export-tokenizer-symlink-out", _verb(["export", "onnx"], "qwen", _link_tokenizer),
         "tokenizer.json: symlink resolves to"),
    Case("fp8-to-bf16-weights-symlink-out", _verb(["fp8-to-bf16"], "fp8", _link_weights),
         "model-00001-of-00003.safetensors: symlink resolves to"),
    Case("inspect-config-symlink-out", _verb(["inspect"], "qwen", _link_config, dst_name=None),
         "config.json: symlink resolves to"),
    Case("run-config-symlink-out", _verb(["run"], "qwen", _link_config, "--input-ids", "1,2", dst_name=None),
         "config.json: symlink resolves to"),
    Case("run-manifest-absolute-path", _verb(["run"], "bf16", _manifest_path("/etc/shadow"), "--input-ids", "1,2",
                                            dst_name=None), "'/etc/shadow' is absolute"),
    Case("run-manifest-dotdot-path", _verb(["run"], "bf16", _manifest_path("../../outside/secret.json"),
                                          "--input-ids", "1,2", dst_name=None), "escapes the checkpoint directory"),
    Case("inspect-manifest-absolute-path", _verb(["inspect"], "bf16", _manifest_path("/etc/shadow"), dst_name=None),
         "'/etc/shadow' is absolute", rc=3, form="report"),
    Case("quantize-index-escapes", _quantize("qwen", _index_escape), "escapes the checkpoint directory"),
    Case("export-index-escapes", _verb(["export", "onnx"], "qwen", _index_escape), "escapes the checkpoint directory"),
    Case("export-pickle-only", _verb(["export", "onnx"], "qwen", _pickle_only), "only pickle weights found"),
    # --- config vs weights, checked before anything is written
    Case("quantize-experts-lie", _quantize("fp8", _experts_lie), "4 of 8 experts missing"),
    Case("shard-experts-lie", _verb(["shard"], "fp8", _experts_lie, "--ep", "2"), "4 of 8 experts missing"),
    Case("fp8-to-bf16-experts-lie", _verb(["fp8-to-bf16"], "fp8", _experts_lie), "4 of 8 experts missing"),
    Case("quantize-q-a-proj-shape", _quantize("bf16", _q_a_wrong_shape), "q_a_proj.weight"),
    Case("shard-q-a-proj-shape", _verb(["shard"], "bf16", _q_a_wrong_shape, "--ep", "2"), "q_a_proj.weight"),
    Case("inspect-experts-lie", _verb(["inspect"], "fp8", _experts_lie, dst_name=None), "4 of 8 experts missing",
         rc=3, form="report"),
    # --- config.json values the runtime refuses: every writer refuses them first (issue 24 item 7)
    Case("fp8-to-bf16-first-k-dense-past-layers", _verb(["fp8-to-bf16"], "fp8", _config(first_k_dense_replace=5)),
         "config.json first_k_dense_replace = 5: past the model's 3 decoder layers"),
    Case("quantize-n-group-not-dividing", _quantize("bf16", _config(n_group=3)),
         "config.json n_group = 3: must divide n_routed_experts (4)"),
    Case("shard-rms-norm-eps-negative", _verb(["shard"], "fp8", _config(rms_norm_eps=-1e-6), "--ep", "2"),
         "config.json rms_norm_eps = -1e-06: must be a finite number > 0"),
    Case("quantize-yarn-factor-negative", _quantize("qwen", _config(rope_scaling={"rope_type": "yarn", "factor": -4})),
         "config.json rope_scaling.factor = -4: must be a finite number >= 1"),
    Case("inspect-experts-per-token-past-experts", _verb(["inspect"], "fp8", _config(num_experts_per_tok=9),
                                                       dst_name=None),
         "config.json num_experts_per_tok = 9: must be an integer in 1..4", rc=3, form="report"),
    Case("fp8-to-bf16-dense-layer-holds-experts", _verb(["fp8-to-bf16"], "fp8", _config(first_k_dense_replace=3)),
         "layer 1 holds MoE tensors"),
    # --- a FIFO where a file is expected (issue 24 item 6d): refused, not skipped nor read forever
    Case("quantize-tokenizer-fifo", _quantize("qwen", _fifo_tokenizer), "tokenizer.json: not a regular file (a FIFO)"),
    Case("shard-tokenizer-fifo", _verb(["shard"], "fp8", _fifo_tokenizer, "--ep", "2"),
         "tokenizer.json: not a regular file (a FIFO)"),
    # --- sizes that describe no model, unbounded work
    Case("plan-heads-zero", _verb(["plan"], "fp8", _heads_zero, "--ep", "2", dst_name=None),
         "num_attention_heads = 0"),
    Case("shard-dry-run-heads-zero", _verb(["shard"], "fp8", _heads_zero, "--ep", "2", "--dry-run", dst_name=None),
         "num_attention_heads = 0"),
    Case("run-hidden-negative", _verb(["run"], "qwen", _hidden_negative, "--input-ids", "1,2", dst_name=None),
         "hidden_size = -256"),
    Case("plan-ep-huge", _verb(["plan"], "fp8", _nothing, "--ep", "1000000000", dst_name=None),
         "a world of 1000000000 ranks"),
    # --- calibration / evaluation text read only as far as it is used (issue 24 item 5)
    Case("verify-data-dev-zero", _verify("qwen", _nothing, "--data", "/dev/zero"),
         "--data /dev/zero: not a regular file (a character device)"),
    # --- invalid side files
    Case("shard-placement-bad-expert-id", _placement([1, 2], bad_id=-1), "expert id -1 is outside 0..3"),
    Case("shard-placement-missing-layer", _placement([1]), "places 1 of the model's 2 MoE layers"),
    Case("quantize-bad-yaml-recipe", _quantize("qwen", _bad_recipe, "--recipe", "RECIPE"), "recipe.yaml: not valid YAML"),
    Case("run-manifest-invalid", _verb(["run"], "bf16", _manifest_invalid, "--input-ids", "1,2", dst_name=None),
         "files.0.blake3"),
    Case("run-procs-manifest-invalid", _verb(["run"], "bf16", _manifest_invalid, "--input-ids", "1,2",
                                            "--procs", "2", dst_name=None), "tensor_count"),
    # --- NaN / Inf
    Case("quantize-nan-weight", _quantize("qwen", _nan_weight), "non-finite"),
    Case("run-nan-weight", _verb(["run"], "qwen", _nan_weight, "--input-ids", "1,2", "--dtype", "fp32",
                                 dst_name=None), "non-finite logits"),
    Case("verify-nan-candidate", _verify("qwen", _nan_weight, "--min-cosine", "0.99", "--max-mean-kl", "1"),
         "is NaN", rc=4),
    Case("verify-inf-candidate", _verify("qwen", _nan_weight, "--min-cosine", "0.99", "inf"), "non-finite", rc=4),
    Case("verify-threshold-nan", _verify("qwen", _nothing, "--min-cosine", "nan"),
         "Invalid value for '--min-cosine': 'nan' is not a finite number", rc=2),
    # --- finite input, non-finite output (issue 24 item 6c): refused, naming the tensor
    Case("quantize-w4a8-bf16-max-scale-bias", _quantize("qwen", _bf16_max_rows, "--scheme", "w4a8", "--format",
                                                        "ascend"),
         "mlp.experts.0.gate_proj.scale_bias: 1 of its 48 values are NaN / Inf"),
    Case("quantize-w8a8c8-bf16-max-fa-scales", _quantize("bf16", _bf16_max_rows, "--scheme", "w8a8c8", "--format",
                                                         "ascend"),
         "model.layers.0.self_attn.fa_q.scale: 4 of its 4 values are NaN / Inf"),
    Case("quantize-mxfp4-bf16-max", _quantize("bf16", _bf16_max_rows, "--scheme", "fp4", "--fp4-format", "mxfp4"),
         "q_a_proj.weight: its fp4 quantization is not finite"),
    Case("quantize-smoothquant-nan-norm", _quantize("qwen", _nan_norm, "--method", "smoothquant"),
         "model.layers.0.post_attention_layernorm.weight: 1 of its 96 values are NaN / Inf"),
    Case("fp8-to-bf16-scale-overflows-bf16", _verb(["fp8-to-bf16"], "fp8", _scale_3e38),
         "down_proj.weight_scale_inv (F32 [2, 3], model-00001-of-00003.safetensors): 3.0000000054977558e+38 at block "
         "[0, 0] times 448 (the largest e4m3 value) overflows bfloat16"),
    # --- two runs at once
    Case("export-onnx-locked", _locked_export, "another cvt run is writing to this directory"),
    *ISSUE_24,
    # --- issue 24: cvt's own folders in DST are never links; --overwrite keeps unrecorded files;
    # a report is never written into a checkpoint being read
    Case("quantize-calib-state-symlink", _calib_link(), ".cvt-calib: is a symlink"),
    Case("quantize-calib-state-symlink-no-resume", _calib_link("--no-resume"), ".cvt-calib: is a symlink"),
    Case("shard-rank-dir-symlink-resume", _rank_link(resume=True), "rank-00000: is a symlink"),
    Case("shard-rank-dir-symlink-overwrite", _rank_link(resume=False),
         "rank-00000: exists and no cvt run recorded it"),
    Case("fp8-to-bf16-overwrite-unrecorded-file", _convert_beside_foreign,
         "config.json: exists and no cvt run recorded it"),
    Case("export-onnx-overwrite-unrecorded-file", _export_beside_foreign, "config.json: exists and no cvt run recorded it"),
    Case("verify-report-inside-candidate", _verify("qwen", _nothing, report_in="cand"),
         "--report is inside the candidate checkpoint"),
    Case("verify-report-inside-reference", _verify("qwen", _nothing, report_in="ref"),
         "--report is inside the reference checkpoint"),
    Case("verify-report-symlink-into-candidate", _verify("qwen", _nothing, report_in="link"),
         "--report is inside the candidate checkpoint"),
]


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


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow)
                                  if c.id in SLOW or c.id.startswith("quantize-state-") else c for c in CASES],
                         ids=[c.id for c in CASES])
def test_bad_input(case: Case, sources, tmp_path):
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


def test_every_verb_has_cases():
    verbs = {c.id.split("-")[0] for c in CASES}
    assert {"quantize", "fp8", "shard", "plan", "run", "verify", "export", "inspect"} <= verbs


# ------------------------------------------------------------ issue 24: the runs that succeed
OVERWRITE = {  # verb -> (argv before SRC DST, source, options): each a run other than the one DST holds
    "fp8-to-bf16": (["fp8-to-bf16"], "fp8", ["--max-shard-size", "1MB"]),
    "quantize": (["quantize"], "qwen", ["--scheme", "w8a8"]),
    "shard": (["shard"], "bf16", ["--ep", "2"]),
    "export-onnx": (["export", "onnx"], "qwen", []),
}


@pytest.mark.parametrize("verb", OVERWRITE)
def test_overwrite_deletes_only_recorded_files(verb, sources, tmp_path):
    """--overwrite of an earlier cvt run's output that also holds files no cvt run wrote: the
    earlier run's recorded files go, everything else stays with its bytes, nothing is written
    outside DST (export onnx removed the whole DST and kept a lock file beside it)."""
    global _OPENED
    fp8, bf16, qwen = sources
    ctx = Ctx(tmp_path, fp8, bf16, qwen)
    argv, which, opts = OVERWRITE[verb]
    src = ctx.copy(which)
    dst = ctx.copy("bf16", "out")  # the earlier run: a cvt fp8-to-bf16 output
    old = {f["path"] for f in json.loads((dst / "cvt_manifest.json").read_text())["files"]}
    (dst / "notes.txt").write_text("mine")
    (dst / "data").mkdir()
    (dst / "data" / "keep.bin").write_bytes(b"\x00mine")
    (dst / "linked").symlink_to(ctx.outside / "secret.json")
    foreign = {k: v for k, v in _tree_hash(dst).items() if k.split("/")[0] in ("notes.txt", "data", "linked")}
    beside = sorted(p.name for p in tmp_path.iterdir())
    outside = _tree_hash(ctx.outside)
    _OPENED = []
    _WRITTEN.clear()
    try:
        r = run_cvt(*argv, src, dst, *opts, "--overwrite", "--quiet")
    finally:
        _OPENED = None
    assert r.rc == 0, r.err
    after = _tree_hash(dst)
    assert {k: after.get(k) for k in foreign} == foreign, "an unrecorded file was changed or deleted"
    manifest = json.loads(((dst / "export_manifest.json") if verb == "export-onnx" else
                           (dst / "cvt_manifest.json")).read_text())
    new = {f["path"] for f in manifest["files"]}
    assert not [p for p in old - new if (dst / p).exists()], "a file of the earlier run survived"
    assert sorted(p.name for p in tmp_path.iterdir()) == beside, "written beside DST"
    assert not [k for k in after if k.startswith(".")], "a temp or state file was left in DST"
    assert _tree_hash(ctx.outside) == outside
    assert not _written_outside(_WRITTEN, dst), _written_outside(_WRITTEN, dst)


@pytest.mark.slow
def test_no_temp_folders_left(sources, tmp_path):
    """`run` (as verify and export: the loader's imports) imports torch._dynamo, which made
    $TMPDIR/torchinductor_<user> and left it: each command's temp folder is private and removed
    (`cvt.scratch`, around every command). A subprocess with a fresh TMPDIR and no
    TORCHINDUCTOR_CACHE_DIR: torch makes the folder when it is first imported in a process."""
    import subprocess

    _, _, qwen = sources
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "CVT_DEBUG")}
    r = subprocess.run([sys.executable, "-m", "cvt", "run", str(qwen), "--input-ids", "1,2", "--max-new-tokens", "1",
                        "--quiet"], capture_output=True, text=True, env={**env, "TMPDIR": str(tmpdir)}, timeout=300)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in tmpdir.iterdir()) == []
