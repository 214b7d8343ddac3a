"""The quantize stage's output tensors, planned before a byte is written.

`OutputPlan.build` walks SRC's tensors in order: a quantized module becomes its on-disk parts
(`DiskLayouts`, made by the `Quantizer` when the writer asks), a float tensor is written as stored
or dequantized to BF16 (FP8, DeepSeek-V4's FP4 experts) or as calibration changed it (a smoothed
norm), and a float linear stored packed (compressed-tensors INT4) once as its BF16 weight. Then the
tensors the architecture table adds to the format's output (`ArchTable.ascend_copies`: DeepSeek-V4's
MTP draft copies) and the KV-cache tensors (`kv_outputs`). Each tensor gets its description tag
(quant_model_description.json / the compressed-tensors config), and the linears left float are listed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cvt.lazy import torch

from cvt.convert.arch import ArchSpec, TensorInfo, arch_for, text_config
from cvt.convert.config import SourceFormat
from cvt.convert.ct_source import DROPPED as CT_DROPPED
from cvt.convert.fp8 import kernel_name as fp8_kernel_name
from cvt.convert.fp8_to_bf16 import dequantized_pieces
from cvt.convert.safetensors_io import TensorSpec
from cvt.convert.writer import OutTensor
from cvt.dtypes import dtype_code
from cvt.quant import qkernel
from cvt.qtensor.disk_specs import DiskLayouts
from cvt.qtensor.layouts import ASCEND
from cvt.quant.stage.assignment import CT_PARTS, FP8_SCALE, Plan, weight_shape
from cvt.quant.stage.quantizer import Quantizer, Source

LINEAR_ROLES = ("linear", "expert", "shared_expert", "mtp_proj", "head", "router")


@dataclass
class Outputs:
    """The output's tensors in order, each one's description tag, the linears left float and the
    MoE modules whose fused experts are (`Format.write_metadata`)."""

    tensors: list[OutTensor] = field(default_factory=list)
    tags: dict[str, str] = field(default_factory=dict)
    float_linears: list[str] = field(default_factory=list)
    float_experts: list[str] = field(default_factory=list)  # MoE modules whose fused [E, ...] experts stay float

    def add(self, tensor: OutTensor, tag: str = "FLOAT") -> None:
        self.tensors.append(tensor)
        self.tags[tensor.spec.name] = tag


@dataclass
class OutputPlan:
    """What the output holds of SRC (module doc), for one run."""

    ckpt: Any
    arch: ArchSpec
    plan: Plan
    form: Any  # the output format (`cvt.qtensor.formats`)
    source: Source
    src_fmt: SourceFormat
    cal: Any  # the calibration's results (`cvt.quant.stage.calibrate.Calibrated`)
    target: str
    quantizer: Quantizer = field(init=False)
    layouts: DiskLayouts = field(init=False)

    def build(self) -> Outputs:
        """SRC's tensors as the output holds them, then the table's extra tensors for the format."""
        cal = self.cal
        self.quantizer = Quantizer(self.source, self.plan, self.form, cal.static_inputs, cal.quantized,
                                   cal.methods_applied, cal.sqnr, self.target, cal.loader)
        self.layouts = DiskLayouts(self.form, self.target)
        out, emitted = Outputs(), set()
        for name, ref in self.ckpt.tensors.items():
            if name.endswith(FP8_SCALE):
                continue
            info = self.arch.classify(name)
            if info.param == self.source.scale_param:  # DeepSeek-V4's X.scale: with its weight, or dropped
                continue
            if info.module in self.plan.schemes:
                if info.module not in emitted:
                    emitted.add(info.module)
                    self._quantized(out, info.module, ref)
            elif self.src_fmt is SourceFormat.CT_INT4 and info.param in CT_PARTS:
                if info.param == "weight_packed":  # a float module stored packed: written once, as BF16 weight
                    self._unpacked(out, info.module)
            elif name in self.source.ct_parts:  # a compressed-tensors linear kept float: its BF16 weight, once
                if name == self.source.ct_parts[name].anchor:
                    self._unpacked(out, info.module)
            elif self.source.ct_linears and info.param in CT_DROPPED:
                continue  # the source's activation / KV-cache scales: not what the output quantizes with
            elif name in self.source.mxfp4_scales:
                continue  # gpt-oss's MXFP4 scales: read with their blocks (`Source.float_tensor`)
            else:
                self._float(out, name, ref, info)
        if self.form.name == ASCEND:
            self._copies(out)
        return out

    def _quantized(self, out: Outputs, module: str, ref) -> None:
        """A quantized module's on-disk parts; the first one made by the quantizer (in pieces where
        the packed weight is fused: `Quantizer.pieces`) and carrying the module's manifest entry."""
        plan, quantizer = self.plan, self.quantizer
        shape = weight_shape(self.ckpt, plan.modules[module])
        static = module in self.cal.static_inputs
        has_bias = "bias" in plan.modules[module] and not static
        b = self.ckpt.tensors[plan.modules[module]["bias"]] if has_bias else None
        specs, module_tags = self.layouts.get(module, plan.schemes[module], shape, static,
                                              None if b is None else b.shape,
                                              None if b is None else getattr(torch, torch_name(b.dtype)),
                                              plan.experts[module])
        out.tags.update(module_tags)
        streamed = qkernel.kernel_name() == "c"
        for j, (disk_name, (shape_, dt)) in enumerate(specs.items()):
            out.tensors.append(OutTensor(
                spec=TensorSpec(disk_name, dt, shape_),
                produce=(lambda m=module, n=disk_name, c=len(specs): quantizer.pieces(m, n, c)) if j == 0 and streamed
                else (lambda m=module, n=disk_name, c=len(specs): quantizer.part(m, n, c)),
                pieces=j == 0 and streamed,
                read_bytes=ref.nbytes if j == 0 else 0,
                meta=(lambda m=module: (m, quantizer.info[m].model_dump())) if j == 0 else None,
                meta_key=module if j == 0 else None,
            ))

    def _unpacked(self, out: Outputs, module: str) -> None:
        """A float linear stored as compressed-tensors INT4 (or FP4 / FP8 / INT8): its BF16 weight."""
        params = self.plan.modules[module]
        source = self.source
        out.add(OutTensor(TensorSpec(module + ".weight", "BF16", weight_shape(self.ckpt, params)),
                          produce=lambda p=params: source.float_weight(p).to(torch.bfloat16)))
        out.float_linears.append(module)

    def _float(self, out: Outputs, name: str, ref, info: TensorInfo) -> None:
        """A tensor kept float: as calibration left it, FP8 dequantized (by the C kernel in pieces),
        DeepSeek-V4 FP4 dequantized, or as stored."""
        ckpt, source, cal = self.ckpt, self.source, self.cal
        dt, shape = source.float_spec(name)
        pieces = name not in cal.float_overrides and ref.dtype == "F8_E4M3" and fp8_kernel_name() == "c"
        if name in cal.float_overrides:
            read = cal.float_loader or cal.float_overrides.get
            produce = (lambda n=name, d=dt, read=read: read(n).to(getattr(torch, torch_name(d))).contiguous())
        elif pieces:  # FP8 dequantized to BF16 by the C kernel, in pieces (which refuses NaN codes)
            produce = (lambda n=name: dequantized_pieces(ckpt, n, source.scale_of(n), source.block, verb="quantize"))
        elif dt != ref.dtype:  # FP8 (or DeepSeek-V4 FP4) dequantized to BF16
            produce = (lambda n=name: source.float_tensor(n))
        else:
            produce = (lambda n=name: ckpt.view(n))
        out.add(OutTensor(TensorSpec(source.float_name(name), dt, shape), produce=produce,
                          release=(lambda n=name: ckpt.release(n)),
                          read_bytes=ref.nbytes, pieces=pieces, finite=pieces,
                          source=None if name in cal.float_overrides else ref.describe()))
        module = info.module
        # a carried tower's linear too where its consumers would quantize it (`ArchTable.carried_linears_ignored`)
        linear = info.role.value in LINEAR_ROLES or (
            info.role.value == "carried" and self.arch.table.carried_linears_ignored)
        if info.param == "weight" and len(ref.shape) == 2 and linear and module not in out.float_linears:
            out.float_linears.append(module)
        elif info.role.value == "expert" and len(shape) == 3 and module not in out.float_experts:
            out.float_experts.append(module)  # routed experts fused into [E, ...] tensors (gpt-oss), float

    def _copies(self, out: Outputs) -> None:
        """The copies the architecture table has an Ascend output hold where SRC lacks them
        (`ArchSpec.missing_copies`: DeepSeek-V4's MTP draft embed / head), as float as the original;
        none for a layout transformers' save_pretrained wrote (`Checkpoint.renamed`): it holds no MTP
        layer, so there is no draft to feed."""
        if getattr(self.ckpt, "renamed", None):
            return
        source = self.source
        for copy, name in self.arch.missing_copies(self.ckpt.tensors).items():
            dt, shape = source.float_spec(name)
            out.add(OutTensor(TensorSpec(copy, dt, shape), produce=lambda n=name: source.float_tensor(n),
                              source=self.ckpt.tensors[name].describe()))


def int8_kv(plan: Plan) -> bool:
    """Whether a scheme of the plan quantizes the KV cache to int8 (C8)."""
    return any(getattr(s, "kv_cache", None) == "int8" for s in plan.schemes.values())


def kv_static(config: dict, plan: Plan, fmt: str) -> bool:
    """Whether the run calibrates static KV-cache scales: an int8 KV cache, except DeepSeek-V3.2's
    in the Ascend format, whose C8 is the indexer's dynamic one (`cvt.qtensor.indexer_c8`)."""
    from cvt.qtensor import indexer_c8

    return int8_kv(plan) and not indexer_c8.applies(text_config(config), fmt)


@dataclass
class KVOutputs:
    """What the output says of its KV cache: the manifest's ``kv_cache`` entry, whether the format
    describes an (MLA FAKQuant / GQA C8) int8 cache, and the format's extra description keys."""

    manifest: dict | None = None
    c8: bool = False
    meta_kw: dict[str, Any] = field(default_factory=dict)


def kv_outputs(out: Outputs, config: dict, plan: Plan, form, kv_scales: dict, fmt: str,
               kv_dtype: str | None) -> KVOutputs:
    """Add the KV-cache tensors to `out`: DeepSeek-V3.2's indexer rotations on Ascend (its C8 is
    the indexer's, `cvt.qtensor.indexer_c8`), or the calibrated scales of an int8 (or Ascend
    950's fp8 FAKQuant) cache."""
    c8 = int8_kv(plan)
    if c8 and not kv_static(config, plan, fmt):  # DeepSeek-V3.2 on Ascend: the indexer C8
        from cvt.qtensor import indexer_c8

        lm = text_config(config)
        rots = indexer_c8.rotation_tensors(lm)
        for n, t in rots.items():
            out.add(OutTensor(TensorSpec(n, dtype_code(t.dtype), tuple(t.shape)), produce=lambda t=t: t))
        # no MLA (FAKQuant) scales
        return KVOutputs({"convention": indexer_c8.CONVENTION, "tensors": sorted(rots)}, False,
                         {"extra_keys": indexer_c8.description_keys(lm)})
    if not c8:
        return KVOutputs()
    meta = form.kv_manifest(kv_scales)  # Ascend int8 names, or compressed-tensors fp8 k_scale / v_scale
    if kv_dtype is not None and kv_dtype != form.kv_codec:  # Ascend 950's fp8 FAKQuant cache
        from cvt.qtensor.kv_tensors import FP8_FAKQUANT

        meta["convention"] = {**meta["convention"], **FP8_FAKQUANT}
    tag = arch_for(config).table.attention.kv_quant.tag  # FAKQuant's FAQuant, GQA's C8
    for n, t in kv_scales.items():
        out.add(OutTensor(TensorSpec(n, dtype_code(t.dtype), tuple(t.shape)), produce=lambda t=t: t.contiguous()),
                tag)
    return KVOutputs(meta, True)


def torch_name(code: str) -> str:
    """The torch dtype attribute of a safetensors dtype code ("BF16" -> "bfloat16")."""
    from cvt.dtypes import DTYPES

    return DTYPES[code][0]
