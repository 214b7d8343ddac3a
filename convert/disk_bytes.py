"""What the weights of a plan cost on disk: the scheme a plan counts (`plan_scheme`) and each
quantized linear's shard as `cvt quantize` writes it for a format and target (`DiskBytes`, read
from the layout table through `cvt.qtensor.disk_specs`, the one owner quantize and shard
read)."""

from __future__ import annotations

import math

from cvt.errors import CvtError, ShapeError

STORED = ("bf16", "fp8")  # weights planned as stored: float, or an FP8 release's blocks


def plan_schemes() -> tuple[str, ...]:
    """What a plan can count: the stored forms, then every registered quantization scheme."""
    from cvt.qtensor.schemes import scheme_names

    return (*STORED, *scheme_names())
def plan_scheme(scheme: str | None, group_size: int | None, fmt: str | None = None, fp4_format: str | None = None):
    if scheme in (None, "bf16", "fp8"):
        if group_size is not None:
            raise CvtError(f"group_size applies to quantized schemes, not {scheme or 'the source'}")
        return None
    if scheme not in plan_schemes():
        raise CvtError(f"unknown scheme {scheme!r} for the plan (known: {', '.join(plan_schemes())})")
    from cvt.qtensor.formats import default_group
    from cvt.qtensor.schemes import SCHEMES, get_scheme

    if group_size is None and fmt is not None:
        group_size = default_group(fmt, scheme)  # what cvt quantize writes for that format
    opts = {} if group_size is None else {"group_size": group_size}
    if fp4_format is not None:
        if "fp4_format" not in SCHEMES.get(scheme).options:
            raise CvtError(f"fp4_format applies to scheme "
                           f"{' or '.join(n for n in SCHEMES.names() if 'fp4_format' in SCHEMES.get(n).options)}, "
                           f"not {scheme}")
        opts["fp4_format"] = fp4_format
    return get_scheme(scheme, **opts)


class DiskBytes:
    """Bytes of a quantized linear's shard as `cvt quantize` writes it for `fmt` / `target`
    (the layout table, `cvt.qtensor.disk_specs`: the one owner quantize and shard read), or
    None where that target keeps the module float (a layout loaded for MoE experts only)."""

    @classmethod
    def resolve(cls, scheme: str, group_size: int | None, fmt: str | None, target: str | None,
                fp4_format: str | None):
        """(scheme, DiskBytes) of a quantized scheme name: `fmt` None is compressed-tensors when it
        has the scheme (cvt quantize's default), else ascend; then w4a16's group as quantize
        defaults it for that format."""
        from cvt.qtensor import layouts as L

        from cvt.qtensor.formats import DEFAULT_FORMAT, format_names

        if fmt is None:  # the default format when it has the scheme, else the first that does
            kf = L.kernel_fmt_of(plan_scheme(scheme, group_size, None, fp4_format))
            fmt = next((f for f in (DEFAULT_FORMAT, *format_names())
                        if L.candidates(f, kf, L.check_target(f, None))), DEFAULT_FORMAT)
        sch = plan_scheme(scheme, group_size, fmt, fp4_format)
        return sch, cls(sch, fmt, target)

    def __init__(self, scheme, fmt: str, target: str | None):
        from cvt.qtensor import layouts as L
        from cvt.qtensor.disk_specs import DiskLayouts
        from cvt.qtensor.formats import get_format

        kf = L.kernel_fmt_of(scheme)
        self.fmt, self.target, self.scheme = fmt, L.check_target(fmt, target), scheme
        self.form = form = get_format(fmt)
        form.supports(scheme, self.target)
        self.layouts = DiskLayouts(form, self.target)
        self.float_reason = L.experts_only_reason(fmt, kf, self.target)
        self.expert_float_reason = L.linears_only_reason(fmt, kf, self.target)
        self._channel = None

    def stays_float(self, expert: bool) -> bool:
        """Whether a module of this kind stays float by default (the target loads the layout for
        experts only, or for linears only)."""
        return (self.expert_float_reason if expert else self.float_reason) is not None

    def group_fit(self, module: str, shape: tuple, expert: bool) -> str | None:
        """As cvt quantize decides for a whole linear [n, k] (`cvt.qtensor.formats.group_fallback`):
        None when the group size divides k (or the module stays float), else why it is written
        per channel; FormatError where the format refuses it."""
        from cvt.qtensor.formats import group_fallback

        if self.stays_float(expert):
            return None
        return group_fallback(self.form, module, self.scheme, tuple(shape), self.target)

    def __call__(self, module: str, shape: tuple, expert: bool, per_channel: bool = False, row: bool = False,
                 k_degree: int = 1, axis: str = "tp") -> int | None:
        """Bytes of the shard `shape` of a linear split `k_degree` ways along in_features by `axis`
        (1: not along k); `row`: a RowParallelLinear, for a scheme sized by that role (`for_parallel`). A
        layout whose transforms are sized for the whole k (`Layout.max_tp`) counts the rank's part
        of the whole module's tensors (`Layout.k_shard`); ShapeError where it cannot be split so."""
        from cvt.dtypes import DTYPES

        if self.stays_float(expert):
            return None
        scheme = self.scheme
        if per_channel:  # a group_fit fallback: the scheme per channel, as quantize writes it
            if self._channel is None:
                from cvt.qtensor.schemes import get_scheme

                self._channel = get_scheme(scheme.name, group_size=0, symmetric=scheme.symmetric)
            scheme = self._channel
        if getattr(scheme, "row_sensitive", False):  # as the quantize plan sizes it (`cvt.quant.stage.assignment`)
            scheme = scheme.for_parallel(row)
        whole = (shape[0], shape[1] * k_degree)
        lo = self._layout(module, scheme, whole, expert) if k_degree > 1 else None
        if lo is not None and lo.max_tp:
            why = lo.k_split_problem(axis, k_degree)
            if why is not None:
                raise ShapeError(f"{module}: {why}")
            specs = self._specs(module, scheme, whole, expert)
            return sum(math.prod(lo.k_shard(n.rsplit(".", 1)[-1], s, k_degree)) * DTYPES[code][1]
                       for n, (s, code) in specs.items())
        specs = self._specs(module, scheme, shape, expert)
        return sum(math.prod(s) * DTYPES[code][1] for s, code in specs.values())

    def _specs(self, module: str, scheme, shape: tuple, expert: bool) -> dict:
        try:
            specs, _ = self.layouts.get(module, scheme, tuple(shape), False, None, None, expert)
        except CvtError as exc:  # worded for the layouts' probe module: name the real one
            probe = f"{self.layouts.PROBE}.{module.rsplit('.', 1)[-1]}"
            raise type(exc)(str(exc).replace(probe, module)) from exc
        return specs

    def _layout(self, module: str, scheme, shape: tuple, expert: bool):
        """The layout entry quantize writes this module in."""
        from cvt.qtensor.disk_specs import shell_q

        return self.form.layout_for(module, shell_q(scheme, shape), target=self.target, expert=expert)


def format_group(disk: DiskBytes | None, scheme: str) -> bool:
    """Whether the scheme's group size came from the format's default (`Format.default_groups`)."""
    from cvt.qtensor.formats import default_group

    return disk is not None and default_group(disk.fmt, scheme) is not None
