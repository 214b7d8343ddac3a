"""The on-disk tensors of a quantized module, planned before anything is quantized: the writer
needs every file's tensor names, shapes and dtypes up front (it shards, reserves and resumes by
them), so the quantize stage asks `DiskLayouts` for each module's {name: (shape, dtype)} and
Ascend tags, computed on a small zero probe through the format's own encoder and scaled by the
layout's dims (`cvt.qtensor.layouts.DiskTensor`)."""

from __future__ import annotations

from cvt.lazy import torch

from cvt.dtypes import dtype_code
from cvt.errors import CvtError
from cvt.qtensor.layouts import fuses, kernel_fmt_of
from cvt.qtensor.schemes.base import QuantizedTensor, Scheme


def _role(scheme: Scheme) -> dict:
    """The extra a scheme's tensors carry for the layout choice: ``{"parallel": "row"}`` for a
    scheme sized for a RowParallelLinear (`cvt.qtensor.schemes.flatquant_mx`), else nothing."""
    return {"parallel": "row"} if getattr(scheme, "row", False) else {}


def probe_q(scheme: Scheme, shape: tuple[int, int], static: bool) -> QuantizedTensor:
    """A QuantizedTensor of zeros with the scheme's part shapes and dtypes, for planning the
    on-disk layout (formats validate values, so meta tensors will not do)."""
    z = lambda s_, d: torch.zeros(s_, dtype=d)  # noqa: E731
    parts = {p: z(s_, d) for p, (s_, d) in scheme.param_info(shape).items()}
    if "weight_scale" in parts and parts["weight_scale"].is_floating_point():
        parts["weight_scale"] = torch.ones_like(parts["weight_scale"])
    if "weight_global_scale" in parts:
        parts["weight_global_scale"] = torch.ones_like(parts["weight_global_scale"])
    extra = _role(scheme)
    if static:
        n = shape[0]
        parts = {"weight": parts["weight"], "input_scale": torch.ones(1), "input_offset": z((1,), torch.float32),
                 "deq_scale": torch.ones(n), "quant_bias": z((n,), torch.int32)}
        extra = {"weight_scale": torch.ones(n, 1)}
    return QuantizedTensor(scheme.name, kernel_fmt_of(scheme, static), shape, parts, scheme.group_size,
                           scheme.symmetric, extra)


def shell_q(scheme: Scheme, shape: tuple[int, int], static: bool = False) -> QuantizedTensor:
    """A QuantizedTensor without parts: all a format's `layout_for` reads (kernel format, shape,
    group size, symmetry), so the layout is chosen before anything is quantized."""
    kf = kernel_fmt_of(scheme, static)
    return QuantizedTensor(scheme.name, kf, tuple(shape), {}, scheme.group_size,
                           scheme.symmetric, {"fp4_format": kf} if getattr(scheme, "fp4_format", None) else _role(scheme))


def data_planned(layout, scheme, shape: tuple[int, int], static: bool, bias: bool) -> bool:
    """Whether a module's on-disk tensors are exactly its layout entry's non-optional ones, in
    table order, so `DiskLayouts` plans them from the table, without a probe and without torch:
    what the fused RTN kernels write (`cvt.qtensor.layouts.fuses`; where an encoder would refuse,
    they do not fuse, and the probe raises that refusal before anything is written), with no
    bias, static inputs or optional tensors in play (ct-int4's zero points are written only when
    asymmetric). ``tests/quant/test_qkernel_stage.py::test_stage_plans_fused_layouts_from_the_table``
    holds this equal to the probe."""
    return (not static and not bias and fuses(layout, scheme, shape)
            and (scheme.symmetric or not any(t.optional for t in layout.tensors)))


class DiskLayouts:
    """On-disk {suffix: (shape, dtype)} and Ascend tags per (scheme, shape, static, bias),
    computed once on a zero probe and reused for every module of that kind; for the fused
    RTN layouts (`data_planned`), read from the layout table instead (no torch needed).

    The probe has `PROBE_ROWS` rows (k and the group size as the module's; the same layout),
    and the layout's dims (`cvt.qtensor.layouts.DiskTensor`) scale its shapes to n rows: a probe
    of the module's full size costs what quantizing it does (the int4 packers' int64
    temporaries: ~1 GB for a 7168 x 16384 weight). Row counts that are not a multiple of it
    keep the full-size probe."""

    PROBE = "probe"
    PROBE_ROWS = 16  # a multiple of every row packing (pairs; c-t zero points, 8 per word)

    def __init__(self, form, target: str):
        self.form, self.target = form, target
        self._cache: dict = {}

    def get(self, module: str, scheme: Scheme, shape, static: bool, bias_shape, bias_dtype, expert: bool):
        """``({disk name: (shape, dtype code)}, {disk name: tag})`` of one quantized module;
        `bias_dtype` a torch dtype (None without a bias)."""
        # a layout may depend on the module's own name (W4A8_DYNAMIC's scale_bias shape,
        # `cvt.qtensor.layouts.scale_bias_role`): probe under it, once per distinct last component
        probe = f"{self.PROBE}.{module.rsplit('.', 1)[-1]}"
        key = (id(scheme), tuple(shape), static, bias_shape, bias_dtype, expert, probe)
        if key not in self._cache:
            try:
                self._cache[key] = (
                    self._from_table(probe, scheme, tuple(shape), static, bias_shape is not None, expert)
                    or self._probed(probe, scheme, tuple(shape), static, bias_shape, bias_dtype, expert))
            except CvtError as exc:  # worded for the probe (its name, maybe its fewer rows): name the module
                msg = str(exc).replace(f"{probe}.weight {[self.PROBE_ROWS, shape[1]]}", f"{module}.weight {list(shape)}")
                raise type(exc)(msg.replace(probe, module)) from None
        specs, tags = self._cache[key]
        return ({module + k: v for k, v in specs.items()}, {module + k: v for k, v in tags.items()})

    def _from_table(self, probe: str, scheme: Scheme, shape, static: bool, bias: bool, expert: bool):
        n, k = shape
        shell = shell_q(scheme, shape, static)
        lo = self.form.layout_for(probe, shell, target=self.target, expert=expert)
        if not data_planned(lo, scheme, shape, static, bias):
            return None
        specs = {f".{t.suffix}": (t.shape(n, k, shell.group_size), t.dtype) for t in lo.tensors if not t.optional}
        tags = lo.tags("", [s[1:] for s in specs]) if hasattr(self.form, "tags") else {}
        return specs, tags

    def _probed(self, probe: str, scheme: Scheme, shape, static: bool, bias_shape, bias_dtype, expert: bool):
        n, k = shape
        small = n % self.PROBE_ROWS == 0 and n > self.PROBE_ROWS
        q = probe_q(scheme, (self.PROBE_ROWS, k) if small else shape, static)
        b = None if bias_shape is None else torch.zeros(bias_shape, dtype=bias_dtype)
        kw = {"target": self.target, "expert": expert}
        disk = self.form.disk_tensors(probe, q, b, **kw)
        specs = {n_[len(probe):]: (tuple(t.shape), dtype_code(t.dtype)) for n_, t in disk.items()}
        if small:
            specs = self._scaled(specs, self.form.layout_for(probe, q, **kw), scheme, n, k)
        tags = ({n_[len(probe):]: t for n_, t in self.form.tags(probe, q, bias=b is not None, **kw).items()}
                if hasattr(self.form, "tags") else {})
        return specs, tags

    def _scaled(self, specs: dict, layout, scheme: Scheme, n: int, k: int) -> dict:
        g = 0 if scheme.group_size in (0, k) else scheme.group_size
        out = {}
        for suffix, (shape, code) in specs.items():
            t = layout.tensor(suffix[1:])
            if t is None:  # the bias: probed at its real shape
                out[suffix] = (shape, code)
                continue
            if t.shape(self.PROBE_ROWS, k, g) != shape:
                raise RuntimeError(f"internal: layout {layout.name} says {suffix[1:]} of [{self.PROBE_ROWS}, {k}] is "
                                   f"{list(t.shape(self.PROBE_ROWS, k, g))}, its encoder wrote {list(shape)}")
            out[suffix] = (t.shape(n, k, g), code)
        return out


__all__ = ["DiskLayouts", "data_planned", "probe_q", "shell_q"]
