"""Progress on long work: the one bar (cvt.progress) and where it is shown -- model loading,
verify's scoring, generation, the benches -- with `--quiet` honoured; a bench's missing --dir."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tqdm import tqdm

from cvt.convert.reader import open_checkpoint
from cvt.testing.checkpoints import tiny_qwen3_config, write_bf16_checkpoint
from cvt.progress import ETA_AFTER, make_progress
from cvt.tests.conftest import run_cvt

REPO = Path(__file__).resolve().parents[1]


def test_no_eta_until_the_rate_is_known_and_start_up_is_not_progress():
    out = io.StringIO()
    bar = make_progress(1000, "x", False, unit="row", file=out, mininterval=0)
    bar.start_t -= 3600  # an hour of start-up before the first row: a plain tqdm bar shows an ETA of days
    frames = []
    for _ in range(ETA_AFTER):
        bar.update(10)
        frames.append(str(bar))
    assert all("<" not in f and "/s" not in f for f in frames[:-1]), frames  # neither ETA nor rate yet
    assert frames[0] == "x:   1%|1         | 10/1000 [1:00:00]"
    eta = re.search(r"<([\d:]+),", frames[-1]).group(1)  # the rate counts from the first update: seconds, not days
    assert eta in ("00:00", "00:01"), frames[-1]
    bar.close()
    quiet = io.StringIO()
    with make_progress(10, "q", True, file=quiet) as q:
        q.update(10)
    assert quiet.getvalue() == ""


def test_one_progress_helper():
    """Every bar is cvt.progress's: no module of the package builds a tqdm bar of its own."""
    own = [p.relative_to(REPO) for d in ("convert", "qtensor", "quant", "export", "runtime", "schemas", "cvt", "bench")
           for p in (REPO / d).rglob("*.py") if p.name != "progress.py" and re.search(r"\btqdm\(", p.read_text())]
    assert own == []


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Path:
    return write_bf16_checkpoint(tmp_path_factory.mktemp("progress") / "bf16", tiny_qwen3_config(moe=False))


def test_run_and_verify_show_progress_on_stderr_unless_quiet(qwen, tmp_path):
    run = run_cvt("run", qwen, "--prompt", "hi", "--max-new-tokens", "4", "--device", "cpu")
    assert run.rc == 0, run.err
    with open_checkpoint(qwen) as ckpt:  # the load bar counts every tensor's bytes
        size = tqdm.format_sizeof(sum(r.nbytes for r in ckpt.tensors.values()), divisor=1024)
    assert re.search(rf"load: 100%\|[^|]*\| {re.escape(size)}/{re.escape(size)} \[", run.err), run.err
    assert "generate: 100%|" in run.err
    assert "4/4" in run.err.split("generate:")[-1]

    v = run_cvt("verify", qwen, "--reference", qwen, "--report", tmp_path / "rep", "--device", "cpu",
                "--seq-len", "16", "--max-sequences", "2")
    assert v.rc == 0, v.err
    for bar in ("load reference: 100%|", "load candidate: 100%|", "score 2 x 16 tokens: 100%|"):
        assert bar in v.err, v.err
    layers = tiny_qwen3_config(moe=False)["num_hidden_layers"]
    assert f"{2 * (layers + 1)}/{2 * (layers + 1)} [" in v.err  # each model: the embedding, then every layer
    assert ("result: no gates applied: no threshold given (--min-cosine, --max-ppl-ratio, --max-mean-kl, "
            "--min-top1): nothing was checked") in v.out

    for args in (("run", qwen, "--prompt", "hi", "--max-new-tokens", "4", "--device", "cpu"),
                 ("verify", qwen, "--reference", qwen, "--report", tmp_path / "q", "--device", "cpu",
                  "--seq-len", "16", "--max-sequences", "2")):
        q = run_cvt(*args, "--quiet")
        assert q.rc == 0 and q.err == "", q.err


def test_verify_with_gates_prints_the_verdict(qwen, tmp_path):
    v = run_cvt("verify", qwen, "--reference", qwen, "--report", tmp_path / "rep", "--device", "cpu",
                "--seq-len", "16", "--max-sequences", "2", "--min-cosine", "0.99", "--min-top1", "1")
    assert v.rc == 0 and "result: PASSED (2 gates)" in v.out, v.out + v.err


@pytest.mark.slow
def test_bench_missing_dir_is_one_clear_error(tmp_path):
    missing = tmp_path / "nope"
    p = subprocess.run([sys.executable, str(REPO / "bench" / "runtime.py"), "--dir", str(missing)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1] == f"runtime.py: error: argument --dir: {missing}: no such directory (create it first)"
    assert not missing.exists()
    # every bench with a --dir checks it the same way before any work
    for f in sorted((REPO / "bench").glob("*.py")):
        for line in re.findall(r'add_argument\("--dir".*', f.read_text()):
            assert "type=scratch_dir" in line or f.name == "shard.py", f"{f.name}: {line}"  # shard.py creates it
