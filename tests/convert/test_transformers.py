"""A BF16 output loads in transformers and computes exactly what the reference dequantized weights compute.

The reference is built here, independently of cvt's kernels: the FP8 release is read with
safetensors, every `X.weight` with an `X.weight_scale_inv` is dequantized in torch as
`w.float() * scale broadcast over 128x128 blocks -> bfloat16`, everything else is copied and
the scales are dropped. Both directories are loaded with
`DeepseekV3ForCausalLM.from_pretrained` and must give bit-identical weights and logits.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from cvt.convert.fp8_to_bf16 import fp8_to_bf16  # noqa: E402

SCALE = "_scale_inv"
LAYER_RE = re.compile(r"model\.layers\.(\d+)\.")
EXPERT_RE = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
# tensor names as they appear in transformers' load reports / warnings
NAME_RE = re.compile(r"[\w.]*\.(?:weight|bias|e_score_correction_bias|gate_up_proj|down_proj)\b")


def read_dir(d: Path) -> dict[str, "torch.Tensor"]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(f, framework="pt") as sf:
            for k in sf.keys():
                assert k not in out, f"{k} stored twice in {d}"
                out[k] = sf.get_tensor(k)
    return out


def reference_dequant(src: Path, dst: Path, block: tuple[int, int]) -> dict[str, "torch.Tensor"]:
    """Dequantize the release at SRC into DST (one model.safetensors + config.json), no cvt code."""
    raw = read_dir(src)
    bn, bk = block
    ref = {}
    for name, t in raw.items():
        if name.endswith(SCALE):
            continue
        s = raw.get(name + SCALE)
        if s is None:
            ref[name] = t
            continue
        assert t.dtype == torch.float8_e4m3fn
        n, k = t.shape
        full = s.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
        ref[name] = (t.float() * full).to(torch.bfloat16)
    dst.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in ref.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return ref


def is_mtp(name: str, n_layers: int) -> bool:
    m = LAYER_RE.search(name)
    return m is not None and int(m.group(1)) >= n_layers


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def load(d: Path, n_layers: int):
    """from_pretrained D; assert no missing keys and only MTP unexpected keys, in the info and the logs."""
    logger = logging.getLogger("transformers")
    cap = _Capture()
    logger.addHandler(cap)
    try:
        model, info = transformers.DeepseekV3ForCausalLM.from_pretrained(
            str(d), dtype=torch.bfloat16, output_loading_info=True, local_files_only=True
        )
    finally:
        logger.removeHandler(cap)
    model.eval()
    assert not info["missing_keys"], f"{d}: missing keys {sorted(info['missing_keys'])}"
    assert not info.get("mismatched_keys"), f"{d}: mismatched keys {info['mismatched_keys']}"
    assert not info.get("error_msgs"), f"{d}: {info['error_msgs']}"
    unexpected = sorted(info["unexpected_keys"])
    assert unexpected, "the MTP layer should be present in the checkpoint and ignored by transformers"
    assert all(is_mtp(k, n_layers) for k in unexpected), f"{d}: non-MTP unexpected keys {unexpected}"
    for msg in cap.messages:
        low = msg.lower()
        assert "missing" not in low and "newly initialized" not in low and "mismatch" not in low, msg
        for name in NAME_RE.findall(msg):
            assert is_mtp(name, n_layers), f"{d}: load warning about non-MTP weight {name}:\n{msg}"
    return model


def expected_state(ref: dict, sd: dict, n_layers: int) -> dict[str, "torch.Tensor"]:
    """Reference tensors keyed like the loaded model's state_dict (fusing per-expert weights
    into transformers v5's [E, 2I, H] gate_up_proj and [E, H, I] down_proj when it does)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in ref.items():
        if is_mtp(name, n_layers):
            continue
        m = EXPERT_RE.match(name)
        if name in sd or m is None:
            out[name] = t
        else:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
    for prefix, by_e in experts.items():
        ids = sorted(by_e)
        assert ids == list(range(len(ids))), f"{prefix}: experts {ids}"
        out[prefix + ".gate_up_proj"] = torch.stack([torch.cat([by_e[e]["gate"], by_e[e]["up"]], 0) for e in ids])
        out[prefix + ".down_proj"] = torch.stack([by_e[e]["down"] for e in ids])
    return out


def test_bf16_output_loads_in_transformers_with_reference_logits(fp8_release_session, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    src = fp8_release_session
    cfg = json.loads((src / "config.json").read_text())
    n_layers = cfg["num_hidden_layers"]
    block = tuple(cfg["quantization_config"]["weight_block_size"])

    out = tmp_path / "bf16"
    fp8_to_bf16(src, out, quiet=True)
    ref = reference_dequant(src, tmp_path / "ref", block)

    # the files: same names, dtypes and bits as the independent reference (MTP included)
    got = read_dir(out)
    assert sorted(got) == sorted(ref)
    assert any(is_mtp(k, n_layers) for k in ref)
    for name, want in ref.items():
        assert got[name].dtype == want.dtype, name
        assert got[name].shape == want.shape, name
        assert torch.equal(got[name], want), f"{name} differs from the reference dequantization"
    assert not json.loads((out / "config.json").read_text()).get("quantization_config")

    m_out = load(out, n_layers)
    m_ref = load(tmp_path / "ref", n_layers)

    # the loaded weights: identical between the two, and equal to the reference tensors
    sd_out, sd_ref = m_out.state_dict(), m_ref.state_dict()
    assert sorted(sd_out) == sorted(sd_ref)
    for k in sd_out:
        assert sd_out[k].dtype == sd_ref[k].dtype and torch.equal(sd_out[k], sd_ref[k]), k
    want = expected_state(ref, sd_out, n_layers)
    # (state_dict, not named_parameters: e_score_correction_bias is a persistent buffer)
    assert sorted(want) == sorted(sd_out), "the loaded state_dict does not match the checkpoint's non-MTP weights"
    for k, t in want.items():
        # transformers may keep some modules in float32 whatever the checkpoint stores (5.24 does so
        # for the DeepSeek router `mlp.gate`, `_keep_in_fp32_modules`): a widening is exact, any
        # other dtype change is not
        got = sd_out[k]
        assert got.dtype == t.dtype or (got.dtype == torch.float32 and t.dtype == torch.bfloat16), \
            f"{k}: loaded as {got.dtype}, stored {t.dtype}"
        assert torch.equal(got, t.to(got.dtype)), f"{k}: loaded tensor differs from the reference"

    # the logits
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["vocab_size"], (2, 7), generator=g)
    with torch.no_grad():
        lo = m_out(input_ids=ids).logits
        lr = m_ref(input_ids=ids).logits
    assert lo.shape == (2, 7, cfg["vocab_size"])
    assert torch.isfinite(lo).all()
    assert torch.equal(lo, lr)
