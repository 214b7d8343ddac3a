"""On-disk formats for quantized weights: one protocol, a registry, one module per format.

A format only renames and lays out a `QuantizedTensor`'s canonical parts (`cvt.quant.schemes`)
through the layouts of `cvt.quant.layouts` (one entry per on-disk form, chosen per serving
target and module); it holds no quantization logic, and ``read(module, disk_tensors(module, q),
meta) == q`` exactly (same parts, dtypes, shapes, scheme, group size, symmetry, extra).

==================  =====================  ==============================================
format              weights file prefix    metadata
==================  =====================  ==============================================
ascend              quant_model_weights    quant_model_description.json (`description`)
compressed-tensors  model                  config.json "quantization_config"
==================  =====================  ==============================================

Protocol (names are the full tensor names ``f"{module}.{part}"``; the writer shards):

* ``supports(scheme, target=None)`` -- None, or raise FormatError saying why and what is supported;
* ``check_shape(module, scheme, shape, target=None, expert=False)`` -- raise naming the module
  when the target loads no layout of this scheme for this module (e.g. vllm-ascend W4A16 only
  for MoE experts) or the layout cannot store that shape (Ascend grouped int8 W4A16: n even);
* ``disk_tensors(module, q, bias=None, target=None, expert=False) -> {name: tensor}`` -- exact
  names/dtypes/shapes;
* ``read(module, disk, meta) -> QuantizedTensor`` -- the inverse, for the runtime loader
  (``disk`` holds at least the module's tensors; a ``bias`` is the loader's business).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from cvt.lazy import torch

from cvt.registry import Registry
from cvt.errors import FormatError
from cvt.quant.schemes.base import QuantizedTensor


@runtime_checkable
class Format(Protocol):
    name: str
    weights_prefix: str

    def supports(self, scheme, target: str | None = None) -> None: ...

    def check_shape(self, module: str, scheme, shape: tuple[int, int], *, target: str | None = None,
                    expert: bool = False) -> None: ...

    def disk_tensors(self, module: str, q: QuantizedTensor, bias: torch.Tensor | None = None, *,
                     target: str | None = None, expert: bool = False) -> dict[str, torch.Tensor]: ...

    def read(self, module: str, disk: dict[str, torch.Tensor], meta=None) -> QuantizedTensor: ...


FORMATS: Registry[type] = Registry("output format", FormatError)
register = FORMATS.register


def format_names() -> list[str]:
    return FORMATS.names()


def get_format(name: str) -> Format:
    return FORMATS.get(name)()


# w4a16's group size when --group-size is not given: what each format's consumers load best
DEFAULT_GROUP = {("w4a16", "compressed-tensors"): 128, ("w4a16", "ascend"): 64}


def group_fallback(form, module: str, scheme, shape, target: str | None = None) -> str | None:
    """None when `scheme`'s group size divides the linear's in_features (or it is not grouped);
    else why `module` is quantized per channel instead: where every config group carries its own
    strategy (``form.per_channel_fallback``: compressed-tensors), as peers do for such a linear
    (compressed-tensors 0.20 ``strategy_cdiv`` warns and uses ceil(k/G) groups, the last one short,
    which vLLM's int4 kernels do not load; for k < G that single short group gives the per-channel
    numbers). A format whose stacks read one global group size (ascend) gets FormatError naming
    the module and what to do instead."""
    g, k = getattr(scheme, "group_size", 0) or 0, shape[1]
    if not g or k % g == 0:
        return None
    if not getattr(form, "per_channel_fallback", False):
        raise FormatError(
            f"{module}.weight {list(shape)}: group size {g} does not divide in_features={k}, and the {form.name} "
            f"format's stacks read one global group_size, so this linear cannot be written per channel: give a "
            f"--group-size that divides every grouped linear's in_features (a divisor of {k}), or keep it float "
            "(--ignore, or a recipe rule)")
    return f"group size {g} does not divide in_features={k}: quantized per channel (its own config group)"


def scheme_name(scheme) -> str:
    """The registry name of a scheme instance (or a name passed as a string)."""
    return scheme if isinstance(scheme, str) else scheme.name


from cvt.quant.formats import ascend, compressed_tensors  # noqa: E402,F401  isort: skip  (registers)

__all__ = ["DEFAULT_GROUP", "FORMATS", "Format", "format_names", "get_format", "group_fallback", "register"]
