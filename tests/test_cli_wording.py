"""What the CLI says (issue 23, item 9): bare `cvt`, Ctrl-C, counts and articles, the mixed
recipe's summary, --method's help against what quantize accepts, --soc-version, the missing C
kernels, `--ep` that does not divide, and `cvt shard --dry-run`'s plan options."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from cvt.testing.checkpoints import tiny_deepseek_config, write_bf16_checkpoint, write_fp8_release
from cvt.tests.conftest import run_cvt


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return write_fp8_release(tmp_path_factory.mktemp("wording") / "src")


def test_bare_cvt_prints_the_help():
    """Was `cvt: error: Usage: ...` on stderr, exit 2."""
    for argv in ((), ("export",)):
        r = run_cvt(*argv)
        assert r.rc == 0 and "cvt: error" not in r.out + r.err, (r.rc, r.err)
        assert r.out.startswith("Usage: cvt " + " ".join(argv)) and "Commands:" in r.out
    assert "DeepSeek-V3.2" in run_cvt().out  # a supported family (convert/arch; every one: tests/test_help.py)


SIGINT_AT_CONFIG = textwrap.dedent("""
    import os, signal, sys
    from cvt.cli import main
    src = os.path.abspath(sys.argv[2])
    fired = []
    def hook(event, args):  # a real SIGINT, delivered while the verb opens SRC's config.json
        if (event == "open" and not fired and isinstance(args[0], str) and args[0].startswith(src)
                and args[0].endswith("config.json")):
            fired.append(1)
            os.kill(os.getpid(), signal.SIGINT)
    sys.addaudithook(hook)
    main(sys.argv[1:])
""")


@pytest.mark.parametrize("argv,resumes", [(["fp8-to-bf16", "SRC", "DST"], True), (["inspect", "SRC"], False)])
def test_ctrl_c_says_whether_re_running_resumes(release, tmp_path, argv, resumes):
    """Was `cvt: aborted` for every verb (click turns KeyboardInterrupt into Abort)."""
    argv = [str(release) if a == "SRC" else str(tmp_path / "out") if a == "DST" else a for a in argv]
    p = subprocess.run([sys.executable, "-c", SIGINT_AT_CONFIG, *argv], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 130, p.stderr
    assert last == ("cvt: interrupted; re-run the same command to resume" if resumes else "cvt: interrupted"), p.stderr


def test_counts_and_articles():
    from cvt.units import article, plural

    assert [plural(1, "weight file"), plural(3, "weight file"), plural(0, "linear")] == [
        "1 weight file", "3 weight files", "0 linears"]
    assert [article("other-quantized"), article("awq"), article("bf16")] == ["an other-quantized", "an awq", "a bf16"]


def test_messages_use_them(release, tmp_path):
    """Was "wrote 1 weight files" and "a awq checkpoint"."""
    r = run_cvt("quantize", release, tmp_path / "q", "--scheme", "w8a8")
    assert r.rc == 0 and "wrote 1 weight file (0 already done)" in r.out, r.out
    cfg = tiny_deepseek_config()
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    src = write_bf16_checkpoint(tmp_path / "awq", cfg)
    r = run_cvt("shard", src, tmp_path / "s", "--ep", "2")
    assert r.rc == 1 and ": an awq checkpoint not written by cvt quantize" in r.err, r.err


def test_a_mixed_recipe_summary_counts_each_scheme(release, tmp_path):
    """Was "quantized 69 linears (w8a8, ...)" with 48 of them w4a16."""
    recipe = tmp_path / "r.json"
    recipe.write_text(json.dumps({"rules": [{"pattern": r"mlp\.experts\.", "scheme": "w4a16", "group_size": 32}]}))
    r = run_cvt("quantize", release, tmp_path / "q", "--scheme", "w8a8", "--recipe", recipe)
    assert r.rc == 0, r.err
    tensors = json.loads((tmp_path / "q" / "cvt_manifest.json").read_text())["quant"]["tensors"]
    n = {s: sum(t["scheme"] == s for t in tensors.values()) for s in ("w4a16", "w8a8")}
    assert n["w4a16"] and n["w8a8"]
    first, second = sorted(n, key=lambda s: (-n[s], s))
    assert (f"quantized {len(tensors)} linears ({n[first]} {first}, {n[second]} {second}; rtn; compressed-tensors)"
            in r.out), r.out


def test_method_help_says_what_quantize_accepts():
    """--method's help once said gptq is for w4a16 (it takes w8a8 too) and smoothquant for w8a8
    (w4a16 was accepted, with nothing to smooth): the help lists, per method, exactly the
    schemes whose kernel format the stage accepts (`method_kernels`)."""
    from cvt.cli.main import quantize_cmd
    from cvt.cli.options import METHODS as METHOD_CHOICE, SCHEMES as SCHEME_CHOICE
    from cvt.qtensor.layouts import kernel_formats
    from cvt.qtensor.schemes import get_scheme
    from cvt.quant.stage.assignment import method_kernels

    text = " ".join(next(p for p in quantize_cmd.params if p.name == "method").help.split())
    METHODS, SCHEMES = METHOD_CHOICE.choices, SCHEME_CHOICE.choices
    for m in METHODS:
        kernels = method_kernels(m)
        if kernels is None:
            assert f"{m}: any scheme" in text, m
            continue
        ok = [s for s in SCHEMES if kernel_formats(get_scheme(s)) & set(kernels)]
        assert f"{m}: {', '.join(ok)}" in text and f"{m}: {', '.join(ok)}," not in text, (m, ok, text)


def test_smoothquant_on_a_weight_only_scheme_is_refused(release, tmp_path):
    r = run_cvt("quantize", release, tmp_path / "q", "--scheme", "w4a16", "--method", "smoothquant")
    # issue 37: a usage error (exit 2) that starts with the option, not a module name, and names the
    # schemes the method applies to (the method table's)
    assert r.rc == 2 and r.err == ("cvt: error: --method smoothquant does not apply to --scheme w4a16: it smooths "
                                   "activations for their int8 per-token quantization, which w4a16 does not use; "
                                   "smoothquant applies to --scheme w4a8, w8a8, w8a8c8\n"), r.err
    assert not (tmp_path / "q" / "cvt_manifest.json").exists()


def test_soc_version_must_be_a_known_series(tmp_path):
    """Was: `--soc-version Ascend999` accepted (only the name's shape was checked)."""
    from cvt.errors import CvtError
    from cvt.export.atc import check_soc_version

    for good in ("Ascend910B3", "Ascend310P3", "Ascend910_9392", "Ascend310B1", "Ascend310"):
        assert check_soc_version(good) == good
    with pytest.raises(CvtError, match=r"--soc-version 'Ascend999': no Ascend SoC series 999 \(atc knows 310, 610, "
                                       r"910, 950"):
        check_soc_version("Ascend999")
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "m.onnx")
    r = run_cvt("export", "om", tmp_path / "m.onnx", tmp_path / "om", "--soc-version", "Ascend999", "--dry-run")
    assert r.rc != 0 and "no Ascend SoC series 999" in r.err, r.err


MISSING_KERNELS = textwrap.dedent("""
    import sys
    sys.modules["cvt.convert._fp8kernel"] = None   # what a build without a C compiler leaves: no module
    sys.modules["cvt.quant._qkernel"] = None
    from cvt.convert import fp8
    from cvt.quant import qkernel
    print(fp8.kernel_name(), fp8.kernel_name(), qkernel.kernel_name(), qkernel.kernel_name())
""")


def test_a_missing_c_kernel_is_said_once():
    """Was silent: the torch kernels are several times slower."""
    p = subprocess.run([sys.executable, "-c", MISSING_KERNELS], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.split() == ["torch"] * 4, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("cvt: the C FP8 kernel (cvt.convert._fp8kernel) is not built") and "~8x slower" in lines[0]
    assert lines[1].startswith("cvt: the C quantize kernel (cvt.quant._qkernel) is not built")
    assert all("install gcc or cc and reinstall cvt" in line for line in lines)
    ok = subprocess.run([sys.executable, "-c", "from cvt.convert import fp8; print(fp8.kernel_name())"],
                        capture_output=True, text=True, timeout=120)
    if ok.stdout.strip() == "c":  # built here: nothing to say
        assert ok.stderr == ""


@pytest.mark.slow
def test_ep_that_divides_nothing_says_why():
    """Was "valid ep: 1" alone for --ep 7 on 384 experts."""
    r = run_cvt("plan", os.path.join(os.path.dirname(__file__), "data", "configs", "kimi-k2.json"), "--ep", "7")
    assert r.rc == 3
    assert ("config.n_routed_experts = 384 routed experts: ep 7 does not divide it; valid ep: 1 (the divisors of 384 "
            "that also divide the world size 7; 384's divisors: 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, ... 384)"
            in r.out), r.out


def test_shard_dry_run_takes_the_plan_options(release, tmp_path):
    """`cvt plan --help` says shard --dry-run prints the same plan; shard lacked --format,
    --target and --fp4-format."""
    opts = ["--ep", "4", "--scheme", "w4a16", "--format", "ascend", "--target", "mindie", "--group-size", "64"]
    dry, plan = run_cvt("shard", release, "--dry-run", *opts), run_cvt("plan", release, *opts)
    assert dry.rc == plan.rc == 0 and dry.out == plan.out and "--format ascend --target mindie" in dry.out, dry.err
    fp4 = ["--ep", "4", "--scheme", "fp4", "--format", "ascend", "--fp4-format", "mxfp4"]
    assert run_cvt("shard", release, "--dry-run", *fp4).out == run_cvt("plan", release, *fp4).out
    r = run_cvt("shard", release, tmp_path / "s", "--ep", "4", "--format", "ascend")
    assert r.rc == 2 and "belong to --dry-run" in r.err
