"""Optional dependencies: which pip extra brings each, and one clear error when one is missing.

A plain ``pip install cvt`` brings what fp8-to-bf16, inspect, plan, quantize, shard, run (torch
backend), verify and demo need. ONNX (`cvt export onnx`, the graph pre-check of `cvt export om`,
`cvt run --backend onnxruntime`, the ``--verify`` of both exports) needs onnx and onnxruntime:
the ``export`` extra (``pip install 'cvt[export]'``). Code that needs one of them calls
`require` before any work, so a missing one is one line naming the extra (exit 1), never a
``ModuleNotFoundError`` (exit 70); `cvt.cli.main` turns a ``ModuleNotFoundError`` of a module
listed here, raised where no `require` came first, into the same line.

The compiled kernels are optional too (`c_kernel`: without a C compiler at install time they
are absent, and cvt says once what runs instead). Dependencies of the platform rather than of
cvt (torch_npu, ais_bench: Ascend's own wheels) are not extras: their callers say what to
install.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

from cvt.errors import CvtError

# extra -> the import names it brings (pyproject.toml's [project.optional-dependencies])
EXTRAS: dict[str, tuple[str, ...]] = {"export": ("onnx", "onnxruntime")}


class MissingDependencyError(CvtError):
    """An optional dependency is not installed (or does not import)."""


def extra_of(module: str | None) -> str | None:
    """The extra that brings MODULE (a dotted name: its top-level package counts), or None."""
    top = (module or "").split(".")[0]
    return next((extra for extra, mods in EXTRAS.items() if top in mods), None)


def message(module: str, needed_for: str | None = None, detail: str | None = None) -> str:
    """`<needed_for> needs <module>, ...: pip install 'cvt[<extra>]'` (the line after ``cvt: error:``)."""
    extra = extra_of(module)
    top = module.split(".")[0]
    what = f"{needed_for} needs {top}" if needed_for else f"this command needs {top}"
    why = f" ({detail})" if detail else ""
    if extra is None:
        return f"{what}, which is not installed{why}: pip install {top}"
    return f"{what}, which a plain install of cvt leaves out{why}: pip install 'cvt[{extra}]'"


def require(module: str, needed_for: str) -> ModuleType:
    """Import MODULE, or raise MissingDependencyError naming the extra to install.
    `needed_for`: the verb or option that needs it (``"cvt export onnx"``)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:  # not installed, or installed and broken (a missing shared library)
        detail = None if isinstance(exc, ModuleNotFoundError) and exc.name == module.split(".")[0] else str(exc)
        raise MissingDependencyError(message(module, needed_for, detail)) from exc


def missing(extra: str) -> list[str]:
    """The modules of EXTRA that are not installed (without importing any)."""
    return [m for m in EXTRAS[extra] if importlib.util.find_spec(m) is None]


__all__ = ["EXTRAS", "MissingDependencyError", "extra_of", "message", "require", "missing", "SIMD_LEVELS",
           "simd_level", "simd_name"]


# the compiled kernels' SIMD levels (`simd_level`): what each may use at most
SIMD_LEVELS = {"scalar": 0, "avx2": 1, "avx512": 2}


def simd_name(level: int) -> str:
    """The name of a SIMD level a compiled kernel reports running at: level 1 is NEON on aarch64
    (``CVT_KERNEL_SIMD=avx2`` allows it there: the level, not the instruction set)."""
    import platform

    if level == SIMD_LEVELS["avx2"] and platform.machine().lower() in ("aarch64", "arm64"):
        return "neon"
    return next(name for name, v in SIMD_LEVELS.items() if v == level)


def simd_level(simd: bool | int = True) -> int:
    """The highest SIMD level a compiled kernel may use: `simd` True -> the best the CPU has
    (the kernel checks at run time; AVX-512 where present), False -> 0 (the scalar loops), or a
    level of `SIMD_LEVELS`; capped by ``CVT_KERNEL_SIMD`` (scalar, avx2 or avx512: to compare
    the paths or rule one out; every level writes the same bytes)."""
    level = SIMD_LEVELS["avx512"] if simd is True else int(simd)
    cap = os.environ.get("CVT_KERNEL_SIMD", "").strip().lower()
    if cap:
        if cap not in SIMD_LEVELS:
            raise CvtError(f"CVT_KERNEL_SIMD={cap}: expected one of {', '.join(SIMD_LEVELS)}")
        level = min(level, SIMD_LEVELS[cap])
    return level


def c_kernel(module: str, what: str, fallback: str):
    """`ctypes.CDLL` of one of cvt's compiled kernels (an optional extension module such as
    ``cvt.convert._fp8kernel``), or None after one warning line saying what runs instead: the
    install had no C compiler. The caller caches the answer, so the line is said once per process."""
    import ctypes
    import importlib
    import logging

    try:
        mod = importlib.import_module(module)
    except ImportError:
        logging.getLogger("cvt").warning(
            f"cvt: the C {what} ({module}) is not built - there was no C compiler when cvt was installed: {fallback} "
            "(same bytes); install gcc or cc and reinstall cvt (pip install --force-reinstall --no-deps .)")
        return None
    return ctypes.CDLL(mod.__file__)
