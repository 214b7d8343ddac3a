"""`cvt verify CANDIDATE --reference REF`: how far a converted/quantized model is from BF16.

Both models run on the same token batches (``--data`` text/jsonl, or a built-in sample),
tokenized with the reference's tokenizer. Compared:

* per layer: the residual stream after the embedding and after every decoder layer, plus the
  logits, with Ascend's compare columns (`cvt.runtime.metrics.compare_tensors`);
* per weight: SQNR of every linear both models hold (the candidate's weight dequantized);
* logits: PPL of each and their ratio, KL(ref || cand) mean and percentiles, same top-1, RMS dp;
* NaN / Inf: counted in every layer output and every weight of both models (`nonfinite_layers`,
  `nonfinite_weights`, `first_nonfinite_layer`); the metrics of a non-finite output are NaN
  (`cvt.runtime.metrics`) and fail every threshold.

Thresholds are validated before any model is loaded (`Thresholds.coerce`: an invalid limit is a
`CvtError` naming the option). Writes report.json (schemas/report.schema.json), report.md and a
self-contained report.html, and evaluates the thresholds; the CLI exits non-zero when one is
violated.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from cvt.version import __version__
from cvt.convert.paths import check_outside
from cvt.convert.quant_summary import fallback_lines, method_counts, mixed_lines
from cvt.errors import CvtError
from cvt.runtime import metrics
from cvt.runtime.kernels import Linear
from cvt.runtime.loader import Loaded, load_model
from cvt.runtime.report import evaluate_thresholds, write_report
from cvt.runtime.tokenizer import load_tokenizer, read_ids
from cvt.schemas.manifest import ToolInfo
from cvt.schemas.report import (DataInfo, LayerRow, LogitStats, ModelRef, NonFinite, Report, Thresholds,
                                WeightSqnrRow)

SAMPLE_TEXT = (
    "#ifndef _UAPI_LINUX_TYPES_H\n#define _UAPI_LINUX_TYPES_H\n\n#include <asm/types.h>\n\n"
    "struct sockaddr_storage {\n\tunsigned short ss_family;\n\tchar __data[126];\n};\n\n"
    "The quick brown fox jumps over the lazy dog. Large language models are converted, quantized and "
    "sharded before they are served; every step must be checked against the reference weights. "
    "static inline int add(int a, int b) { return a + b; }\n"
) * 4


@dataclass
class VerifyResult:
    report: Report
    paths: dict[str, Path]


def _ref(loaded: Loaded, path) -> ModelRef:
    m = loaded.manifest
    q = m.quant if m else None
    return ModelRef(path=str(path), format=m.format if m else None, stages=[s.name for s in m.stages] if m else [],
                    methods=method_counts(q) if q else {}, fallback_count=len(q.fallbacks) if q else 0,
                    fallbacks=fallback_lines(q, loaded.config) if q else [],
                    mixed_precision=mixed_lines(q) if q else [])


def _batches(tokenizer, data: Path | None, seq_len: int, max_sequences: int, limit: int) -> tuple[torch.Tensor, DataInfo]:
    seq_len = min(seq_len, limit)
    # only what the batches use is read (a huge line or /dev/zero costs nothing extra)
    ids = read_ids(tokenizer, data, max_sequences * seq_len, option="--data")[0] if data \
        else tokenizer.encode(SAMPLE_TEXT)
    n = min(max_sequences, len(ids) // seq_len)
    if n < 1:
        raise CvtError(f"{data or 'the built-in sample'}: {len(ids)} tokens, fewer than one sequence of {seq_len}")
    tokens = torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)
    info = DataInfo(source="file" if data else "builtin-sample", path=str(data) if data else None,
                    sequences=n, tokens=n * (seq_len - 1))
    return tokens, info


class _Counted(list):
    """The hidden-states list a model appends to after the embedding and after each decoder
    layer: every append advances `bar` (progress within the one batched forward)."""

    def __init__(self, bar):
        super().__init__()
        self.bar = bar

    def append(self, x) -> None:
        super().append(x)
        self.bar.update(1)


@torch.no_grad()
def _run(model, tokens: torch.Tensor, device, bar=None) -> tuple[list[torch.Tensor], torch.Tensor]:
    hidden: list[torch.Tensor] = [] if bar is None else _Counted(bar)
    logits = model(tokens.to(device), hidden_states=hidden)
    return [h.float().cpu() for h in hidden], logits.float().cpu()


def weight_sqnr(cand, ref) -> list[WeightSqnrRow]:
    ref_linears = {n: m for n, m in ref.named_modules() if isinstance(m, Linear)}
    rows = []
    for name, mod in cand.named_modules():
        other = ref_linears.get(name)
        if isinstance(mod, Linear) and other is not None:
            w_ref, w = other.dense_weight(), mod.dense_weight()
            if w_ref.shape != w.shape:
                raise CvtError(f"{name}.weight is {list(w.shape)} in the candidate and {list(w_ref.shape)} in the "
                               "reference: not the same model")
            rows.append(WeightSqnrRow(name=f"{name}.weight", sqnr_db=metrics.sqnr_db(w_ref, w), format=mod.fmt))
    return rows


def count_nonfinite(name: str, side: str, t: torch.Tensor) -> NonFinite | None:
    """A `NonFinite` row for tensor `t` (layer output or weight `name` of `side`), None when all finite."""
    nan, pinf, ninf = metrics.nonfinite_counts(t)
    if nan + pinf + ninf == 0:
        return None
    return NonFinite(name=name, side=side, nan=nan, posinf=pinf, neginf=ninf, numel=int(t.numel()))


def nonfinite_layers(names: list[str], cand: list[torch.Tensor], ref: list[torch.Tensor]) -> list[NonFinite]:
    """The layer outputs holding NaN / Inf, in model order, candidate before reference."""
    out = []
    for name, c, r in zip(names, cand, ref):
        out += [row for row in (count_nonfinite(name, "candidate", c), count_nonfinite(name, "reference", r)) if row]
    return out


def nonfinite_weights(cand, ref) -> list[NonFinite]:
    """Every floating parameter or buffer of either model that holds NaN / Inf (candidate first)."""
    out = []
    for side, model in (("candidate", cand), ("reference", ref)):
        seen: set[int] = set()
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if id(t) in seen or not t.dtype.is_floating_point or t.numel() == 0:
                continue
            seen.add(id(t))
            row = count_nonfinite(name, side, t)
            if row:
                out.append(row)
    return out


def _same_model(cand, ref, cand_path, ref_path) -> None:
    """CvtError unless both are the same model (family and sizes): a Qwen candidate against a
    DeepSeek reference has nothing to compare layer by layer."""
    if cand.family != ref.family:
        raise CvtError(f"the candidate {cand_path} is a {cand.family} model and the reference {ref_path} a "
                       f"{ref.family} model: verify compares a converted model with the model it came from")
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "moe_intermediate_size"):
        a, b = getattr(cand, key, None), getattr(ref, key, None)
        if a != b:
            raise CvtError(f"the candidate {cand_path} and the reference {ref_path} differ in {key}: {a} vs {b} "
                           "(verify compares a converted model with the model it came from)")


def verify(candidate, reference, report_dir, *, data: Path | None = None,
           thresholds: Thresholds | dict | None = None, device: str | torch.device = "cpu",
           dtype: torch.dtype = torch.float32, seq_len: int = 128, max_sequences: int = 8,
           quiet: bool = True) -> VerifyResult:
    """Run both models, compare, write the report into `report_dir`; see the module doc.

    thresholds: `Thresholds`, or a dict of the limits (min_cosine=..., as the CLI's options), or
        None (none applied); validated first: an invalid limit raises `CvtError` naming the option
        before any model is loaded.
    quiet: False shows progress bars on stderr: loading each model, then scoring (one step per
        layer output of either model).
    """
    from cvt.progress import make_progress

    thresholds = Thresholds.coerce(thresholds)
    for what, path in (("candidate", candidate), ("reference", reference)):
        if Path(str(path)).exists():  # a local checkpoint: refused before anything loads
            check_outside(path, report_dir, "--report", what)
    ref = load_model(reference, device=device, dtype=dtype, quiet=quiet, desc="load reference")
    cand = load_model(candidate, device=device, dtype=dtype, quiet=quiet, desc="load candidate")
    for what, loaded in (("candidate", cand), ("reference", ref)):  # a hub id, resolved to its snapshot
        check_outside(loaded.checkpoint_path, report_dir, "--report", what)
    _same_model(cand.model.args, ref.model.args, candidate, reference)
    tokenizer = load_tokenizer(ref.checkpoint_path, ref.config)
    tokens, data_info = _batches(tokenizer, data, seq_len, max_sequences, ref.model.max_positions)

    steps = ref.model.args.num_hidden_layers + cand.model.args.num_hidden_layers + 2  # + the embeddings
    with make_progress(steps, f"score {len(tokens)} x {tokens.shape[1]} tokens", quiet, unit="layer") as bar:
        ref_hidden, ref_logits = _run(ref.model, tokens, ref.device, bar)
        cand_hidden, cand_logits = _run(cand.model, tokens, cand.device, bar)
    if len(ref_hidden) != len(cand_hidden):
        raise CvtError(f"layer counts differ: candidate {len(cand_hidden) - 1}, reference {len(ref_hidden) - 1}")
    names = ["embed"] + [f"layer.{i}" for i in range(len(ref_hidden) - 1)] + ["logits"]
    layers = [LayerRow(name=n, **metrics.compare_tensors(c, r))
              for n, c, r in zip(names, [*cand_hidden, cand_logits], [*ref_hidden, ref_logits])]
    bad_layers = nonfinite_layers(names, [*cand_hidden, cand_logits], [*ref_hidden, ref_logits])

    v = ref_logits.shape[-1]
    stats = metrics.logit_stats(cand_logits[:, :-1].reshape(-1, v), ref_logits[:, :-1].reshape(-1, v),
                                tokens[:, 1:].reshape(-1))
    kl = stats.pop("kl_per_token")
    logits = LogitStats(**stats)
    outcome = evaluate_thresholds(thresholds, layers, logits, bad_layers)
    report = Report(
        tool=ToolInfo(version=__version__),
        candidate=_ref(cand, candidate),
        reference=_ref(ref, reference),
        data=data_info,
        layers=layers,
        first_divergent_layer=outcome.first_divergent_layer,
        first_nonfinite_layer=bad_layers[0].name if bad_layers else None,
        nonfinite_layers=bad_layers,
        nonfinite_weights=nonfinite_weights(cand.model, ref.model),
        weights=weight_sqnr(cand.model, ref.model),
        logits=logits,
        thresholds=thresholds,
        checks=outcome.checks,
        violations=outcome.violations,
        passed=outcome.passed,
    )
    paths = write_report(report, Path(report_dir), kl_values=kl)
    return VerifyResult(report, paths)
