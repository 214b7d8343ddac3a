"""Multi-rank runtime: one rank of a `cvt shard` output, run with torch.distributed.

A `ParallelContext` holds the rank's place in the layout (`cvt.convert.placement`: ``coords``,
``group``) and one process group per group of every axis of size > 1 (``dist.new_group``
for every group of every axis, all ranks calling in the same order; an axis spanning the
world uses the world group). Backend: gloo on CPU, nccl on CUDA, hccl with torch_npu.
Collectives upcast bf16 / fp16 to float32 around gloo (gloo does not reduce bf16) and cast
back; nccl / hccl reduce in the tensor's dtype.

The local model is the same model class built with the rank's sizes (`local_args`), only
the rank's routed experts instantiated (`experts.{global id}`, the router still scores all
experts; gpt-oss's fused ``[E, ...]`` experts: the rank's contiguous id range, as `cvt shard`
split them), loaded from the rank's directory alone by tensor name, then wrapped where the
communication happens:

==================  =======================================================================
module              on this rank                                communication
==================  =======================================================================
embed_tokens        vocab rows ``[i V/embed_tp, (i+1) V/embed_tp)``   all-reduce over embed_tp
                    (ids outside the range give 0)
attention           heads / tp (GQA: KV heads / tp), q/k/v/q_b/kv_b   o_proj all-reduce over tp
                    column-parallel, o_proj row-parallel
dense MLP           intermediate / dense_tp                      down_proj all-reduce over dense_tp
MoE                 the rank's experts, moe_intermediate / moe_tp   all-reduce over the world
lm_head             vocab rows / lmhead_tp                       all-gather over lmhead_tp
==================  =======================================================================

MoE, by all-reduce of partial sums (not all_to_all): every rank runs the router on all
tokens and computes, for all tokens routed to its experts, its slice's (moe_tp) weighted
partial output; the world all-reduce sums them. Shared experts are added by the ep_rank-0
ranks only (split moe_tp ways, ``layout.shared_experts == "moe_tp"``) or by rank 0 only
(``"replicated"``), so the world sum counts them once.

Redundant experts: a token routed to logical expert e is computed by exactly one replica:
replica ``t % count(e)`` among the EP ranks holding e, in EP-rank order, where t is the
token's index in the call's flattened ``[batch * seq]`` tokens.

Row-parallel additive terms (a row-parallel ``bias``, the int8 static ``quant_bias``, which
includes the input-offset correction of the whole row) are applied by the group's
coordinate-0 rank only; the others drop them, else the sum would count them ``degree``
times. Row-parallel linears with dynamic per-token activation quantization (w8a8 dynamic)
quantize each rank's input slice with its own scale, as MindIE / vllm-ascend do: such a
layer differs from the single-process run by quantization noise; weight-only and static
formats agree with it to float rounding.

The module paths above are the Hugging Face layout's; a family that names its parts otherwise
says where they are (``Model.parallel``, a `ParallelNames`: DeepSeek-V4's ``embed``,
``layers.{i}.attn.wo_b``, ``ffn``, ``head``, the Args fields a rank holds a share of, and the
linears whose split rows are all-gathered).

Attention DP: every rank runs the same tokens (the dp ranks are replicas here; serving
would give each dp group its own sequences). Every rank therefore routes identically (the
same inputs, bit-identical all-reduce results), which the MoE scheme relies on. MTP layers
are neither built nor read (the runtime never runs them).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cvt.convert.placement import Layout, RankCoords, coords, group
from cvt.errors import CvtError, ManifestError
from cvt.runtime.models.base import ParallelNames, shared_part
from cvt.schemas.parallel_layout import AXES
from cvt.schemas.manifest import Manifest, RankShard

log = logging.getLogger(__name__)

WORLD = "world"
_LOW_PRECISION = (torch.bfloat16, torch.float16)


# ------------------------------------------------------------------------------ context
def backend_for(device: torch.device) -> str:
    """torch.distributed backend for a device type: gloo (cpu), nccl (cuda), hccl (npu)."""
    from cvt.world import backend_for as for_type

    return for_type(torch.device(device).type)


def rank_device(name: str, local_rank: int) -> torch.device:
    """`--device` for one rank: cuda / npu take device index LOCAL_RANK (and make it current)."""
    from cvt.runtime.device import resolve_device

    dev = resolve_device(name)
    if dev.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise CvtError(f"LOCAL_RANK {local_rank}: only {torch.cuda.device_count()} CUDA devices are visible")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if dev.type == "npu":
        torch.npu.set_device(local_rank)
        return torch.device("npu", local_rank)
    return dev


@dataclass
class ParallelContext:
    """A rank's coordinates and process groups; `all_reduce` / `all_gather` along an axis
    (a layout axis name, or ``"world"``). Built by `create` once torch.distributed is
    initialized (or for a world of one, without it)."""

    layout: Layout
    rank: int
    device: torch.device
    coords: RankCoords
    backend: str | None = None
    groups: dict[str, Any] = dataclasses.field(default_factory=dict)  # axis -> process group

    @classmethod
    def create(cls, layout: Layout, rank: int, device: torch.device) -> "ParallelContext":
        """Every rank calls this with the same layout: process groups are created in the same order."""
        import torch.distributed as dist

        ctx = cls(layout, rank, torch.device(device), coords(layout, rank))
        W = layout.world_size
        if W == 1:
            return ctx
        if not dist.is_initialized():
            raise CvtError(f"a world of {W} ranks needs torch.distributed initialized (launch with torchrun)")
        if dist.get_world_size() != W or dist.get_rank() != rank:
            raise CvtError(f"torch.distributed runs rank {dist.get_rank()} of {dist.get_world_size()}, the "
                           f"layout needs rank {rank} of {W}")
        ctx.backend = dist.get_backend()
        ctx.groups[WORLD] = dist.group.WORLD
        made: dict[tuple[int, ...], Any] = {}
        for axis in AXES:
            size = getattr(layout, axis)
            if size == 1:
                continue
            if size == W:
                ctx.groups[axis] = dist.group.WORLD
                continue
            for r in range(W):
                ranks = tuple(group(layout, axis, r))
                if ranks not in made:  # identical rank sets of different axes share one group
                    made[ranks] = dist.new_group(list(ranks))
                if r == rank:
                    ctx.groups[axis] = made[ranks]
        return ctx

    def close(self) -> None:
        """Every rank, together, when done: a barrier, then the sub-groups `create` made are
        destroyed (a rank tearing its gloo pairs down while a peer still uses them can abort
        the peer; a caller running several worlds in one process must not leak groups)."""
        import torch.distributed as dist

        if not self.groups or not dist.is_initialized():
            return
        dist.barrier()
        for g in {id(g): g for g in self.groups.values() if g is not dist.group.WORLD}.values():
            dist.destroy_process_group(g)
        self.groups.clear()

    def size(self, axis: str) -> int:
        return self.layout.world_size if axis == WORLD else getattr(self.layout, axis)

    def coord(self, axis: str) -> int:
        return self.rank if axis == WORLD else getattr(self.coords, f"{axis}_rank")

    def _buffer(self, t: torch.Tensor) -> torch.Tensor:
        if self.backend == "gloo" and t.dtype in _LOW_PRECISION:
            return t.float()
        return t.contiguous()

    def all_reduce(self, t: torch.Tensor, axis: str) -> torch.Tensor:
        """Sum of `t` over the rank's `axis` group (in place on float32 / native buffers)."""
        if self.size(axis) == 1:
            return t
        import torch.distributed as dist

        buf = self._buffer(t)
        dist.all_reduce(buf, group=self.groups[axis])
        return buf.to(t.dtype)

    def all_gather(self, t: torch.Tensor, axis: str, dim: int = -1) -> torch.Tensor:
        """The group's `t`s concatenated along `dim`, in coordinate order."""
        n = self.size(axis)
        if n == 1:
            return t
        import torch.distributed as dist

        buf = self._buffer(t)
        parts = [torch.empty_like(buf) for _ in range(n)]
        dist.all_gather(parts, buf, group=self.groups[axis])
        return torch.cat(parts, dim=dim).to(t.dtype)


def agree(failed: bool, device: torch.device) -> list[int]:
    """Ranks that report `failed` (every rank calls this; without a process group: this rank)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [0] if failed else []
    flags = torch.zeros(dist.get_world_size(), dtype=torch.float32, device=device)
    flags[dist.get_rank()] = float(failed)
    dist.all_reduce(flags)
    return [i for i, f in enumerate(flags.tolist()) if f]


# ------------------------------------------------------------------------------ modules
def drop_additive(linear: nn.Module) -> None:
    """Remove the terms a row-parallel linear adds after its GEMM (bias, int8 static quant_bias),
    on every rank of the group but coordinate 0."""
    if getattr(linear, "bias", None) is not None:
        linear.bias = None
    qb = getattr(linear, "quant_bias", None)
    if isinstance(qb, torch.Tensor):
        linear.quant_bias = torch.zeros_like(qb)


class RowParallel(nn.Module):
    """Row-parallel linear (input features split over `axis`): local partial product, then all-reduce."""

    def __init__(self, linear: nn.Module, ctx: ParallelContext, axis: str):
        super().__init__()
        self.linear, self.ctx, self.axis = linear, ctx, axis
        if ctx.size(axis) > 1 and ctx.coord(axis) != 0:
            drop_additive(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ctx.all_reduce(self.linear(x), self.axis)

    def dense_weight(self) -> torch.Tensor:  # the local slice [out, in / degree]
        return self.linear.dense_weight()


class VocabParallelEmbedding(nn.Module):
    """weight ``[V / degree, h]`` = vocab rows ``[start, start + V / degree)``; ids outside give 0,
    the all-reduce over `axis` completes every row."""

    def __init__(self, weight: torch.Tensor, start: int, ctx: ParallelContext, axis: str = "embed_tp"):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.start, self.ctx, self.axis = start, ctx, axis

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        y = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.ctx.all_reduce(y.masked_fill(outside[..., None], 0), self.axis)


class GatheredHead(nn.Module):
    """Column-parallel lm_head: logits for the rank's vocab rows (float32), all-gathered over `axis`.
    `linear` None: tied embeddings, logits from `weight` (the vocab-parallel embedding's rows)."""

    def __init__(self, linear: nn.Module | None, ctx: ParallelContext, axis: str, weight: nn.Parameter | None = None):
        super().__init__()
        self.linear, self.ctx, self.axis = linear, ctx, axis
        self.tied = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x) if self.linear is not None else F.linear(x, self.tied.to(x.dtype))
        return self.ctx.all_gather(y.float(), self.axis, dim=-1)


class Gathered(nn.Module):
    """A linear whose output rows are split over `axis`: the rank's rows, all-gathered (in the
    input's dtype; float32 through gloo for bf16 / fp16) so that every rank has them all."""

    def __init__(self, linear: nn.Module, ctx: ParallelContext, axis: str):
        super().__init__()
        self.linear, self.ctx, self.axis = linear, ctx, axis

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ctx.all_gather(self.linear(x), self.axis, dim=-1)


class ParallelMoE(nn.Module):
    """A MoE layer's share on this rank (module docstring): route all tokens, run the local
    experts on the tokens this rank computes for them, add the shared experts where they count,
    all-reduce over the world. `holders`: global expert id -> EP ranks holding it, in order."""

    def __init__(self, moe: nn.Module, ctx: ParallelContext, holders: dict[int, list[int]], down: str = "down_proj"):
        super().__init__()
        self.moe, self.ctx = moe, ctx
        ep_rank = ctx.coords.ep_rank
        self.slots = []  # (global id, replica index of this rank, replica count)
        for key in moe.experts.keys():
            e = int(key)
            ranks = holders.get(e, [])
            if ep_rank not in ranks:
                raise ManifestError(f"expert {e} is on this rank (EP rank {ep_rank}) but the placement puts it on "
                                    f"EP ranks {ranks}")
            self.slots.append((e, ranks.index(ep_rank), len(ranks)))
        shared = shared_part(moe)
        # the MoE's shared output: its shared experts', or what the family computes (Qwen3.5's gated one)
        self.shared_output = getattr(moe, "shared_output", None) or (lambda x: shared_part(self.moe)(x))
        if shared is None:
            self.shared = False
        elif ctx.layout.shared_experts == "moe_tp":
            self.shared = ep_rank == 0
            if ctx.size("moe_tp") > 1 and ctx.coord("moe_tp") != 0:
                drop_additive(getattr(shared, down))
        else:
            self.shared = ctx.rank == 0
        if ctx.size("moe_tp") > 1 and ctx.coord("moe_tp") != 0:
            for expert in moe.experts.values():
                drop_additive(getattr(expert, down))

    def forward(self, x: torch.Tensor, *route_args) -> torch.Tensor:
        """x [b, s, h] -> [b, s, h] (the full MoE output on every rank); `route_args`: what the
        MoE's router takes besides the tokens' states (DeepSeek-V4's hash layers: the token ids)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])                                           # [n, h]
        weights, idx = self.moe.route(x, *route_args)                          # [n, k], global ids
        weights = weights.to(x.dtype)
        y = torch.zeros_like(x)
        for e, replica, count in self.slots:
            tok, slot = torch.where(idx == e)
            if count > 1:
                mine = tok % count == replica
                tok, slot = tok[mine], slot[mine]
            if tok.numel():
                y.index_add_(0, tok, self.moe.experts[str(e)](x[tok]) * weights[tok, slot, None])
        if self.shared:
            y = y + self.shared_output(x)
        return self.ctx.all_reduce(y, WORLD).view(shape)


# ------------------------------------------------------------------------------ local model
def names_of(model_or_class) -> ParallelNames:
    """Where `cvt.runtime.parallel` finds the parts of this model (class) (`ParallelNames`)."""
    cls = model_or_class if isinstance(model_or_class, type) else type(model_or_class)
    return getattr(cls, "parallel", None) or ParallelNames()


def local_args(args, layout: Layout, names: ParallelNames | None = None):
    """The model args of one rank: the fields `names.local_sizes` lists divided by their degree
    (by default heads / tp, KV heads / tp, intermediate / dense_tp, moe_intermediate / moe_tp;
    vocab stays global: embedding and head are resized apart)."""
    changes: dict[str, Any] = {}
    if hasattr(args, "dim_head"):  # GQA families: keep the head size when the head count shrinks
        changes["head_dim"] = args.dim_head
    for key, axis in (names or ParallelNames()).local_sizes:
        value, degree = getattr(args, key, None), getattr(layout, axis)
        if value is None or degree == 1:
            continue
        if value % degree:
            raise CvtError(f"config.json {key} = {value} does not divide over {axis} {degree}")
        changes[key] = value // degree
    out = dataclasses.replace(args, **changes)
    out.validate()
    return out


@dataclass
class RankModel:
    """A rank's loaded, wrapped model (forward / new_cache as any runtime model) and where it sits."""

    model: nn.Module
    config: dict
    ctx: ParallelContext
    entry: RankShard


def _local_kv(kv: dict[str, torch.Tensor], ctx: ParallelContext) -> dict[str, torch.Tensor]:
    """KV-cache scales that cover every head (replicated by the sharder: GQA per-channel scales
    over the KV heads, MLA's fa_q [heads, 1]) keep the rank's heads; per-tensor ones ([1], [1, 1])
    stay whole, and so do DeepSeek-V3.2's indexer rotations (the indexer is replicated): one rule
    for every attention kind."""
    from cvt.runtime.kv_cache import INDEXER_ROT_RE

    tp = ctx.size("tp")
    if tp == 1:
        return kv
    return {n: t if t.shape[0] == 1 or INDEXER_ROT_RE.match(n) else t.chunk(tp, dim=0)[ctx.coord("tp")].clone()
            for n, t in kv.items()}


def load_rank(root, manifest: Manifest, config: dict, ctx: ParallelContext, *, dtype: torch.dtype) -> RankModel:
    """Build the rank's local model on meta, load its directory (only), wrap it for the layout."""
    from cvt.convert.arch import arch_for
    from cvt.convert.config import source_format
    from cvt.convert.reader import open_checkpoint
    from cvt.convert.shard import expert_holders
    from cvt.runtime import kv_cache
    from cvt.runtime.loader import assign_tensors, check_complete, fp8_block, refuse_unloadable
    from cvt.runtime.models import family

    root = Path(root)
    shard = manifest.shard
    layout = shard.layout
    entry = next(e for e in shard.ranks if e.rank == ctx.rank)
    mod, cfg = family(config)
    args = mod.Args.from_config(cfg)
    names = names_of(mod.Model)
    largs = local_args(args, layout, names)
    n_layers = args.num_hidden_layers
    experts = {int(L): ids for L, ids in entry.experts.items() if int(L) < n_layers}
    kw = {"mtp": False} if "mtp" in inspect.signature(mod.Model).parameters else {}
    with torch.device("meta"):
        model = mod.Model(largs, dtype=dtype, experts=experts, **kw)
        _resize(model, args, layout, dtype, names)
    arch = arch_for(config)
    ckpt = open_checkpoint(root / entry.dir, need_config=False)
    try:
        ckpt.config = config
        nbytes = sum(r.nbytes for r in ckpt.tensors.values())
        if len(ckpt.tensors) != entry.tensors or nbytes != entry.bytes:
            raise ManifestError(f"{root / entry.dir}: the manifest records {entry.tensors} tensors / {entry.bytes} "
                                f"bytes for rank {ctx.rank}, the files hold {len(ckpt.tensors)} / {nbytes}")
        # a shard of a cvt quantize output (its manifest has a quant section) is cvt's own format
        refuse_unloadable(source_format(config, manifest.quant is not None), root, sharded=True)
        fmt = source_format(config)
        block = fp8_block(ckpt, fmt)
        _, kv = assign_tensors(model, ckpt, ctx.device, block, skip=lambda name: arch.classify(name).is_mtp,
                               adjust=_local_shape(shard.tensors), rank_local=True)
    finally:
        ckpt.close()
    if kv:
        kv = _local_kv(kv, ctx)
        kv_cache.attach_kv_cache_scales(model, {k: v.to(ctx.device) for k, v in kv.items()},
                                        kv_cache.codec_of_config(config, manifest))
    check_complete(model, root / entry.dir)
    holders = expert_holders(layout, config)
    _wrap(model, ctx, holders, names)
    model.eval()
    return RankModel(model, config, ctx, entry)


def _local_shape(tensors):
    """`assign_tensors` adjust: compressed-tensors ``weight_shape`` holds the global [n, k]; the
    rank's is that with the split dim divided by the degree (from the module's packed weight)."""

    def adjust(name: str, t: torch.Tensor) -> torch.Tensor:
        if not name.endswith(".weight_shape"):
            return t
        module = name[: -len(".weight_shape")]
        for part in ("weight_packed", "weight"):
            info = tensors.get(f"{module}.{part}")
            if info is not None:
                break
        if info is None or info.dim is None:
            return t
        shape = t.clone().reshape(-1)
        if int(shape[info.dim]) % info.degree:
            raise ManifestError(f"{name} = {shape.tolist()}: dim {info.dim} does not divide by {info.axis} "
                                f"{info.degree}")
        shape[info.dim] //= info.degree
        return shape.reshape(t.shape)

    return adjust


def _get(root: nn.Module, path: str):
    for part in path.split("."):
        root = getattr(root, part)
    return root


def _find(root: nn.Module, path: str):
    """The module at dotted `path`, or None where there is none (a tied head)."""
    try:
        return _get(root, path)
    except AttributeError:
        return None


def _set(root: nn.Module, path: str, module: nn.Module) -> None:
    *parent, last = path.split(".")
    setattr(_get(root, ".".join(parent)) if parent else root, last, module)


def _resize(model: nn.Module, args, layout: Layout, dtype, names: ParallelNames) -> None:
    """Parts `local_args` cannot express (on meta): vocab-parallel embedding rows, lm_head rows,
    shared experts held whole (``replicated``) under moe_tp, the rows of `names.gathered`."""
    from cvt.runtime.kernels import Linear
    from cvt.runtime.models.base import MLP

    h, V = args.hidden_size, args.vocab_size
    if layout.embed_tp > 1:
        emb = nn.Embedding(V // layout.embed_tp, h, dtype=dtype)
        emb.weight.requires_grad_(False)
        _set(model, names.embed, emb)
    if _find(model, names.head) is not None and layout.lmhead_tp > 1:
        _set(model, names.head, Linear(h, V // layout.lmhead_tp, dtype=dtype))
    for layer in _get(model, names.layers)[: args.num_hidden_layers]:
        mlp = _get(layer, names.mlp)
        shared = shared_part(mlp)
        if layout.shared_experts == "replicated" and layout.moe_tp > 1 and shared is not None:
            width = (getattr(args, "shared_expert_intermediate_size", None)   # Qwen3.5's own width
                     or args.moe_intermediate_size * (getattr(args, "n_shared_experts", None) or 1))
            # the family's own shared-expert class, built from the global args (DeepSeek-V4's
            # Expert(args)); the HF-layout families' MLP(hidden, width) (Qwen3.5's gated subclass)
            setattr(mlp, getattr(mlp, "shared_name", "shared_experts"),
                    type(shared)(h, width, dtype=dtype) if isinstance(shared, MLP) else type(shared)(args, dtype))
        for path in names.gathered if layout.tp > 1 else ():
            try:
                linear = _get(layer, path)
            except AttributeError:  # not in this layer (e.g. V4's indexer: its CSA layers only)
                continue
            if linear.out_features % layout.tp:
                raise CvtError(f"{path}: {linear.out_features} output rows do not divide over tp {layout.tp}")
            _set(layer, path, Linear(linear.in_features, linear.out_features // layout.tp, dtype=dtype))


def _wrap(model: nn.Module, ctx: ParallelContext, holders: dict[int, dict[int, list[int]]],
          names: ParallelNames) -> None:
    """Put the collectives in (after loading: the loader swaps quantized linears in by name)."""
    layout = ctx.layout
    emb = _get(model, names.embed)
    V = model.args.vocab_size
    if layout.embed_tp > 1:
        start = ctx.coord("embed_tp") * (V // layout.embed_tp)
        _set(model, names.embed, VocabParallelEmbedding(emb.weight, start, ctx))
    if _find(model, names.head) is not None:
        if layout.lmhead_tp > 1:
            _set(model, names.head, GatheredHead(_get(model, names.head), ctx, "lmhead_tp"))
    elif layout.embed_tp > 1:  # tied embeddings: the head has the embedding's vocab rows
        _set(model, names.head, GatheredHead(None, ctx, "embed_tp", weight=_get(model, names.embed).weight))
    layers = _get(model, names.layers)
    for i in range(model.args.num_hidden_layers):
        layer = layers[i]
        for out in (names.attn_out, *names.mixer_outs) if layout.tp > 1 else ():
            if _find(layer, out) is not None:  # the layer's token mixer (Qwen3.5: self_attn or linear_attn)
                _set(layer, out, RowParallel(_get(layer, out), ctx, "tp"))
        if layout.tp > 1 and _find(layer, names.attn_out) is not None:
            for path in names.gathered:
                try:
                    linear = _get(layer, path)
                except AttributeError:
                    continue
                _set(layer, path, Gathered(linear, ctx, "tp"))
        mlp = _get(layer, names.mlp)
        if hasattr(mlp, "route"):
            _set(layer, names.mlp, ParallelMoE(mlp, ctx, holders.get(i, {}), names.down))
        elif layout.dense_tp > 1:
            setattr(mlp, names.down, RowParallel(getattr(mlp, names.down), ctx, "dense_tp"))


__all__ = ["ParallelContext", "RowParallel", "VocabParallelEmbedding", "GatheredHead", "Gathered", "ParallelMoE",
           "backend_for", "rank_device", "agree", "local_args", "names_of", "load_rank", "RankModel", "WORLD"]
