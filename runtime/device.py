"""`--device auto|cpu|cuda|npu`: resolve to a torch.device, or say why it is not available."""

from __future__ import annotations

import importlib

import torch

from cvt.errors import CvtError

CHOICES = ("auto", "cpu", "cuda", "npu")


def npu_available() -> bool:
    try:
        importlib.import_module("torch_npu")
    except ImportError:
        return False
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


def resolve_device(name: str) -> torch.device:
    if name not in CHOICES:
        raise CvtError(f"--device {name!r} is not one of {', '.join(CHOICES)}")
    if name == "auto":
        if npu_available():
            return torch.device("npu")
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise CvtError(f"--device cuda: no CUDA device is available (torch {torch.__version__}, "
                       f"built {'with' if torch.backends.cuda.is_built() else 'without'} CUDA)")
    if name == "npu" and not npu_available():
        raise CvtError("--device npu: torch_npu is not installed or no Ascend NPU is visible")
    return torch.device(name)


DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}
