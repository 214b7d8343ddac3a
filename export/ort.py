"""onnxruntime as a runtime backend: sessions over an export, generation, and the parity check.

`OrtCausalLM(dst)` wraps the ``model.onnx`` of an export in the runtime model contract
(`cvt.runtime.models.base`): ``model(tokens, start_pos, cache) -> float32 logits`` and
``new_cache(batch, max_len)``, so `cvt.runtime.generate.generate` drives it unchanged (same
sampling, same prefill / decode timing as the torch runtime) and `cvt run --backend
onnxruntime DST` is `generate` over it.

`parity(dst, model)` runs the exported graph(s) in onnxruntime (CPU) against the torch runtime
model on the same inputs: for ``--scope model`` a prefill of a seeded prompt and several decode
steps (teacher-forced with the torch model's greedy tokens), comparing logits and whether the
greedy tokens agree; for ``--scope layer`` / ``block`` a prefill and decode steps of seeded
hidden states through the layer / module, comparing its output and the cache it returns.

Reference and tolerances. The graphs compute in float32, so the reference is the torch runtime
in float32 on the same artifact. The check passes when max |ORT - torch| <= tol * max(1,
max |torch|) with tol (`TOLERANCES`):

* fp32 / bf16 weights: 1e-4 (the same weights; only summation order differs -- seen ~1e-6);
* fp16 weights: 2e-2 (bf16 / fp32 weights rounded to fp16, against the float32 model);
* int4 weights (W4A16; MatMulNBits accuracy_level 0 / 1 or int4 DequantizeLinear): 1e-3
  (dequantized weights are exact; seen ~1e-6);
* int8 activations (W8A8, either op) or an int8 KV cache: 3e-2. The integer path reproduces the
  runtime's integers (each linear alone, on the same input: bit-identical), but a float32
  difference of 1e-7 upstream (attention, norms) can move one activation across a rounding
  boundary: one int8 step, 1/127 of that token's range. Seen on the tiny models: ~1e-6 mostly,
  up to 1.5e-2 relative with an int8 KV cache (o_proj's input is built from dequantized int8
  values) and ~1e-2 with Q/DQ (which sums in float32);
* MatMulNBits accuracy_level 2-4 (fp16 / bf16 / int8 activations inside the op): 5e-2.

Without quantized activations every output row must be within the tolerance and greedy tokens
must agree at every step.

Quantized activations (W8A8 linears or an int8 KV cache) make those two checks depend on the
CPU: which float sums differ in the last bit (and so which activations land one int8 step
apart) depends on the SIMD kernels of onnxruntime and torch, and a MoE router downstream of a
flipped activation can pick another expert for that token, moving its row far beyond any
tolerance. For such graphs the check is bounded instead (`FLIP_SHARE`): at most 1/8 of the
compared rows (token positions, all steps) may exceed the tolerance, a returned int8 cache may
differ from the runtime's by one step in at most 1/8 of its entries, and greedy agreement is
reported but not required (a top-2 margin within the tolerance may pick the other token). A
wrong scale, zero point, weight layout or cache position moves most rows (or entries), so it
still fails. Each quantizer is exact on identical inputs, which the tests check per linear.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from cvt.qtensor import kernel_formats as KF
from cvt.errors import CvtError

MANIFEST = "export_manifest.json"
TOLERANCES = {"float": 1e-4, "fp16": 2e-2, "int4": 1e-3, "int8": 3e-2, "approximate": 5e-2}
FLIP_SHARE = 1 / 8   # quantized activations: the share of rows / int8 cache entries that may flip (module doc)


def read_manifest(dst) -> dict:
    path = Path(dst) / MANIFEST
    if not path.is_file():
        raise CvtError(f"{dst}: no {MANIFEST}; not a finished `cvt export onnx` output")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CvtError(f"{path}: not valid JSON: {exc}") from exc


def session(path: Path, manifest: dict, threads: int | None = None):
    """A CPU InferenceSession; a fused int4 Q/DQ MatMul keeps the export's accuracy level."""
    from cvt.extras import require

    ort = require("onnxruntime", "running an ONNX export (cvt run --backend onnxruntime, --verify)")
    so = ort.SessionOptions()
    so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(manifest.get("accuracy_level", 0)))
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads = threads
    try:
        return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own exception types
        raise CvtError(f"{path}: onnxruntime cannot load it: {str(exc).splitlines()[0]}") from exc


def _empty_cache(graph: dict, batch: int) -> dict[str, np.ndarray]:
    out = {}
    for inp in graph["inputs"]:
        if inp["name"].startswith("past_key_values."):
            shape = [batch if d == "batch" else 0 if d == "past" else d for d in inp["shape"]]
            out[inp["name"]] = np.zeros(shape, dtype=np.dtype(inp["dtype"]))
    return out


def _seq_axis(graph: dict) -> int:
    for inp in graph["inputs"]:
        if inp["name"].startswith("past_key_values."):
            return inp["shape"].index("past")
    raise CvtError(f"graph {graph['name']} has no cache inputs")


@dataclass
class OrtCache:
    """The cache arrays fed to the next call (present outputs of the last one)."""

    arrays: dict
    seq_axis: int
    max_len: int

    @property
    def length(self) -> int:
        return next(iter(self.arrays.values())).shape[self.seq_axis]


class OrtCausalLM:
    """An exported ``--scope model`` graph behind the runtime model contract (CPU)."""

    def __init__(self, dst, threads: int | None = None):
        self.dst = Path(dst)
        self.manifest = read_manifest(dst)
        graphs = {g["name"]: g for g in self.manifest["graphs"]}
        if "model" not in graphs:
            raise CvtError(f"{dst}: an export of --scope {self.manifest.get('scope')} (graphs: "
                           f"{', '.join(graphs)}); generation needs a --scope model export")
        self.graph = graphs["model"]
        self.session = session(self.dst / self.graph["file"], self.manifest, threads)
        self.outputs = [o["name"] for o in self.graph["outputs"]]
        self.max_positions = int(self.manifest["max_positions"])
        self.vocab_size = int(self.manifest["vocab_size"])
        self.args = SimpleNamespace(vocab_size=self.vocab_size, num_hidden_layers=self.manifest["num_hidden_layers"])

    def new_cache(self, batch: int, max_len: int, dtype=None, device=None) -> OrtCache:
        if max_len > self.max_positions:
            raise CvtError(f"cache max_len {max_len} exceeds max_position_embeddings {self.max_positions}")
        return OrtCache(_empty_cache(self.graph, batch), _seq_axis(self.graph), max_len)

    def run(self, ids: np.ndarray, cache: OrtCache) -> np.ndarray:
        """ids int64 [b, s] at positions cache.length.. -> logits float32 [b, s, vocab]; cache updated."""
        if cache.length + ids.shape[1] > cache.max_len:
            raise CvtError(f"cache of max_len {cache.max_len} cannot hold positions up to "
                           f"{cache.length + ids.shape[1] - 1}")
        outs = self.session.run(self.outputs, {"input_ids": ids.astype(np.int64, copy=False), **cache.arrays})
        for name, value in zip(self.outputs[1:], outs[1:]):
            cache.arrays["past_key_values." + name[len("present."):]] = value
        return outs[0]

    def __call__(self, tokens, start_pos: int = 0, cache: OrtCache | None = None, hidden_states=None):
        import torch

        if hidden_states is not None:
            raise CvtError("the onnxruntime backend does not return hidden states")
        own = cache is None
        if own:
            cache = self.new_cache(tokens.shape[0], start_pos + tokens.shape[1])
        if start_pos != cache.length:
            raise CvtError(f"start_pos {start_pos} does not follow the cache ({cache.length} positions); the "
                           "onnxruntime backend appends to the cache it is given")
        ids = tokens.cpu().numpy() if hasattr(tokens, "numpy") else np.asarray(tokens)
        return torch.from_numpy(self.run(ids, cache))


# ----------------------------------------------------------------------------------- parity
@dataclass
class Parity:
    graph: str
    reference: str
    steps: list = field(default_factory=list)   # (label, max |diff|, max |reference|)
    greedy_agree: bool | None = None
    tolerance: float = 0.0
    seconds: float = 0.0
    cache_max_abs: float | None = None          # layer / attention graphs: returned cache vs the runtime's
    cache_int8: bool = False                    # the cache is int8: cache_max_abs in int8 steps
    cache_share: float = 0.0                    # int8 cache: share of entries that differ
    rows: list = field(default_factory=list)    # max |diff| of every output row (token position), all steps
    flips: bool = False                         # quantized activations: the bounded check (module doc)

    @property
    def max_abs(self) -> float:
        return max(d for _, d, _ in self.steps)

    @property
    def ref_max(self) -> float:
        return max(r for _, _, r in self.steps)

    @property
    def bound(self) -> float:
        return self.tolerance * max(1.0, self.ref_max)

    @property
    def rows_off(self) -> int:
        """Rows beyond the tolerance (NaN included)."""
        return sum(not d <= self.bound for d in self.rows)

    @property
    def rows_allowed(self) -> int:
        """Rows that may exceed the tolerance: 0, or FLIP_SHARE of them with quantized activations."""
        return int(FLIP_SHARE * len(self.rows)) if self.flips else 0

    @property
    def passed(self) -> bool:
        if self.cache_int8:
            cache_ok = (self.cache_max_abs or 0.0) <= 1 and self.cache_share <= FLIP_SHARE
        else:
            cache_ok = (self.cache_max_abs or 0.0) <= self.bound
        if self.flips:
            return self.rows_off <= self.rows_allowed and cache_ok
        return self.max_abs <= self.bound and cache_ok and self.greedy_agree is not False

    def render(self) -> str:
        parts = ", ".join(f"{label} {d:.3g}" for label, d, _ in self.steps)
        rows = (f"; rows beyond it {self.rows_off}/{len(self.rows)} (up to {self.rows_allowed} may flip)"
                if self.flips else "")
        cache = ("" if self.cache_max_abs is None else
                 f"; cache max |diff| {self.cache_max_abs:.3g} int8 steps, in {self.cache_share:.2%} of entries"
                 if self.cache_int8 else f"; cache max |diff| {self.cache_max_abs:.3g}")
        agree = "" if self.greedy_agree is None else f"; greedy tokens agree: {'yes' if self.greedy_agree else 'NO'}"
        agree += " (not required: quantized activations)" if self.flips and self.greedy_agree is False else ""
        return (f"{self.graph}: onnxruntime vs {self.reference}: max |diff| {self.max_abs:.3g} (max |ref| "
                f"{self.ref_max:.3g}, tolerance {self.tolerance:g} x max(1, |ref|)) [{parts}]{rows}{cache}{agree}: "
                f"{'PASS' if self.passed else 'FAIL'}")


def tolerance(manifest: dict) -> float:
    """The parity tolerance of an export (see the module docstring), from its manifest."""
    lin = manifest.get("linears", {})
    tol = TOLERANCES["fp16"] if manifest.get("dtype") == "fp16" else TOLERANCES["float"]
    if any(k.startswith(KF.W4A16) for k in lin):
        tol = max(tol, TOLERANCES["approximate"] if manifest.get("accuracy_level", 0) >= 2 else TOLERANCES["int4"])
    if quantized_activations(manifest):
        tol = max(tol, TOLERANCES["int8"])
    return tol


def quantized_activations(manifest: dict) -> bool:
    """Whether the export quantizes activations (W8A8 / W4A8 linears or an int8 KV cache): the bounded check."""
    return (any(k.startswith((KF.W8A8_DYNAMIC, KF.W8A8_STATIC, KF.W4A8_DYNAMIC)) for k in manifest.get("linears", {}))
            or manifest.get("kv_cache", {}).get("dtype") == "int8")


def _numpy(b) -> np.ndarray:
    return b.detach().float().cpu().numpy() if hasattr(b, "detach") else np.asarray(b, np.float32)


def _diff(a: np.ndarray, b) -> tuple[float, float]:
    b = _numpy(b)
    return float(np.abs(a.astype(np.float32) - b).max()), float(np.abs(b).max())


def _row_diffs(a: np.ndarray, b) -> list[float]:
    """max |a - b| of every row (last axis) of outputs [b, s, d]."""
    d = np.abs(a.astype(np.float32) - _numpy(b))
    return d.reshape(-1, d.shape[-1]).max(axis=-1).tolist()


def parity(dst, model, *, batch: int = 2, prompt_len: int = 7, steps: int = 4, seed: int = 0,
           threads: int | None = None) -> list[Parity]:
    """Compare every graph of the export in DST against the torch runtime `model` (float32)."""
    manifest = read_manifest(dst)
    out = []
    for graph in manifest["graphs"]:
        t0 = time.perf_counter()
        if graph["name"] == "model":
            p = _model_parity(dst, manifest, model, batch, prompt_len, steps, seed, threads)
        else:
            p = _module_parity(dst, manifest, graph, model, batch, prompt_len, steps, seed, threads)
        p.tolerance = tolerance(manifest)
        p.flips = quantized_activations(manifest)
        p.seconds = time.perf_counter() - t0
        out.append(p)
    return out


def _model_parity(dst, manifest, model, batch, prompt_len, steps, seed, threads) -> Parity:
    import torch

    lm = OrtCausalLM(dst, threads)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, lm.vocab_size, (batch, prompt_len), generator=gen)
    total = prompt_len + steps
    tcache, ocache = model.new_cache(batch, total, dtype=torch.float32), lm.new_cache(batch, total)
    p = Parity("model", "torch runtime (float32, same artifact)")
    agree, pos = True, 0
    for step in range(steps + 1):
        ref = model(tokens, start_pos=pos, cache=tcache)
        got = lm.run(tokens.numpy(), ocache)
        p.steps.append(("prefill" if step == 0 else f"decode{step}", *_diff(got, ref)))
        p.rows += _row_diffs(got, ref)
        agree &= bool((torch.from_numpy(got[:, -1]).argmax(-1) == ref[:, -1].argmax(-1)).all())
        pos += tokens.shape[1]
        tokens = ref[:, -1].argmax(-1, keepdim=True)  # teacher-forced with the reference's greedy token
    p.greedy_agree = agree
    return p


def _module_parity(dst, manifest, graph, model, batch, prompt_len, steps, seed, threads) -> Parity:
    import torch

    name = graph["name"]                               # layer_N or layer_N.self_attn / layer_N.mlp
    i = int(name.split(".")[0].split("_")[1])
    block = name.split(".")[1] if "." in name else None
    layer = model.model.layers[i]
    sess = session(Path(dst) / graph["file"], manifest, threads)
    outs = [o["name"] for o in graph["outputs"]]
    gen = torch.Generator().manual_seed(seed)
    h = model.args.hidden_size
    cached = block != "mlp"
    tcache = model.new_cache(batch, prompt_len + steps, dtype=torch.float32)[i] if cached else None
    arrays = _empty_cache(graph, batch) if cached else {}
    p = Parity(name, "torch runtime module (float32, same artifact)")
    pos = 0
    for step in range(steps + 1):
        s = prompt_len if step == 0 else 1
        x = torch.randn(batch, s, h, generator=gen)
        if block == "mlp":
            ref = layer.mlp(x)
        else:
            cos, sin, mask = torch_positions(model, pos, s, cached=True)
            ref = (layer.self_attn(x, cos, sin, mask, pos, tcache) if block == "self_attn"
                   else layer(x, cos, sin, mask, pos, tcache))
        res = sess.run(outs, {"hidden_states": x.numpy(), **arrays})
        p.steps.append(("prefill" if step == 0 else f"decode{step}", *_diff(res[0], ref)))
        p.rows += _row_diffs(res[0], ref)
        if cached:
            for o, v in zip(outs[1:], res[1:]):
                arrays["past_key_values." + o[len("present."):]] = v
        pos += s
    if cached:  # the cache the graph returned vs the runtime's cache contents
        pairs = list(zip(arrays.values(), _torch_cache_tensors(tcache, pos)))
        ints = [(v, t) for v, t in pairs if v.dtype == np.int8]  # C8 (MLA: the latent only)
        p.cache_max_abs = max(_diff(v.astype(np.float32), t)[0] for v, t in (ints or pairs))
        if ints:  # in int8 steps; float parts of the cache (MLA's rope key) are checked by the outputs
            p.cache_int8 = True
            p.cache_share = (sum(int((v.astype(np.int32) != _numpy(t)).sum()) for v, t in ints)
                             / sum(v.size for v, _ in ints))
    return p


def _torch_cache_tensors(cache, end: int):
    if hasattr(cache, "kv"):  # MLA
        return [cache.kv[:, :end], cache.pe[:, :end]]
    return [cache.k[:, :, :end], cache.v[:, :, :end]]


def torch_positions(model, start_pos: int, s: int, cached: bool = True):
    """cos, sin, mask exactly as the runtime model's forward builds them (float32 activations)."""
    import torch

    from cvt.export import onnx_models as om

    pos = torch.arange(start_pos, start_pos + s)
    freqs = pos[:, None].float() * model.inv_freq[None]
    if om.graphs(model).rope_halves:
        freqs = torch.cat((freqs, freqs), dim=-1)
    cos, sin = freqs.cos() * model.rope_scale, freqs.sin() * model.rope_scale
    keys = torch.arange(start_pos + s) if cached else pos
    return cos, sin, keys[None, :] <= pos[:, None]


# ------------------------------------------------------------------------------- generation
def load_for_generation(dst, threads: int | None = None):
    """(OrtCausalLM, tokenizer) from an export directory (config.json + tokenizer copied by export)."""
    from cvt.extras import require
    from cvt.runtime.tokenizer import load_tokenizer

    require("onnxruntime", "cvt run --backend onnxruntime")  # before DST is read: an install problem first

    lm = OrtCausalLM(dst, threads)
    cfg_path = Path(dst) / "config.json"
    if not cfg_path.is_file():
        raise CvtError(f"{dst}: no config.json next to the ONNX graphs (export copies it from SRC)")
    from cvt.convert.arch import text_config

    config = dict(text_config(json.loads(cfg_path.read_text())))
    return lm, load_tokenizer(dst, config)
