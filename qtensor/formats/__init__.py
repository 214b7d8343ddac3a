"""On-disk formats for quantized weights: one protocol, a registry, one module per format.

A format only renames and lays out a `QuantizedTensor`'s canonical parts (`cvt.qtensor.schemes`)
through the layouts of `cvt.qtensor.layouts` (one entry per on-disk form, chosen per serving
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
  (``disk`` holds at least the module's tensors; a ``bias`` is the loader's business);
* ``kv_manifest(kv_tensors) -> dict`` -- the manifest's description of a quantized KV cache;
* ``write_metadata(config, tags, schemes, ...) -> [(file name, bytes)]`` -- the format's own
  metadata: keys into the output's config.json, and extra files (Ascend's description).

Attributes: ``name``, ``weights_prefix``, ``kv_codec`` (how a quantized KV cache is stored:
"int8" or "fp8"), ``static_attention`` (holds static-W8A8 attention), ``default_groups``
({scheme: group size} when none is given).
"""

from cvt.qtensor.formats.base import (FORMATS, Format, default_group, format_names, get_format, group_fallback,
                                      lm_section, register, scheme_name)
from cvt.qtensor.formats import ascend, compressed_tensors  # noqa: F401  (register)

DEFAULT_FORMAT = compressed_tensors.CompressedTensors.name  # what `cvt quantize` writes without --format

__all__ = ["DEFAULT_FORMAT", "FORMATS", "Format", "default_group", "format_names", "get_format", "group_fallback", "lm_section", "register", "scheme_name"]
