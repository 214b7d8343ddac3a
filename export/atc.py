"""What Ascend's `atc` accepts from an ONNX graph, and the exact `atc` command line for it.

Pure checks and string building, no subprocess (that is `cvt.export.om`). Nothing heavy is
imported at module level; onnx is imported by the functions that read a graph.

Where the rules come from (CANN documentation, hiascend.com; read for this module, not
re-verified against a real atc, which does not exist on the machines cvt is tested on):

- opset: `--framework=5` takes "only operators of the ai.onnx domain, opset v9~v18" (ATC
  guide, CANN 7.0 `atlasatc_16_0048`, `atlasatc_16_0201`: ONNX 1.12.0, opset v9~v18, ONNX
  Runtime 1.14.0). Some CANN 8.0 community builds state v11~v15; we use 9..18 and let the
  caller narrow it (`min_opset` / `max_opset`).
- operators: `SUPPORTED_OPS` is the "支持ONNX算子清单" (supported ONNX operators) list of
  CANN 8.0.0 (`apiref/aolapi/operatorlist_00176`), written with the ONNX spellings (the page
  writes Argmax, Cumsum, LogSoftMax). The per-operator pages add attribute and dtype limits
  and an opset range per op that this table does not model. DequantizeLinear,
  QuantizeLinear, MatMulInteger and DynamicQuantizeLinear are *not* in that list: Ascend's
  quantized ONNX path uses its own AscendQuant / AscendAntiQuant ops (also listed), so cvt
  refuses QDQ graphs unless the user vouches for a plugin with `allow_ops`.
- parser behaviour (GE's open-sourced ONNX parser, github.com/hicann/ge
  `parser/parser/onnx/onnx_parser.cc`): every node is looked up as `domain::opset::OpType`
  in the registered op plugins (an unknown one fails with E16002), a root graph without
  inputs or outputs fails with E16001, `ir_version` is not checked, external data is read.
- dtypes: ONNX 1.12 predates float8 (1.14) and int4/uint4 (1.16); bfloat16 runs only on
  Atlas A2/A3 SoCs ("Atlas 推理系列产品不支持bf16").
- flags: ATC parameter pages of CANN 8.0/8.5/9.0 (`atlasatcparam_16_00xx`): --framework
  (5 = ONNX), --model, --output (atc appends `.om`, possibly `_<os>_<arch>.om`; path
  characters limited to letters, digits, `_ - .` and CJK), --soc_version (`Ascend` + the
  `npu-smi info` Name; A3: `<Chip Name>_<NPU Name>`), --input_format (ONNX: NCHW default,
  NCDHW, ND), --input_shape (`name:d0,d1;name2:...`; -1 or `a~b` for dynamic dims; empty
  for a scalar), --dynamic_dims (2..100 profiles `v,v;v,v`, one value per -1 in
  --input_shape, needs ND), --precision_mode (values below; default force_fp16), --log.

So the check is conservative: a graph it passes can still fail in atc (an attribute or
dtype limit of one operator), and a graph it refuses may convert on a newer CANN; the
refusal names every offending op so that either case is quick to judge.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from cvt.errors import CvtError, OptionError

MIN_OPSET, MAX_OPSET = 9, 18
DEFAULT_DOMAINS = ("", "ai.onnx")

# CANN 8.0.0 "supported ONNX operators" (ai.onnx domain), ONNX spellings.
SUPPORTED_OPS = frozenset("""
Abs Acos Acosh AdaptiveAvgPool2D Add AffineGrid And ArgMax ArgMin AscendAntiQuant AscendQuant
Asin Asinh Atan Atanh AveragePool BatchNormalization BatchMultiClassNMS BitShift BitwiseAnd
BitwiseNot BitwiseOr BitwiseXor Cast Ceil Celu Clip Compress Concat Constant ConstantOfShape
Conv ConvTranspose Corr Cos Cosh CumSum DeformableConv2D DepthToSpace Det Div Dropout
DynSeqOuter Einsum Elu EmbeddingBag Equal Erf Exp Expand EyeLike Flatten Floor Gather
GatherElements GatherND Gemm GlobalAveragePool GlobalLpPool GlobalMaxPool Greater
GreaterOrEqual GridSample GRU Hardmax HardSigmoid HardSwish Identity If InstanceNormalization
IsInf IsNaN LayerNormalization LeakyRelu Less LessOrEqual Log LogSoftmax LpNormalization LpPool
LRN LSTM LSTMP MatMul Max MaxPool MaxRoiPool MaxUnpool Mean MeanVarianceNormalization Min Mod
MovingSumWithSigmoid Mul Multinomial Neg NonMaxSuppression NonZero Not OneHot Or Pad Pow
RandomNormal RandomNormalLike RandomUniform RandomUniformLike Range Reciprocal ReduceL1
ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMean ReduceMin ReduceProd ReduceSumSquare ReduceSum
ReduceMax Relu Reshape Resize ReverseSequence RoiAlign RoiExtractor Round PRelu Scatter
ScatterElements ScatterND Selu Shape Shrink Sigmoid Sign Sin Sinh Size Slice Softmax
SoftmaxCrossEntropyLoss Softplus Softsign SpaceToDepth Split Sqrt Squeeze Sub Sum Tan Tanh
TfIdfVectorizer ThresholdedRelu Tile TopK Transpose Trilu Unsqueeze Where Xor
""".split())

_QDQ = ("not in CANN's ONNX operator list (Ascend quantizes with its own AscendQuant/AscendAntiQuant ops); "
        "export float weights for atc, or pass --allow-op if your CANN has a parser plugin for it")
_ORT = "an onnxruntime contrib op; atc parses only ai.onnx ops"
# Ops an LLM exporter emits that atc does not take, with the reason shown to the user.
UNSUPPORTED_HINTS = {
    "DequantizeLinear": _QDQ,
    "QuantizeLinear": _QDQ,
    "DynamicQuantizeLinear": _QDQ,
    "MatMulInteger": _QDQ,
    "QLinearMatMul": _QDQ,
    "com.microsoft.MatMulNBits": "onnxruntime's int4 kernel (com.microsoft domain), unknown to atc; "
                                 "export float weights for atc (int4 only reaches Ascend through its own W4A16 ops)",
    "com.microsoft.SimplifiedLayerNormalization": _ORT,
    "com.microsoft.SkipSimplifiedLayerNormalization": _ORT,
    "com.microsoft.RotaryEmbedding": _ORT,
    "com.microsoft.GroupQueryAttention": _ORT,
    "com.microsoft.MultiHeadAttention": _ORT,
    "SimplifiedLayerNormalization": _ORT,
    "CastLike": "not in CANN's ONNX operator list; use Cast",
    "Gelu": "opset 20 op, beyond atc's opset 18; use Erf/Tanh arithmetic",
    "RMSNormalization": "opset 23 op, beyond atc's opset 18; use ReduceMean/Sqrt arithmetic",
    "RotaryEmbedding": "opset 23 op, beyond atc's opset 18",
    "Attention": "opset 23 op, beyond atc's opset 18",
    "Loop": "not in CANN's ONNX operator list (only If is)",
    "Scan": "not in CANN's ONNX operator list (only If is)",
}

# Tensor element types atc's ONNX 1.12 parser knows; bfloat16 is SoC-dependent (below).
KNOWN_DTYPES = frozenset({"FLOAT", "UINT8", "INT8", "UINT16", "INT16", "INT32", "INT64", "BOOL", "FLOAT16",
                          "DOUBLE", "UINT32", "UINT64", "BFLOAT16"})
BF16_SOCS = ("Ascend910B", "Ascend910_93", "Ascend950")  # Atlas A2, A3, 950
SOC_RE = re.compile(r"^Ascend[0-9]{3}[A-Za-z0-9]*(_[A-Za-z0-9]+)?$")
SOC_EXAMPLES = "Ascend910B3, Ascend310P3, Ascend910_9392"
# The chip series atc knows (CANN's --soc_version values: Ascend310 / 310B* / 310P* inference,
# Ascend610*, Ascend910 / 910A / 910Pro* training, 910B* Atlas A2, 910_93* Atlas A3, 950*): a
# name outside them (a typo, Ascend999) would only fail inside atc on the Ascend host.
SOC_SERIES = ("Ascend310", "Ascend610", "Ascend910", "Ascend950")

# --precision_mode values (ATC parameter reference, CANN 8.x/9.0; force_fp16 is atc's default).
PRECISION_MODES = ("force_fp32", "cube_fp16in_fp32out", "force_fp16", "allow_fp32_to_fp16", "must_keep_origin_dtype",
                   "allow_mix_precision", "allow_mix_precision_fp16", "allow_mix_precision_bf16", "allow_fp32_to_bf16")
BF16_PRECISION_MODES = ("allow_mix_precision_bf16", "allow_fp32_to_bf16")
INPUT_FORMATS = ("ND", "NCHW", "NCDHW")  # what --input_format takes for ONNX
LOG_LEVELS = ("debug", "info", "warning", "error", "null")
# flags atc_command sets itself; `extra` may not repeat them
MANAGED_FLAGS = ("mode", "framework", "model", "weight", "output", "soc_version", "input_format", "input_shape",
                 "dynamic_dims", "precision_mode", "log")
_OUTPUT_CHARS = re.compile(r"^[A-Za-z0-9_.\-/\u4e00-\u9fff]+$")
_FLAG = re.compile(r"^--[a-z][a-z0-9_]*(=.*)?$")


@dataclass(frozen=True)
class Problem:
    """One reason atc would refuse the graph: `what` (an op such as com.microsoft.MatMulNBits,
    `opset 21`, or a dtype), why, and where (the first nodes or tensors, `count` in all)."""

    what: str
    reason: str
    where: tuple[str, ...] = ()
    count: int = 0

    def __str__(self) -> str:
        if not self.where:
            return f"{self.what}: {self.reason}"
        more = f" and {self.count - len(self.where)} more" if self.count > len(self.where) else ""
        n = f" x{self.count}" if self.count > 1 else ""
        return f"{self.what}{n} (at {', '.join(self.where)}{more}): {self.reason}"


class GraphCheckError(CvtError):
    """The ONNX graph uses something atc does not accept (exit code 3, like other 'problems found')."""

    exit_code = 3

    def __init__(self, label: str, problems: list[Problem]):
        self.problems = problems
        super().__init__(f"{label}: atc would not convert this graph ({len(problems)} problem"
                         f"{'s' if len(problems) != 1 else ''}): " + "; ".join(map(str, problems)))


# -- reading a graph --------------------------------------------------------------------------
def onnx_file(path: Path) -> Path:
    """`path` when it is a regular file; else CvtError saying what it is (from its stat, never
    opened: a FIFO would block the open until a writer comes)."""
    import stat

    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise CvtError(f"{path}: no such ONNX file") from None
    except OSError as exc:
        raise CvtError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        from cvt.convert.reader import file_kind

        raise CvtError(f"{path}: not a regular file ({file_kind(path)}); give an .onnx file")
    return path


def load_model(model):
    """(ModelProto, label) from a path or a ModelProto; external weights are not read."""
    from cvt.extras import require

    onnx = require("onnx", "reading an ONNX graph (cvt export om)")

    if isinstance(model, onnx.ModelProto):
        return model, f"<model {model.graph.name or 'graph'}>"
    path = onnx_file(Path(model))
    try:
        return onnx.load(str(path), load_external_data=False), str(path)
    except Exception as exc:  # protobuf DecodeError and friends
        raise CvtError(f"{path}: not a readable ONNX model ({type(exc).__name__}: {exc})") from None


def _subgraphs(node) -> Iterator:
    for attr in node.attribute:
        if attr.g.ByteSize():
            yield attr.g
        yield from attr.graphs


def _walk(graph) -> Iterator:
    for node in graph.node:
        yield node
        for sub in _subgraphs(node):
            yield from _walk(sub)


def _graphs(graph) -> Iterator:
    yield graph
    for node in graph.node:
        for sub in _subgraphs(node):
            yield from _graphs(sub)


def op_id(node) -> str:
    return node.op_type if node.domain in DEFAULT_DOMAINS else f"{node.domain}.{node.op_type}"


def _attr(node, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            import onnx

            return onnx.helper.get_attribute_value(a)
    return default


def _dtype_sites(model) -> Iterator[tuple[str, int]]:
    """(where, element type) of every typed tensor the graph declares or creates."""
    for g in _graphs(model.graph):
        for vi in (*g.input, *g.output, *g.value_info):
            if vi.type.HasField("tensor_type"):
                yield vi.name, vi.type.tensor_type.elem_type
        for t in g.initializer:
            yield t.name, t.data_type
        for node in g.node:
            where = node.name or (node.output[0] if node.output else node.op_type)
            for a in node.attribute:
                if a.HasField("t"):
                    yield where, a.t.data_type
                elif a.name in ("to", "dtype", "output_dtype") and a.type == a.INT and a.i:
                    yield where, a.i


def _soc_has_bf16(soc: str | None) -> bool:
    return soc is None or soc.startswith(BF16_SOCS)


def _node_reason(node, functions: set, allow_ops: set) -> str | None:
    oid = op_id(node)
    if (node.domain, node.op_type) in functions:
        return "an ONNX model-local function, which atc does not expand; inline it first (onnx.inliner.inline_local_functions)"
    if node.op_type in ("DequantizeLinear", "QuantizeLinear") and (_attr(node, "block_size", 0) or 0) > 0:
        return (f"blockwise (block_size={_attr(node, 'block_size')}, opset 21) quantization, which atc does not parse; "
                "export float weights for atc")
    if oid in allow_ops:
        return None
    if node.domain not in DEFAULT_DOMAINS:
        return UNSUPPORTED_HINTS.get(oid, f"domain {node.domain!r} is not ai.onnx, the only domain atc parses")
    if oid in SUPPORTED_OPS:
        return None
    return UNSUPPORTED_HINTS.get(oid, "not in CANN's ONNX operator list (CANN 8.0.0)")


def precheck(model, soc_version: str | None = None, *, min_opset: int = MIN_OPSET, max_opset: int = MAX_OPSET,
             allow_ops: Iterable[str] = (), max_where: int = 3) -> list[Problem]:
    """Every reason atc would refuse `model` (a path or ModelProto); empty when it looks fine.

    Checks the ai.onnx opset against [min_opset, max_opset], every node (subgraphs included)
    against `SUPPORTED_OPS` (domain, local functions, blockwise Q/DQ), and every declared
    tensor type (int4, float8, and bfloat16 on a SoC without it), and that the main graph has
    inputs and outputs. `allow_ops` lists op types (`Op`, or `domain.Op`) to accept anyway,
    for a CANN with a parser plugin for them; blockwise Q/DQ and dtypes are still checked.
    """
    import onnx

    m, _ = load_model(model)
    problems: list[Problem] = []
    versions = [o.version for o in m.opset_import if o.domain in DEFAULT_DOMAINS]
    if versions and not min_opset <= max(versions) <= max_opset:
        problems.append(Problem(f"opset {max(versions)}", f"atc takes ai.onnx opset {min_opset}..{max_opset}; "
                                                         f"re-export with an opset in that range"))
    real_inputs = {i.name for i in m.graph.input} - {t.name for t in m.graph.initializer}
    if not real_inputs or not m.graph.output:
        problems.append(Problem("graph", f"the main graph has no {'inputs' if not real_inputs else 'outputs'}; "
                                         "atc refuses such a graph (E16001)"))
    functions = {(f.domain, f.name) for f in m.functions}
    allow = set(allow_ops)
    found: dict[tuple[str, str], list[str]] = {}
    for node in _walk(m.graph):
        reason = _node_reason(node, functions, allow)
        if reason:
            found.setdefault((op_id(node), reason), []).append(node.name or (node.output[0] if node.output else "?"))
    names = {v: k for k, v in onnx.TensorProto.DataType.items()}
    for where, code in _dtype_sites(m):
        name = names.get(code, f"type {code}")
        if code == 0:
            continue
        if name not in KNOWN_DTYPES:
            hint = "; int4 weights: export float weights for atc" if name in ("INT4", "UINT4") else ""
            found.setdefault((f"dtype {name}", f"atc's ONNX parser (ONNX 1.12) has no {name} tensors{hint}"), []).append(where)
        elif name == "BFLOAT16" and not _soc_has_bf16(soc_version):
            found.setdefault((f"dtype {name}", f"{soc_version} has no bfloat16 (only Atlas A2/A3: Ascend910B*, "
                                               "Ascend910_93*); export fp16 or fp32 weights"), []).append(where)
    for (what, reason), where in found.items():
        uniq = list(dict.fromkeys(where))
        problems.append(Problem(what, reason, tuple(uniq[:max_where]), len(uniq)))
    return problems


def check_for_atc(model, soc_version: str | None = None, *, label: str | None = None, **kw) -> None:
    """`precheck`, raising GraphCheckError (naming every offending op and dtype, prefixed by
    `label` or the file name) if it finds anything."""
    m, name = load_model(model)
    problems = precheck(m, soc_version, **kw)
    if problems:
        raise GraphCheckError(label or name, problems)


# -- input shapes -----------------------------------------------------------------------------
def graph_inputs(model) -> list[tuple[str, list[int | str] | None]]:
    """(name, dims) of the real inputs (initializers excluded); a dim is an int or a symbol ('?' if
    unnamed); dims is None when the graph does not say the input's rank."""
    m, _ = load_model(model)
    inits = {t.name for t in m.graph.initializer}
    out = []
    for vi in m.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tt.shape.dim] \
            if tt.HasField("shape") else None
        out.append((vi.name, dims))
    return out


def _fmt_dims(dims) -> str:
    return "rank ?" if dims is None else ",".join(str(d) for d in dims)


def _static(dims) -> bool:
    return dims is not None and all(isinstance(d, int) and d > 0 for d in dims)


def _parse_dim(tok: str, name: str) -> str:
    tok = tok.strip()
    if re.fullmatch(r"-1|[1-9][0-9]*", tok):
        return tok
    m = re.fullmatch(r"([1-9][0-9]*)~([1-9][0-9]*|-1)", tok)
    if m and (m.group(2) == "-1" or int(m.group(1)) <= int(m.group(2))):
        return tok
    raise CvtError(f"--input-shape {name}: dim {tok!r} is not a positive size, -1 (dynamic) or a range like 1~512")


def parse_input_shape(spec: str) -> dict[str, list[str]]:
    """'a:1,-1;b:' -> {'a': ['1', '-1'], 'b': []} (syntax only)."""
    out: dict[str, list[str]] = {}
    for entry in filter(None, (e.strip() for e in spec.split(";"))):
        if ":" not in entry:
            raise CvtError(f"--input-shape entry {entry!r} is not name:d0,d1,... (e.g. input_ids:1,128)")
        name, dims = entry.rsplit(":", 1)
        name = name.strip()
        if not name or name in out:
            raise CvtError(f"--input-shape: {'empty' if not name else 'duplicate'} input name in {entry!r}")
        out[name] = [_parse_dim(t, name) for t in dims.split(",")] if dims.strip() else []
    if not out:
        raise CvtError(f"--input-shape {spec!r} names no input (format: name:d0,d1;name2:d0)")
    return out


def parse_dynamic_dims(spec: str) -> list[list[int]]:
    """'1,128;1,256' -> [[1, 128], [1, 256]]: 2..100 profiles of equal length (atc's limits)."""
    profiles = []
    for prof in filter(None, (p.strip() for p in spec.split(";"))):
        try:
            vals = [int(v) for v in prof.split(",")]
        except ValueError:
            raise CvtError(f"--dynamic-dims profile {prof!r} is not comma-separated sizes (e.g. \"1,128;1,256\")") from None
        if any(v < 1 for v in vals):
            raise CvtError(f"--dynamic-dims profile {prof!r}: sizes must be >= 1")
        profiles.append(vals)
    if not 2 <= len(profiles) <= 100:
        raise CvtError(f"--dynamic-dims {spec!r}: atc needs 2 to 100 profiles separated by ';', got {len(profiles)}")
    if len({len(p) for p in profiles}) != 1:
        raise CvtError(f"--dynamic-dims {spec!r}: every profile needs the same number of values")
    return profiles


def resolve_input_shape(model, input_shape: str | None = None, dynamic_dims: str | None = None) -> str | None:
    """The --input_shape value for `model`: the user's, checked against the graph inputs (names,
    ranks, static dims) and completed with the static inputs it leaves out; or, when not given,
    derived from a graph whose inputs are all static. A dynamic input without a shape is an
    error that shows the template to fill in. None for a graph without inputs."""
    inputs = graph_inputs(model)
    for name, _ in inputs:
        if ":" in name or ";" in name:
            raise CvtError(f"graph input {name!r}: atc's --input_shape cannot name an input containing ':' or ';'; "
                           "rename it in the export")
    given = parse_input_shape(input_shape) if input_shape else {}
    known = dict(inputs)
    unknown = [n for n in given if n not in known]
    if unknown:
        raise CvtError(f"--input-shape names {unknown[0]!r}, which is not a graph input; inputs: "
                       + ", ".join(f"{n}[{_fmt_dims(d)}]" for n, d in inputs))
    parts, dynamic = [], []
    for name, dims in inputs:
        if name in given:
            user = given[name]
            if dims is None:
                parts.append(f"{name}:{','.join(user)}")
                continue
            if len(user) != len(dims):
                raise CvtError(f"--input-shape {name}: {len(user)} dims given, the graph input has rank {len(dims)} "
                               f"[{_fmt_dims(dims)}]")
            for i, (u, d) in enumerate(zip(user, dims)):
                if isinstance(d, int) and d > 0 and u != str(d):
                    raise CvtError(f"--input-shape {name}: dim {i} is fixed to {d} in the graph, got {u}")
            parts.append(f"{name}:{','.join(user)}")
        elif _static(dims):
            parts.append(f"{name}:{_fmt_dims(dims)}")
        else:
            dynamic.append((name, dims))
    if dynamic:
        tmpl = ";".join(f"{n}:" + ("d0,d1,..." if dims is None else
                                   ",".join(str(d) if isinstance(d, int) and d > 0 else "-1" for d in dims))
                        for n, dims in dynamic)
        raise CvtError("atc needs a shape for the dynamic graph inputs "
                       + ", ".join(f"{n}[{_fmt_dims(d)}]" for n, d in dynamic)
                       + f": pass --input-shape \"{tmpl}\" with the -1s replaced by sizes, or keep the -1s and add "
                         "--dynamic-dims \"v,..;v,..\" (2-100 profiles, one value per -1, in order)")
    spec = ";".join(parts) or None
    if dynamic_dims:
        _check_profiles(spec or "", dynamic_dims)
    return spec


def _check_profiles(input_shape: str, dynamic_dims: str) -> None:
    profiles = parse_dynamic_dims(dynamic_dims)
    dims = [d for ds in parse_input_shape(input_shape).values() for d in ds] if input_shape else []
    if any("~" in d for d in dims):
        raise CvtError("--dynamic-dims cannot be combined with a range (a~b) in --input-shape; use -1 for the profiled dims")
    holes = dims.count("-1")
    if holes != len(profiles[0]):
        raise CvtError(f"--dynamic-dims gives {len(profiles[0])} value(s) per profile but --input-shape has {holes} "
                       "dynamic (-1) dim(s); they must match, in order")


# -- the command ------------------------------------------------------------------------------
def soc_problem(soc_version: str) -> str | None:
    """Why `soc_version` is not an Ascend SoC name of a series atc knows (`SOC_SERIES`), starting
    with the value, valid examples in it; None when it is one. The CLI's option type
    (`cvt.cli.options.SocVersion`, exit 2) and `check_soc_version` say the same."""
    if not SOC_RE.match(soc_version or ""):
        return (f"{soc_version!r} is not an Ascend SoC name like {SOC_EXAMPLES} ('Ascend' + the Name that npu-smi "
                "info shows; A3: <Chip Name>_<NPU Name>)")
    if soc_version[:9] not in SOC_SERIES:
        return (f"{soc_version!r}: no Ascend SoC series {soc_version[6:9]} (atc knows "
                f"{', '.join(s[6:] for s in SOC_SERIES)}: e.g. {SOC_EXAMPLES})")
    return None


def check_soc_version(soc_version: str) -> str:
    """`soc_version` when it is an Ascend SoC name of a series atc knows, else OptionError (`soc_problem`)."""
    why = soc_problem(soc_version)
    if why is not None:
        raise OptionError(f"--soc-version {why}")
    return soc_version


def atc_command(onnx, output, soc_version: str, input_shape: str | None = None, dynamic_dims: str | None = None,
                precision_mode: str | None = None, input_format: str = "ND", log: str | None = None,
                extra: Iterable[str] = ()) -> list[str]:
    """The argv of `atc --framework=5 --model=ONNX --output=OUTPUT --soc_version=SOC --input_format=FMT
    [--input_shape=..] [--dynamic_dims=..] [--precision_mode=..] [--log=..] [EXTRA..]`.

    `output` is the OM path without `.om` (atc appends it; a trailing `.om` is dropped).
    Values are validated against the documented forms; the graph itself is not read (see
    `resolve_input_shape` for the shape that fits a graph).
    """
    check_soc_version(soc_version)
    if input_format not in INPUT_FORMATS:
        raise CvtError(f"input format {input_format!r}: atc takes {', '.join(INPUT_FORMATS)} for ONNX")
    if precision_mode is not None:
        if precision_mode not in PRECISION_MODES:
            raise CvtError(f"--precision-mode {precision_mode!r}: choose one of {', '.join(PRECISION_MODES)}")
        if precision_mode in BF16_PRECISION_MODES and not _soc_has_bf16(soc_version):
            raise CvtError(f"--precision-mode {precision_mode} needs bfloat16, which {soc_version} does not have "
                           "(only Atlas A2/A3: Ascend910B*, Ascend910_93*)")
    if log is not None and log not in LOG_LEVELS:
        raise CvtError(f"atc log level {log!r}: choose one of {', '.join(LOG_LEVELS)}")
    if input_shape:
        dims = [d for ds in parse_input_shape(input_shape).values() for d in ds]
        if (not dynamic_dims and any(d == "-1" or "~" in d for d in dims)
                and (soc_version == "Ascend310" or soc_version.startswith("Ascend310B"))):
            raise CvtError(f"{soc_version} does not take shape ranges (-1 or a~b without --dynamic-dims); "
                           "fix the sizes or give --dynamic-dims profiles")
    if dynamic_dims:
        if not input_shape:
            raise CvtError("--dynamic-dims needs --input-shape with a -1 for each profiled dim")
        if input_format != "ND":
            raise CvtError(f"--dynamic-dims needs --input-format ND, got {input_format}")
        _check_profiles(input_shape, dynamic_dims)
    out = os.path.abspath(os.fspath(output))
    if out.endswith(".om"):
        out = out[:-3]
    if not _OUTPUT_CHARS.match(out):
        bad = sorted({c for c in out if not _OUTPUT_CHARS.match(c)})
        raise CvtError(f"output path {out!r}: atc accepts only letters, digits, '_', '-', '.' and '/' in it, "
                       f"not {''.join(bad)!r}; choose another DST or rename the ONNX file")
    extra = list(extra)
    for arg in extra:
        m = _FLAG.match(arg)
        if not m:
            raise CvtError(f"extra atc argument {arg!r} is not --flag or --flag=value")
        flag = arg[2:].split("=", 1)[0]
        if flag in MANAGED_FLAGS:
            raise CvtError(f"extra atc argument {arg!r}: --{flag} is set by cvt; use its own option")
        if flag == "precision_mode_v2" and precision_mode:
            raise CvtError("atc refuses --precision_mode together with --precision_mode_v2; give one")
    cmd = ["atc", "--framework=5", f"--model={os.path.abspath(os.fspath(onnx))}", f"--output={out}",
           f"--soc_version={soc_version}", f"--input_format={input_format}"]
    if input_shape:
        cmd.append(f"--input_shape={input_shape}")
    if dynamic_dims:
        cmd.append(f"--dynamic_dims={dynamic_dims}")
    if precision_mode:
        cmd.append(f"--precision_mode={precision_mode}")
    if log:
        cmd.append(f"--log={log}")
    return cmd + extra
