"""Where a calibrated layer's time goes: forward passes (statistics, replays, its output), the
solve (GPTQ / AWQ / RTN on the collected statistics, and the exchange between ranks) and IO
(reading its weights and expert chunks, saving its state).

`Phases` adds wall seconds per phase; the streaming driver keeps one per layer and the manifest
records them (``quant.calibration.phase_seconds``), so that `bench/calibrate.py` shows per layer
whether a run waits on the forward, the solver or the disk. On CUDA / NPU a phase ends with a
device synchronize (kernels run asynchronously: without it their time would land in whichever
phase next waits for them) -- a few per layer, never inside a loop.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

PHASES = ("forward", "solve", "io")


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    npu = getattr(torch, "npu", None)
    if npu is not None and getattr(npu, "is_initialized", lambda: False)():
        npu.synchronize()


class Phases:
    """Wall seconds per phase (`PHASES`); ``with phases("solve"): ...`` adds to one. Nested uses
    count once, in the outer phase."""

    def __init__(self):
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._depth = 0

    @contextmanager
    def __call__(self, name: str):
        if self._depth:
            yield
            return
        self._depth += 1
        t0 = time.perf_counter()
        try:
            yield
        finally:
            _sync()
            self.seconds[name] += time.perf_counter() - t0
            self._depth -= 1


__all__ = ["Phases", "PHASES"]
