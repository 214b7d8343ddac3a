"""`cvt quantize --kl-budget X`: the fewest units kept at a higher precision (`--kl-high`: w8a8 by
default, or float) so that the measured mean KL(float || output) holds X.

Units: per decoder layer, its attention (``self_attn.*``; Qwen3.5's Gated DeltaNet layers:
``linear_attn.*``), its dense MLP or shared experts
(``mlp.*`` but the routed experts) and its routed experts (``mlp.experts.*``) -- the quantized
linears of each that the run's own plan gives the low ``--scheme`` by default (a recipe rule's
choice is kept as the rule says; MTP layers, which the forward does not run, stay low).

Algorithm, on the calibration tokens (``--calib``, or the built-in calibration text):

1. One streamed pass (`cvt.quant.methods.sensitivity.unit_errors`) measures each unit's local
   error with float inputs: the decoder layer's output error with only that unit at the low
   scheme, and at the high one (a local proxy of its contribution to the final KL).
2. Units are ordered greedily by error removed per extra byte kept high:
   (error_low - error_high) / (bytes_high - bytes_low), largest first.
3. The exact mean KL of the output that keeps the first k units high is measured with the
   runtime kernels, streamed (`sensitivity.mixed_kl`): k = all units (refused when even that
   misses the budget), k = 0, then a bisection between the largest k that missed and the
   smallest that held it. The choice is the measured configuration with the fewest high
   bytes whose KL holds the budget.

The measurements are RTN (a --method gptq / awq output is quantized with its method, usually
closer to float than what was measured). Every unit's errors, bytes and choice, and every
measured configuration, go into the manifest (`cvt.schemas.manifest.MixedPrecision`). Memory:
as `sensitivity` (one decoder layer and two layer inputs); 3 + log2(units) passes over the
decoder layers.
"""

from __future__ import annotations

import logging
import math
import re
from contextlib import contextmanager
from dataclasses import dataclass

from cvt.convert.disk_bytes import DiskBytes
from cvt.errors import OptionError
from cvt.qtensor.schemes.w8a8 import W8A8
from cvt.quant.recipe import RTN, Choice, Policy, method_schemes
from cvt.quant.stage.assignment import Plan, weight_shape

log = logging.getLogger("cvt")

FLOAT = "float"


def resolve_budget(kl_budget: float | None, kl_high: str | None, recipe, scheme: str,
                   world_size: int) -> tuple[str | None, float | None]:
    """(high precision, budget) of the run: the options, else the recipe's fields; None without a
    budget. OptionError naming the option for a budget that is not a finite number >= 0, a high
    precision that is not a scheme or float, or one that is --scheme itself."""
    if recipe is not None and kl_budget is None:  # the option wins over the recipe's field
        kl_budget, kl_high = recipe.kl_budget, kl_high or recipe.kl_high
    return _check_budget(kl_budget, kl_high, scheme, world_size), kl_budget


def _check_budget(kl_budget: float | None, kl_high: str | None, scheme: str, world_size: int) -> str | None:
    if kl_budget is None:
        if kl_high is not None:
            raise OptionError(f"--kl-high {kl_high} applies with --kl-budget")
        return None
    if not isinstance(kl_budget, (int, float)) or not math.isfinite(kl_budget) or kl_budget < 0:
        raise OptionError(f"--kl-budget {kl_budget}: give a mean KL, a finite number >= 0 (e.g. 0.005)")
    high = kl_high or W8A8.name
    if high != FLOAT:
        from cvt.qtensor.schemes import SCHEMES

        SCHEMES.get(high)  # an unknown name raises, listing the known ones
    if high == scheme:
        raise OptionError(f"--kl-high {high} is --scheme itself: nothing would be kept higher (give --kl-high float "
                          "or another scheme)")
    if world_size > 1:
        raise OptionError("--kl-budget measures in one process: run it without --procs / torchrun")
    return high


@contextmanager
def plan_warnings_held(hold: bool):
    """The plan's warnings (`make_plan`'s group fallbacks) left unsaid while `hold`: a budgeted
    run's first plan is replaced by the one with the kept units, which says its own."""
    if not hold:
        yield
        return
    logger = logging.getLogger("cvt")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@dataclass(frozen=True)
class Unit:
    """A group of one decoder layer's linears, chosen as one (module doc)."""

    name: str                # e.g. "model.layers.1.mlp.experts"
    modules: tuple[str, ...]
    low_bytes: int
    high_bytes: int


class BudgetPolicy(Policy):
    """The run's policy, except that the modules of the kept units get the high precision."""

    def __init__(self, base: Policy, kept: dict[str, str], high: str):
        super().__init__(base.arch, base.scheme, base.method, base.group_size, (), base.recipe)
        self.ignore, self.kept, self.high = base.ignore, kept, high

    def choose(self, module: str) -> Choice:
        unit = self.kept.get(module)
        if unit is None:
            return super().choose(module)
        why = f"--kl-budget: {unit} kept {self.high}"
        if self.high == FLOAT:
            return Choice(None, "none", None, why)
        takes = method_schemes(self.method)
        return Choice(self.high, self.method if takes is None or self.high in takes else RTN, None, why)


def units_of(ckpt, plan: Plan, policy: Policy, high_plan: Plan, fmt: str, target: str | None) -> list[Unit]:
    """The run's units (module doc), in model order, with their output bytes (as `fmt` / `target`
    lay them out on disk) at the low and high precision."""
    from cvt.quant.methods.decoder_layers import Layout
    from cvt.quant.methods.stream import text_prefix
    from cvt.runtime.models import family

    mod, cfg = family(ckpt.config)
    n_layers = mod.Args.from_config(cfg).num_hidden_layers
    lay = Layout.of(mod.Model)
    head = re.compile(rf"^({re.escape(text_prefix(ckpt) + lay.layers)}\.(\d+))\.")
    groups: dict[str, list[str]] = {}
    for m in plan.schemes:
        hit = head.match(m)
        if hit is None or int(hit.group(2)) >= n_layers or policy.choose(m).explicit:
            continue
        rest = m[hit.end():]
        part = ("experts" if rest.startswith(f"{lay.moe}.experts.") else lay.moe if rest.startswith(f"{lay.moe}.")
                else rest.split(".", 1)[0])  # the layer's attention (Qwen3.5: self_attn or linear_attn)
        groups.setdefault(f"{hit.group(1)}.{part if part != 'experts' else lay.moe + '.experts'}", []).append(m)
    disk: dict[int, DiskBytes] = {}

    def nbytes(m: str, scheme) -> int:
        """The output bytes of module `m` under `scheme` (None: float, bf16)."""
        shape = tuple(weight_shape(ckpt, plan.modules[m]))
        if scheme is None:
            return 2 * math.prod(shape)
        if id(scheme) not in disk:
            disk[id(scheme)] = DiskBytes(scheme, fmt, target)
        b = disk[id(scheme)](m, shape, plan.experts.get(m, False))
        return 2 * math.prod(shape) if b is None else b

    return [Unit(u, tuple(ms), sum(nbytes(m, plan.schemes[m]) for m in ms),
                 sum(nbytes(m, high_plan.schemes.get(m)) for m in ms)) for u, ms in groups.items()]


def choose(ckpt, tokens, plan: Plan, high_plan: Plan, units: list[Unit], budget: float, high: str,
           device) -> tuple[dict[str, str], dict]:
    """(module -> its kept unit, the manifest's record) for `budget` (module doc)."""
    from cvt.quant.methods import sensitivity as S

    pairs = {u.name: {m: (plan.schemes[m], high_plan.schemes.get(m)) for m in u.modules} for u in units}
    errors = S.unit_errors(ckpt, tokens, pairs, device)
    order = sorted(units, key=lambda u: -(errors[u.name][0] - errors[u.name][1]) / max(1, u.high_bytes - u.low_bytes))
    trials: dict[int, dict] = {}

    def measure(k: int) -> float:
        kept = {m for u in order[:k] for m in u.modules}
        schemes = {m: (high_plan.schemes.get(m) if m in kept else s) for m, s in plan.schemes.items()}
        kl = S.mixed_kl(ckpt, tokens, {m: s for m, s in schemes.items() if s is not None}, device)
        trials[k] = {"kept_units": k, "high_bytes": sum(u.high_bytes for u in order[:k]), "kl_mean": kl}
        log.info("--kl-budget: %d of %d units kept %s: mean KL %.5f", k, len(order), high, kl)
        return kl

    if measure(len(order)) > budget:
        raise OptionError(f"--kl-budget {budget}: even with all {len(order)} units at {high} the output measures "
                          f"mean KL {trials[len(order)]['kl_mean']:.5f} on the calibration text; give a larger budget "
                          "or --kl-high float")
    lo, hi = -1, len(order)
    if measure(0) <= budget:
        hi = 0
    else:
        lo = 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if measure(mid) <= budget:
            hi = mid
        else:
            lo = mid
    best = min((t for t in trials.values() if t["kl_mean"] <= budget), key=lambda t: t["high_bytes"])
    k = best["kept_units"]
    kept_names = {u.name for u in order[:k]}
    record = {
        "kl_budget": budget, "high": high, "tokens": int(tokens.numel()), "kl_mean": best["kl_mean"],
        "high_bytes": best["high_bytes"], "quantized_bytes": sum(u.low_bytes for u in units)
        + sum(u.high_bytes - u.low_bytes for u in order[:k]),
        "units": [{"unit": u.name, "linears": len(u.modules), "low_bytes": u.low_bytes, "high_bytes": u.high_bytes,
                   "error_low": errors[u.name][0], "error_high": errors[u.name][1],
                   "rank": order.index(u) + 1, "kept_high": u.name in kept_names} for u in units],
        "trials": [trials[i] for i in sorted(trials)],
    }
    return {m: u.name for u in order[:k] for m in u.modules}, record
