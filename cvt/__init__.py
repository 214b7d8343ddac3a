"""cvt: convert, quantize, shard and export released LLM checkpoints.

The public API is `cvt.api` (one function per verb, each taking a typed options object), also
reachable from here: ``from cvt import quantize, QuantizeOptions``. Importing `cvt` is cheap:
the API module, torch and the optional dependencies are imported on first use.
"""

from cvt.version import __version__

_API = ("Fp8ToBf16Options", "LayoutOptions", "PlanOptions", "QuantizeOptions", "RunOptions", "RunResult",
        "ShardOptions", "VerifyOptions", "fp8_to_bf16", "inspect", "plan", "quantize", "run", "shard", "verify")


def __getattr__(name: str):
    if name in _API:
        from cvt import api

        return getattr(api, name)
    raise AttributeError(f"module 'cvt' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])


__all__ = ["__version__", *_API]
