"""The referee's stubs: vllm, torch_npu, transformers (when not really imported) and vllm-ascend's
NPU modules, so that vllm-ascend's own ``vllm_ascend.quantization`` imports off-device.

``_vllm_ascend(va_src, hf_config, dtype)`` imports it from a local source tree on these stubs and
undoes everything afterwards; ``_track_empty`` tells which parameters a scheme made with
``torch.empty`` (the checkpoint must fill them). Used by every vllm_ascend_referee* module.
"""

from __future__ import annotations

import contextlib
import enum
import importlib.abc
import importlib.machinery
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

import torch


class _Anything:
    """Subclassable, callable, attribute-tolerant placeholder."""

    def __init__(self, *a, **k):
        pass

    def __call__(self, *a, **k):
        return _Anything()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()

    def __bool__(self):
        return False

    def __iter__(self):
        return iter(())


class _AnyMeta(type):
    """Class-level attribute access on stub classes (``CompilationMode.VLLM_COMPILE``)."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()


class _AutoModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        obj = _AnyMeta(name, (_Anything,), {}) if name[:1].isupper() else _Anything()
        setattr(self, name, obj)
        return obj


# vllm_ascend modules that pull in NPU runtime code; the rest of vllm_ascend.quantization is real.
_VA_STUBBED = (
    "vllm_ascend.ascend_config", "vllm_ascend.ascend_forward_context", "vllm_ascend.distributed",
    "vllm_ascend.ops", "vllm_ascend.flash_common3_context", "vllm_ascend.device", "vllm_ascend.utils",
    "vllm_ascend.attention",
)


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, tops: tuple[str, ...]):
        self.tops = tops

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.tops or fullname.startswith(_VA_STUBBED):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _AutoModule(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


class _PerTensorScaleParameter(torch.nn.Parameter):
    def __new__(cls, data=None, weight_loader=None, **kw):
        p = torch.nn.Parameter.__new__(cls, data, requires_grad=False)
        p.weight_loader = weight_loader
        return p


def _set_weight_attrs(weight, attrs):
    for k, v in (attrs or {}).items():
        setattr(weight, k, v)


class _QuantizationConfig(metaclass=_AnyMeta):
    def __init__(self):
        self.packed_modules_mapping: dict[str, list[str]] = {}


@dataclass
class _Env:
    mc: Any                    # vllm_ascend.quantization.modelslim_config
    adapters: Any              # vllm_ascend.quantization.method_adapters
    kv_c8: Any                 # vllm_ascend.quantization.methods.kv_c8
    LinearBase: type
    RowParallelLinear: type
    FusedMoE: type
    AttentionLayerBase: type
    VocabParallelEmbedding: type
    holder: Any                # the stub VllmConfig (quant_config set once the config exists)
    moe_bases: tuple = ()      # main: what _is_fused_moe_layer checks (MoERunner, RoutedExperts)


def _patch_stubs(hf_config: dict, dtype: torch.dtype) -> NS:
    """Give the stubs what vllm-ascend's quantization code calls at import and create time (tp=1, no
    EP / EPLB / MC2, the 0.23 version checks); returns the stub VllmConfig."""
    import vllm.config as vc
    import vllm.distributed as vd
    import vllm.model_executor.layers.fused_moe as vfm
    import vllm.model_executor.layers.quantization as vq
    import vllm.model_executor.layers.quantization.base_config as vqb
    import vllm.model_executor.parameter as vp
    import vllm.model_executor.utils as vmu
    import vllm.utils.math_utils as vmath
    import vllm_ascend.ascend_config as ac
    import vllm_ascend.distributed.parallel_state as ps
    import vllm_ascend.utils as vu

    holder = NS(
        quant_config=None,
        compilation_config=NS(mode=0),
        model_config=NS(enforce_eager=True, dtype=dtype, hf_config=NS(**hf_config),
                        use_mla="kv_lora_rank" in hf_config.get("text_config", hf_config)),
        parallel_config=NS(enable_expert_parallel=False, tensor_parallel_size=1, enable_eplb=False),
        kv_transfer_config=None,
        use_v2_model_runner=False,  # main's MoE schemes read it
    )
    vc.get_current_vllm_config = lambda: holder
    vc.get_current_vllm_config_or_none = lambda: holder
    vd.get_tensor_model_parallel_world_size = lambda: 1
    vd.get_tensor_model_parallel_rank = lambda: 0
    vq.register_quantization_config = lambda name: (lambda cls: cls)
    vqb.QuantizationConfig = _QuantizationConfig
    vp.PerTensorScaleParameter = _PerTensorScaleParameter
    vmu.set_weight_attrs = _set_weight_attrs
    vmath.cdiv = lambda a, b: -(-a // b)  # main's MX linear methods size scales with it
    vfm.FusedMoeWeightScaleSupported = enum.Enum(
        "FusedMoeWeightScaleSupported", {"TENSOR": "tensor", "CHANNEL": "channel", "GROUP": "group",
                                         "BLOCK": "block"})
    ac.get_ascend_config = lambda: NS(eplb_config=NS(dynamic_eplb=False), multistream_overlap_gate=False,
                                      enable_fused_mc2=0)
    vu.vllm_version_is = lambda v: v == "0.23.0"
    vu.COMPRESSED_TENSORS_METHOD = "compressed-tensors"
    vu.ASCEND_QUANTIZATION_METHOD = "ascend"

    def _no_mc2():  # the MoE schemes catch exactly this off-device
        raise AttributeError("no mc2 group off-device")

    ps.get_mc2_group = _no_mc2
    return holder


@contextlib.contextmanager
def _vllm_ascend(va_src: Path, hf_config: dict, dtype: torch.dtype):
    """Import vllm-ascend's quantization package from ``va_src`` on stubs; undo everything after."""
    # vllm and torch_npu are always stubs (a real or stand-in one already imported is set aside and put
    # back afterwards); transformers is used as is when the session already imported it.
    tops = ("vllm", "torch_npu") + (() if "transformers" in sys.modules else ("transformers",))

    def owned(name: str) -> bool:
        return name.split(".")[0] in tops or name.split(".")[0] == "vllm_ascend"

    saved = {k: v for k, v in sys.modules.items() if owned(k)}
    for k in saved:
        del sys.modules[k]
    finder = _StubFinder(tops)
    sys.meta_path.insert(0, finder)
    default_dtype = torch.get_default_dtype()
    try:
        pkg = types.ModuleType("vllm_ascend")
        pkg.__path__ = [str(Path(va_src) / "vllm_ascend")]
        sys.modules["vllm_ascend"] = pkg

        holder = _patch_stubs(hf_config, dtype)

        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
        from vllm.model_executor.layers.fused_moe import FusedMoE
        from vllm.model_executor.layers.linear import LinearBase, RowParallelLinear
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            VocabParallelEmbedding,
        )
        from vllm_ascend.quantization import method_adapters, modelslim_config
        from vllm_ascend.quantization.methods import kv_c8

        torch.set_default_dtype(dtype)
        moe = getattr(modelslim_config, "_is_fused_moe_layer", None)  # main: isinstance of these
        bases = tuple(getattr(modelslim_config, n) for n in ("MoERunner", "RoutedExperts")
                      if moe is not None and isinstance(getattr(modelslim_config, n, None), type))
        yield _Env(modelslim_config, method_adapters, kv_c8, LinearBase, RowParallelLinear, FusedMoE,
                   AttentionLayerBase, VocabParallelEmbedding, holder, bases)
    finally:
        torch.set_default_dtype(default_dtype)
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(finder)
        for k in [k for k in sys.modules if owned(k)]:
            del sys.modules[k]
        sys.modules.update(saved)


@contextlib.contextmanager
def _track_empty():
    """Tensors made by ``torch.empty`` while creating weights: parameters the checkpoint must fill
    (zeros / ones a scheme makes itself are defaults, not requirements)."""
    made: list[torch.Tensor] = []
    orig = torch.empty

    def empty(*a, **k):
        t = orig(*a, **k)
        made.append(t)
        return t

    torch.empty = empty
    try:
        yield made
    finally:
        torch.empty = orig


def _is_empty_made(t: torch.Tensor, made: list[torch.Tensor]) -> bool:
    return t.numel() > 0 and any(m.numel() > 0 and m.data_ptr() == t.data_ptr() for m in made)
