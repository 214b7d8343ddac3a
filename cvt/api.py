"""The public Python API: one function per verb, each taking a typed options object (pydantic,
unknown fields refused) -- the same objects the `cvt` command line builds from its options.

    >>> from cvt import QuantizeOptions, quantize
    >>> r = quantize(QuantizeOptions(src="ckpt", dst="out", scheme="w8a8"))   # doctest: +SKIP
    >>> r = quantize(src="ckpt", dst="out", scheme="w4a16", group_size=32)    # doctest: +SKIP

Every function also takes the options' fields as keywords. An option out of its range raises
pydantic's `ValidationError` (an unknown scheme, format or method: `CvtError`); failures of the
work raise `cvt.errors.CvtError` (one line naming the file, tensor or option); nothing prints.
The verbs that split their work over the ranks of a torchrun world (fp8_to_bf16, quantize, shard)
read that world here, once (`cvt.world.expect`: one process without torchrun's environment, and
as many ranks as `procs` says when given), and pass it down to the stage.
Heavy modules (torch, the stages) are imported on first call, so `import cvt` stays cheap.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

from cvt.errors import CvtError
from cvt.units import parse_size

Device = Literal["auto", "cpu", "cuda", "npu"]
DType = Literal["bf16", "fp16", "fp32"]
Backend = Literal["torch", "onnxruntime"]  # the CLI's choices are these (`typing.get_args`)


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


def _size(v: Any) -> Any:
    """'5GB', '64GiB' or a byte count -> bytes (None stays None)."""
    return None if v is None else parse_size(v)


def _build(cls, options, kw):
    """The options object of a call: `options`, or built from keywords, or `options` with some
    fields replaced by keywords (validated again)."""
    if options is None:
        return cls(**kw)
    if not isinstance(options, cls):
        raise CvtError(f"expected {cls.__name__}, got {type(options).__name__}")
    names = {f.alias: name for name, f in cls.model_fields.items() if f.alias}  # format= -> fmt
    return cls(**{**options.model_dump(), **{names.get(k, k): v for k, v in kw.items()}}) if kw else options


class _WriteOptions(_Options):
    """What every verb that writes a checkpoint directory takes."""

    src: str
    dst: str
    revision: Optional[str] = None  # hub revision when SRC is a repo id
    max_shard_size: int = Field(5 * 10**9, gt=0)
    resume: bool = True
    overwrite: bool = False
    quiet: bool = True  # no progress bar
    # processes: the call runs in this one, a rank of the torchrun world it was started in; given,
    # that world must have `procs` ranks (`cvt VERB --procs N` is what launches N of them)
    procs: Optional[int] = Field(None, ge=1)

    _sizes = field_validator("max_shard_size", mode="before")(_size)


class Fp8ToBf16Options(_WriteOptions):
    """`cvt fp8-to-bf16 SRC DST`: an FP8 block-scaled release -> BF16, bit-exact."""

    workers: Optional[int] = Field(None, ge=1, le=64)


def fp8_to_bf16(options: Fp8ToBf16Options | None = None, /, **kw):
    """Dequantize SRC into DST; returns the writer's result (files, bytes, seconds, `.extra` counts).

    >>> fp8_to_bf16(src="/models/DeepSeek-R1", dst="/data/r1-bf16", workers=2)  # doctest: +SKIP
    """
    o = _build(Fp8ToBf16Options, options, kw)
    from cvt import world
    from cvt.convert.fp8_to_bf16 import fp8_to_bf16 as stage

    w = world.expect(o.procs).start("cpu")  # a rank of torchrun writes its share of the files (peers met before DST)
    return stage(o.src, o.dst, revision=o.revision, workers=o.workers, max_shard_size=o.max_shard_size,
                 resume=o.resume, overwrite=o.overwrite, quiet=o.quiet, world=w)


class QuantizeOptions(_WriteOptions):
    """`cvt quantize SRC DST --scheme ...` (docs/quantize.md; the schemes, formats and targets: docs/formats.md)."""

    scheme: str
    fmt: Optional[str] = Field(None, alias="format")  # None: compressed-tensors
    target: Optional[str] = None
    target_version: Optional[str] = None              # None: 0.23 for vllm-ascend (cvt.qtensor.stack_versions)
    kv_dtype: Optional[str] = None                    # None: the format's own (ascend int8, compressed-tensors fp8)
    method: Optional[str] = None                      # None: rtn
    group_size: Optional[int] = Field(None, ge=0)
    asym: bool = False
    fp4_format: Optional[str] = None                  # None: nvfp4
    calib: Optional[Path] = None
    calib_tokens: Optional[int] = Field(None, ge=16)  # None: up to cvt.corpus.CALIB_TOKENS; given: all of them
    device: str = "cpu"
    expert_memory: int = Field(4 * 2**30, gt=0)
    static_attention: bool = False
    ignore: tuple[str, ...] = ()
    recipe: Optional[Path] = None
    rotate: Optional[str] = None                      # hadamard[:SEED] (cvt.quant.rotate); None: no rotation
    workers: Optional[int] = Field(None, ge=1, le=64)
    kl_budget: Optional[float] = None                 # checked by the stage (exit 2 with one line)
    kl_high: Optional[str] = None                     # None: w8a8
    # --method flatquant's fit (cvt.quant.methods.flatquant; None: its defaults); refused without that method
    flatquant_steps: Optional[int] = Field(None, ge=1, le=100000)
    flatquant_lr: Optional[float] = Field(None, gt=0, le=1, allow_inf_nan=False)
    flatquant_seed: Optional[int] = Field(None, ge=0, le=2**31 - 1)

    _memory = field_validator("expert_memory", mode="before")(_size)

    @field_validator("scheme")
    @classmethod
    def _known_scheme(cls, v: str) -> str:
        from cvt.qtensor.schemes import SCHEMES

        SCHEMES.get(v)  # an unknown name raises, listing the known ones
        return v

    @field_validator("fmt")
    @classmethod
    def _known_format(cls, v: str | None) -> str | None:
        from cvt.qtensor.formats import FORMATS

        if v is not None:
            FORMATS.get(v)
        return v

    @field_validator("rotate")
    @classmethod
    def _known_rotation(cls, v: str | None) -> str | None:
        if v is None:
            return v
        from cvt.quant.rotate import parse  # torch: only when a rotation is asked for

        return parse(v)

    @field_validator("method")
    @classmethod
    def _known_method(cls, v: str | None) -> str | None:
        from cvt.quant.recipe import METHODS

        if v is not None and v not in METHODS:
            raise ValueError(f"unknown method {v!r} (known: {', '.join(METHODS)})")
        return v


def quantize(options: QuantizeOptions | None = None, /, **kw):
    """Quantize SRC into DST; returns the writer's result, the manifest in `.manifest`.

    >>> quantize(src="/data/r1-bf16", dst="/data/r1-w8a8", scheme="w8a8", fmt="ascend")  # doctest: +SKIP
    """
    o = _build(QuantizeOptions, options, kw)
    from cvt import world
    from cvt.quant.recipe import load_recipe

    from cvt.quant.stage import quantize as stage

    device, w = o.device, world.expect(o.procs)
    if device != "cpu" and w.size > 1:  # a rank of torchrun computes on its node's device LOCAL_RANK
        from cvt.runtime.parallel import rank_device

        device = rank_device(device, w.local_rank)
    elif device != "cpu":  # "cpu" needs no check; resolving imports torch, which RTN with the C kernels never does
        from cvt.runtime.device import resolve_device

        device = resolve_device(device)
    w.start(getattr(device, "type", device))  # a rank of torchrun: its process group (gloo / nccl / hccl)
    return stage(o.src, o.dst, scheme=o.scheme, fmt=o.fmt, method=o.method, group_size=o.group_size, asym=o.asym,
                 fp4_format=o.fp4_format, calib=o.calib, calib_tokens=o.calib_tokens,
                 static_attention=o.static_attention, ignore=o.ignore,
                 recipe=load_recipe(o.recipe) if o.recipe else None, revision=o.revision, workers=o.workers,
                 max_shard_size=o.max_shard_size, resume=o.resume, overwrite=o.overwrite, quiet=o.quiet,
                 target=o.target, device=device, expert_memory=o.expert_memory, target_version=o.target_version,
                 kv_dtype=o.kv_dtype, rotate=o.rotate, world=w, kl_budget=o.kl_budget, kl_high=o.kl_high,
                 fit={k: v for k in ("flatquant_steps", "flatquant_lr", "flatquant_seed")
                      if (v := getattr(o, k)) is not None})


class LayoutOptions(_Options):
    """A parallel layout (DESIGN.md "Parallel layout"): the degrees, and the expert placement."""

    world_size: Optional[int] = Field(None, ge=1)
    tp: Optional[int] = Field(None, ge=1)
    ep: Optional[int] = Field(None, ge=1)
    moe_tp: Optional[int] = Field(None, ge=1)
    dense_tp: Optional[int] = Field(None, ge=1)
    embed_tp: Optional[int] = Field(None, ge=1)
    lmhead_tp: Optional[int] = Field(None, ge=1)
    placement: Optional[Path] = None
    redundant: int = Field(0, ge=0)
    shared_experts: Literal["moe_tp", "replicated"] = "moe_tp"

    def build(self, config: dict):
        """The `cvt.convert.placement.Layout` for this model's config: degrees, then the placement
        (an EPLB / MindIE file, or `redundant` copies of the first experts)."""
        from cvt.convert.placement import layout_for

        return layout_for(config, self.world_size, self.tp, self.ep, self.moe_tp, self.dense_tp, self.embed_tp,
                          self.lmhead_tp, placement=self.placement, redundant=self.redundant,
                          shared_experts=self.shared_experts)


class PlanOptions(_Options):
    """`cvt plan MODEL` / `cvt shard SRC --dry-run`: per-rank memory from config.json alone.
    `scheme` None: the source's own weights (a cvt quantize output's scheme, format and target;
    an FP8 release; else bf16)."""

    model: str  # a checkpoint directory, its config.json, or a hub repo id
    revision: Optional[str] = None  # hub revision when `model` is a repo id
    layout: LayoutOptions = LayoutOptions()
    scheme: Optional[str] = None
    group_size: Optional[int] = Field(None, ge=0)
    fmt: Optional[str] = Field(None, alias="format")
    target: Optional[str] = None
    fp4_format: Optional[str] = None
    hbm: Optional[int] = Field(None, gt=0)
    kv_tokens: int = Field(0, ge=0)

    _sizes = field_validator("hbm", mode="before")(_size)


def plan(options: PlanOptions | None = None, /, **kw):
    """The memory plan (`cvt.convert.memory_plan.Plan`: `.render()`, `.violations`, `.over_budget`).

    >>> p = plan(model="/models/DeepSeek-V3", layout=LayoutOptions(ep=64), hbm="64GB")  # doctest: +SKIP
    """
    o = _build(PlanOptions, options, kw)
    from cvt.convert.memory_plan import memory_plan, read_config
    from cvt.convert.shard import source_weights

    where, config = read_config(o.model, o.revision)
    scheme, group, fmt, target, fp4 = o.scheme, o.group_size, o.fmt, o.target, o.fp4_format
    if scheme is None:  # the source's own weights; options given explicitly win over what it records
        scheme, own_group, own = source_weights(where, config)
        group = own_group if group is None else group
        if own:
            recorded = (own.get("format"), own.get("target"), own.get("fp4_format"))
            fmt, target, fp4 = (a if a is not None else r for a, r in zip((fmt, target, fp4), recorded))
    return memory_plan(config, o.layout.build(config), scheme=scheme or "bf16", group_size=group,
                       kv_tokens=o.kv_tokens, hbm_bytes=o.hbm, fmt=fmt, target=target, fp4_format=fp4)


class ShardOptions(_WriteOptions):
    """`cvt shard SRC DST`: per-rank directories for a layout, with a manifest."""

    layout: LayoutOptions = LayoutOptions()


def shard(options: ShardOptions | None = None, /, **kw):
    """Write SRC's tensors per rank under DST; returns the writer's result and the `.layout` used.

    >>> shard(src="/data/r1-w8a8", dst="/data/r1-ep16", layout=LayoutOptions(ep=16))  # doctest: +SKIP
    """
    o = _build(ShardOptions, options, kw)
    from cvt import world
    from cvt.convert.reader import open_checkpoint
    from cvt.convert.shard import shard as stage

    # the processes of a torchrun world split the rank files (not the layout's ranks); they meet before DST is made
    w = world.expect(o.procs).start("cpu")

    with open_checkpoint(o.src, o.revision) as ckpt:
        layout = o.layout.build(ckpt.config)
    r = stage(o.src, o.dst, layout, revision=o.revision, max_shard_size=o.max_shard_size, resume=o.resume,
              overwrite=o.overwrite, quiet=o.quiet, world=w)
    r.layout = layout
    return r


class VerifyOptions(_Options):
    """`cvt verify CANDIDATE --reference REF --report DIR` and its gates (None: not applied)."""

    candidate: str
    reference: str
    report_dir: Path
    data: Optional[Path] = None
    seq_len: int = Field(128, ge=2)
    max_sequences: int = Field(8, ge=1)
    min_cosine: Optional[float] = Field(None, ge=-1, le=1, allow_inf_nan=False)
    max_ppl_ratio: Optional[float] = Field(None, gt=0, allow_inf_nan=False)
    max_mean_kl: Optional[float] = Field(None, ge=0, allow_inf_nan=False)
    min_top1: Optional[float] = Field(None, ge=0, le=1, allow_inf_nan=False)
    device: Device = "auto"
    dtype: DType = "fp32"
    quiet: bool = True  # no progress bars


def verify(options: VerifyOptions | None = None, /, **kw):
    """Run both models on the same tokens and write report.{json,md,html}; returns the result
    (`.report.passed`, `.report.violations`, `.paths`).

    >>> verify(candidate="out/w8a8", reference="out/bf16", report_dir="out/report", min_cosine=0.99)  # doctest: +SKIP
    """
    o = _build(VerifyOptions, options, kw)
    from cvt.runtime.device import DTYPES, resolve_device
    from cvt.runtime.verify import verify as run_verify
    from cvt.schemas.report import Thresholds

    th = Thresholds.from_options(min_cosine=o.min_cosine, max_ppl_ratio=o.max_ppl_ratio, max_mean_kl=o.max_mean_kl,
                                 min_top1=o.min_top1)  # CvtError naming the option before anything loads
    return run_verify(o.candidate, o.reference, o.report_dir, data=o.data, thresholds=th,
                      device=resolve_device(o.device), dtype=DTYPES[o.dtype], seq_len=o.seq_len,
                      max_sequences=o.max_sequences, quiet=o.quiet)


class RunOptions(_Options):
    """`cvt run MODEL --prompt ...` in this process (a sharded output runs under torchrun: `cvt run
    --procs`)."""

    model: str
    prompts: tuple[str, ...] = ()
    input_ids: tuple[str, ...] = ()
    max_new_tokens: int = Field(32, ge=0)
    temperature: float = Field(0.0, ge=0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    seed: int = Field(0, ge=0, lt=2**64)
    device: Device = "auto"
    dtype: DType = "bf16"
    verify_files: bool = False
    revision: Optional[str] = None
    backend: Backend = "torch"
    quiet: bool = True  # no progress bars


class RunResult(BaseModel):
    """What `run` generated: per prompt its token ids and text, plus the speeds."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    prompt_ids: list[list[int]]
    output_ids: list[list[int]]
    texts: list[str]
    device: str
    dtype: str
    tokenizer: str
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    notes: list[str] = []


def run(options: RunOptions | None = None, /, **kw) -> RunResult:
    """Generate with the bundled runtime (or onnxruntime on a `cvt export onnx` output).

    >>> run(model="out/w8a8", prompts=("def main(",), max_new_tokens=16).texts  # doctest: +SKIP
    """
    o = _build(RunOptions, options, kw)
    from cvt.runtime.generate import generate
    from cvt.runtime.tokenizer import prompt_ids

    notes: list[str] = []

    if not o.prompts and not o.input_ids:
        raise CvtError("give --prompt TEXT or --input-ids 1,2,3")
    if o.backend == "onnxruntime":
        from cvt.export.ort import load_for_generation

        if o.device not in ("auto", "cpu"):
            raise CvtError("--backend onnxruntime runs on one CPU process (--device auto or cpu, no --procs)")
        lm, tok = load_for_generation(o.model)
        dev, dtype = "cpu", f"onnxruntime, {lm.manifest['dtype']} weights"
    else:
        from cvt.runtime.device import DTYPES, resolve_device
        from cvt.runtime.loader import load_model
        from cvt.runtime.tokenizer import load_tokenizer

        dev, dtype = resolve_device(o.device), o.dtype
        loaded = load_model(o.model, device=dev, dtype=DTYPES[o.dtype], verify_files=o.verify_files,
                            revision=o.revision, quiet=o.quiet)
        tok = load_tokenizer(loaded.checkpoint_path, loaded.config)
        lm = loaded.model
        if loaded.skipped:
            from cvt.convert.arch import carried_what

            notes.append(f"{loaded.config.get('model_type')}: running the text model only (the "
                         f"{len(loaded.skipped)} {carried_what(loaded.skipped)} tensors are not loaded)")
    ids = prompt_ids(tok, o.prompts, o.input_ids, lm.args.vocab_size)
    res = generate(lm, ids, o.max_new_tokens, temperature=o.temperature, top_p=o.top_p, seed=o.seed,
                   eos_id=tok.eos_id, device=dev, quiet=o.quiet)
    return RunResult(prompt_ids=ids, output_ids=res.outputs, texts=[tok.decode(p) + tok.decode(x)
                                                                     for p, x in zip(ids, res.outputs)],
                     device=str(dev), dtype=str(dtype), tokenizer=tok.kind,
                     prefill_tokens_per_s=res.prefill_tokens_per_s, decode_tokens_per_s=res.decode_tokens_per_s,
                     notes=notes)


def inspect(path: str, revision: str | None = None):
    """Describe a checkpoint from its headers alone (`.render()`, `.to_dict()`, `.problems`)."""
    from cvt.convert.inspect import inspect_checkpoint

    return inspect_checkpoint(path, revision)


__all__ = ["Fp8ToBf16Options", "LayoutOptions", "PlanOptions", "QuantizeOptions", "RunOptions", "RunResult",
           "ShardOptions", "VerifyOptions", "fp8_to_bf16", "inspect", "plan", "quantize", "run", "shard", "verify"]
