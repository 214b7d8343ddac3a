"""`cvt export onnx`: onnxruntime parity with the torch runtime on tiny DeepSeek-V3 and Qwen3-MoE
models, float and quantized (W8A8 integer / Q-DQ, W4A16 MatMulNBits / int4 DequantizeLinear,
per-channel and grouped, symmetric and asymmetric), model / layer / block scope, C8 caches,
external data. onnxruntime (CPU) is the referee; nothing is mocked.

Each case exports once, then `cvt.export.ort.parity` runs a prefill and decode steps through
onnxruntime and the torch runtime (float32, same artifact) and compares logits (or the layer's
output and cache) against the tolerance stated in `cvt.export.ort` for the export's dtype and
formats; greedy tokens must agree at every step.

Quantized activations (W8A8, C8) are the exception: there the two backends' last-bit float
differences can flip an int8 rounding, and a MoE router downstream of it another expert, on
some CPUs and not others. So each W8A8 linear's quantizer is compared with the runtime's on
identical inputs (exactly), every layer's attention and MLP blocks on identical inputs (the
int8 tolerance on every row), and the whole model with the bounded check of `cvt.export.ort`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from cvt.testing.checkpoints import tiny_deepseek_config, tiny_qwen3_config, write_bf16_checkpoint
from cvt.export.onnx_export import export_onnx
from cvt.export.ort import FLIP_SHARE, TOLERANCES, OrtCausalLM, tolerance
from cvt.quant.stage import quantize

def bf16_source(root: Path, family: str) -> Path:
    """A tiny BF16 checkpoint (random weights): DeepSeek-V3 (MLA, 1 dense + 1 MoE layer of 4
    experts top-2 in 2 groups, a shared expert, an MTP layer) or Qwen3-MoE (GQA 4/2 heads,
    1 dense + 2 MoE layers, 4 experts top-2)."""
    cfg = tiny_deepseek_config(num_hidden_layers=2) if family == "ds" else tiny_qwen3_config(moe=True)
    cfg.pop("quantization_config", None)
    return write_bf16_checkpoint(root / f"{family}-bf16", cfg)


@pytest.fixture(scope="session")
def sources(tmp_path_factory):
    """Lazily built sources shared by the session: family -> quantization name -> directory."""
    root = tmp_path_factory.mktemp("export-src")
    cache: dict[tuple[str, str], Path] = {}
    recipes = {
        "bf16": None,
        "w8a8": dict(scheme="w8a8"),
        "w8a8-static": dict(scheme="w8a8", fmt="ascend", static_attention=True),
        "w8a8c8": dict(scheme="w8a8c8", fmt="ascend", target="mindie"),  # int8 cache (c-t: FP8, refused here)
        "w4a16-asym-g32": dict(scheme="w4a16", asym=True, group_size=32),
        "w4a16-g16": dict(scheme="w4a16", group_size=16),
        "w4a16-channel": dict(scheme="w4a16", fmt="ascend", group_size=0, target="mindie"),
    }

    def get(family: str, name: str) -> Path:
        if (family, "bf16") not in cache:
            cache[family, "bf16"] = bf16_source(root, family)
        if (family, name) not in cache:
            cache[family, name] = root / f"{family}-{name}"
            quantize(cache[family, "bf16"], cache[family, name], quiet=True, **recipes[name])
        return cache[family, name]

    return get


def op_types(path: Path) -> set[str]:
    """Every op type in the graph, If branches included."""
    m = onnx.load(str(path), load_external_data=False)
    out, todo = set(), [m.graph]
    while todo:
        g = todo.pop()
        for n in g.node:
            out.add(n.op_type)
            todo.extend(a.g for a in n.attribute if a.type == onnx.AttributeProto.GRAPH)
    return out


def int4_initializers(path: Path) -> int:
    m = onnx.load(str(path), load_external_data=False)
    out, todo = 0, [m.graph]
    while todo:
        g = todo.pop()
        out += sum(t.data_type == onnx.TensorProto.INT4 for t in g.initializer)
        for n in g.node:
            todo.extend(a.g for a in n.attribute if a.type == onnx.AttributeProto.GRAPH)
    return out


def check_parity(res, expect_greedy: bool = True) -> None:
    """Every graph passes `cvt.export.ort`'s check. With quantized activations that check lets
    1/8 of the rows flip (a MoE router or greedy pick downstream of a quantizer); a block graph
    (layer_N.self_attn / layer_N.mlp) is held to every row anyway: both backends get the same
    seeded input and no router sits behind a quantizer in it, so a flipped int8 rounding moves
    its output by far less than the int8 tolerance."""
    assert res.parity, "no parity result"
    for p in res.parity:
        assert p.passed, p.render()
        if not p.flips or "." in p.graph:
            assert p.max_abs <= p.tolerance * max(1.0, p.ref_max), p.render()
        else:
            assert p.rows_off <= FLIP_SHARE * len(p.rows), p.render()
        if expect_greedy and p.graph == "model" and not p.flips:
            assert p.greedy_agree is True, p.render()


# family, source, export options, op types that must appear, linears key, tolerance key
CASES = [
    ("ds", "bf16", dict(), {"MatMul", "If", "TopK"}, "dense", "float"),
    ("ds", "bf16", dict(dtype="bf16"), {"Cast"}, "dense", "float"),
    ("ds", "w8a8-static", dict(w8a8_op="qdq", opset=13), {"QuantizeLinear", "DequantizeLinear"}, "w8a8_static:qdq",
     "int8"),
    ("ds", "w8a8c8", dict(), {"MatMulInteger"}, "w8a8_dynamic:integer", "int8"),
    ("ds", "w4a16-asym-g32", dict(), {"MatMulNBits"}, "w4a16:matmulnbits", "int4"),
    ("ds", "w4a16-asym-g32", dict(int4_op="qdq"), {"DequantizeLinear"}, "w4a16:qdq", "int4"),
    ("ds", "w4a16-channel", dict(), {"MatMulNBits"}, "w4a16:matmulnbits", "int4"),
    ("ds", "w4a16-channel", dict(int4_op="qdq"), {"DequantizeLinear"}, "w4a16:qdq", "int4"),
    ("qw", "bf16", dict(dtype="fp16"), {"MatMul", "If"}, "dense", "fp16"),
    ("qw", "w8a8-static", dict(), {"MatMulInteger"}, "w8a8_static:integer", "int8"),
    ("qw", "w8a8", dict(w8a8_op="qdq"), {"QuantizeLinear"}, "w8a8_dynamic:qdq", "int8"),
    ("qw", "w4a16-g16", dict(), {"MatMulNBits"}, "w4a16:matmulnbits", "int4"),
    ("qw", "w4a16-g16", dict(int4_op="qdq"), {"DequantizeLinear"}, "w4a16:qdq", "int4"),
    ("qw", "w8a8c8", dict(), {"MatMulInteger"}, "w8a8_dynamic:integer", "int8"),
    ("ds", "w4a16-asym-g32", dict(moe="dense"), {"MatMulNBits"}, "w4a16:matmulnbits", "int4"),
]
IDS = [f"{f}-{s}" + "".join(f"-{k}={v}" for k, v in o.items()) for f, s, o, *_ in CASES]


# slow: the int8 cases (each block is checked too) and variants of an op path a fast case covers
SLOW = {"ds-bf16-dtype=bf16", "ds-w4a16-channel", "ds-w4a16-channel-int4_op=qdq"}


@pytest.mark.parametrize("family,source,opts,ops,linears,tol",
                         [pytest.param(*c, marks=pytest.mark.slow) if c[5] == "int8" or i in SLOW else c
                          for c, i in zip(CASES, IDS)], ids=IDS)
def test_model_parity(sources, tmp_path, family, source, opts, ops, linears, tol):
    src = sources(family, source)
    res = export_onnx(src, tmp_path / "onnx", verify=True, **opts)
    m = res.manifest
    path = tmp_path / "onnx" / "model.onnx"
    onnx.checker.check_model(str(path), full_check=True)
    assert ops <= op_types(path)
    assert ("If" in op_types(path)) == (opts.get("moe", "gated") == "gated")  # every case has MoE layers
    assert linears in m["linears"] and tolerance(m) == TOLERANCES[tol]
    if opts.get("int4_op") == "qdq":
        assert m["opset"] == 21 and int4_initializers(path) > 0
    assert m["kv_cache"]["dtype"] == ("int8" if source == "w8a8c8" else "float32")
    check_parity(res)
    if tol == "int8":  # quantized activations: the model check is bounded, so every block on identical inputs
        assert all(p.flips for p in res.parity)
        for i in range(m["num_hidden_layers"]):
            blocks = export_onnx(src, tmp_path / f"blocks-{i}", scope="block", layer=i, verify=True, **opts)
            assert [g["name"] for g in blocks.graphs] == [f"layer_{i}.self_attn", f"layer_{i}.mlp"]
            check_parity(blocks)


def _w8a8_linear(fmt: str, k: int = 64, n: int = 24, offset: float = 3.0):
    """A runtime W8A8 linear with random int8 weights; static: input scale 1/16 (so x / s is
    exact) and an odd input offset (where round(x / s + off) and round(x / s) + off differ)."""
    import torch

    from cvt.qtensor.primitives import quant_bias_from
    from cvt.runtime.kernels.int8 import W8A8DynamicLinear, W8A8StaticLinear

    g = torch.Generator().manual_seed(0)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    ws = torch.rand(n, 1, generator=g) * 0.01 + 0.001
    if fmt == "w8a8_dynamic":
        return W8A8DynamicLinear.from_parts({"weight": w, "weight_scale": ws, "weight_offset": torch.zeros(n, 1)})
    s_in, off = torch.tensor([1 / 16]), torch.tensor([offset])
    deq = (s_in * ws.view(-1)).float()
    bias = torch.randn(n, generator=g)
    return W8A8StaticLinear.from_parts({"weight": w, "input_scale": s_in, "input_offset": off, "deq_scale": deq,
                                        "quant_bias": quant_bias_from(bias, w, off, deq)})


@pytest.mark.parametrize("op", ["integer", "qdq"])
@pytest.mark.parametrize("fmt", ["w8a8_dynamic", "w8a8_static"])
def test_w8a8_linear_quantizes_as_the_runtime(tmp_path, fmt, op):
    """One W8A8 linear, the same input in onnxruntime and the runtime: the activation quantizer is
    the runtime's, ties included (rows of exact .5 ties of x / s, and of the static offset), so the
    integer path equals the runtime bit for bit and Q/DQ (a float MatMul over dequantized values)
    to float rounding. One activation a step off moves a row by 1e-3 of its max or more (1e-5 is
    allowed), a wrong scale or zero point by far more. Run with onnxruntime's default graph optimizations:
    its Q/DQ -> MatMul fusions are part of what must stay exact."""
    import torch

    from cvt.export.onnx_graph import Graph, LinearOptions, linear
    from cvt.export.ort import session

    mod = _w8a8_linear(fmt)
    k, n = mod.in_features, mod.out_features
    g = torch.Generator().manual_seed(1)
    ties = (torch.randint(-127, 127, (4, k), generator=g) + 0.5) / 16     # x * 16 = j + 0.5 exactly
    ties[:, 0] = 127 / 16                   # per-token scale amax / 127 = 1/16: the dynamic rows tie as well
    x = torch.cat([ties, torch.randn(12, k, generator=g) * 3])
    if op == "integer" and fmt == "w8a8_dynamic":
        # per-token ties where multiplying by the factor fl(127 / amax) and dividing by the scale
        # part (-1.3984375 * fl(127 / 2.796875) is exactly -63.5 -> -64, by division -63), and
        # where one float32 division and torch's 127.0 / t (t.reciprocal() * 127) part (1.484375 *
        # fl(127 / 2.96875) = 63.499996 -> 63; 63.500004 -> 64); a row small enough that the
        # factor is inf; 400 random bf16 rows, a few % of which hold a tie. The runtime and the
        # serving kernels multiply by one division (test_npu_contract), so must the graph.
        rows = torch.zeros(3, k)
        rows[0, :3] = torch.tensor([2.796875, -1.3984375, 0.5])
        rows[1, :3] = torch.tensor([2.96875, 1.484375, 0.0])
        rows[2, :3] = torch.tensor([1e-37, -5e-38, 2e-38])
        a0, a1, x0 = torch.tensor(2.796875), torch.tensor(2.96875), torch.tensor(-1.3984375)
        assert torch.round(x0 * (torch.tensor(127.0) / a0)) == -64 and torch.round(x0 / (a0 / 127)) == -63
        assert torch.round(1.484375 * (torch.tensor(127.0) / a1)) == 63 and torch.round(1.484375 * (127.0 / a1)) == 64
        x = torch.cat([x, rows, torch.randn(400, k, generator=g).bfloat16().float()])
    graph = Graph(opset=13)
    y = linear(graph, mod, graph.add_input("x", onnx.TensorProto.FLOAT, ["m", k]), "lin", LinearOptions(w8a8_op=op))
    graph.add_output(y, "y", onnx.TensorProto.FLOAT, ["m", n])
    onnx.save(graph.model("w8a8"), str(tmp_path / "lin.onnx"))
    got = torch.from_numpy(session(tmp_path / "lin.onnx", {}).run(["y"], {"x": x.numpy()})[0])
    want = mod(x)
    if op == "integer":
        assert torch.equal(got, want)
    else:
        assert ((got - want).abs() <= 1e-5 * want.abs().amax(-1, keepdim=True)).all(), (got - want).abs().max()


_MODELS: dict[Path, object] = {}


def _torch_model(src: Path):
    """The torch runtime model of src in float32 (cached: several exports share a source)."""
    import torch

    from cvt.runtime.loader import load_model

    if src not in _MODELS:
        _MODELS[src] = load_model(src, dtype=torch.float32).model
    return _MODELS[src]


def test_graph_io_are_the_runtime_caches(sources, tmp_path):
    """DeepSeek: MLA latent + rope key per layer; Qwen3: key / value per layer; dynamic axes."""
    ds = export_onnx(sources("ds", "bf16"), tmp_path / "ds").graphs[0]
    ins = {i["name"]: i for i in ds["inputs"]}
    assert ins["input_ids"] == {"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"]}
    assert ins["past_key_values.0.latent"]["shape"] == ["batch", "past", 72]
    assert ins["past_key_values.1.rope_key"]["shape"] == ["batch", "past", 16]
    assert len(ins) == 1 + 2 * 2  # the MTP layer is not run, so not exported
    outs = {o["name"]: o for o in ds["outputs"]}
    assert outs["logits"]["shape"] == ["batch", "seq", 300]
    assert outs["present.1.latent"]["shape"] == ["batch", "total", 72]
    qw = export_onnx(sources("qw", "bf16"), tmp_path / "qw").graphs[0]
    ins = {i["name"]: i for i in qw["inputs"]}
    assert ins["past_key_values.1.value"]["shape"] == ["batch", 2, "past", 24]
    assert len(ins) == 1 + 2 * 3 and len(qw["outputs"]) == 1 + 2 * 3


def test_generation_matches_torch_greedy(sources, tmp_path):
    """Prefill a batch of 2 and decode 6 tokens with the runtime's own generate loop on both backends."""
    from cvt.runtime.generate import generate

    src = sources("ds", "w4a16-asym-g32")
    export_onnx(src, tmp_path / "onnx")
    prompts = [[256, 72, 101, 108, 108, 111], [256, 87, 111, 114, 108, 100]]
    ort_out = generate(OrtCausalLM(tmp_path / "onnx"), prompts, 6, device="cpu").outputs
    assert ort_out == generate(_torch_model(src), prompts, 6).outputs


@pytest.mark.parametrize("scope,family,source", [("layer", "ds", "w4a16-asym-g32"), ("block", "qw", "w8a8"),
                                                 ("block", "ds", "bf16")])
def test_layer_and_block_scope(sources, tmp_path, scope, family, source):
    src = sources(family, source)
    res = export_onnx(src, tmp_path / "onnx", scope=scope, layer=1, verify=True)
    names = [g["name"] for g in res.graphs]
    assert names == (["layer_1"] if scope == "layer" else ["layer_1.self_attn", "layer_1.mlp"])
    for g in res.graphs:
        onnx.checker.check_model(str(tmp_path / "onnx" / g["file"]), full_check=True)
        h = res.manifest["hidden_size"]
        assert g["inputs"][0] == {"name": "hidden_states", "dtype": "float32", "shape": ["batch", "seq", h]}
    check_parity(res)
    assert all(len(p.steps) == 5 for p in res.parity)  # prefill + 4 decode steps


@pytest.mark.slow
def test_external_data_and_relocation(sources, tmp_path):
    """Over the threshold the weights go to model.onnx.data (relative location): the export
    still checks, loads from another directory and agrees with the inline export bit for bit."""
    src = sources("ds", "w4a16-channel")
    inline = export_onnx(src, tmp_path / "inline")
    ext = export_onnx(src, tmp_path / "ext", external_threshold=0)
    assert inline.graphs[0]["external_data"] is None and not list((tmp_path / "inline").glob("*.data"))
    assert ext.graphs[0]["external_data"] == "model.onnx.data"
    files = {f["path"] for f in ext.manifest["files"]}
    assert {"model.onnx", "model.onnx.data", "config.json", "tokenizer.json"} <= files
    moved = tmp_path / "moved"
    shutil.move(str(tmp_path / "ext"), moved)
    onnx.checker.check_model(str(moved / "model.onnx"), full_check=True)
    a, b = OrtCausalLM(tmp_path / "inline"), OrtCausalLM(moved)
    ids = np.array([[256, 1, 2, 3]])
    assert np.array_equal(a.run(ids, a.new_cache(1, 8)), b.run(ids, b.new_cache(1, 8)))


def test_manifest_records_source_and_files(sources, tmp_path):
    src = sources("qw", "w4a16-g16")
    res = export_onnx(src, tmp_path / "onnx", dtype="bf16")
    m = json.loads((tmp_path / "onnx" / "export_manifest.json").read_text())
    assert m == res.manifest
    assert m["format"] == "cvt-onnx" and m["family"] == "qwen3" and m["scope"] == "model"
    assert m["source"]["path"] == str(src) and m["source"]["cvt_manifest_sha256"]
    assert m["opset"] == 17 and m["dtype"] == "bf16" and m["compute_dtype"] == "fp32"
    assert m["moe"]["mode"] == "gated" and "exact" in m["moe"]["math"]
    import blake3

    for f in m["files"]:
        p = tmp_path / "onnx" / f["path"]
        assert p.stat().st_size == f["size"] and blake3.blake3(p.read_bytes()).hexdigest() == f["blake3"]


def _family_configs():
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1,
            "mscale": 1.0, "mscale_all_dim": 1.0}
    ds = tiny_deepseek_config(num_hidden_layers=2, rope_scaling=yarn, rope_interleave=False, n_group=1, topk_group=1)
    ds.pop("quantization_config")
    qwen2 = tiny_qwen3_config(moe=False, model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    del qwen2["attention_bias"], qwen2["head_dim"]  # qwen2: q/k/v biases, head_dim = hidden / heads
    llama = tiny_qwen3_config(moe=False, model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=2,
                              rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 128})
    return {"deepseek-yarn-halves-one-group": ds, "qwen2-qkv-bias": qwen2, "llama3-rope": llama,
            "qwen3-tied-embeddings": tiny_qwen3_config(moe=False, tie_word_embeddings=True, num_hidden_layers=2)}


@pytest.mark.parametrize("name", list(_family_configs()))
def test_family_variants(tmp_path, name):
    """RoPE variants (YaRN with the halves layout, llama3), ungrouped routing, biases, tied lm_head."""
    src = write_bf16_checkpoint(tmp_path / "src", _family_configs()[name])
    check_parity(export_onnx(src, tmp_path / "onnx", verify=True))


def test_fp16_storage_refuses_weights_beyond_its_range():
    import torch

    from cvt.errors import CvtError
    from cvt.export.onnx_graph import Graph

    g = Graph(opset=17, weight_dtype="fp16")
    g.weight(torch.tensor([65504.0, -1.0]), "fits")
    with pytest.raises(CvtError, match=r"big.weight: holds 7e\+04, beyond float16's range \(65504\); export with "
                                       r"--dtype bf16 or fp32"):
        g.weight(torch.tensor([1.0, -70000.0]), "big.weight")
