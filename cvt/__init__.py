"""cvt: convert, quantize, shard and export released LLM checkpoints.

Importing `cvt` is cheap: it pulls in neither torch nor any optional dependency; the
subpackages (`cvt.convert`, `cvt.quant`, `cvt.export`, `cvt.runtime`, `cvt.schemas`)
import what they need when used.
"""

__version__ = "0.1.0"
