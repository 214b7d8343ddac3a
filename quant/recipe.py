"""What gets quantized, and how: architecture defaults, `--ignore`, and `--recipe FILE`.

Resolution for each linear weight (first that applies wins):

1. a `--recipe` rule whose `pattern` (a regex, `re.search` on the module name) matches: its
   `scheme` ("float" keeps the module float), `method`, `group_size`;
2. an `--ignore REGEX` that matches the module name: float;
3. the architecture table: not quantizable (norms, embeddings, router) or float-by-default
   (lm_head, MLA kv_b_proj, MTP heads, eh_proj): float;
4. the stage's `--scheme` / `--method` / `--group-size`.

A recipe file is JSON or YAML: ``{"rules": [{"pattern": "mlp\\.experts\\.", "scheme": "w4a16",
"group_size": 32}, {"pattern": "self_attn", "scheme": "w8a8"}]}`` - mixed precision such as
"experts W4A16, attention W8A8". ``"kl_budget": 0.005`` (and ``"kl_high": "float"``) chooses
the units kept higher by measurement instead (`cvt.quant.stage.kl_budget`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from cvt.convert.arch import ArchSpec
from cvt.errors import CvtError, OptionError, validation_summary
from cvt.qtensor import kernel_formats as KF
from cvt.registry import Registry


@dataclass(frozen=True)
class Method:
    """A quantization method as options, recipes and the help know it, without torch (its
    algorithm: `cvt.quant.methods`): its name, one-line summary, and the kernel formats it
    quantizes (None: every one; `cvt.quant.stage.assignment.method_kernels`)."""

    name: str
    summary: str
    data: bool  # calibrates on --calib text
    kernels: tuple[str, ...] | None = None
    why_not: str = ""  # why a scheme outside `kernels` is refused, for messages


def method_schemes(method: str) -> list[str] | None:
    """The schemes `method` quantizes: those producing a kernel format it takes (None: any)."""
    from cvt.qtensor.layouts import kernel_formats
    from cvt.qtensor.schemes import get_scheme, scheme_names

    kernels = METHOD_TABLE[method].kernels
    if kernels is None:
        return None
    return [s for s in scheme_names() if kernel_formats(get_scheme(s)) & set(kernels)]


RTN, SMOOTHQUANT, GPTQ, AWQ, FLATQUANT = "rtn", "smoothquant", "gptq", "awq", "flatquant"  # the methods' names
# --method flatquant's fit (`cvt.quant.methods.flatquant`): Adam steps per input site (a CPU-sized fit;
# FlatQuant trains 15 epochs of 128 sequences), the transforms' rate (the clip's is 10x), the Hadamard
# start's seed (0: the transforms --method rtn writes). `--flatquant-steps` / `-lr` / `-seed` override them.
FLATQUANT_FIT = {"steps": 100, "lr": 1e-2, "seed": 0}
METHOD_TABLE: Registry[Method] = Registry("method", summarized=True)
for _m in (
    Method(RTN, "round to nearest with the scheme's own scales", data=False),
    # smoothing migrates activation outliers into the weights: only for quantized activations (a
    # weight-only scheme would get harder weights and nothing back)
    Method(SMOOTHQUANT, "per-channel factors folded from the RMSNorm into its consumers, then RTN: flatter "
                        "activations for their int8 quantization", data=True,
           kernels=(KF.W8A8_DYNAMIC, KF.W8A8_STATIC, KF.W4A8_DYNAMIC),
           why_not="it smooths activations for their int8 per-token quantization, which this scheme does not use"),
    Method(GPTQ, "column-wise quantization with inverse-Hessian error feedback", data=True,
           kernels=(KF.W4A16, KF.W8A8_DYNAMIC, KF.NVFP4, KF.MXFP4, KF.MXFP8, KF.W4A4_MXFP4, KF.W4A8_MXFP),
           why_not="its error feedback is written for int4, int8 per-channel, fp4 and MX weights"),
    Method(AWQ, "activation-aware scales folded into the producer and a clipping search, then RTN", data=True),
    Method(FLATQUANT, "the online Kronecker transforms and activation clip fitted per input site on calibration "
                      "rows (output MSE, Adam from the Hadamard start), then RTN behind them", data=True,
           kernels=(KF.W4A4_FLATQUANT, KF.W4A4_MXFP4_FLATQUANT),
           why_not="it fits the online Kronecker transforms (left_trans / right_trans / clip_ratio) that only "
                   "w4a4_flatquant and w4a4_mxfp4_flatquant carry"),
):
    METHOD_TABLE.add(_m.name, _m)
METHODS = tuple(METHOD_TABLE)                 # registration order: rtn first, the default
DATA_METHODS = frozenset(m.name for m in METHOD_TABLE.values() if m.data)  # the ones that calibrate on data


def mixed_site(flat: str, other: str, scheme: str, method: str) -> OptionError:
    """The refusal of linear `other`, which reads the same input as the `--method flatquant`
    linear `flat` and is `scheme` (the same kernel format) too, but `--method method`: the
    quantize plan's (`cvt.quant.stage.assignment.check_fused_methods`, before DST) and the
    calibration driver's (`cvt.quant.methods.flatquant.flatquant_site`) say the same line."""
    return OptionError(f"{other} reads the same input as {flat} and is {scheme} too, but --method {method}: vLLM "
                       "fuses them into one layer with one set of transforms, so give them the same method")


class RecipeRule(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pattern: str = Field(description="regex searched in the module name, e.g. 'mlp\\\\.experts\\\\.'")
    scheme: str = Field(description="a scheme name, or 'float' to keep the module float")
    method: Literal[METHODS] | None = None  # type: ignore[valid-type]
    group_size: int | None = Field(None, ge=0)

    @field_validator("pattern")
    @classmethod
    def _regex(cls, v: str) -> str:
        try:
            re.compile(v)
        except re.error as exc:
            raise ValueError(f"pattern {v!r} is not a valid regex: {exc}") from exc
        return v


class Recipe(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rules: list[RecipeRule] = Field(default_factory=list)
    # `cvt quantize --kl-budget` / `--kl-high` as recipe fields (the options win when given)
    kl_budget: float | None = Field(None, ge=0, allow_inf_nan=False)
    kl_high: str | None = None


def load_recipe(path: Path) -> Recipe:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CvtError(f"{path}: cannot read the recipe: {exc.strerror or exc}") from exc
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError as exc:
            raise CvtError(f"{path}: YAML recipes need PyYAML ({exc}); use JSON") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            raise CvtError(f"{path}: not valid YAML{where}: {getattr(exc, 'problem', None) or exc}") from None
    else:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise CvtError(f"{path}: not valid JSON: {exc}") from None
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        raise CvtError(f"{path}: not a valid recipe: {validation_summary(exc)}") from None


@dataclass(frozen=True)
class Choice:
    """The decision for one linear: scheme None means keep float."""

    scheme: str | None
    method: str
    group_size: int | None
    reason: str
    explicit: bool = False  # chosen by a recipe rule (not the default)


class Policy:
    def __init__(self, arch: ArchSpec, scheme: str, method: str = RTN, group_size: int | None = None,
                 ignore: tuple[str, ...] = (), recipe: Recipe | None = None):
        if method not in METHODS:
            raise CvtError(f"unknown method {method!r} (known: {', '.join(METHODS)})")
        self.arch, self.scheme, self.method, self.group_size = arch, scheme, method, group_size
        try:
            self.ignore = [re.compile(p) for p in ignore]
        except re.error as exc:
            raise CvtError(f"--ignore {exc.pattern!r} is not a valid regex: {exc}") from exc
        self.recipe = recipe or Recipe()

    def choose(self, module: str) -> Choice:
        info = self.arch.classify(module + ".weight")
        for rule in self.recipe.rules:
            if re.search(rule.pattern, module):
                if rule.scheme == "float" or not info.rule.quantizable:
                    return Choice(None, "none", None, f"recipe {rule.pattern!r}")
                return Choice(rule.scheme, rule.method or self.method,
                              rule.group_size if rule.group_size is not None else self.group_size,
                              f"recipe {rule.pattern!r}", explicit=True)
        if any(rx.search(module) for rx in self.ignore):
            return Choice(None, "none", None, "--ignore")
        if not info.rule.quantizable:
            return Choice(None, "none", None, f"{info.role.value} (not a quantizable linear)")
        if info.rule.float_default:
            return Choice(None, "none", None, f"{info.role.value} stays float by default")
        return Choice(self.scheme, self.method, self.group_size, "default")
