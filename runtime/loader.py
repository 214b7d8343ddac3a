"""Checkpoint -> runnable model, streaming one tensor at a time.

`load_model(path)` accepts any cvt output (trusted only through its manifest) and plain
Hugging Face BF16 or FP8 directories (FP8 block weights are dequantized on load, as are
gpt-oss's MXFP4 experts). The model
is built on the meta device and each tensor is read from the mmap, converted and assigned in
place, so the process never holds two copies of the model.

Refused, with one line each: a manifest whose files are missing or of another size (and
checksum, with `verify_files=True`), a manifest whose tensor count or byte total disagrees with
the headers, tensors the model has no place for, model weights the checkpoint lacks (MTP
layers aside: a checkpoint without them just runs without them), and shapes that disagree.
A wrapper's text model (Kimi-K2.5: names under ``language_model.``) loads under the runtime's
names; its carried towers (vision tower, projector) are left unread and listed in `Loaded.skipped`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from cvt.convert.arch import arch_for, carried_names
from cvt.convert.config import SourceFormat, fp8_config, source_format
from cvt.convert.fp8 import dequant_fp8_block
from cvt.convert.reader import Checkpoint, manifest_problems, open_checkpoint, read_manifest
from cvt.errors import CheckpointError, ManifestError, TensorError
from cvt.runtime.kv_cache import is_kv_cache_tensor
from cvt.runtime.models import build_model
from cvt.schemas.manifest import Manifest

log = logging.getLogger(__name__)


@dataclass
class Loaded:
    model: nn.Module
    checkpoint_path: Path
    config: dict
    manifest: Manifest | None
    source_format: str
    device: torch.device
    dtype: torch.dtype
    # tensors the text runtime does not load (a wrapper's carried towers: Kimi-K2.5's vision)
    skipped: tuple[str, ...] = ()


def check_manifest(ckpt: Checkpoint, verify_files: bool = False) -> Manifest | None:
    """The manifest of a cvt output, checked against the files next to it (None: no manifest)."""
    manifest = ckpt.manifest
    if manifest is None:
        return None
    problems = manifest_problems(ckpt, manifest, verify_files)
    if problems:
        raise ManifestError(problems[0])
    return manifest


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str] | None:
    module_name, _, attr = name.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return None
    if attr in module._parameters or attr in module._buffers:
        return module, attr
    return None


def _assign(module: nn.Module, attr: str, value: torch.Tensor, name: str) -> None:
    current = module._parameters.get(attr)
    if current is None:
        current = module._buffers.get(attr)
    if tuple(current.shape) != tuple(value.shape):
        raise TensorError(f"tensor {name}: checkpoint shape {list(value.shape)}, the model expects {list(current.shape)}")
    value = value.to(dtype=current.dtype) if value.is_floating_point() and current.is_floating_point() else value
    if attr in module._parameters:
        module._parameters[attr] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[attr] = value


def load_model(path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
               verify_files: bool = False, revision: str | None = None, quiet: bool = True,
               desc: str = "load") -> Loaded:
    """Load `path` (module doc). `quiet=False` shows a progress bar (`desc`) over the bytes of
    tensors read; a library call is silent by default."""
    from cvt.progress import make_progress

    _refuse_sharded(path)
    ckpt = open_checkpoint(path, revision)
    try:
        manifest = check_manifest(ckpt, verify_files)
        fmt = source_format(ckpt.config, manifest is not None)
        refuse_unloadable(fmt, ckpt.root)
        arch = arch_for(ckpt.config)
        arch.shapes()  # sizes that describe no model: one line naming the key
        bare = arch.prefix_problem(ckpt.tensors)  # Kimi-K2.5 text names without language_model.
        if bare is not None:
            raise CheckpointError(f"{ckpt.root}: {bare}")
        block = fp8_block(ckpt, fmt)
        device = torch.device(device)
        with torch.device("meta"):
            model = build_model(ckpt.config, dtype=dtype)
        n_layers = getattr(model, "args").num_hidden_layers
        with make_progress(sum(r.nbytes for r in ckpt.tensors.values()), desc, quiet) as bar:
            seen, kv = assign_tensors(model, ckpt, device, block, progress=bar)
        if kv:
            from cvt.runtime.kv_cache import attach_kv_cache_scales, codec_of_config

            attach_kv_cache_scales(model, {k: v.to(device) for k, v in kv.items()},
                                   codec_of_config(ckpt.config, manifest))
        _drop_absent_mtp(model, seen, n_layers)
        check_complete(model, ckpt.root)
        model.eval()
        return Loaded(model, ckpt.root, ckpt.config, manifest, fmt.value, device, dtype, carried_tensors(ckpt))
    finally:
        ckpt.close()


# releases the runtime has no kernel for: FP8 per-tensor / per-channel, ModelOpt's (its NVFP4 /
# MXFP8 as stored, not the compressed-tensors parts `_QuantReader` reads)
_UNLOADED = {SourceFormat.CT_FP8: "float-quantized", SourceFormat.MODELOPT_NVFP4: "ModelOpt",
             SourceFormat.MODELOPT_FP8: "ModelOpt", SourceFormat.MODELOPT_MXFP8: "ModelOpt",
             SourceFormat.MODELOPT_FP8_PB_WO: "ModelOpt", SourceFormat.MODELOPT_MIXED: "ModelOpt"}


def refuse_unloadable(fmt: SourceFormat, root, sharded: bool = False) -> None:
    """ManifestError, one line, for a checkpoint (or a `cvt shard` output of one: `sharded`)
    whose format the runtime does not load."""
    if fmt is SourceFormat.OTHER_QUANT:
        raise ManifestError(f"{root}: {fmt.value} checkpoints are not runnable (bf16, fp8-block, "
                            "compressed-tensors and cvt outputs are)")
    if fmt in _UNLOADED:
        way = ("dequantize the release with cvt fp8-to-bf16 (or cvt quantize it) and shard that" if sharded else
               "dequantize it with cvt fp8-to-bf16 (or cvt quantize it) first")
        raise ManifestError(f"{root}: cvt's runtime (run, verify, export) does not load {fmt.value} "
                            f"({_UNLOADED[fmt]}) {'shards' if sharded else 'checkpoints'}; {way}")


def _refuse_sharded(path) -> None:
    """A `cvt shard` output holds per-rank directories: say how to run it instead of failing to index it."""
    if not isinstance(path, (str, os.PathLike)) or not Path(path).is_dir():
        return  # a resolved source object (hub or local), never a sharded directory
    manifest = read_manifest(Path(path))
    if manifest is not None and manifest.shard is not None:
        w = manifest.shard.layout.world_size
        raise ManifestError(f"{path} is sharded for {w} ranks (cvt shard): run it with `cvt run --procs {w}` "
                            f"or `torchrun --nproc-per-node {w} -m cvt.runtime.launch {path}`")


def fp8_block(ckpt: Checkpoint, fmt: SourceFormat) -> tuple[int, int] | None:
    """The FP8 block of an FP8 release (every FP8 weight's scale checked present, well shaped and
    finite; DeepSeek-V4's ``X.scale`` and FP4 experts too), else None."""
    if fmt is not SourceFormat.FP8_BLOCK:
        return None
    block = fp8_config(ckpt.config, str(ckpt.root)).block
    from cvt.convert.fp8_to_bf16 import check_scales_finite, pair_fp8_weights

    check_scales_finite(ckpt, pair_fp8_weights(ckpt, block, _scale_param(ckpt), fp4_experts=_fp4_experts(ckpt)))
    return block


def _scale_param(ckpt: Checkpoint) -> str:
    """The release's block-scale parameter (`ArchTable.scale_param`): ``weight_scale_inv``, or
    DeepSeek-V4's ``scale`` (``X.scale`` next to ``X.weight``)."""
    return arch_for(ckpt.config).table.scale_param


def _fp4_experts(ckpt: Checkpoint) -> bool:
    """Whether config.json says the routed experts are packed FP4 (DeepSeek-V4's ``expert_dtype``)."""
    from cvt.convert.fp4 import EXPERT_DTYPE_FP4

    return ckpt.config.get("expert_dtype") == EXPERT_DTYPE_FP4


def assign_tensors(model: nn.Module, ckpt: Checkpoint, device, block: tuple[int, int] | None, *,
                   skip: Callable[[str], bool] | None = None,
                   adjust: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
                   progress=None, rank_local: bool = False) -> tuple[set[str], dict[str, torch.Tensor]]:
    """Assign every tensor of `ckpt` to `model` (built on meta) by name, one at a time: plain
    tensors in place (FP8 dequantized with `block`), quantized linears replaced by their kernel
    format. Returns (model tensor names assigned, KV-cache scale tensors by name) -- the caller
    attaches the latter. `skip(name)`: tensors left unread (the multi-rank runtime skips MTP
    layers it does not build); `adjust(name, t)`: applied to each quantized part as read (it
    turns compressed-tensors' global ``weight_shape`` into a rank's local shape); `progress`: a
    bar advanced by each module's tensor bytes (skipped ones included) once it is done;
    `rank_local`: a `cvt shard` rank's directory, whose fused MXFP4 experts hold the rank's expert
    range (their dequantized shape is checked against the local model, not config.json)."""
    quant = _quant_reader(ckpt)
    seen: set[str] = set()
    kv: dict[str, torch.Tensor] = {}
    carried = set(carried_tensors(ckpt))
    local = text_names(ckpt)
    scale_param, fp4 = _scale_param(ckpt), block is not None and _fp4_experts(ckpt)
    mx = _mxfp4_pairs(ckpt, rank_local)  # gpt-oss's MXFP4 experts: X_blocks + X_scales -> X, bf16
    for module, params in _advancing(_by_module(ckpt), ckpt, progress):
        params = {p: n for p, n in params.items() if n not in carried and (skip is None or not skip(n))}
        # KV-cache scales first: on GQA models they sit on k_proj / v_proj, next to the
        # quantized weight parts, and must not be taken for a part of the linear
        for param, name in list(params.items()):
            if is_kv_cache_tensor(local(name)):
                kv[local(name)] = ckpt.read(name).clone()
                del params[param]
        if not params:
            continue
        if quant is not None and quant.is_quantized(module, params):
            _load_quantized(model, ckpt, quant, module, params, device, adjust, local(module))
            seen.add(local(module) + ".weight")
            continue
        for param, name in params.items():
            if name.endswith("_scale_inv") or (block is not None and param == scale_param):
                continue
            pair = mx.get(name)
            if pair is not None:
                from cvt.convert.mxfp4_source import dequantize_pair

                if pair.blocks == name:
                    owner = _owner(model, local(pair.name))
                    if owner is None:
                        raise TensorError(f"tensor {name} has no place {pair.name} in the runtime model")
                    _assign(*owner, dequantize_pair(ckpt, pair).to(device), pair.name)
                    seen.add(local(pair.name))
                continue
            ref = ckpt.tensors[name]
            owner = _owner(model, local(name))
            if owner is None:
                raise TensorError(f"tensor {name} ({ref.path.name}) has no place in the "
                                  f"{ckpt.config.get('model_type')} runtime model")
            t = ckpt.read(name)
            # DeepSeek-V4 names a weight's scale X.scale, the others X.weight_scale_inv
            sname = f"{module}.{scale_param}" if scale_param in params else name + "_scale_inv"
            if block is not None and ref.dtype == "F8_E4M3":
                t = dequant_fp8_block(t, ckpt.read(sname), block)
                ckpt.release(sname)
            elif fp4 and param == "weight" and scale_param in params:
                # DeepSeek-V4's packed FP4 expert: bf16 [n, k], bit-exact with the official dequant
                from cvt.convert.fp4 import FP4_DTYPES, dequant_fp4_experts

                if ref.dtype not in FP4_DTYPES:
                    raise TensorError(f"{ref.describe()}: scaled by {sname}, neither F8_E4M3 nor packed FP4")
                t = dequant_fp4_experts(t, ckpt.read(sname))
                ckpt.release(sname)
            else:
                t = t.clone()  # out of the mmap: the model owns its memory
            ckpt.release(name)
            _assign(*owner, t.to(device), name)
            seen.add(local(name))
    return seen, kv


def _mxfp4_pairs(ckpt: Checkpoint, rank_local: bool = False) -> dict:
    """{part name: its pair} of a gpt-oss MXFP4 release or a rank of its shards
    (`cvt.convert.mxfp4_source`; `rank_local`: shapes not checked against config.json), every
    scale checked; {} for any other checkpoint."""
    if source_format(ckpt.config, ckpt.has_manifest) is not SourceFormat.GPT_OSS_MXFP4:
        return {}
    from cvt.convert.mxfp4_source import check_mxfp4_scales, mxfp4_pairs

    pairs = mxfp4_pairs(ckpt.tensors, None if rank_local else arch_for(ckpt.config).shapes())
    check_mxfp4_scales(ckpt, pairs)
    return {n: p for p in pairs.values() for n in (p.blocks, p.scales)}


def check_complete(model: nn.Module, root) -> None:
    """TensorError when a model tensor was never assigned from the checkpoint (still on meta)."""
    missing = [n for n, t in _named_tensors(model) if t.is_meta]
    if missing:
        raise TensorError(f"{root}: the checkpoint lacks {len(missing)} model tensors, e.g. {missing[0]}")


def _advancing(by_module: dict[str, dict[str, str]], ckpt: Checkpoint, progress):
    """by_module's items; `progress` advances by a module's tensor bytes once the loop body
    is done with it (whichever way it continued)."""
    for module, params in by_module.items():
        nbytes = sum(ckpt.tensors[n].nbytes for n in params.values())  # before the body drops some
        yield module, params
        if progress is not None:
            progress.update(nbytes)


def _by_module(ckpt: Checkpoint) -> dict[str, dict[str, str]]:
    """module -> {param: tensor name}, in checkpoint order."""
    out: dict[str, dict[str, str]] = {}
    for name in ckpt.tensors:
        module, _, param = name.rpartition(".")
        out.setdefault(module, {})[param] = name
    return out


class _QuantReader:
    """Reads quantized linears of an Ascend (quant_model_description.json) or
    compressed-tensors (config quantization_config) checkpoint through cvt.qtensor.formats."""

    def __init__(self, fmt, meta, tags: dict | None):
        self.fmt, self.meta, self.tags = fmt, meta, tags

    def is_quantized(self, module: str, params: dict[str, str]) -> bool:
        if self.tags is not None:
            tag = self.tags.get(f"{module}.weight") or self.tags.get(f"{module}.weight_packed") or "FLOAT"
            return tag not in ("FLOAT", "C8", "FAQuant")
        return bool(set(params) & {"weight_packed", "weight_scale", "weight_fp4"}) and "weight_scale_inv" not in params


def _quant_reader(ckpt: Checkpoint) -> _QuantReader | None:
    from cvt.convert.config import quantization_config
    from cvt.convert.safetensors_io import load_json
    from cvt.qtensor.formats import format_names, get_format

    qc = quantization_config(ckpt.config)
    for form in map(get_format, format_names()):  # ascend first: its description file wins
        found = form.stored_metadata(ckpt.root, qc, load_json)
        if found is not None:
            return _QuantReader(form, *found)
    return None


def _load_quantized(model: nn.Module, ckpt: Checkpoint, quant: _QuantReader, module: str, params: dict[str, str],
                    device, adjust=None, target: str | None = None) -> None:
    """Replace the model's linear `target` (default: `module`, the checkpoint's name) by the kernel
    format of the quantized tensors `params` of checkpoint module `module`."""
    from cvt.runtime import kernels

    target = module if target is None else target
    try:
        current = model.get_submodule(target)
    except AttributeError:
        current = None
    if not isinstance(current, kernels.Linear):
        raise TensorError(f"{module}: quantized tensors for a module that is not a linear of the runtime model")
    disk = {name: ckpt.read(name).clone() for p, name in params.items() if p != "bias" or quant.tags is not None}
    if adjust is not None:
        disk = {name: adjust(name, t) for name, t in disk.items()}
    bias = disk.pop(f"{module}.bias", None) if quant.tags is not None else (
        ckpt.read(params["bias"]).clone() if "bias" in params else None)
    q = quant.fmt.read(module, disk, quant.meta)
    if tuple(q.shape) != (current.out_features, current.in_features):
        raise TensorError(f"{module}: quantized weight is {list(q.shape)}, the model expects "
                          f"[{current.out_features}, {current.in_features}]")
    parts = {k: v.to(device) for k, v in q.parts.items()}
    new = kernels.get(q.kernel_fmt).from_parts(parts, None if bias is None else bias.to(device))
    parent, _, attr = target.rpartition(".")
    setattr(model.get_submodule(parent), attr, new)
    for name in params.values():
        ckpt.release(name)


def carried_tensors(ckpt: Checkpoint) -> tuple[str, ...]:
    """The checkpoint's tensors the text runtime leaves unread: a wrapper's carried towers
    (`cvt.convert.arch.carried_names`: Kimi-K2.5's vision tower and projector)."""
    return tuple(carried_names(ckpt.config, ckpt.tensors))


def text_names(ckpt: Checkpoint) -> Callable[[str], str]:
    """Checkpoint tensor name -> the runtime model's name (a wrapper's text prefix dropped)."""
    prefix = arch_for(ckpt.config).table.text_prefix
    return lambda name: name[len(prefix):] if prefix and name.startswith(prefix) else name


def _named_tensors(model: nn.Module):
    yield from model.named_parameters()
    yield from model.named_buffers()


def _drop_absent_mtp(model: nn.Module, seen: set[str], n_layers: int) -> None:
    """MTP layers (index >= num_hidden_layers) are optional: keep them only if fully loaded."""
    if isinstance(getattr(model, "mtp", None), nn.ModuleList):  # DeepSeek-V4 stores them apart, as mtp.{j}
        if not any(n.startswith("mtp.") for n in seen):
            model.mtp = nn.ModuleList()
        return
    layers = model.get_submodule("model.layers")
    if len(layers) <= n_layers:
        return
    mtp_loaded = any(n.startswith(f"model.layers.{i}.") for n in seen for i in range(n_layers, len(layers)))
    if not mtp_loaded:
        model.get_submodule("model").layers = nn.ModuleList(list(layers)[:n_layers])
        log.debug("checkpoint has no MTP weights; running without the MTP layer")

