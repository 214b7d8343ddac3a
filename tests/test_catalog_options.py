"""The bad-input catalog, continued (issue 37, causes 2, 7-10, 14-17): option values and inputs
that a hostile or careless user hands cvt, each refused before any work with one line naming the
culprit and the README's exit code (2: a bad argument value, knowable from the arguments alone;
1: refused input, which needs a file read to tell).

The cases run through `tests/catalog_harness.py` (`_check`: the real CLI entry point, one
``cvt: error:`` line, SRC untouched, nothing opened or written outside the checkpoint and DST, no
complete-looking DST). Beside it: the bar of tokens through a calibrated layer (cause 7's "no
progress inside a layer").

* 2: ``--procs`` above four ranks per CPU of this node (65 ranks on 2 cores ran 145 s for nothing;
  a million made 919,000 rank folders): exit 2 before torchrun starts; 8, 9: a ``WORLD_SIZE``
  above `cvt.world.MAX_WORLD`, or without MASTER_ADDR / MASTER_PORT: exit 1 naming them, no DST;
* 7: ``--calib-tokens`` above what the calibration text gives (the built-in set or ``--calib``):
  exit 1, naming the option and both counts (the count available depends on the model's
  tokenizer and the file: input, not arguments);
* 10: a ``--calib`` / ``--data`` .jsonl line nested 50,000 deep: exit 1 naming file and line;
* 14 (V4 GPTQ above ``--expert-memory`` said "0.0 GiB"): gone with the refusal itself -- V4 blocks now
  stream their experts a chunk at a time (tests/quant/test_calibrate_v4.py);
* 15: V4 with an int8 / fp8 KV cache: V4 has no KV quantization in cvt (not vllm-ascend's GQA
  rule); ``CVT_WORLD_SIZE`` in the environment named as such (was: "--procs 7 was asked for");
* 16: ``export om`` on a FIFO (not "no such file", never opened); an unknown ``--soc-version``
  (exit 2, naming valid ones);
* 17: ``run --input-ids ,,`` (exit 2 naming the option); ``--method smoothquant`` with w4a16
  (exit 2, naming the schemes it applies to); ``plan --ep 7 --tp 3`` (exit 3, the layout's report).
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest

from cvt.testing.checkpoints_v4 import write_v4_release
from cvt.tests.conftest import run_cvt
from cvt.tests.catalog_harness import _GPTQ, Case, Ctx, _check, _nothing, _verb, _verify, sources  # noqa: F401

SOC = ("--soc-version", "Ascend910B3")
DEEP = "[" * 50_000 + "]" * 50_000  # a JSON value Python's parser cannot descend (RecursionError)


@dataclass
class OptCtx(Ctx):
    v4: Path | None = None  # a DeepSeek-V4 release (FP4 experts)


@dataclass(frozen=True)
class EnvCase(Case):
    env: tuple[tuple[str, str], ...] = ()  # set in os.environ while the CLI runs


# ------------------------------------------------------------------------------ builders
def _write(name: str, text: str):
    """A prep writing ``ctx.tmp / name``; the argv names it as ``@name``."""
    def prep(ctx, src):
        (ctx.tmp / name).write_text(text)
    return prep


def _at(argv: list, ctx: Ctx) -> list:
    return [ctx.tmp / a[1:] if isinstance(a, str) and a.startswith("@") else a for a in argv]


def _with_files(build):
    def wrapped(ctx: Ctx):
        argv, src, dst = build(ctx)
        return _at(argv, ctx), src, dst
    return wrapped


def _om(make) -> callable:
    """`export om ONNX DST ...` with `make(folder)` giving the ONNX path inside a folder of its own
    (the case's SRC)."""
    def build(ctx: Ctx):
        src = ctx.tmp / "graph"
        src.mkdir()
        return ["export", "om", make(src), ctx.tmp / "om"], src, ctx.tmp / "om"
    return build


def _fifo_onnx(folder: Path) -> Path:
    os.mkfifo(folder / "m.onnx")
    return folder / "m.onnx"


def _fifo_in_dir(folder: Path) -> Path:
    os.mkfifo(folder / "m.onnx")
    return folder


def _file_onnx(folder: Path) -> Path:
    (folder / "m.onnx").write_bytes(b"not read: the options are refused first")
    return folder / "m.onnx"


def _om_args(make, *extra):
    def build(ctx: Ctx):
        argv, src, dst = _om(make)(ctx)
        return [*argv, *extra], src, dst
    return build



_SQ_W4A16 = ("--method smoothquant does not apply to --scheme w4a16: it smooths activations for their int8 per-token "
             "quantization, which w4a16 does not use; smoothquant applies to --scheme w4a8, w8a8, w8a8c8")
_V4_NO_KV = ("deepseek_v4: --scheme w8a8c8 --kv-dtype fp8 quantizes the KV cache, and cvt has no KV-cache "
             "quantization for DeepSeek-V4")

CASES = [
    # --- 7: more calibration tokens than the text gives (exit 1: it takes the tokenizer to know)
    # (the counts are the tokenizer's: `test_calib_tokens_above_the_text_name_both_counts`)
    Case("quantize-calib-tokens-1e12-builtin", _verb(["quantize"], "qwen", _nothing, *_GPTQ[:-1], str(10**12)),
         f"--calib-tokens {10**12}: more than the "),
    Case("quantize-calib-tokens-above-calib-file",
         _with_files(_verb(["quantize"], "qwen", _write("calib.txt", "some calibration text " * 20), *_GPTQ[:-1],
                           "5000", "--calib", "@calib.txt")), "--calib-tokens 5000: more than the "),
    # a read of 16 x 10**9 characters allocated that much before (MemoryError, exit 70)
    Case("quantize-calib-tokens-1e9-calib-file",
         _with_files(_verb(["quantize"], "qwen", _write("calib.txt", "some calibration text " * 20), *_GPTQ[:-1],
                           str(10**9), "--calib", "@calib.txt")), f"--calib-tokens {10**9}: more than the "),
    # --- 10: a .jsonl line nested 50,000 deep (was exit 70, RecursionError)
    Case("quantize-calib-jsonl-nested",
         _with_files(_verb(["quantize"], "qwen", _write("deep.jsonl", '{"text": "x = 1"}\n' + DEEP + "\n"), *_GPTQ,
                           "--calib", "@deep.jsonl")), "deep.jsonl:2: JSON nested too deeply"),
    Case("verify-data-jsonl-nested",
         _with_files(_verify("qwen", _write("deep.jsonl", DEEP + "\n"), "--data", "@deep.jsonl")),
         "deep.jsonl:1: JSON nested too deeply"),
    # --- 15: V4 has no KV-cache quantization (was: vllm-ascend's GQA C8 cache is int8)
    Case("quantize-v4-w8a8c8-kv-dtype-fp8",
         _verb(["quantize"], "v4", _nothing, "--scheme", "w8a8c8", "--format", "ascend", "--kv-dtype", "fp8"),
         _V4_NO_KV, rc=2),
    # --- 16: export om
    Case("export-om-onnx-fifo", _om_args(_fifo_onnx, *SOC), "m.onnx: not a regular file (a FIFO)"),
    Case("export-om-onnx-dir-holding-fifo", _om_args(_fifo_in_dir, *SOC), "m.onnx: not a regular file (a FIFO)"),
    Case("export-om-soc-version-unknown-series", _om_args(_file_onnx, "--soc-version", "Ascend999"),
         "Invalid value for '--soc-version': 'Ascend999': no Ascend SoC series 999 (atc knows 310, 610, 910, 950: "
         "e.g. Ascend910B3, Ascend310P3, Ascend910_9392)", rc=2),
    Case("export-om-soc-version-not-a-name", _om_args(_file_onnx, "--soc-version", "ascend910b3"),
         "Invalid value for '--soc-version': 'ascend910b3' is not an Ascend SoC name like Ascend910B3", rc=2),
    # --- 17
    Case("run-input-ids-only-commas", _verb(["run"], "qwen", _nothing, "--input-ids", ",,", dst_name=None),
         "Invalid value for '--input-ids': ',,': no token id in it", rc=2),
    Case("run-input-ids-empty", _verb(["run"], "qwen", _nothing, "--input-ids", "", dst_name=None),
         "Invalid value for '--input-ids': '': no token id in it", rc=2),
    Case("run-input-ids-negative", _verb(["run"], "qwen", _nothing, "--input-ids", "1,-1", dst_name=None),
         "Invalid value for '--input-ids': '1,-1': token id -1 is negative", rc=2),
    Case("run-input-ids-not-integers", _verb(["run"], "qwen", _nothing, "--input-ids", "1,x", dst_name=None),
         "Invalid value for '--input-ids': '1,x': expected comma-separated integers", rc=2),
    Case("run-input-ids-past-the-vocabulary", _verb(["run"], "qwen", _nothing, "--input-ids", "1,99999",
                                                    dst_name=None),
         "--input-ids '1,99999': token id 99999 is outside the vocabulary (0..299)"),  # needs the model: 1
    Case("quantize-smoothquant-w4a16", _verb(["quantize"], "qwen", _nothing, "--scheme", "w4a16", "--method",
                                             "smoothquant"), _SQ_W4A16, rc=2),
    Case("plan-ep-7-tp-3", _verb(["plan"], "fp8", _nothing, "--ep", "7", "--tp", "3", dst_name=None),
         "tp 3 does not divide the world size 7", rc=3, form="report"),
]

# --- 2: more ranks than this node runs (at most 4 per CPU, and cvt.world.MAX_WORLD): refused before torchrun starts
PROCS_CASES = [
    Case("fp8-to-bf16-procs-1000000", _verb(["fp8-to-bf16"], "fp8", _nothing, "--procs", "1000000"),
         "--procs 1000000: this node gives cvt ", rc=2),
    Case("quantize-procs-5000", _verb(["quantize"], "qwen", _nothing, "--scheme", "w8a8", "--procs", "5000"),
         "--procs 5000: this node gives cvt ", rc=2),
    Case("shard-procs-100000", _verb(["shard"], "qwen", _nothing, "--ep", "2", "--procs", "100000"),
         "--procs 100000: this node gives cvt ", rc=2),
]
CASES += PROCS_CASES

# --- 15: CVT_WORLD_SIZE (set by `--procs N` for its ranks) left in a user's environment; 9: a WORLD_SIZE
# no list may be sized by; 8: WORLD_SIZE without the address the ranks meet at
ENV_CASES = [
    EnvCase("fp8-to-bf16-cvt-world-size-in-env", _verb(["fp8-to-bf16"], "fp8", _nothing),
            "CVT_WORLD_SIZE=7 in the environment", env=(("CVT_WORLD_SIZE", "7"),)),
    EnvCase("fp8-to-bf16-world-size-10-to-the-30", _verb(["fp8-to-bf16"], "fp8", _nothing),
            f"WORLD_SIZE {10**30}: above the 4096 ranks cvt runs on", env=(("WORLD_SIZE", str(10**30)), ("RANK", "0"))),
    EnvCase("quantize-world-size-without-master-addr", _verb(["quantize"], "qwen", _nothing, "--scheme", "w8a8"),
            "WORLD_SIZE 2 without MASTER_ADDR / MASTER_PORT: the ranks meet at MASTER_ADDR:MASTER_PORT",
            env=(("WORLD_SIZE", "2"), ("RANK", "0"), ("MASTER_ADDR", ""), ("MASTER_PORT", ""))),
    EnvCase("fp8-to-bf16-world-size-without-master-port", _verb(["fp8-to-bf16"], "fp8", _nothing),
            "WORLD_SIZE 2 without MASTER_PORT: ",
            env=(("WORLD_SIZE", "2"), ("RANK", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", ""))),
]


@pytest.fixture(scope="module")
def v4_release(tmp_path_factory):
    return write_v4_release(tmp_path_factory.mktemp("catalog-v4") / "v4")


def _run_case(case: Case, sources, v4_release, tmp_path, monkeypatch):
    fp8, bf16, qwen = sources
    for k, v in getattr(case, "env", ()):
        monkeypatch.setenv(k, v)
    # a FIFO opened for reading blocks until a writer comes: fail the case rather than hang the suite
    old = signal.signal(signal.SIGALRM, lambda *a: pytest.fail(f"{case.id}: still running after 240 s"))
    signal.alarm(240)
    try:
        _check(OptCtx(tmp_path, fp8, bf16, qwen, v4=v4_release), case)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_option(case: Case, sources, v4_release, tmp_path, monkeypatch):
    _run_case(case, sources, v4_release, tmp_path, monkeypatch)


@pytest.mark.parametrize("case", ENV_CASES, ids=lambda c: c.id)
def test_bad_environment(case: EnvCase, sources, v4_release, tmp_path, monkeypatch):
    _run_case(case, sources, v4_release, tmp_path, monkeypatch)


@pytest.mark.slow  # a calibrated quantize run
def test_the_default_calib_tokens_still_take_a_shorter_file(sources, tmp_path, caplog):
    """The default --calib-tokens is a bound, not a demand: a --calib file shorter than 32768
    tokens is used whole, with one warning (docs/quantize.md); only a count the user gives is
    refused when the text is shorter."""
    _, _, qwen = sources
    calib = tmp_path / "calib.txt"
    calib.write_text("x = 1\n" * 100)
    r = run_cvt("quantize", qwen, tmp_path / "q", "--scheme", "w8a8", "--method", "smoothquant", "--calib", calib,
                "--quiet")
    assert r.rc == 0, r.err
    assert "fewer than the 32768 asked for (--calib-tokens)" in r.err + caplog.text
    cal = json.loads((tmp_path / "q" / "cvt_manifest.json").read_text())["quant"]["calibration"]
    assert cal["tokens"] == 512  # 601 tokens of text: two sequences of 256


def test_calib_tokens_above_the_text_name_both_counts(tmp_path):
    """A byte-level tokenizer gives one token per byte of text plus the BOS: the built-in set's
    count is its UTF-8 length + 1, a file's likewise; asking one more is refused naming both."""
    from types import SimpleNamespace

    from cvt import corpus
    from cvt.errors import CvtError
    from cvt.quant.methods.data import calib_tokens

    tok = SimpleNamespace(encode=lambda t: [256] + list(t.encode()), bos_id=256)
    have = 1 + len(corpus.text("calibration").encode())
    with pytest.raises(CvtError) as e:
        calib_tokens(tok, None, seq_len=256, max_sequences=(have + 1) // 256 + 1, asked=have + 1)
    assert str(e.value) == (f"--calib-tokens {have + 1}: more than the {have} tokens the built-in calibration set "
                            f"gives with this model's tokenizer; give --calib-tokens {have} or fewer, or a --calib "
                            "file with more text")
    assert calib_tokens(tok, None, seq_len=256, max_sequences=have // 256, asked=have).numel() == have // 256 * 256
    (tmp_path / "c.txt").write_text("x = 1\n" * 100)  # 600 bytes
    with pytest.raises(CvtError, match=r"^--calib-tokens 602: more than the 601 tokens --calib .*c\.txt gives "):
        calib_tokens(tok, tmp_path / "c.txt", seq_len=256, max_sequences=2, asked=602)
    assert calib_tokens(tok, tmp_path / "c.txt", seq_len=256, max_sequences=2, asked=601).shape == (2, 256)


def test_a_calibrated_layer_shows_the_tokens_through_it():
    """Progress inside a layer (cause 7: no layer done in 600 s, nothing moving): a bar under the
    layers' counts the tokens through the decoder layer, batch by batch, one pass at a time."""
    import torch

    from cvt.quant.methods.stream import _layer_progress

    layer = torch.nn.Linear(4, 4)
    with _layer_progress(layer, "layer 2/3", 2 * 3 * 5, quiet=False) as bar:
        for p in range(3):  # three passes of two batches of [3, 5, 4] (3 sequences of 5 tokens)
            layer(torch.zeros(3, 5, 4))
            assert bar.n == 15 and bar.total == 30
            layer(torch.zeros(3, 5, 4))
            assert bar.n == 30 and bar.desc.removesuffix(": ") == ("layer 2/3" if p == 0 else f"layer 2/3, pass {p + 1}")
    assert not layer._forward_hooks  # the hook goes with the layer's calibration


@pytest.mark.slow  # a calibrated quantize run
def test_quantize_shows_the_layer_bar(sources, tmp_path):
    _, _, qwen = sources
    r = run_cvt("quantize", qwen, tmp_path / "q", "--scheme", "w8a8", "--method", "smoothquant", "--calib-tokens",
                "1024")
    assert r.rc == 0, r.err
    frames = r.err.replace("\r", "\n")
    assert "layer 1/3:" in frames and "/1024 [" in frames and "layer 3/3, pass 2" in frames, frames[-3000:]
