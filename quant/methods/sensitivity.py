"""What quantizing a group of linears costs the model's output, measured on calibration tokens
streamed through the runtime model one decoder layer at a time (as calibration reads a model,
`cvt.quant.methods.stream`): the measurements behind `cvt quantize --kl-budget`
(`cvt.quant.stage.kl_budget`).

* `unit_errors` (a local proxy, one pass): the float model's layer inputs; at each decoder layer
  its float output y, then for every unit (a group of the layer's linears) the output with only
  that unit's linears quantized, once with the low scheme and once with the high one:
  error = sum (y_unit - y)^2 / sum y^2 over the calibration tokens. The layer's float output is
  the next layer's input, so one unit's error does not depend on any other's choice.
* `mixed_kl` (exact, one pass): mean KL(float || mixed) of the next-token distributions over the
  calibration tokens, the float model and the mixed one (each linear of `schemes` quantized as
  given, the others float) streamed side by side; the quantized linears are the runtime's own
  kernels (`cvt.runtime.kernels`, activations quantized as the runtime does), built from the
  scheme's RTN, so for an RTN output it is the KL `cvt verify` measures on these tokens.

Memory: one decoder layer in float32, read whole (routed experts are not read a chunk at a time
here), two layer inputs [b, s, h] float32 (the float stream and the mixed or unit one) and one
batch of logits [batch, s, vocab]. The families whose forward is `CausalLM`'s (embedding, decoder
layers, final norm, lm_head) are measured; any other is refused (`check_family`).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from cvt.errors import OptionError
from cvt.qtensor.schemes.base import Scheme


def check_family(config: dict) -> None:
    """OptionError unless the family's model runs embedding, decoder layers, norm and lm_head as
    `CausalLM` does (what `mixed_kl` streams)."""
    from cvt.runtime.models import family
    from cvt.runtime.models.base import CausalLM

    model_cls = family(config)[0].Model
    if not (issubclass(model_cls, CausalLM) and model_cls.forward is CausalLM.forward):
        raise OptionError(f"{config.get('model_type')}: --kl-budget is not measured for this model family (its "
                          "forward is not embedding, decoder layers, norm, lm_head)")


class _Stream:
    """The runtime model on the meta device, its layer-0 inputs for `tokens` (the embedding's rows
    read through mmap) and the decoder layers read one at a time (`layers`)."""

    def __init__(self, ckpt, tokens: torch.Tensor, device, batch_size: int):
        from cvt.convert.config import source_format
        from cvt.quant.methods.decoder_layers import Layout
        from cvt.quant.methods.stream import _first_input, text_prefix
        from cvt.runtime.loader import fp8_block
        from cvt.runtime.models import build_model

        self.ckpt, self.device, self.batch_size = ckpt, torch.device(device), batch_size
        with torch.device("meta"):
            self.model = build_model(ckpt.config, dtype=torch.float32)
        self.layout = Layout.of(self.model)
        self.tp = text_prefix(ckpt)
        self.block = fp8_block(ckpt, source_format(ckpt.config))
        self.x, self.args, self.kwargs = _first_input(self.model, self.layout, ckpt, tokens, tokens, self.device,
                                                      self.tp)
        ckpt.release(f"{self.tp}{self.layout.embed}.weight")

    def layers(self) -> Iterator[tuple[str, nn.Module]]:
        """(checkpoint prefix "model.layers.{i}.", layer with its float weights), one in memory."""
        from cvt.quant.methods.stream import _dense_linears, _trim
        from cvt.runtime.loader import assign_tensors

        for i, layer in enumerate(self.layout.decoder_layers(self.model)[:self.model.args.num_hidden_layers]):
            prefix = f"{self.tp}{self.layout.layers}.{i}."
            assign_tensors(self.model, self.ckpt, self.device, self.block, skip=lambda n: not n.startswith(prefix))
            _dense_linears(layer)
            try:
                yield prefix, layer
            finally:
                layer.to("meta")
                _trim()

    def run(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        from cvt.quant.methods.calib import _run_layer

        return _run_layer(layer, x, self.args, self.kwargs, self.batch_size)

    def load_head(self) -> None:
        """Everything outside the decoder layers and the embedding: the final norm and lm_head."""
        from cvt.runtime.loader import assign_tensors

        skip = (f"{self.tp}{self.layout.layers}.", f"{self.tp}{self.layout.embed}.")
        assign_tensors(self.model, self.ckpt, self.device, self.block, skip=lambda n: n.startswith(skip)
                       or not n.startswith(self.tp))


def _kernel(mod: nn.Module, scheme: Scheme | None) -> nn.Module:
    """`mod` (a float runtime Linear) as the runtime kernel of its `scheme` RTN (None: `mod`)."""
    if scheme is None:
        return mod
    from cvt.runtime import kernels

    w = mod.weight.detach().float()
    qt = scheme.quantize(w)
    bias = None if mod.bias is None else mod.bias.detach().float()
    return kernels.get(qt.kernel_fmt).from_parts({k: v.to(w.device) for k, v in qt.parts.items()}, bias)


@contextmanager
def swapped(root: nn.Module, schemes: dict[str, Scheme | None]):
    """`root`'s linears named in `schemes` (relative names) replaced by their quantized kernels for
    the duration, then put back."""
    saved = []
    try:
        for name, scheme in schemes.items():
            parent, _, attr = name.rpartition(".")
            owner = root.get_submodule(parent) if parent else root
            mod = getattr(owner, attr)
            saved.append((owner, attr, mod))
            setattr(owner, attr, _kernel(mod, scheme))
        yield
    finally:
        for owner, attr, mod in reversed(saved):
            setattr(owner, attr, mod)


def _rel_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref.double()).square().sum() / ref.double().square().sum().clamp_min(1e-30))


@torch.no_grad()
def unit_errors(ckpt, tokens: torch.Tensor, units: dict[str, dict[str, tuple[Scheme, Scheme | None]]],
                device="cpu", batch_size: int = 8) -> dict[str, tuple[float, float]]:
    """unit -> (error with its linears at the low scheme, error at the high one; None: float = 0),
    the local proxy of the module doc. `units`: unit -> {checkpoint module: (low, high)}; a unit's
    modules lie in one decoder layer."""
    s = _Stream(ckpt, tokens, device, batch_size)
    out: dict[str, tuple[float, float]] = {}
    x = s.x
    for prefix, layer in s.layers():
        y = s.run(layer, x)
        for unit, mods in units.items():
            if not next(iter(mods)).startswith(prefix):
                continue
            errs = []
            for side in (0, 1):
                chosen = {m[len(prefix):]: pair[side] for m, pair in mods.items()}
                if all(v is None for v in chosen.values()):
                    errs.append(0.0)
                    continue
                with swapped(layer, chosen):
                    errs.append(_rel_error(s.run(layer, x), y))
            out[unit] = (errs[0], errs[1])
        x = y
    return out


@torch.no_grad()
def mixed_kl(ckpt, tokens: torch.Tensor, schemes: dict[str, Scheme], device="cpu", batch_size: int = 8) -> float:
    """Mean KL(float || mixed) over the calibration positions (each sequence's last position has
    no next token and is left out, as `cvt verify` does). `schemes`: checkpoint module ->
    scheme of the mixed model's quantized linears."""
    from cvt.runtime.metrics import logit_stats

    s = _Stream(ckpt, tokens, device, batch_size)
    xf = xm = s.x
    for prefix, layer in s.layers():
        xf = s.run(layer, xf)
        with swapped(layer, {m[len(prefix):]: sc for m, sc in schemes.items() if m.startswith(prefix)}):
            xm = s.run(layer, xm)
    s.load_head()
    layers_at = f"{s.tp}{s.layout.layers}."
    head = {m[len(s.tp):]: sc for m, sc in schemes.items() if m.startswith(s.tp) and not m.startswith(layers_at)}
    model, total, count = s.model, 0.0, 0
    for b0 in range(0, xf.shape[0], batch_size):
        ref = model.logits(model.model.norm(xf[b0:b0 + batch_size]))[:, :-1]
        with swapped(model, head):
            cand = model.logits(model.model.norm(xm[b0:b0 + batch_size]))[:, :-1]
        targets = tokens[b0:b0 + batch_size, 1:].to(ref.device)
        kl = logit_stats(cand, ref, targets)["kl_per_token"]
        total, count = total + float(kl.sum()), count + kl.numel()
    model.to("meta")
    return total / max(count, 1)
