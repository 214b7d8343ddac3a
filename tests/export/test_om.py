"""`cvt export om`: the atc pre-check, the command builder, and running atc.

No real atc exists on the machines these tests run on: the runs use a stub `atc` executable
on PATH (a contract test: it records its argv, writes `<output>.om`, prints log lines and
exits with the code in $STUB_ATC_EXIT). The graphs are tiny ONNX models built here with
onnx.helper, independent of `cvt export onnx`.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from cvt.cli.export import om_cmd as om_command
from cvt.errors import CvtError, OutputError
from cvt.export.atc import MAX_OPSET, MIN_OPSET, PRECISION_MODES, SUPPORTED_OPS
from cvt.export.om import (
    AtcFailedError,
    AtcNotFoundError,
    GraphCheckError,
    atc_command,
    check_for_atc,
    precheck,
    resolve_input_shape,
)

SOC = "Ascend910B3"


# -- tiny graphs ------------------------------------------------------------------------------
def _model(nodes, inputs, outputs, inits=(), opset=17, extra_opsets=(), functions=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    opsets = [helper.make_opsetid("", opset), *(helper.make_opsetid(d, v) for d, v in extra_opsets)]
    # IR 8 (ONNX 1.12, what atc documents) unless the opset needs a newer one
    return helper.make_model(graph, opset_imports=opsets, functions=list(functions), ir_version=8 if opset <= 18 else 10)


def mm_softmax(x_dims=(2, 8), opset=17, dtype=TensorProto.FLOAT):
    """x[2,8] @ W[8,4] -> Softmax -> y: what every LLM graph is made of."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32), "W")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
             helper.make_node("Softmax", ["h"], ["y"], name="sm", axis=-1)]
    if dtype != TensorProto.FLOAT:
        w = helper.make_tensor("W", dtype, [8, 4], [0.0] * 32)
    return _model(nodes, [helper.make_tensor_value_info("x", dtype, list(x_dims))],
                  [helper.make_tensor_value_info("y", dtype, [x_dims[0], 4])], [w], opset=opset)


def matmulnbits():
    """onnxruntime's W4A16 fast path: com.microsoft.MatMulNBits."""
    node = helper.make_node("MatMulNBits", ["x", "Wq", "scales"], ["y"], name="layers.0.mlp", domain="com.microsoft",
                            K=8, N=4, bits=4, block_size=32)
    inits = [helper.make_tensor("Wq", TensorProto.UINT8, [4, 1, 16], [0] * 64),
             helper.make_tensor("scales", TensorProto.FLOAT, [4], [1.0] * 4)]
    return _model([node], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], inits,
                  extra_opsets=[("com.microsoft", 1)])


def blockwise_dq():
    """W4A16 as opset-21 blockwise DequantizeLinear(int4, block_size=4) + MatMul."""
    inits = [helper.make_tensor("Wq", TensorProto.INT4, [8, 4], [1] * 32),
             helper.make_tensor("s", TensorProto.FLOAT, [2, 4], [0.5] * 8)]
    nodes = [helper.make_node("DequantizeLinear", ["Wq", "s"], ["W"], name="dq", axis=0, block_size=4),
             helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], inits, opset=21)


def with_op(op_type, domain=""):
    node = helper.make_node(op_type, ["x"], ["y"], name=f"my_{op_type}", domain=domain)
    return _model([node], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])])


def save(model, path: Path) -> Path:
    onnx.save(model, str(path))
    return path


# -- pre-check --------------------------------------------------------------------------------
def test_precheck_passes_a_plain_matmul_softmax_graph(tmp_path):
    model = mm_softmax()
    onnx.checker.check_model(model)
    assert precheck(model, SOC) == []
    assert precheck(save(model, tmp_path / "m.onnx"), SOC) == []
    check_for_atc(tmp_path / "m.onnx", SOC)  # does not raise


def test_op_table_covers_what_an_llm_graph_uses():
    llm = ("MatMul Gemm Add Mul Div Sub Pow Sqrt Reciprocal Softmax Gather Concat Reshape Transpose Slice Unsqueeze "
           "Squeeze Cast Where Expand Shape Range Sigmoid Tanh Neg ReduceMean ReduceSum ReduceMax TopK Equal Less "
           "Greater ScatterElements Sin Cos Exp Log Erf Split ConstantOfShape Constant Trilu CumSum LayerNormalization")
    assert set(llm.split()) <= SUPPORTED_OPS
    assert not {"DequantizeLinear", "QuantizeLinear", "MatMulInteger", "MatMulNBits", "CastLike"} & SUPPORTED_OPS
    assert (MIN_OPSET, MAX_OPSET) == (9, 18)


def test_refuses_matmulnbits_naming_it():
    with pytest.raises(GraphCheckError) as ei:
        check_for_atc(matmulnbits(), SOC)
    msg = str(ei.value)
    assert "com.microsoft.MatMulNBits" in msg and "layers.0.mlp" in msg and "export float weights" in msg
    assert ei.value.exit_code == 3 and [p.what for p in ei.value.problems] == ["com.microsoft.MatMulNBits"]


def test_refuses_opset21_blockwise_dequantizelinear(tmp_path):
    problems = precheck(save(blockwise_dq(), tmp_path / "w4.onnx"), SOC)
    by_what = {p.what: p for p in problems}
    assert set(by_what) == {"opset 21", "DequantizeLinear", "dtype INT4"}
    assert "block_size=4" in by_what["DequantizeLinear"].reason and by_what["DequantizeLinear"].where == ("dq",)
    assert "9..18" in by_what["opset 21"].reason
    with pytest.raises(GraphCheckError, match=r"w4\.onnx: atc would not convert this graph \(3 problems\).*DequantizeLinear"):
        check_for_atc(tmp_path / "w4.onnx", SOC)


@pytest.mark.parametrize("op,domain,expect", [
    ("FancyAttention", "", "not in CANN's ONNX operator list"),
    ("CastLike", "", "use Cast"),
    ("Whatever", "my.vendor", "domain 'my.vendor' is not ai.onnx"),
], ids=["unknown-op", "castlike", "vendor-domain"])
def test_refuses_unknown_ops_naming_them(op, domain, expect):
    name = f"{domain}.{op}" if domain else op
    with pytest.raises(GraphCheckError, match=rf"{name} \(at my_{op}\): .*{expect}"):
        check_for_atc(with_op(op, domain))


def test_every_offending_op_is_named_once_with_a_count():
    # two FancyOps in the then-branch of an If, one QuantizeLinear at the top
    then = helper.make_graph([helper.make_node("FancyOp", ["x"], ["a"], name="f1"),
                              helper.make_node("FancyOp", ["a"], ["t"], name="f2")], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, [2, 8])])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, [2, 8])])
    nodes = [helper.make_node("If", ["c"], ["y"], name="branch", then_branch=then, else_branch=other),
             helper.make_node("QuantizeLinear", ["y", "s"], ["q"], name="quant")]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8]),
                           helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                   [helper.make_tensor_value_info("q", TensorProto.INT8, [2, 8])],
                   [helper.make_tensor("s", TensorProto.FLOAT, [], [0.1])])
    problems = {p.what: p for p in precheck(model)}
    assert set(problems) == {"FancyOp", "QuantizeLinear"}
    assert problems["FancyOp"].count == 2 and problems["FancyOp"].where == ("f1", "f2")
    assert "FancyOp x2 (at f1, f2)" in str(problems["FancyOp"])
    # a user who has a parser plugin for QuantizeLinear can vouch for it
    assert {p.what for p in precheck(model, allow_ops=["QuantizeLinear"])} == {"FancyOp"}


def test_bfloat16_only_on_socs_that_have_it():
    model = mm_softmax(dtype=TensorProto.BFLOAT16)
    assert precheck(model, "Ascend910B3") == [] and precheck(model, "Ascend910_9392") == []
    (p,) = precheck(model, "Ascend310P3")
    assert p.what == "dtype BFLOAT16" and "Ascend310P3 has no bfloat16" in p.reason and p.count == 3


def test_opset_outside_atc_range():
    assert [p.what for p in precheck(mm_softmax(opset=8))] == ["opset 8"]
    assert precheck(mm_softmax(opset=19), max_opset=19) == []


def test_graph_without_inputs_and_local_functions():
    const = helper.make_node("Constant", [], ["y"], name="c", value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0]))
    model = _model([const], [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    assert [(p.what, "E16001" in p.reason) for p in precheck(model)] == [("graph", True)]
    fn = helper.make_function("local", "MyGelu", ["x"], ["y"], [helper.make_node("Erf", ["x"], ["y"])],
                              [helper.make_opsetid("", 17)])
    model = _model([helper.make_node("MyGelu", ["x"], ["y"], name="g", domain="local")],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
                   extra_opsets=[("local", 1)], functions=[fn])
    (p,) = precheck(model)
    assert p.what == "local.MyGelu" and "inline_local_functions" in p.reason


def test_allow_op_covers_plugin_ops_but_not_int4():
    assert precheck(matmulnbits(), allow_ops=["com.microsoft.MatMulNBits"]) == []
    assert {p.what for p in precheck(blockwise_dq(), max_opset=21, allow_ops=["DequantizeLinear"])} == \
        {"DequantizeLinear", "dtype INT4"}


def test_unreadable_file_is_one_clear_error(tmp_path):
    (tmp_path / "bad.onnx").write_bytes(b"\x00not a protobuf\xff" * 4)
    with pytest.raises(CvtError, match=r"bad\.onnx: not a readable ONNX model"):
        precheck(tmp_path / "bad.onnx")


# -- the command ------------------------------------------------------------------------------
def test_command_minimal_exact_argv(tmp_path):
    cmd = atc_command(tmp_path / "m.onnx", tmp_path / "out" / "m.om", SOC)
    assert cmd == ["atc", "--framework=5", f"--model={tmp_path}/m.onnx", f"--output={tmp_path}/out/m",
                   "--soc_version=Ascend910B3", "--input_format=ND"]


def test_command_every_flag_exact_argv(tmp_path):
    cmd = atc_command(tmp_path / "m.onnx", tmp_path / "m", "Ascend310P3",
                      input_shape="input_ids:1,-1;attention_mask:1,-1", dynamic_dims="128,128;512,512;2048,2048",
                      precision_mode="must_keep_origin_dtype", log="error", extra=["--op_select_implmode=high_precision"])
    assert cmd == ["atc", "--framework=5", f"--model={tmp_path}/m.onnx", f"--output={tmp_path}/m",
                   "--soc_version=Ascend310P3", "--input_format=ND",
                   "--input_shape=input_ids:1,-1;attention_mask:1,-1", "--dynamic_dims=128,128;512,512;2048,2048",
                   "--precision_mode=must_keep_origin_dtype", "--log=error", "--op_select_implmode=high_precision"]
    # printed for a shell: the ';' values are quoted, everything else is as is
    assert shlex.split(shlex.join(cmd)) == cmd and "'--input_shape=input_ids:1,-1;attention_mask:1,-1'" in shlex.join(cmd)


def test_documented_precision_modes():
    assert set(PRECISION_MODES) == {"force_fp32", "cube_fp16in_fp32out", "force_fp16", "allow_fp32_to_fp16",
                                    "must_keep_origin_dtype", "allow_mix_precision", "allow_mix_precision_fp16",
                                    "allow_mix_precision_bf16", "allow_fp32_to_bf16"}


@pytest.mark.parametrize("kw,msg", [
    ({"soc_version": "ascend910b3"}, "not an Ascend SoC name like Ascend910B3"),
    ({"soc_version": "Ascend910B3 "}, "not an Ascend SoC name"),
    ({"precision_mode": "fp16"}, "choose one of force_fp32"),
    ({"soc_version": "Ascend310P3", "precision_mode": "allow_mix_precision_bf16"}, "Ascend310P3 does not have"),
    ({"input_format": "NHWC"}, "atc takes ND, NCHW, NCDHW"),
    ({"log": "verbose"}, "choose one of debug"),
    ({"dynamic_dims": "1;2"}, "--dynamic-dims needs --input-shape"),
    ({"input_shape": "x:1,-1", "dynamic_dims": "4"}, "2 to 100 profiles"),
    ({"input_shape": "x:1,-1", "dynamic_dims": "4,4;8,8"}, "2 value\\(s\\) per profile but --input-shape has 1"),
    ({"input_shape": "x:1,-1", "dynamic_dims": "4;8", "input_format": "NCHW"}, "needs --input-format ND"),
    ({"input_shape": "x:1,0"}, "dim '0' is not a positive size"),
    ({"input_shape": "x"}, "is not name:d0,d1"),
    ({"input_shape": "x:1,-1", "soc_version": "Ascend310B1"}, "does not take shape ranges"),
    ({"extra": ["--soc_version=Ascend310"]}, "--soc_version is set by cvt"),
    ({"extra": ["-v"]}, "is not --flag or --flag=value"),
    ({"extra": ["--precision_mode_v2=fp16"], "precision_mode": "force_fp16"}, "precision_mode_v2"),
], ids=lambda v: str(v)[:40])
def test_command_refuses_undocumented_values(tmp_path, kw, msg):
    kw = {"soc_version": SOC, **kw}
    with pytest.raises(CvtError, match=msg):
        atc_command(tmp_path / "m.onnx", tmp_path / "m", kw.pop("soc_version"), **kw)


def test_output_path_characters(tmp_path):
    with pytest.raises(CvtError, match="atc accepts only letters"):
        atc_command(tmp_path / "m.onnx", tmp_path / "my out" / "m", SOC)


# -- input shapes -----------------------------------------------------------------------------
def _two_inputs(ids_dims, mask_dims):
    nodes = [helper.make_node("Add", ["ids", "mask"], ["y"])]
    return _model(nodes, [helper.make_tensor_value_info("ids", TensorProto.INT64, ids_dims),
                          helper.make_tensor_value_info("mask", TensorProto.INT64, mask_dims)],
                  [helper.make_tensor_value_info("y", TensorProto.INT64, ids_dims)])


def test_input_shape_derived_from_a_static_graph():
    assert resolve_input_shape(mm_softmax()) == "x:2,8"
    assert resolve_input_shape(_two_inputs([1, 16], [1, 16])) == "ids:1,16;mask:1,16"


def test_dynamic_inputs_need_a_shape_and_the_error_shows_the_template():
    model = _two_inputs(["batch", "seq"], [1, "seq"])
    with pytest.raises(CvtError, match=r'dynamic graph inputs ids\[batch,seq\], mask\[1,seq\]: '
                                       r'pass --input-shape "ids:-1,-1;mask:1,-1"'):
        resolve_input_shape(model)
    assert resolve_input_shape(model, "ids:1,128;mask:1,128") == "ids:1,128;mask:1,128"
    assert resolve_input_shape(model, "mask:1,-1; ids:1,-1", "64,64;128,128") == "ids:1,-1;mask:1,-1"
    # a static input the user leaves out is filled in from the graph
    assert resolve_input_shape(_two_inputs(["b", 16], [1, 16]), "ids:4,16") == "ids:4,16;mask:1,16"
    # an input of unknown rank takes whatever the user gives, and nothing by default
    model = _two_inputs(None, [1, 16])
    assert resolve_input_shape(model, "ids:1,16") == "ids:1,16;mask:1,16"
    with pytest.raises(CvtError, match=r'ids\[rank \?\]: pass --input-shape "ids:d0,d1,..."'):
        resolve_input_shape(model)


@pytest.mark.parametrize("spec,dims,msg", [
    ("ids:1,128;nope:1", None, "'nope', which is not a graph input; inputs: ids\\[batch,seq\\], mask\\[1,seq\\]"),
    ("ids:1;mask:1,8", None, "ids: 1 dims given, the graph input has rank 2"),
    ("ids:1,8;mask:2,8", None, "mask: dim 0 is fixed to 1 in the graph, got 2"),
    ("ids:1,8;ids:1,9", None, "duplicate input name"),
    ("ids:1,-1;mask:1,-1", "8;16;32,4", "same number of values"),
    ("ids:1,-1;mask:1,-1", "8;16", "1 value\\(s\\) per profile but --input-shape has 2"),
])
def test_input_shape_checked_against_the_graph(spec, dims, msg):
    with pytest.raises(CvtError, match=msg):
        resolve_input_shape(_two_inputs(["batch", "seq"], [1, "seq"]), spec, dims)


# -- running atc: contract tests with a stub -------------------------------------------------
STUB = textwrap.dedent("""\
    #!{python}
    # stub atc (contract test): record argv, print log lines, write <output>.om, exit $STUB_ATC_EXIT
    import json, os, sys
    args = sys.argv[1:]
    with open(os.environ["STUB_ATC_RECORD"], "w") as f:
        json.dump(args, f)
    print("ATC start working now, please wait for a moment.", flush=True)
    out = next(a.split("=", 1)[1] for a in args if a.startswith("--output="))
    code = int(os.environ.get("STUB_ATC_EXIT", "0"))
    with open(out + ".om", "wb") as f:  # also on failure: a partial file cvt must not leave behind
        f.write(b"OM" + json.dumps(args).encode())
    if code:
        print("E10001: Value [x:9] for parameter [--input_shape] is invalid.", file=sys.stderr, flush=True)
        print("ATC run failed, Please check the detail log, Try 'atc --help' for more information", flush=True)
    else:
        print("ATC run success, welcome to the next use.", flush=True)
    sys.exit(code)
    """)


@pytest.fixture
def stub_atc(tmp_path, monkeypatch):
    """A stub `atc` first on PATH; returns the file it records its argv into."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "atc"
    exe.write_text(STUB.format(python=sys.executable))
    exe.chmod(0o755)
    record = tmp_path / "atc-argv.json"
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("STUB_ATC_RECORD", str(record))
    monkeypatch.delenv("STUB_ATC_EXIT", raising=False)
    return record


@pytest.fixture
def no_atc(tmp_path, monkeypatch):
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


def invoke(*args):
    return CliRunner().invoke(om_command, [str(a) for a in args])


def test_contract_stub_atc_invocation_log_and_om(tmp_path, stub_atc):
    """Contract test (no real atc here): the stub sees exactly the built argv; its output lands
    in DST/<name>.atc.log, its .om in DST, and the command in DST/<name>.atc.sh."""
    onnx_path = save(mm_softmax(), tmp_path / "m.onnx")
    dst = tmp_path / "dst"
    r = invoke(onnx_path, dst, "--soc-version", SOC, "--precision-mode", "force_fp32")
    assert r.exit_code == 0, (r.output, r.exception)
    expected = ["--framework=5", f"--model={onnx_path}", f"--output={dst}/m", f"--soc_version={SOC}",
                "--input_format=ND", "--input_shape=x:2,8", "--precision_mode=force_fp32"]
    assert json.loads(stub_atc.read_text()) == expected
    assert (dst / "m.om").read_bytes() == b"OM" + json.dumps(expected).encode()
    log_text = (dst / "m.atc.log").read_text()
    assert log_text.startswith("$ atc --framework=5 ") and "ATC run success" in log_text and "ATC start working" in log_text
    assert shlex.split((dst / "m.atc.sh").read_text().splitlines()[-1]) == ["atc", *expected]
    assert f"wrote {dst}/m.om" in r.output and "atc log:" in r.output

    # the same DST again: refused without --overwrite, nothing touched
    r = invoke(onnx_path, dst, "--soc-version", SOC)
    assert isinstance(r.exception, OutputError) and "already holds m.om" in str(r.exception)


@pytest.mark.parametrize("name", ["m.atc.log", "m.atc.sh", "m.om"])
def test_symlink_in_dst_is_refused(tmp_path, stub_atc, name):
    """A link in DST where export om writes its log, script or OM: refused before atc runs (the
    log and script were written through it, outside DST)."""
    onnx_path = save(mm_softmax(), tmp_path / "m.onnx")
    dst = tmp_path / "dst"
    dst.mkdir()
    target = tmp_path / "outside.txt"
    target.write_text("not cvt's")
    (dst / name).symlink_to(target)
    r = invoke(onnx_path, dst, "--soc-version", SOC, "--overwrite")
    assert isinstance(r.exception, OutputError) and f"{name}: is a symlink" in str(r.exception)
    assert target.read_text() == "not cvt's" and not stub_atc.exists()  # atc never ran


def test_contract_stub_atc_failure_propagates(tmp_path, stub_atc, monkeypatch):
    """Contract test: atc exiting 1 is an error quoting its last log lines; no .om is left."""
    onnx_path = save(mm_softmax(), tmp_path / "m.onnx")
    dst = tmp_path / "dst"
    monkeypatch.setenv("STUB_ATC_EXIT", "1")
    r = invoke(onnx_path, dst, "--soc-version", SOC, "--overwrite")
    assert isinstance(r.exception, AtcFailedError) and r.exit_code == 1
    msg = str(r.exception)
    assert "atc exited with code 1" in msg and f"{dst}/m.atc.log" in msg
    assert "E10001: Value [x:9]" in msg and "ATC run failed" in msg and "\n" not in msg
    assert not list(dst.glob("*.om")) and "E10001" in (dst / "m.atc.log").read_text()


def test_absent_atc_prints_the_command_and_fails(tmp_path, no_atc):
    onnx_path = save(mm_softmax(), tmp_path / "m.onnx")
    r = invoke(onnx_path, tmp_path / "dst", "--soc-version", SOC)
    assert isinstance(r.exception, AtcNotFoundError) and r.exit_code == 1
    cmd = ["atc", "--framework=5", f"--model={onnx_path}", f"--output={tmp_path}/dst/m", f"--soc_version={SOC}",
           "--input_format=ND", "--input_shape=x:2,8"]
    assert shlex.split(r.stdout.strip()) == cmd
    assert "atc is not on PATH" in str(r.exception) and "CANN toolkit" in str(r.exception)
    assert not (tmp_path / "dst").exists()


def test_dry_run_prints_the_command_and_writes_nothing(tmp_path, no_atc):
    onnx_path = save(_two_inputs(["b", "s"], ["b", "s"]), tmp_path / "g.onnx")
    r = invoke(tmp_path, tmp_path / "dst", "--soc-version", "Ascend310P3", "--input-shape", "ids:1,-1;mask:1,-1",
               "--dynamic-dims", "16,16;32,32", "--dry-run")  # a directory holding one .onnx works too
    assert r.exit_code == 0, (r.output, r.exception)
    assert shlex.split(r.output.strip()) == [
        "atc", "--framework=5", f"--model={onnx_path}", f"--output={tmp_path}/dst/g", "--soc_version=Ascend310P3",
        "--input_format=ND", "--input_shape=ids:1,-1;mask:1,-1", "--dynamic_dims=16,16;32,32"]
    assert not (tmp_path / "dst").exists()


def test_precheck_runs_before_atc(tmp_path, stub_atc):
    onnx_path = save(matmulnbits(), tmp_path / "w4.onnx")
    r = invoke(onnx_path, tmp_path / "dst", "--soc-version", SOC)
    assert isinstance(r.exception, GraphCheckError) and r.exception.exit_code == 3
    assert "com.microsoft.MatMulNBits" in str(r.exception) and not stub_atc.exists()


def test_verify_needs_ais_bench(tmp_path, stub_atc, monkeypatch):
    monkeypatch.setitem(sys.modules, "ais_bench", None)  # not importable, even if installed
    r = invoke(save(mm_softmax(), tmp_path / "m.onnx"), tmp_path / "dst", "--soc-version", SOC, "--verify")
    assert isinstance(r.exception, CvtError) and "--verify needs ais_bench" in str(r.exception)
    assert not stub_atc.exists()  # said before spending time in atc


FAKE_AIS_BENCH = '''\
"""Fake ais_bench (contract test): InferSession runs the ONNX graph named in $FAKE_OM_ONNX."""
import os
import onnxruntime as ort

class InferSession:
    def __init__(self, device_id, model_path):
        assert model_path.endswith(".om")
        self.sess = ort.InferenceSession(os.environ["FAKE_OM_ONNX"], providers=["CPUExecutionProvider"])

    def infer(self, feeds, mode="static", custom_sizes=None):
        assert mode == "static"
        names = [i.name for i in self.sess.get_inputs()]
        return [o.ravel() for o in self.sess.run(None, dict(zip(names, feeds)))]
'''


def test_verify_with_ais_bench_compares_outputs(tmp_path, stub_atc, monkeypatch):
    """Contract test: --verify feeds the same inputs to ais_bench's InferSession and onnxruntime."""
    pkg = tmp_path / "fake" / "ais_bench" / "infer"
    pkg.mkdir(parents=True)
    (pkg.parent / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "interface.py").write_text(FAKE_AIS_BENCH)
    monkeypatch.syspath_prepend(str(tmp_path / "fake"))
    onnx_path = save(mm_softmax(), tmp_path / "m.onnx")
    monkeypatch.setenv("FAKE_OM_ONNX", str(onnx_path))
    r = invoke(onnx_path, tmp_path / "dst", "--soc-version", SOC, "--verify")
    assert r.exit_code == 0, (r.output, r.exception)
    assert "verify y: cosine 1.000000, max abs err 0" in r.output


def test_exit_codes_through_the_real_entry_point(tmp_path):
    """`cvt ... om` via cvt.cli.main: missing atc -> 1 (command on stdout, one error line),
    unsupported op -> 3, bad usage -> 2."""
    ok = save(mm_softmax(), tmp_path / "m.onnx")
    bad = save(matmulnbits(), tmp_path / "w4.onnx")
    script = textwrap.dedent(f"""\
        import contextlib, io, json, sys
        from cvt.cli import cli, main
        from cvt.cli.export import om_cmd
        cli.add_command(om_cmd)
        res = []
        for argv in {[["om", str(ok), str(tmp_path / "d"), "--soc-version", SOC],
                      ["om", str(bad), str(tmp_path / "d"), "--soc-version", SOC],
                      ["om", str(ok), str(tmp_path / "d")]]!r}:
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    main(argv)
                except SystemExit as e:
                    res.append([e.code, out.getvalue(), err.getvalue()])
        print(json.dumps(res))
        """)
    env = {**os.environ, "PATH": str(tmp_path)}
    env.pop("CVT_DEBUG", None)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    (rc1, out1, err1), (rc3, _, err3), (rc2, _, err2) = json.loads(p.stdout.strip().splitlines()[-1])
    assert rc1 == 1 and shlex.split(out1)[:2] == ["atc", "--framework=5"]
    assert err1.startswith("cvt: error: atc is not on PATH") and err1.count("\n") == 1
    assert rc3 == 3 and err3.startswith("cvt: error: ") and "com.microsoft.MatMulNBits" in err3 and err3.count("\n") == 1
    assert rc2 == 2 and "Missing option '--soc-version'" in err2


def test_importing_the_om_module_stays_cheap():
    code = "import sys, cvt.export.om; print([m for m in ('onnx', 'onnxruntime', 'torch') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"
