"""Help and summaries that match the code (issue 36, item 2): what --procs says per verb, one
word for processes, the registries' lists and summaries in the help, every architecture in
`cvt --help`, `cvt plan` on a hub id and on degrees that make no layout, the plan's units, the
demo's word on its cached model, fallbacks said by reason (quantize's summary, verify's report)
and a run on several processes saying so."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest

from cvt.testing.checkpoints import tiny_deepseek_config, write_bf16_checkpoint, write_fp8_release
from cvt.tests.conftest import run_cvt

CONFIGS = Path(__file__).resolve().parent / "data" / "configs"


def words(text: str) -> str:
    """Help text with click's line wrapping undone (and a word it broke at a hyphen joined)."""
    return re.sub(r"-\s+", "-", " ".join(text.split()))


def commands(group: click.Group = None, path: str = "cvt"):
    """(path, command) of every verb, `cvt export onnx` included."""
    from cvt.cli import cli

    group = group or cli
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            yield from commands(cmd, f"{path} {name}")
        else:
            yield f"{path} {name}", cmd


def option(cmd: click.Command, name: str) -> click.Option | None:
    return next((p for p in cmd.params if p.name == name), None)


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return write_fp8_release(tmp_path_factory.mktemp("help") / "src")


# ------------------------------------------------------------------------------ --procs, one word
def test_quantize_procs_help_says_what_bytes_hold_per_method():
    """Was "same bytes as one process" for every method; GPTQ on 2 ranks writes other bytes."""
    from cvt.cli.main import quantize_cmd
    from cvt.quant.recipe import DATA_METHODS

    text = words(option(quantize_cmd, "procs").help)
    assert "same bytes as one process" not in text
    assert "Without calibration the bytes are those of one process" in text
    calibrated = text.split("calibrated (", 1)[1].split(")", 1)[0]
    assert all(m in calibrated for m in DATA_METHODS), calibrated
    assert "the same N writes the same bytes" in text


def test_procs_help_names_only_options_its_verb_has():
    """Was "gloo / nccl / hccl by --device" on fp8-to-bf16 and shard, which have no --device."""
    seen = 0
    for path, cmd in commands():
        procs = option(cmd, "procs")
        if procs is None:
            continue
        seen += 1
        names = {o for p in cmd.params for o in p.opts}
        for flag in re.findall(r"--[a-z][a-z0-9-]*", procs.help):
            assert flag in names, (path, flag)
    assert seen == 4  # fp8-to-bf16, quantize, shard, run


def test_procs_means_processes_and_world_size_the_layout():
    """`--procs N`: processes to launch, in every verb that launches them; a visible `--world-size`
    only where it is the parallel layout's world (shard, plan)."""
    launching, layout = set(), set()
    for path, cmd in commands():
        procs = option(cmd, "procs")
        if procs is not None:
            assert procs.opts == ["--procs"] and procs.help.startswith("Processes to launch"), path
            launching.add(path)
        for p in cmd.params:
            if "--world-size" in p.opts and not getattr(p, "hidden", False):
                assert p.name == "world_size" and option(cmd, "ep") is not None, path  # beside the layout degrees
                layout.add(path)
    assert launching == {"cvt fp8-to-bf16", "cvt quantize", "cvt shard", "cvt run"}
    assert layout == {"cvt shard", "cvt plan"}


WARNING = "cvt: warning: --world-size is deprecated for {}; use --procs"


@pytest.mark.parametrize("verb,args", [("fp8-to-bf16", ()), ("quantize", ("--scheme", "w8a8"))])
def test_old_world_size_spelling_warns_once_and_does_what_procs_does(release, tmp_path, verb, args):
    old = run_cvt(verb, release, tmp_path / "old", *args, "--world-size", "1")
    new = run_cvt(verb, release, tmp_path / "new", *args, "--procs", "1")
    assert old.rc == new.rc == 0, old.err
    assert old.err.splitlines()[0] == WARNING.format(verb) and old.err.count("deprecated") == 1
    assert "deprecated" not in new.err
    def said(r, dst):  # the summary, less the timings
        return re.sub(r"[0-9.]+ s( \([^)]*/s\))?", "T", r.out.replace(str(tmp_path / dst), "DST"))

    assert said(old, "old") == said(new, "new")
    files = sorted(p.name for p in (tmp_path / "new").iterdir() if p.suffix == ".safetensors")
    assert files and all((tmp_path / "old" / f).read_bytes() == (tmp_path / "new" / f).read_bytes() for f in files)


def test_run_takes_procs_and_the_old_spelling_with_a_warning(tmp_path):
    """`cvt run` with a process count on a model that is not sharded: the same refusal, naming --procs."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    new = run_cvt("run", tmp_path / "m", "--procs", "2", "--input-ids", "1")
    old = run_cvt("run", tmp_path / "m", "--world-size", "2", "--input-ids", "1")
    assert new.rc == old.rc == 1
    assert "not a cvt shard output" in new.err and "--procs runs sharded checkpoints" in new.err
    assert old.err.splitlines() == [WARNING.format("run"), new.err.strip()]


def test_api_procs_must_be_the_world_it_runs_in(release, tmp_path):
    from cvt import api
    from cvt.errors import CvtError

    with pytest.raises(CvtError, match="this process is not one of 2 torchrun ranks"):
        api.fp8_to_bf16(src=str(release), dst=str(tmp_path / "x"), procs=2)
    assert not (tmp_path / "x").exists()
    assert api.fp8_to_bf16(src=str(release), dst=str(tmp_path / "y"), procs=1).processes == 1


# ------------------------------------------------------------------------------ lists from the registries
def test_quantize_help_lists_every_registered_entry_with_its_summary():
    """Was: 5 of the 8 schemes described (mxfp8, w4a4_mxfp4, w4a8_mxfp had no line), written by hand."""
    from cvt.quant.recipe import METHOD_TABLE
    from cvt.qtensor.formats import FORMATS
    from cvt.qtensor.layouts import ASCEND_TARGETS, TARGET_SUMMARIES
    from cvt.qtensor.schemes import SCHEMES

    r = run_cvt("quantize", "--help", subprocess_=True)
    assert r.rc == 0
    text = words(r.out)
    for registry in (SCHEMES, FORMATS, METHOD_TABLE):
        assert len(registry.summaries()) == len(list(registry))
        for name, summary in registry.summaries().items():
            assert f"{name}: " in text and words(summary) in text, (name, summary)
    assert list(TARGET_SUMMARIES) == list(ASCEND_TARGETS)
    for name in ASCEND_TARGETS:
        assert f"{name}: {words(TARGET_SUMMARIES[name])}" in text


def test_a_registry_entry_without_a_summary_is_refused():
    from cvt.errors import CvtError
    from cvt.registry import Registry

    reg = Registry("scheme", summarized=True)

    class Bare:
        name = "bare"

    class TwoLines:
        name, summary = "two", "one\ntwo"

    for cls in (Bare, TwoLines):
        with pytest.raises(CvtError, match=f"scheme '{cls.name}' has no one-line `summary`"):
            reg.register(cls)


def test_top_level_help_names_every_architecture_table():
    """Was: DeepSeek-V3/R1/V3.1/V3.2, Kimi-K2, Qwen3, Qwen3-MoE, written by hand (no V4, GLM-5,
    Kimi-K2.5). `cvt --help` stays cheap: no torch, no quantization registry."""
    from cvt.convert.arch import TABLES, WRAPPERS

    code = ("import sys\nfrom cvt.cli import main\ntry: main(['--help'])\nexcept SystemExit: pass\n"
            "print([m for m in sys.modules if m == 'torch' or m.startswith('cvt.quant')])")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    out, loaded = p.stdout.rsplit("\n", 2)[0], p.stdout.strip().splitlines()[-1]
    assert loaded == "[]"
    text = words(out)
    displays = [t.display for t in TABLES.values()] + [w.display for w in WRAPPERS.values()]
    assert all(d.strip() for d in displays)
    for d in displays:
        assert words(d) in text, d
    for family in ("DeepSeek-V4", "GLM-5", "Kimi-K2.5", "DeepSeek-V3.2", "Qwen3-MoE"):
        assert family in text


# ------------------------------------------------------------------------------ cvt plan
@pytest.mark.slow
def test_plan_takes_a_hub_id_as_inspect_does(release, tmp_path):
    """Was: "deepseek-ai/DeepSeek-V3: no config.json". The fake hub cache of test_source, offline."""
    from cvt.tests.convert.test_source import COMMIT, REPO_ID, build_hub_cache, hub_env

    build_hub_cache(tmp_path / "hf", release)
    env = hub_env(tmp_path / "hf")
    local = run_cvt("plan", release, "--ep", "2", "--scheme", "w8a8")
    hub = run_cvt("plan", REPO_ID, "--ep", "2", "--scheme", "w8a8", env=env)
    pinned = run_cvt("plan", REPO_ID, "--ep", "2", "--scheme", "w8a8", "--revision", COMMIT, env=env)
    assert local.rc == hub.rc == pinned.rc == 0, hub.err
    assert hub.out == local.out == pinned.out and "memory plan: deepseek_v3" in hub.out
    dry = run_cvt("shard", REPO_ID, "--dry-run", "--ep", "2", "--scheme", "w8a8", env=env)
    assert dry.rc == 0 and dry.out == local.out, dry.err
    missing = run_cvt("plan", "cvt-test/absent", "--ep", "2", env=env)
    assert missing.rc == 1 and "not available from the hub cache" in missing.err, missing.err


def test_degrees_that_make_no_layout_are_the_plans_violations(release, tmp_path):
    """Was: exit 1, "cvt: error: tp 3 does not divide the world size 7"; the exit table says 3
    for plan / shard --dry-run. Every broken degree is listed; writing shards still refuses (1)."""
    r = run_cvt("plan", CONFIGS / "kimi-k2.json", "--ep", "7", "--tp", "3")
    assert r.rc == 3 and r.err == "", r.err
    assert ("layout violations (cvt shard refuses this layout):\n  - tp 3 does not divide the world size 7 "
            "(valid tp: 1, 7)") in r.out, r.out
    both = run_cvt("plan", CONFIGS / "kimi-k2.json", "--ep", "8", "--tp", "3", "--dense-tp", "5")
    assert both.rc == 3 and "  - tp 3 does not divide the world size 8" in both.out
    assert "  - dense_tp 5 does not divide the world size 8" in both.out
    dry = run_cvt("shard", release, "--dry-run", "--ep", "7", "--tp", "3")
    assert dry.rc == 3 and "  - tp 3 does not divide the world size 7" in dry.out, dry.out + dry.err
    write = run_cvt("shard", release, tmp_path / "out", "--ep", "7", "--tp", "3")
    assert write.rc == 1 and "cvt: error: tp 3 does not divide the world size 7" in write.err


def test_plan_cells_show_a_tiny_models_bytes(tmp_path):
    """Was "0.00 GiB" in every cell of the demo model's plan (`cvt.api.plan(...).render()`)."""
    from cvt import api
    from cvt.units import binary_size

    src = write_bf16_checkpoint(tmp_path / "tiny", tiny_deepseek_config())
    plan = api.plan(model=str(src), layout=api.LayoutOptions(ep=2), kv_tokens=64)
    rows = {line.split()[0]: line.split()[1:] for line in plan.render().split("per rank", 1)[1].splitlines()[1:]
            if line.strip() and not line.startswith(" ")}
    rows = {k: v for k, v in rows.items() if k in ("total", "weights", "kv_cache", "norm", "router")}
    assert set(rows) == {"total", "weights", "kv_cache", "norm", "router"}
    for name, cells in rows.items():
        values = [" ".join(cells[i:i + 2]) for i in range(0, len(cells), 2)]  # "4.10 MiB" per cell
        assert len(values) == 3 and not any(v.startswith("0.00 ") or v == "0 B" for v in values), (name, values)
    assert [binary_size(n) for n in (0, 1023, 1536, 5 * 2**30, 3 * 2**40)] == [
        "0 B", "1023 B", "1.50 KiB", "5.00 GiB", "3.00 TiB"]


# ------------------------------------------------------------------------------ the demo
def test_demo_says_whether_it_reuses_its_cached_model(tmp_path):
    """Was: "the first run trains it, about a minute" on every run (2 minutes measured; the
    second run reuses the cache)."""
    from cvt.demo_model import model_file, model_note

    fresh = model_note(tmp_path)
    assert fresh.startswith("(this first run trains it: 200 steps") and "minute" not in fresh
    planted = model_file(tmp_path)
    planted.parent.mkdir(parents=True)
    planted.write_bytes(b"")  # only its presence is read
    assert model_note(tmp_path) == f"(reusing the model an earlier run trained, cached in {planted.parent})"


# ------------------------------------------------------------------------------ fallbacks, said by reason
def _quant_info(fallbacks, methods):
    from cvt.schemas.manifest import Fallback, QuantInfo, QuantTensorInfo

    tensors = {m: QuantTensorInfo(scheme="w8a8", kernel_fmt="w8a8_dynamic", method=meth, group_size=0, sqnr_db=40.0)
               for m, meth in methods.items()}
    return QuantInfo(scheme="w8a8", format="compressed-tensors", method="gptq", tensors=tensors,
                     fallbacks=[Fallback(**f) for f in fallbacks])


def test_fallback_lines_group_by_reason_and_say_where():
    """Was "19 fallbacks": which, and why? (GPTQ on the tiny model: the MTP layer's linears, which
    calibration does not run, got RTN.)"""
    from cvt.convert.quant_summary import fallback_lines

    mtp = [f"model.layers.3.{m}" for m in ("self_attn.q_a_proj", "self_attn.o_proj", "mlp.shared_experts.up_proj")]
    few = {"model.layers.1.mlp.experts.2.up_proj": 3, "model.layers.2.mlp.experts.0.up_proj": 9}
    fbs = ([{"module": m, "method": "gptq", "reason": "not covered by calibration"} for m in mtp]
           + [{"module": m, "method": "gptq", "reason": f"{n} calibration tokens < min_tokens 16", "tokens": n}
              for m, n in few.items()])
    q = _quant_info(fbs, {m: "rtn-fallback" for m in [*mtp, *few]} | {"model.layers.0.self_attn.o_proj": "gptq"})
    assert fallback_lines(q, tiny_deepseek_config()) == [
        "3 linears fell back from gptq to RTN in the MTP layer (layer 3): not covered by calibration",
        "2 linears fell back from gptq to RTN in layers 1-2: 3-9 calibration tokens < min_tokens 16"]


@pytest.fixture(scope="module")
def q96(tmp_path_factory):
    """q LoRA rank 96: q_b_proj's in_features, which w4a16's group 128 does not divide (per channel)."""
    return write_bf16_checkpoint(tmp_path_factory.mktemp("q96") / "src", tiny_deepseek_config(q_lora_rank=96))


GROUP_LINE = ("4 linears fell back in layers 0-2 and the MTP layer (layer 3): group size 128 does not divide "
              "in_features=96: quantized per channel (its own config group)")


@pytest.mark.slow
def test_quantize_summary_and_verify_report_say_the_fallbacks(q96, tmp_path):
    """The summary names the fallbacks by reason (was "4 fallbacks"); verify's report.html and
    report.md show the candidate's methods and fallbacks (they showed neither)."""
    q = run_cvt("quantize", q96, tmp_path / "q", "--scheme", "w4a16")
    assert q.rc == 0, q.err
    assert f"4 fallbacks; worst SQNR" in q.out and f"\n  {GROUP_LINE}\n" in q.out, q.out
    r = run_cvt("verify", tmp_path / "q", "--reference", q96, "--report", tmp_path / "rep", "--seq-len", "16",
                "--max-sequences", "1", "--device", "cpu", "-q")
    assert r.rc == 0, r.err
    manifest = json.loads((tmp_path / "q" / "cvt_manifest.json").read_text())["quant"]
    n = len(manifest["tensors"])
    html = (tmp_path / "rep" / "report.html").read_text()
    header = html.split("<h2", 1)[0]  # the list under the title
    assert f"Quantization methods: rtn ({n} linears); 4 fallbacks<ul><li>{GROUP_LINE}</li></ul>" in header, header
    md = (tmp_path / "rep" / "report.md").read_text().split("\n## ", 1)[0]
    assert f"  - Quantization methods: rtn ({n} linears); 4 fallbacks\n    - {GROUP_LINE}" in md, md
    doc = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert doc["candidate"]["fallback_count"] == 4 and doc["candidate"]["fallbacks"] == [GROUP_LINE]
    assert doc["reference"]["methods"] == {} and "Quantization" not in md.split("- Reference:", 1)[1]


# ------------------------------------------------------------------------------ several processes
@pytest.mark.slow
def test_a_run_on_two_processes_says_so(release, tmp_path):
    """Was: the same summary as one process. A real 2-rank torchrun (gloo) of the tiny fixture."""
    one = run_cvt("fp8-to-bf16", release, tmp_path / "one")
    two = run_cvt("fp8-to-bf16", release, tmp_path / "two", "--procs", "2", subprocess_=True)
    assert one.rc == two.rc == 0, two.err
    assert two.out.splitlines()[-1].endswith("/s) on 2 processes") and one.out.splitlines()[-1].endswith("/s)")
    assert two.out.count("dequantized") == 1  # rank 0's summary alone
    old = run_cvt("fp8-to-bf16", release, tmp_path / "old", "--world-size", "2", subprocess_=True)
    assert old.rc == 0 and old.out.splitlines()[-1].endswith("/s) on 2 processes"), old.err
    assert old.err.count("deprecated") == 1 and WARNING.format("fp8-to-bf16") in old.err
    assert sorted(p.name for p in (tmp_path / "old").iterdir()) == sorted(p.name for p in (tmp_path / "two").iterdir())
    for f in (tmp_path / "two").iterdir():  # the same bytes, manifest included
        assert f.read_bytes() == (tmp_path / "old" / f.name).read_bytes(), f.name
    q = run_cvt("quantize", tmp_path / "one", tmp_path / "q2", "--scheme", "w8a8", "--procs", "2", subprocess_=True)
    assert q.rc == 0 and re.search(r"to .*q2: .* in [0-9.]+ s on 2 processes\n", q.out), q.out + q.err
