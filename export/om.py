"""`cvt export om ONNX DST`: an ONNX graph to an Ascend offline model (.om) through `atc`.

Steps, each of which can stop the run with one clear line:

1. pre-check the graph against what atc takes (`cvt.export.atc.check_for_atc`: opset 9..18,
   the documented ai.onnx op list, no int4/float8, bfloat16 only on A2/A3), naming every
   offending op (exit code 3);
2. build the exact command, `atc --framework=5 --model=ONNX --output=DST/<stem>
   --soc_version=SOC --input_format=ND --input_shape=... [--dynamic_dims ...]
   [--precision_mode ...]`; the input shape is derived from the graph when every input is
   static, and required (with a template in the error) when some input is dynamic;
3. `--dry-run` prints it and stops; without `atc` on PATH the command is printed and the run
   fails, saying to install the CANN toolkit or to run the command on an Ascend host;
4. otherwise run atc with its stdout/stderr captured in `DST/<stem>.atc.log` (the command
   is also saved as `DST/<stem>.atc.sh`); a non-zero exit quotes the log's last lines;
5. `--verify` (needs `ais_bench`, Ascend's ait benchmark interface) runs the OM and
   onnxruntime on the same random inputs and compares every output (cosine >= 0.99).

Nothing heavy is imported at module level: the CLI imports this module to register `om`.
"""

from __future__ import annotations

import logging
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from cvt.errors import CvtError, OutputError
from cvt.extras import require
from cvt.export.atc import (
    INPUT_FORMATS,
    LOG_LEVELS,
    PRECISION_MODES,
    GraphCheckError,
    Problem,
    atc_command,
    check_for_atc,
    check_soc_version,
    load_model,
    onnx_file,
    parse_dynamic_dims,
    parse_input_shape,
    precheck,
    resolve_input_shape,
)

__all__ = ["AtcFailedError", "AtcNotFoundError", "GraphCheckError", "OmResult", "Problem", "atc_command",
           "check_for_atc", "export_om", "precheck", "resolve_input_shape", "run_atc", "verify_om"]

log = logging.getLogger("cvt.export.om")

LOG_TAIL_LINES = 8
VERIFY_MIN_COSINE = 0.99  # fp16 inside the OM (atc's default force_fp16) vs fp32 onnxruntime


class AtcNotFoundError(CvtError):
    """`atc` is not on PATH; `command` is what to run on a machine that has it."""

    def __init__(self, cmd: list[str]):
        self.command = shlex.join(cmd)
        super().__init__("atc is not on PATH: install the CANN toolkit and source its set_env.sh, or run on an "
                         f"Ascend host: {self.command}")


class AtcFailedError(CvtError):
    """atc ran and exited non-zero (or wrote no .om)."""


@dataclass
class OmResult:
    command: list[str]
    dry_run: bool = False
    om_path: Path | None = None
    log_path: Path | None = None
    seconds: float = 0.0
    verify: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def command_line(self) -> str:
        return shlex.join(self.command)


def _tail(path: Path, n: int = LOG_TAIL_LINES) -> list[str]:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("$ ")][-n:]


def run_atc(cmd: list[str], log_path: Path | str) -> int:
    """Run `cmd` (from `atc_command`) with stdout+stderr captured in `log_path` (the command
    line first, `$ atc ...`); lines are also logged at DEBUG. Returns 0, or raises
    AtcNotFoundError when `atc` is not on PATH and AtcFailedError quoting the log's last lines
    when it exits non-zero."""
    exe = shutil.which(cmd[0])
    if exe is None:
        raise AtcNotFoundError(cmd)
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w", encoding="utf-8", errors="replace") as fh:
        fh.write(f"$ {shlex.join(cmd)}\n")
        fh.flush()
        try:
            proc = subprocess.Popen([exe, *cmd[1:]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, errors="replace")
        except OSError as exc:
            raise AtcFailedError(f"{exe}: cannot run atc: {exc.strerror or exc}") from None
        assert proc.stdout is not None
        with proc:
            for line in proc.stdout:
                fh.write(line)
                log.debug("atc: %s", line.rstrip())
        rc = proc.returncode
    if rc != 0:
        tail = " | ".join(_tail(log_path)) or "(no output)"
        raise AtcFailedError(f"atc exited with code {rc}; log: {log_path}; last lines: {tail}")
    return 0


def _om_files(base: Path) -> list[Path]:
    """What atc wrote for `--output=base`: base.om, or base_<os>_<arch>.om."""
    import re

    # atc's own suffix only (<os>_<arch>, e.g. _linux_aarch64): not another graph's model_v2.om
    own = re.compile(re.escape(base.name) + r"(_[a-z0-9]+_[a-z0-9_]+)?\.om")
    return sorted(p for p in base.parent.glob(f"{base.name}*.om") if own.fullmatch(p.name))


def find_onnx(path: Path) -> Path:
    """The ONNX file itself, or the single *.onnx in a directory."""
    if path.is_dir():
        found = sorted(path.glob("*.onnx"))
        if len(found) != 1:
            raise CvtError(f"{path}: holds {len(found)} .onnx files ({', '.join(p.name for p in found) or 'none'}); "
                           "give the one to convert")
        return onnx_file(found[0])
    return onnx_file(path)


def export_om(onnx, dst, soc_version: str, *, input_shape: str | None = None, dynamic_dims: str | None = None,
              precision_mode: str | None = None, input_format: str = "ND", atc_log: str | None = None,
              extra: tuple[str, ...] = (), allow_ops: tuple[str, ...] = (), dry_run: bool = False,
              verify: bool = False, device_id: int = 0, overwrite: bool = False) -> OmResult:
    """Pre-check ONNX, build the atc command for DST/<stem>.om and (unless dry_run) run it."""
    onnx_path = find_onnx(Path(onnx))
    check_soc_version(soc_version)
    model, _ = load_model(onnx_path)  # the graph only: external weights stay on disk
    check_for_atc(model, soc_version, label=str(onnx_path), allow_ops=allow_ops)
    shape = resolve_input_shape(model, input_shape, dynamic_dims)
    del model
    dst = Path(dst)
    base = dst / onnx_path.stem
    cmd = atc_command(onnx_path, base, soc_version, input_shape=shape, dynamic_dims=dynamic_dims,
                      precision_mode=precision_mode, input_format=input_format, log=atc_log, extra=extra)
    if dry_run:
        return OmResult(cmd, dry_run=True)
    if shutil.which("atc") is None:
        raise AtcNotFoundError(cmd)
    if verify:
        _require_ais_bench()
        require("onnxruntime", "cvt export om --verify")
    if dst.exists() and not dst.is_dir():
        raise OutputError(f"{dst}: exists and is not a directory")
    log_path, script = dst / f"{onnx_path.stem}.atc.log", dst / f"{onnx_path.stem}.atc.sh"
    ours = [*_om_files(base), log_path, script]
    for p in ours:  # written or deleted below: never through a link placed in DST
        if p.is_symlink():
            raise OutputError(f"{p}: is a symlink; cvt never writes or deletes through a link in DST: remove it")
    if not overwrite and any(p.exists() for p in ours):
        raise OutputError(f"{dst}: already holds {next(p for p in ours if p.exists()).name} from an earlier "
                          "conversion; pass --overwrite or choose another DST")
    try:
        dst.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"{dst}: cannot create the output directory: {exc.strerror or exc}") from None
    for p in _om_files(base):  # no stale OM may survive a failed run
        p.unlink()
    script.write_text(f"#!/bin/sh\n# written by cvt export om; run on a host with the CANN toolkit\n"
                      f"{shlex.join(cmd)}\n")
    script.chmod(0o755)
    t0 = time.perf_counter()
    try:
        run_atc(cmd, log_path)
    except AtcFailedError:
        for p in _om_files(base):
            p.unlink()
        raise
    oms = _om_files(base)
    if not oms:
        raise AtcFailedError(f"atc exited 0 but wrote no {base.name}*.om in {dst}; log: {log_path}")
    res = OmResult(cmd, om_path=oms[0], log_path=log_path, seconds=time.perf_counter() - t0)
    if verify:
        res.verify = verify_om(onnx_path, res.om_path, shape, dynamic_dims, device_id=device_id)
    return res


# -- verify -----------------------------------------------------------------------------------
def _require_ais_bench():
    try:
        from ais_bench.infer.interface import InferSession  # noqa: F401
    except ImportError:
        raise CvtError("--verify needs ais_bench (Ascend's ait benchmark: install its aclruntime and ais_bench "
                       "wheels on the Ascend host); drop --verify to convert without running the OM") from None
    return InferSession


def _concrete(shape: str | None, dynamic_dims: str | None) -> tuple[dict[str, list[int]], str]:
    """Input shapes for one verification run (the first --dynamic-dims profile; a~b -> a; -1 -> 1)
    and the ais_bench mode."""
    dims = parse_input_shape(shape) if shape else {}
    profile = iter(parse_dynamic_dims(dynamic_dims)[0]) if dynamic_dims else iter(())
    flat = [d for ds in dims.values() for d in ds]
    mode = "dymdims" if dynamic_dims else ("dymshape" if any(d == "-1" or "~" in d for d in flat) else "static")
    out = {}
    for name, ds in dims.items():
        out[name] = [next(profile) if d == "-1" and dynamic_dims else
                     (1 if d == "-1" else int(d.split("~")[0])) for d in ds]
    return out, mode


def verify_om(onnx_path: Path, om_path: Path, shape: str | None, dynamic_dims: str | None = None,
              device_id: int = 0, seed: int = 0) -> dict[str, dict[str, float]]:
    """Run the OM (ais_bench) and the ONNX graph (onnxruntime, CPU) on the same random inputs
    and compare every output with cvt's metrics; raise if a cosine is below VERIFY_MIN_COSINE."""
    import numpy as np
    import torch

    ort = require("onnxruntime", "cvt export om --verify")

    from cvt.runtime.metrics import compare_tensors

    InferSession = _require_ais_bench()
    shapes, mode = _concrete(shape, dynamic_dims)
    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(seed)
    feeds = {}
    for inp in sess.get_inputs():
        dims = shapes.get(inp.name) or [d if isinstance(d, int) else 1 for d in inp.shape]
        dtype = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
                 "tensor(int32)": np.int32, "tensor(bool)": np.bool_}.get(inp.type)
        if dtype is None:
            raise CvtError(f"--verify: input {inp.name} has type {inp.type}, which cvt cannot generate")
        if np.issubdtype(dtype, np.floating):
            feeds[inp.name] = rng.standard_normal(dims).astype(dtype)
        else:
            feeds[inp.name] = rng.integers(0, 2 if dtype is np.bool_ else 16, size=dims).astype(dtype)
    ref = sess.run(None, feeds)
    om = InferSession(device_id, str(om_path))
    got = om.infer([feeds[i.name] for i in sess.get_inputs()], mode=mode, **({"custom_sizes": 10**8}
                                                                               if mode == "dymshape" else {}))
    report, bad = {}, []
    for out, r, g in zip(sess.get_outputs(), ref, got):
        g = np.asarray(g)
        if g.size != r.size:
            raise CvtError(f"--verify: output {out.name} has {g.size} elements in the OM, {r.size} in onnxruntime")
        m = compare_tensors(torch.from_numpy(g.reshape(r.shape).astype(np.float64)),
                            torch.from_numpy(r.astype(np.float64)))
        report[out.name] = m
        if not m["Cosine"] >= VERIFY_MIN_COSINE:
            bad.append(f"{out.name} cosine {m['Cosine']:.6f}")
    if bad:
        raise CvtError(f"--verify: the OM disagrees with onnxruntime (cosine < {VERIFY_MIN_COSINE}): {', '.join(bad)}")
    return report
