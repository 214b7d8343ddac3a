"""The one progress bar of every long-running step (tqdm on stderr; `--quiet` turns it off).

`make_progress(total, desc, quiet, unit)` is used by the writers (bytes written), model loading
(bytes of tensors read), verify (layers scored), generation (tokens), calibration (layers, and
the tokens through the current layer, pass by pass), ONNX export and the benches (rows).

A plain tqdm bar estimates its rate, and so its ETA, from the first update on: when that
update comes after a slow start (opening files, building the model, a first matmul) the first
frame shows an ETA of hours. This bar shows neither rate nor ETA until `ETA_AFTER` updates
have come, and then counts its rate from the first update (what came before it is start-up,
not progress).
"""

from __future__ import annotations

ETA_AFTER = 3
"""Updates before the bar shows a rate and an ETA: two intervals measured after the first."""

WARMUP_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"
"""The bar before its rate is known: tqdm's default without `<{remaining}, {rate_fmt}`."""

_bar_class = None


def _progress_class():
    """The tqdm subclass, built on first use (tqdm is imported only when a bar is made)."""
    global _bar_class
    if _bar_class is None:
        from tqdm import tqdm

        class Progress(tqdm):
            def __init__(self, *args, **kwargs):
                # before tqdm's __init__: it draws the first frame, which reads format_dict
                self._updates, self._first = 0, None
                super().__init__(*args, **kwargs)

            def reset(self, total=None):  # a new run of the same bar: its rate is measured afresh
                self._updates, self._first = 0, None
                return super().reset(total)

            def update(self, n=1):
                if not self.disable:
                    self._updates += 1
                    if self._first is None:  # (count, seconds since start) at the first update
                        self._first = (self.n + n, super().format_dict["elapsed"])
                return super().update(n)

            @property
            def format_dict(self):
                d = super().format_dict
                if self.disable:
                    return d
                if self._updates < ETA_AFTER or self._first is None:
                    if d.get("total"):  # no total: tqdm shows no ETA anyway, only the rate
                        d["bar_format"] = WARMUP_FORMAT
                    d["rate"] = None
                    return d
                n0, t0 = self._first
                dt = d["elapsed"] - t0
                d["rate"] = (d["n"] - n0) / dt if dt > 0 and d["n"] > n0 else None
                return d

        _bar_class = Progress
    return _bar_class


def make_progress(total: int | None, desc: str, quiet: bool, unit: str = "B", **kwargs):
    """A progress bar on stderr: `total` units (None: unknown), bytes scaled to KiB/MiB when
    unit is "B"; disabled with `quiet`. Use as a context manager, `.update(n)` per step."""
    scaled = unit == "B"
    return _progress_class()(total=total, unit=unit, unit_scale=scaled, unit_divisor=1024 if scaled else 1000,
                             desc=desc, disable=quiet, dynamic_ncols=True, smoothing=0.1, **kwargs)
