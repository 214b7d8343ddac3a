"""The msModelSlim side of bench/msmodelslim_peer.py: runs in the msModelSlim venv (stdlib, torch and
msmodelslim imports only), never in cvt's, and never under `make test`.

    VENV/bin/python bench/msmodelslim_inner.py --versions        # the three versions, as JSON
    VENV/bin/python bench/msmodelslim_inner.py quant ARGS...      # `msmodelslim quant ARGS`, patched

`quant` patches msModelSlim's DeepSeekV3ModelAdapter for the bench's fixture (workarounds b, c and
e of bench/msmodelslim_peer.py's docstring), then calls msModelSlim's own CLI `main()`; no file of
the package is edited, and processors, quantizers and the AscendV1 saver are msModelSlim's.
"""

from __future__ import annotations

import json
import sys


def _patch_deepseek_v3_adapter() -> None:
    """Workarounds b and c of bench/msmodelslim_peer.py's docstring, applied to msModelSlim's
    DeepSeekV3ModelAdapter."""
    import torch
    from torch import nn
    from msmodelslim.core.base.protocol import ProcessRequest
    from msmodelslim.model.common.layer_wise_forward import TransformersForwardBreak
    from msmodelslim.model.deepseek_v3 import model_adapter as ma
    from msmodelslim.utils.exception import InvalidModelError
    from msmodelslim.utils.security.model import SafeGenerator

    adapter = ma.DeepSeekV3ModelAdapter

    def init_model(self, device=None):
        with ma.default_dtype(torch.bfloat16):
            model = SafeGenerator.get_model_from_pretrained(
                model_path=str(self.model_path), config=self.config, trust_remote_code=self.trust_remote_code,
                device_map="cpu", torch_dtype="auto", attn_implementation="eager")
        for name, mod in model.named_modules():
            experts = getattr(mod, "experts", None)
            if experts is not None and not isinstance(experts, nn.ModuleList):
                raise SystemExit(
                    f"BLOCKER: {name}.experts is {type(experts).__name__}, not a ModuleList of nn.Linear MLPs: "
                    "this transformers fuses DeepSeek-V3 experts into 3-D parameters, which msModelSlim's "
                    "linear_quant cannot quantize. Use transformers 4.51-4.57 in the msModelSlim venv.")
            if "e_score_correction_bias" in getattr(mod, "_buffers", {}):
                bias = mod._buffers.pop("e_score_correction_bias")
                mod.e_score_correction_bias = nn.Parameter(bias.float(), requires_grad=False)
        model.eval()
        return model

    def generate_decoder_layer(self, model):
        for idx, layer in enumerate(model.model.layers):
            yield f"model.layers.{idx}", layer

    def generate_model_forward(self, model, inputs):
        first = None

        def break_hook(module, args, kwargs):
            nonlocal first
            first = (args, kwargs)
            raise TransformersForwardBreak()

        handle = model.model.layers[0].register_forward_pre_hook(break_hook, with_kwargs=True, prepend=True)
        try:
            if isinstance(inputs, (list, tuple)):
                model(inputs[0])
            elif isinstance(inputs, dict):
                model(**inputs)
            else:
                model(inputs)
        except TransformersForwardBreak:
            pass
        finally:
            handle.remove()
        if first is None:
            raise InvalidModelError("Can't get first block input.", action="Please check the model and input")
        current = first
        for name, block in self.generate_decoder_layer(model):
            args, kwargs = current
            outputs = yield ProcessRequest(name, block, args, kwargs)
            hidden = outputs[0] if isinstance(outputs, tuple) else outputs
            current = ((hidden,), current[1])

    original_subgraphs = adapter.get_adapter_config_for_subgraph

    def get_adapter_config_for_subgraph(self):
        self.config.num_hidden_layers += 1          # the original skips its last layer (MTP)
        try:
            return original_subgraphs(self)
        finally:
            self.config.num_hidden_layers -= 1

    adapter.init_model = init_model
    adapter.generate_decoder_layer = generate_decoder_layer
    adapter.generate_model_forward = generate_model_forward
    adapter.get_adapter_config_for_subgraph = get_adapter_config_for_subgraph


def _patch_quarot_maps() -> None:
    """Workaround e: msModelSlim's DeepSeek-V3 QuaRot maps (model/deepseek_v3/quarot.py get_ln_fuse_map /
    get_rotate_map) take the adapter's last layer for the MTP layer (its init_model has added one:
    num_hidden_layers + 1) and name its enorm / hnorm / eh_proj / embed_tokens / shared_head. The fixture
    has no MTP weights and init_model here adds no layer, so the maps are built for num_hidden_layers + 1
    layers and every entry of that absent layer dropped: each real layer gets exactly the rotations and
    norm folds msModelSlim gives it in the 671B release."""
    from msmodelslim.model.deepseek_v3 import model_adapter as ma

    adapter = ma.DeepSeekV3ModelAdapter

    def absent(n_layers):
        mtp = f"model.layers.{n_layers}."
        return lambda names: any(str(x).startswith(mtp) for x in (names if isinstance(names, (list, tuple))
                                                                  else [names]))

    def get_ln_fuse_map(self):
        n = self.config.num_hidden_layers
        drop = absent(n)
        fuse = ma.get_ln_fuse_map(self.config, num_hidden_layers=n + 1)
        return {}, {k: v for k, v in fuse.items() if not drop(k) and not drop(v)}

    def get_rotate_map(self, block_size):
        n = self.config.num_hidden_layers
        drop = absent(n)
        pre_run, rot_pairs, _ = ma.get_rotate_map(self.config, block_size, num_hidden_layers=n + 1)
        for pair in rot_pairs.values():
            for side in (pair.left_rot, pair.right_rot):
                for name in [k for k in side if drop(k)]:
                    del side[name]
        return [pre_run], list(rot_pairs.values())

    adapter.get_ln_fuse_map = get_ln_fuse_map
    adapter.get_rotate_map = get_rotate_map


def main(argv: list[str]) -> None:
    if argv and argv[0] == "--versions":
        from importlib.metadata import version
        print(json.dumps({p: version(p) for p in ("msmodelslim", "transformers", "torch")}))
        return
    _patch_deepseek_v3_adapter()
    _patch_quarot_maps()
    from msmodelslim.cli.__main__ import main as msmodelslim_main
    sys.argv = ["msmodelslim", *argv]
    msmodelslim_main()


if __name__ == "__main__":
    main(sys.argv[1:])
