"""`cvt quantize --rotate hadamard[:SEED]`: SRC seen through a QuaRot-style rotation folded into
its weights (the family's `cvt.convert.arch.rotation` table says where; `cvt.qtensor.hadamard` gives
the orthogonal matrices), so that every scheme and method then quantizes weights and activations
without the outlier channels the residual stream carries.

`RotatedCheckpoint` is a `Checkpoint` whose tensors are the rotated model's, in BF16 (FP8 weights
dequantized as `cvt fp8-to-bf16` does, then rotated in float32 and rounded once): the quantize
stage, calibration and the writers read it like any BF16 checkpoint, one tensor at a time, so
nothing is held beyond the tensor being read (the embedding and head rotate in row chunks). The
float model it describes equals SRC's within float error (tests/quant/test_rotate.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

import torch

from cvt.convert.arch import ArchSpec
from cvt.convert.arch.rotation import Rotation
from cvt.convert.config import SourceFormat, fp8_config
from cvt.convert.fp8 import dequant_fp8_block
from cvt.convert.reader import Checkpoint
from cvt.convert.safetensors_io import TensorRef, torch_dtype
from cvt.errors import FormatError, OptionError
from cvt.qtensor.hadamard import Orthogonal

SPEC = re.compile(r"hadamard(?::(\d{1,9}))?")
ROWS = 4096  # rows of an embedding / head rotated at once (V3's embedding: 129280 x 7168)
DECODER = ("model.embed_tokens", "model.norm", "lm_head")  # `cvt.convert.arch.base.DECODER_RULES`


def parse(spec: str) -> str:
    """The canonical form of a --rotate value (``hadamard:SEED``); OptionError otherwise."""
    m = SPEC.fullmatch(spec.strip().lower())
    if m is None:
        raise OptionError(f"--rotate {spec!r}: expected hadamard or hadamard:SEED (SEED a whole number "
                          "below 10^9)")
    return f"hadamard:{int(m.group(1) or 0)}"


def seed_of(spec: str) -> int:
    return int(parse(spec).partition(":")[2])


def check(arch: ArchSpec, config: Mapping, src_fmt: SourceFormat) -> Rotation:
    """The family's rotation table; FormatError (one line) where rotation cannot be exact."""
    rot, name = arch.table.rotation, arch.model_type
    if isinstance(rot, str):
        raise FormatError(f"{name}: --rotate is refused: {rot}")
    if config.get("tie_word_embeddings"):
        raise FormatError(f"{name}: --rotate is refused: tie_word_embeddings is true, and folding the final "
                          "norm into the head would untie it from the embedding")
    if src_fmt not in (SourceFormat.BF16, SourceFormat.FP8_BLOCK):
        raise FormatError(f"{name}: --rotate reads BF16 and FP8 block checkpoints, not {src_fmt.value}")
    return rot


@dataclass(frozen=True)
class Op:
    """One step of a tensor's rotation. kind: "in" (columns: W diag(g) Q), "out" (rows: Q^T W,
    the first `rows` rows, all when 0), "vin" / "vout" (value heads' columns / rows), "cat"
    (column blocks, one norm each), "embed" (rows: E Q), "ones" (a folded norm)."""

    kind: str
    space: str = "residual"
    norms: tuple[str, ...] = ()
    rows: int = 0


def layer_ops(rot: Rotation, config: Mapping) -> dict[str, list[Op]]:
    """module pattern under a decoder layer -> its ops, in the order they apply."""
    ops: dict[str, list[Op]] = {}

    def add(module: str, op: Op) -> None:
        ops.setdefault(module, []).append(op)

    for norm, readers in rot.readers.items():
        add(norm, Op("ones"))
        for r in readers:
            add(r, Op("in", norms=(norm,)))
    for r, norms in rot.concat_readers.items():
        for n in norms:
            add(n, Op("ones"))
        add(r, Op("cat", norms=norms))
        add(r, Op("out"))
    for w in rot.writers:
        add(w, Op("out"))
    for e in rot.embeddings:
        add(e, Op("embed"))
    for lat in rot.latents:
        width = config.get(lat.width)
        if not width:  # e.g. q_lora_rank null: no q latent
            continue
        add(lat.producer, Op("out", space=lat.width, rows=int(width)))
        add(lat.norm, Op("ones"))
        for c in lat.consumers:
            add(c, Op("in", space=lat.width, norms=(lat.norm,)))
    if rot.values is not None:
        add(rot.values.producer, Op("vout", space="values"))
        add(rot.values.consumer, Op("vin", space="values"))
    return ops


class Rotator:
    """The rotated value of each SRC tensor (module docstring), read from `base`."""

    def __init__(self, base: Checkpoint, arch: ArchSpec, rot: Rotation, seed: int):
        self.base, self.seed, self.config = base, seed, arch.config
        self.prefix = arch.table.text_prefix
        self.values = rot.values.layout(arch.config) if rot.values is not None else None
        self.ops = layer_ops(rot, arch.config)
        self.patterns = [(re.compile(re.escape(m).replace(r"\{E\}", r"\d+") + r"\.(weight|bias)"), ops)
                         for m, ops in self.ops.items()]
        self.top = {f"{self.prefix}{DECODER[0]}.weight": [Op("embed")],
                    f"{self.prefix}{DECODER[1]}.weight": [Op("ones")],
                    f"{self.prefix}{DECODER[2]}.weight": [Op("in", norms=(f"{self.prefix}{DECODER[1]}",))]}
        self._spaces: dict[str, Orthogonal] = {}

    def space(self, label: str, n: int) -> Orthogonal:
        key = f"{label}:{n}"
        if key not in self._spaces:  # the writers' threads may race here: both build the same Q
            self._spaces[key] = Orthogonal(n, self.seed, label)
        return self._spaces[key]

    def ops_of(self, name: str) -> tuple[list[Op], str]:
        """(ops, the tensor's layer prefix ending in '.') of a tensor name; ([], "") when it stays."""
        if name in self.top:
            return self.top[name], ""
        m = re.match(re.escape(self.prefix) + r"model\.layers\.\d+\.", name)
        if m is None:
            return [], ""
        rest = name[m.end():]
        for pattern, ops in self.patterns:
            if pattern.fullmatch(rest):
                return ops, m.group(0)
        return [], ""

    def kinds(self) -> dict[str, str]:
        """{space: its matrix' kind} of the spaces used so far (tests; the kinds follow from the widths)."""
        return {k: q.kind for k, q in sorted(self._spaces.items())}

    def _norm(self, layer: str, norm: str) -> torch.Tensor:
        name = f"{layer}{norm}.weight" if layer else f"{norm}.weight"
        return self.base.read(name).float()

    def apply(self, name: str, w: torch.Tensor, ops: list[Op], layer: str) -> torch.Tensor:
        """`w` (float32, as stored in SRC) rotated by `ops`."""
        bias = name.endswith(".bias")
        for op in ops:
            if op.kind == "ones":
                w = torch.ones_like(w)
            elif op.kind in ("in", "cat", "vin", "embed") and bias:
                continue  # a bias lives on the output side
            elif op.kind in ("in", "embed"):
                if op.norms:
                    w = w * self._norm(layer, op.norms[0])
                w = self._rows(w, lambda x: self.space(op.space, x.shape[-1]).right(x))
            elif op.kind == "cat":
                parts = w.split(w.shape[1] // len(op.norms), dim=1)
                q = self.space(op.space, parts[0].shape[1])
                w = torch.cat([q.right(p * self._norm(layer, n)) for p, n in zip(parts, op.norms)], dim=1)
            elif op.kind == "out":
                rows = op.rows or w.shape[0]
                q = self.space(op.space, rows)
                w = torch.cat([q.left_t(w[:rows]), w[rows:]]) if rows < w.shape[0] else q.left_t(w)
            else:
                w = self._values(w, op.kind)
        return w

    def _values(self, w: torch.Tensor, kind: str) -> torch.Tensor:
        blocks, stride, offset, d = self.values
        q = self.space("values", d)
        w = w.clone()
        if kind == "vin":  # the output projection's columns, one head-width block per query head
            cols = w.shape[1] // d
            w.copy_(q.right(w.reshape(w.shape[0], cols, d)).reshape(w.shape))
            return w
        for b in range(blocks):  # each head's value rows: R^T W
            lo = b * stride + offset
            w[lo:lo + d] = q.left_t(w[lo:lo + d])
        return w

    @staticmethod
    def _rows(w: torch.Tensor, f) -> torch.Tensor:
        if w.dim() < 2 or w.shape[0] <= ROWS:
            return f(w)
        return torch.cat([f(w[i:i + ROWS]) for i in range(0, w.shape[0], ROWS)])


class RotatedCheckpoint(Checkpoint):
    """SRC as the rotated BF16 checkpoint (module docstring). `dtype`: the tensors' storage
    ("BF16"; "F32" keeps the float32 result, for the equivalence tests)."""

    def __init__(self, base: Checkpoint, arch: ArchSpec, rot: Rotation, spec: str, scale_param: str,
                 dtype: str = "BF16"):
        config = {k: v for k, v in base.config.items() if k != "quantization_config"}
        self.spec, self._base, self._dtype = parse(spec), base, dtype
        fp8 = "quantization_config" in base.config and any(r.dtype == "F8_E4M3" for r in base.tensors.values())
        self._block = fp8_config(base.config, str(base.root)).block if fp8 else None
        self._scale_param = scale_param
        self.rotator = Rotator(base, arch, rot, seed_of(spec))
        scales = {self._scale_of(n) for n, r in base.tensors.items() if r.dtype == "F8_E4M3"}
        tensors, self._made = {}, set()
        for n, r in base.tensors.items():
            if n in scales:
                continue
            ops, _ = self.rotator.ops_of(n)
            if n.endswith(".bias") and any(op.kind in ("ones", "cat") for op in ops):
                # a norm's bias would add in the rotated basis; none of the tables' norms has one
                raise FormatError(f"{n}: --rotate folds RMSNorm weights and this norm has a bias")
            if ops or r.dtype == "F8_E4M3":
                self._made.add(n)
                out = "F32" if r.dtype == "F32" else dtype  # a float32 tensor stays float32
                size = torch.tensor([], dtype=torch_dtype(out)).element_size()
                r = TensorRef(n, r.path, out, r.shape, r.start, r.start + size * r.numel)
            tensors[n] = r
        super().__init__(base.root, base.source, config, tensors, base.index_path)

    def _scale_of(self, weight: str) -> str:
        return f"{weight.rpartition('.')[0]}.{self._scale_param}"

    @property
    def content_identity(self) -> dict[str, str]:
        return {**self._base.content_identity, "rotation": self.spec}

    def read(self, name: str):
        if name not in self._made:
            return self._base.read(name)
        ops, layer = self.rotator.ops_of(name)
        w = self._base.read(name)
        if w.dtype == torch.float8_e4m3fn:
            w = dequant_fp8_block(w, self._base.read(self._scale_of(name)), self._block)
        w = self.rotator.apply(name, w.float(), ops, layer) if ops else w
        return w.to(torch_dtype(self.tensors[name].dtype)).contiguous()

    def view(self, name: str) -> memoryview:
        if name not in self._made:
            return self._base.view(name)
        return memoryview(self.read(name).view(torch.uint8).numpy()).cast("B")

    def release(self, name: str) -> None:
        self._base.release(name)
        scale = self._scale_of(name)
        if name in self._made and scale in self._base.tensors:
            self._base.release(scale)

    def close(self) -> None:
        self._base.close()
