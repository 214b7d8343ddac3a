"""The help text that lists what the registries hold: schemes, methods, output formats, ascend
targets (each entry's one-line `summary`) and the supported architectures (each table's
display name). Built when click first reads an option's help (`LazyHelp`), so `cvt --help` and
the verbs that take no such option import no registry; the docs render the same text.
"""

from __future__ import annotations

from typing import Callable

import click


class _LazyText:
    """A click option or command whose help is `text()`, written when first read (`--help`)."""

    def __init__(self, *args, text: Callable[[], str], **kwargs):
        self._text, self._written = text, None
        super().__init__(*args, **kwargs)

    @property
    def help(self) -> str:
        if self._written is None:
            self._written = self._text()
        return self._written

    @help.setter
    def help(self, value) -> None:  # click's __init__ sets it (a docstring, or None): the text is `text()`'s
        pass


class LazyHelp(_LazyText, click.Option):
    """An option whose help lists a registry (`cls=LazyHelp, text=describe.schemes`)."""


class LazyHelpGroup(_LazyText, click.Group):
    """The `cvt` group: its help names the architectures (`group_help`)."""


class LazyHelpCommand(_LazyText, click.Command):
    """A verb whose help lists a registry (`fp8-to-bf16`: the sources it reads)."""


def fp8_to_bf16() -> str:
    from cvt.convert.sources import SOURCES

    reads = "; ".join(f"{p.name}: {p.summary}" for p in SOURCES.values() if "fp8-to-bf16" in p.verbs)
    return ("Dequantize a quantized release (any precision under Reads) to BF16.\n\n"
            "Bit-exact with the official math: bf16 = RNE(float32(w) * float32(scale)) per 128x128 block (partial "
            "edge blocks included), each source's own decompression for the others. Other tensors are copied byte "
            "for byte, scales are dropped, config.json loses quantization_config. Streams one tensor at a time; "
            f"re-running after a crash resumes.\n\nReads: {reads}.")


def quantize() -> str:
    from cvt.convert.sources import SourceFormat, readable

    quantized = [name for name in readable("quantize") if name != SourceFormat.BF16.value]
    return ("Quantize SRC into DST in the Ascend or compressed-tensors format, with cvt_manifest.json recording every "
            "tensor's scheme, method and SQNR. Router, lm_head, embeddings, norms and MLA kv_b_proj stay float by "
            "default.\n\nSRC: BF16, or a quantized release dequantized on the fly, one tensor at a time ("
            f"{', '.join(quantized)}); FP4 codes already on the target's grid (DeepSeek-V4's experts, "
            "compressed-tensors MXFP4 / NVFP4, ModelOpt NVFP4 where its global scale converts exactly) are carried "
            "unchanged.")


def group_help() -> str:
    return ("cvt: convert released LLM checkpoints for Ascend NPUs and any torch machine.\n\n"
            f"Models: {architectures()}.\n\nSRC may be a local directory or a Hugging Face hub repo id (owner/name; HF_HUB_OFFLINE=1 uses only "
            "the local cache). Every output directory carries cvt_manifest.json.")


def _entries(summaries: dict[str, str]) -> str:
    return "; ".join(f"{name}: {summary}" for name, summary in summaries.items())


def schemes() -> str:
    from cvt.qtensor.schemes import SCHEMES

    return f"{_entries(SCHEMES.summaries())}."


def formats() -> str:
    from cvt.qtensor.formats import DEFAULT_FORMAT, FORMATS

    return f"Default {DEFAULT_FORMAT}. {_entries(FORMATS.summaries())}."


def targets() -> str:
    from cvt.qtensor.layouts import ASCEND_TARGETS, DEFAULT_TARGET, TARGET_SUMMARIES

    return (f"ascend: the serving stack the layouts are for (default {DEFAULT_TARGET}). "
            f"{_entries({t: TARGET_SUMMARIES[t] for t in ASCEND_TARGETS})}.")


def methods() -> str:
    from cvt.quant.recipe import METHOD_TABLE, METHODS, method_schemes

    parts = []
    for m in METHOD_TABLE.values():
        ok = method_schemes(m.name)
        parts.append(f"{m.name}: {'any scheme' if ok is None else ', '.join(ok)} - {m.summary}"
                     + ("" if m.data else " (no data)"))
    data = [m.name for m in METHOD_TABLE.values() if m.data]
    return (f"Default {METHODS[0]}. " + ". ".join(parts) + f". {', '.join(data[:-1])} and {data[-1]} calibrate on "
            "--calib text; a recipe can give modules other methods.")


def flatquant_fit(what: str) -> str:
    """The help of `--flatquant-steps` / `-lr` / `-seed`, with the fit's defaults."""
    from cvt.quant.recipe import FLATQUANT_FIT

    text = {"steps": "Adam steps of each input site's fit",
            "lr": "the transforms' learning rate (the clip's is ten times it)",
            "seed": "the randomised Hadamard start (0: the transforms --method rtn writes); same seed, same bytes"}
    return f"--method flatquant: {text[what]} (default {FLATQUANT_FIT[what]})."


def architectures() -> str:
    """The supported families, as the architecture tables name them (`ArchTable.display`)."""
    from cvt.convert.arch import families

    return "; ".join(families())
