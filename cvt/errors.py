"""One exception family for everything cvt reports to a user.

Messages restate the input: the file, the tensor, its shape and dtype, and what would
have been valid, so that one line is enough to act on. The CLI prints `cvt: error: <msg>`
and exits non-zero; the traceback is shown only with `--debug`.
"""

from __future__ import annotations


class CvtError(Exception):
    """Base class: anything wrong with the user's input, environment or request."""

    exit_code = 1


class OptionError(CvtError):
    """Options that do not go together or do not apply (``--asym`` with w4a8, ``--calib`` with
    RTN only): refused like a click usage error, exit 2, rather than silently ignored."""

    exit_code = 2


class CheckpointError(CvtError):
    """A source checkpoint is malformed: header, index, missing file, unsafe path, pickle."""


class TensorError(CheckpointError):
    """A tensor is missing, misshaped, of the wrong dtype, or holds non-finite scales."""


class ArchError(CvtError):
    """Unknown model_type, or a tensor name that the architecture table cannot map."""


class FormatError(CvtError):
    """The source is not in the format a stage needs (e.g. bf16 given to fp8-to-bf16)."""


class ShapeError(FormatError):
    """A linear's shape breaks a format's packing rule (int4 pairs viewed as int32, W4A8's 16
    scale_bias runs): `quantize` refuses it, `plan` lists it as a problem of the layout."""


class OutputError(CvtError):
    """The destination cannot be written, is locked by another run, or holds other data."""


class ManifestError(CvtError):
    """A cvt_manifest.json is invalid or disagrees with the files next to it."""


def validation_summary(exc, limit: int = 4) -> str:
    """A pydantic ValidationError in one line naming each invalid field:
    ``"files.0.sha256: String should match pattern ...; shard.layout.ep: Input should be ..."``.
    Anything else: its first line."""
    errors = getattr(exc, "errors", None)
    if errors is None:
        return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    items = []
    for e in errors(include_url=False):
        loc = ".".join(str(p) for p in e.get("loc", ())) or "(top level)"
        msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        items.append(f"{loc}: {msg}")
    more = f"; and {len(items) - limit} more" if len(items) > limit else ""
    return "; ".join(items[:limit]) + more
