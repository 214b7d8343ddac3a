"""The output-format protocol and registry (`cvt.qtensor.formats` documents both); the
format modules register here."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from cvt.lazy import torch

from cvt.registry import Registry
from cvt.errors import FormatError
from cvt.qtensor.schemes.base import QuantizedTensor


@runtime_checkable
class Format(Protocol):
    name: str
    weights_prefix: str
    kv_codec: str
    static_attention: bool
    default_groups: dict[str, int]
    # model_type -> why no consumer of the format loads that family's quantized output (one clause,
    # citing the consumer's code): which formats serve which model, as data; `cvt quantize` refuses
    # the pair before DST
    refused_models: dict[str, str]

    def supports(self, scheme, target: str | None = None) -> None: ...

    def check_shape(self, module: str, scheme, shape: tuple[int, int], *, target: str | None = None,
                    expert: bool = False) -> None: ...

    def disk_tensors(self, module: str, q: QuantizedTensor, bias: torch.Tensor | None = None, *,
                     target: str | None = None, expert: bool = False) -> dict[str, torch.Tensor]: ...

    def read(self, module: str, disk: dict[str, torch.Tensor], meta=None) -> QuantizedTensor: ...

    def kv_manifest(self, kv_tensors) -> dict: ...

    def write_metadata(self, config: dict, tags: dict[str, str], schemes: dict, *, float_linears: list[str],
                       kv_cache: bool, mla: bool, target: str, float_experts: list[str] = ()
                       ) -> list[tuple[str, bytes]]: ...


FORMATS: Registry[type] = Registry("output format", FormatError, summarized=True)  # each: name, summary
register = FORMATS.register


def format_names() -> list[str]:
    return FORMATS.names()


def get_format(name: str) -> Format:
    return FORMATS.get(name)()


def default_group(fmt: str, scheme: str) -> int | None:
    """A scheme's group size when none is given: what the format's consumers load best (the
    format's `default_groups`; None: the scheme's own default)."""
    return FORMATS.get(fmt).default_groups.get(scheme)


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


def lm_section(config: dict) -> dict:
    """The part of a config.json that describes the language model: `text_config` of a wrapper
    (Kimi-K2.5's), else the config itself; quantization keys go there."""
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) and "model_type" not in config else config


def scheme_name(scheme) -> str:
    """The registry name of a scheme instance (or a name passed as a string)."""
    return scheme if isinstance(scheme, str) else scheme.name
