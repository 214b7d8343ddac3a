"""The int8 KV cache (C8): quantization math, the convention's names / shapes, calibration, the
int8 caches of the MLA (trained DeepSeek-V3 fixture) and GQA (tiny random Qwen3) models, and
the compressed-tensors conversion."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cvt.testing.checkpoints import tiny_qwen3_config, write_bf16_checkpoint
from cvt.errors import CvtError
from cvt.runtime import kv_cache as K
from cvt.qtensor import kv_tensors
from cvt.runtime.generate import generate
from cvt.runtime.loader import load_model
from cvt.runtime.models.deepseek_v3 import Int8MLACache, MLACache
from cvt.runtime.models.qwen3 import Int8KVCache, KVCache

# C-header-like text (the fixture was trained on UAPI headers): calibration and a held-out part
CALIB_TEXT = r"""/* SPDX-License-Identifier: GPL-2.0 WITH Linux-syscall-note */
#ifndef _UAPI_LINUX_DEMO_H
#define _UAPI_LINUX_DEMO_H

#include <linux/types.h>
#include <linux/ioctl.h>

#define DEMO_MAX_QUEUES		16
#define DEMO_FLAG_ENABLED	(1U << 0)
#define DEMO_FLAG_POLLED	(1U << 1)
#define DEMO_FLAG_SHARED	(1U << 2)

/**
 * struct demo_queue_info - describes one hardware queue
 * @index: queue number, 0 based
 * @depth: number of descriptors in the ring
 * @flags: DEMO_FLAG_* bits
 * @reserved: must be zero
 */
struct demo_queue_info {
	__u32 index;
	__u32 depth;
	__u32 flags;
	__u32 reserved;
};

struct demo_stats {
	__u64 rx_packets;
	__u64 tx_packets;
	__u64 rx_bytes;
	__u64 tx_bytes;
	__u64 errors;
	__u64 dropped;
};

enum demo_state {
	DEMO_STATE_DOWN = 0,
	DEMO_STATE_UP,
	DEMO_STATE_RESET,
	__DEMO_STATE_MAX,
};
#define DEMO_STATE_MAX (__DEMO_STATE_MAX - 1)

#define DEMO_IOC_MAGIC		'd'
#define DEMO_IOC_GET_INFO	_IOR(DEMO_IOC_MAGIC, 1, struct demo_queue_info)
#define DEMO_IOC_SET_INFO	_IOW(DEMO_IOC_MAGIC, 2, struct demo_queue_info)
#define DEMO_IOC_GET_STATS	_IOR(DEMO_IOC_MAGIC, 3, struct demo_stats)
#define DEMO_IOC_RESET		_IO(DEMO_IOC_MAGIC, 4)

struct demo_event {
	__u16 type;
	__u16 code;
	__s32 value;
	__u64 timestamp;
};

#endif /* _UAPI_LINUX_DEMO_H */
/* SPDX-License-Identifier: GPL-2.0 WITH Linux-syscall-note */
#ifndef _LINUX_FAKEBUS_H
#define _LINUX_FAKEBUS_H

#include <linux/types.h>

#define FAKEBUS_NAME_LEN	32
#define FAKEBUS_VERSION		0x0102

struct fakebus_device_id {
	__u16 vendor;
	__u16 device;
	__u32 class;
	char name[FAKEBUS_NAME_LEN];
};

struct fakebus_msg {
	__u8 addr;
	__u8 len;
	__u16 flags;
	__u8 *buf;
};

#define FAKEBUS_M_RD		0x0001
#define FAKEBUS_M_TEN		0x0010
#define FAKEBUS_M_NOSTART	0x4000

enum fakebus_speed {
	FAKEBUS_SPEED_LOW,
	FAKEBUS_SPEED_FULL,
	FAKEBUS_SPEED_HIGH,
};

#endif /* _LINUX_FAKEBUS_H */
"""
HELD_OUT_TEXT = r"""/* SPDX-License-Identifier: GPL-2.0 WITH Linux-syscall-note */
#ifndef _UAPI_LINUX_WIDGET_H
#define _UAPI_LINUX_WIDGET_H

#include <linux/types.h>

struct widget_config {
	__u32 mode;
	__u32 rate;
	__u64 mask;
};

#define WIDGET_IOC_MAGIC	'w'
#define WIDGET_IOC_CONFIG	_IOW(WIDGET_IOC_MAGIC, 1, struct widget_config)
"""


def byte_tokens(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode()), dtype=torch.long)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


# Incremental decode vs the full forward. The two compute the cached K / V with matmuls of other
# shapes (1 token vs the whole sequence), whose sums may differ in the last bit on some CPUs (SIMD
# kernels differ); a value on a rounding boundary of the int8 cache then lands one step away,
# and that step moves every later logit by more than float noise. So the check is split:
# (1) the int8 contents written incrementally are the full forward's, up to such one-step flips
#     in a small share of entries (a wrong position, rope offset or scale moves most entries, by
#     many steps); (2) on identical cache contents - the incremental run's own, replayed - the
#     full forward gives the incremental logits to float rounding (a wrong query position, mask
#     or read-back fails this).
INT8_FIELDS = {Int8KVCache: ("k", "v"), Int8MLACache: ("kv", "pe")}


def assert_same_int8_contents(got: list, want: list, max_share: float = 0.01) -> None:
    """Caches `got` hold `want`'s int8 entries, each within one step, at most `max_share` differing
    (float parts of a cache - MLA's rope key under FAKQuant - are checked by the logits)."""
    differ = total = 0
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        for f in INT8_FIELDS[type(w)]:
            if getattr(w, f).dtype != torch.int8:
                continue
            d = getattr(g, f).int() - getattr(w, f).int()
            assert d.abs().max() <= 1, (i, f, d.abs().max())
            differ, total = differ + int(d.count_nonzero()), total + d.numel()
    assert differ <= max_share * total, (differ, total)


def replaying(cache: list) -> list:
    """The int8 caches `cache`, their writes turned into no-ops: a forward through them attends to
    exactly the int8 entries stored now (and the full forward's mask hides the later positions)."""
    for c in cache:
        if isinstance(c, Int8MLACache):
            c.write = lambda *_: None
        else:
            def update(k, v, start_pos, c=c):
                end = start_pos + k.shape[2]
                return (K.dequantize(c.k[:k.shape[0], :, :end], c.k_scale, k.dtype),
                        K.dequantize(c.v[:v.shape[0], :, :end], c.v_scale, v.dtype))
            c.update = update
    return cache


# ------------------------------------------------------------------------------ math
def test_quantize_dequantize_exact_formula():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 16, generator=g) * 4
    amax = x.abs().amax(dim=(0, 1))
    scale = K.scales_from_amax(amax)
    torch.testing.assert_close(scale, (amax / 127).clamp_min(2.0 ** -14), rtol=0, atol=0)
    x[0, 0, 0] = 1e4                                       # clamps to 127
    x[0, 0, 1] = -1e4                                      # clamps to -128
    x[0, 0, 2] = 2.5 * scale[2]                            # round half to even -> 2
    q = K.quantize(x, scale)
    assert q.dtype == torch.int8
    expected = torch.round(x / scale).clamp(-128, 127).to(torch.int8)
    assert torch.equal(q, expected)
    assert q[0, 0, 0] == 127 and q[0, 0, 1] == -128 and q[0, 0, 2] == 2
    within = x.abs() <= amax                               # calibrated range never leaves +-127
    assert q[within].abs().max() <= 127
    for dtype in (torch.float32, torch.bfloat16):
        d = K.dequantize(q, scale, dtype)
        assert d.dtype == dtype and torch.equal(d, (q.float() * scale).to(dtype))
    xb = x.bfloat16()
    assert torch.equal(K.fake_quantize(xb, scale), (K.quantize(xb, scale).float() * scale).bfloat16())
    # dead channel: finite floor scale, zeros stay zero
    assert K.scales_from_amax(torch.zeros(2)).tolist() == [2.0 ** -14] * 2


def test_int8_caches_store_quantized_and_read_dequantized():
    g = torch.Generator().manual_seed(1)
    ks, ps = torch.rand(1, generator=g) + 0.01, torch.rand(4, generator=g) + 0.01
    kv, pe = torch.randn(2, 3, 8, generator=g), torch.randn(2, 3, 4, generator=g)
    # FAKQuant (the Ascend stacks): the latent int8 with one scale, the rope key float
    c = Int8MLACache(2, 6, 8, 4, ks, dtype=torch.float32)
    c.write(1, kv, pe)
    assert c.kv.dtype == torch.int8 and c.pe.dtype == torch.float32 and c.quant == "int8"
    assert torch.equal(c.kv[:, 1:4], K.quantize(kv, ks)) and torch.equal(c.pe[:, 1:4], pe)
    rkv, rpe = c.read(2, 4)
    assert torch.equal(rkv[:, 1:4], K.fake_quantize(kv, ks)) and torch.equal(rpe[:, 1:4], pe)
    assert rkv.dtype == torch.float32 and not rkv[:, 0].any()
    assert c.nbytes == 2 * 6 * 8 + 2 * 6 * 4 * 4
    with pytest.raises(CvtError, match="max_len 6"):
        c.write(4, kv, pe)
    c = Int8MLACache(2, 6, 8, 4, ks, ps, dtype=torch.float32)  # a rope-key scale quantizes it too
    c.write(0, kv, pe)
    assert c.pe.dtype == torch.int8 and torch.equal(c.read(2, 3)[1], K.fake_quantize(pe, ps))

    kvh, d = 2, 3
    k_s, v_s = torch.rand(kvh * d, generator=g) + 0.01, torch.rand(kvh * d, generator=g) + 0.01
    c = Int8KVCache(1, kvh, 5, d, k_s, v_s)
    k, v = torch.randn(1, kvh, 2, d, generator=g), torch.randn(1, kvh, 2, d, generator=g)
    rk, rv = c.update(k, v, 0)
    # channel = head * head_dim + d
    assert torch.equal(c.k[:, :, :2], K.quantize(k, k_s.view(kvh, 1, d))) and c.k.dtype == torch.int8
    assert torch.equal(rk, K.fake_quantize(k, k_s.view(kvh, 1, d)))
    assert torch.equal(rv, K.fake_quantize(v, v_s.view(kvh, 1, d)))
    assert c.nbytes == 2 * kvh * 5 * d


# ------------------------------------------------------------------------ convention
def test_convention_names_and_shapes_match_the_models(trained_fixture, tmp_path):
    dsv3 = load_model(trained_fixture, dtype=torch.float32).model
    specs = K.kv_cache_tensor_specs(dsv3)
    a = dsv3.args
    # FAKQuant, as vllm-ascend declares it (quantization/methods/kv_c8.py AscendFAQuantAttentionMethod:
    # fa_q.scale [num_heads, 1], fa_k / fa_v.scale [num_kv_heads = 1, 1], offsets int8) and
    # msModelSlim saves it (save/ascendv1.py _save_activation_per_head)
    assert len(specs) == 6 * a.num_hidden_layers
    for s in specs:
        assert s.name == f"model.layers.{s.layer}.self_attn.fa_{s.role}.{s.kind}" and K.is_kv_cache_tensor(s.name)
        assert s.shape == ((a.num_attention_heads if s.role == "q" else 1), 1)
        assert s.dtype == (torch.float32 if s.kind == "scale" else torch.int8)
    # same answer from config.json alone (what a writer has)
    import json
    cfg = json.loads((trained_fixture / "config.json").read_text())
    assert K.kv_cache_tensor_names(cfg) == K.kv_cache_tensor_names(dsv3)
    assert K.latent_cache(cfg) and kv_tensors.KV_CONVENTION["version"] == 2

    qcfg = tiny_qwen3_config(moe=False)
    qwen = load_model(write_bf16_checkpoint(tmp_path / "q", qcfg), dtype=torch.float32).model
    names = K.kv_cache_tensor_names(qwen)
    for i in range(qcfg["num_hidden_layers"]):
        attn = qwen.model.layers[i].self_attn
        for proj in ("k_proj", "v_proj"):
            for kind in ("scale", "offset"):
                assert names[f"model.layers.{i}.self_attn.{proj}.kv_cache_{kind}"] == \
                    (getattr(attn, proj).weight.shape[0],)
    assert len(names) == 4 * qcfg["num_hidden_layers"] and not K.latent_cache(qcfg)
    assert K.is_kv_cache_tensor("model.layers.3.self_attn.k_scale")
    assert not K.is_kv_cache_tensor("model.layers.3.self_attn.k_proj.weight_scale")


# ---------------------------------------------------------------------------- MLA
@pytest.fixture(scope="module")
def dsv3(trained_fixture):
    return load_model(trained_fixture, dtype=torch.float32).model


@pytest.mark.slow
def test_mla_int8_cache_on_trained_fixture(dsv3):
    model = dsv3
    test = byte_tokens(HELD_OUT_TEXT)[None]
    prompt = list(b"#include <linux/")
    ref = model(test)
    ref_gen = generate(model, [prompt], 16).outputs[0]
    short = byte_tokens(CALIB_TEXT[:256])
    short_scales = K.calibrate_kv_scales(model, short)
    with pytest.raises(CvtError, match="int8 KV cache needs calibrated"):
        model.new_cache(1, 8, quant="int8")

    scales = K.calibrate_kv_scales(model, [byte_tokens(CALIB_TEXT)])
    assert set(scales) == set(K.kv_cache_tensor_names(model))
    # against the statistics taken independently: the latent after kv_a_layernorm (one scale per
    # layer, K and V alike) and the absorbed query q_nope @ W_UK per head (msModelSlim's FA3 observer)
    lat, qab = {}, {}
    hooks = []
    for i, layer in enumerate(model.model.layers[:model.args.num_hidden_layers]):
        at = layer.self_attn
        hooks.append(at.kv_a_layernorm.register_forward_hook(
            lambda m, i_, o, i=i: lat.__setitem__(i, o.detach().abs().amax())))

        def q_hook(m, i_, o, i=i, at=at):
            b_, s_, _ = o.shape
            q_nope = o.view(b_, s_, at.n_heads, -1)[..., :at.nope]
            w = at.kv_b_proj.weight.float().view(at.n_heads, -1, at.kv_lora_rank)[:, :at.nope]
            qab[i] = torch.einsum("bshd,hdc->bshc", q_nope, w).abs().amax(dim=(0, 1, 3))
        hooks.append((at.q_b_proj if at.q_lora else at.q_proj).register_forward_hook(q_hook))
    try:
        model(byte_tokens(CALIB_TEXT)[None])
    finally:
        for h in hooks:
            h.remove()
    for i in lat:
        p = f"model.layers.{i}.self_attn."
        assert torch.equal(scales[p + "fa_k.scale"], (lat[i] / 127).reshape(1, 1))
        assert torch.equal(scales[p + "fa_v.scale"], scales[p + "fa_k.scale"])
        torch.testing.assert_close(scales[p + "fa_q.scale"], (qab[i] / 127).reshape(-1, 1), rtol=1e-6, atol=0)
        assert scales[p + "fa_q.offset"].dtype == torch.int8 and not scales[p + "fa_q.offset"].any()
    assert torch.equal(model(test), ref)                    # calibration leaves the model as it was
    K.attach_kv_cache_scales(model, scales)
    try:
        assert K.has_kv_cache_scales(model)
        q = model(test)
        assert cosine(q, ref) > 0.999
        assert not torch.equal(q, ref)                      # C8 is really on in the full forward
        assert generate(model, [prompt], 16).outputs[0] == ref_gen

        cache = model.new_cache(1, test.shape[1])           # auto -> int8
        fcache = model.new_cache(1, test.shape[1], quant=None)
        assert all(isinstance(c, Int8MLACache) and c.kv.dtype == torch.int8 and c.pe.dtype == torch.float32
                   for c in cache)
        assert type(fcache[0]) is MLACache and fcache[0].kv.dtype == torch.float32
        assert cache[0].nbytes == test.shape[1] * (model.args.kv_lora_rank + 4 * model.args.qk_rope_head_dim)

        # prefill through the int8 cache equals the (quantized) full forward: the same matmuls
        s = test.shape[1]
        full = model.new_cache(1, s)
        torch.testing.assert_close(model(test, 0, full), q, rtol=0, atol=0)
        # decode stays on it: the entries within one-step flips, the logits on the same entries
        # (see assert_same_int8_contents; the MoE routing margins on this text, >= 7e-5, are far
        # above float noise, so routing does not flip between the two)
        steps = [model(test[:, :s - 24], 0, cache)] + [model(test[:, p:p + 1], p, cache) for p in range(s - 24, s)]
        inc = torch.cat(steps, dim=1)
        assert_same_int8_contents(cache, full)
        torch.testing.assert_close(model(test, 0, replaying(cache)), inc, rtol=1e-5,
                                   atol=1e-5 * inc.abs().max().item())
        # the float cache on the same model is the float model
        fl = model(test, 0, fcache)
        torch.testing.assert_close(fl, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())

        # round trip of the attached scales; re-calibrating a C8 model gives the float statistics
        got = K.get_kv_cache_scales(model)
        assert set(got) == set(scales) and all(torch.equal(got[n], scales[n]) for n in scales)
        again = K.calibrate_kv_scales(model, short)
        assert all(torch.equal(again[n], short_scales[n]) for n in scales)
        assert K.has_kv_cache_scales(model)
    finally:
        K.detach_kv_cache_scales(model)
    assert torch.equal(model(test), ref)


# ---------------------------------------------------------------------------- GQA
@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = write_bf16_checkpoint(tmp_path_factory.mktemp("qwen3") / "ckpt", tiny_qwen3_config(moe=False))
    return load_model(path, dtype=torch.float32).model


@pytest.mark.slow
def test_gqa_int8_cache_on_tiny_qwen3(qwen3):
    model = qwen3
    g = torch.Generator().manual_seed(0)
    calib = torch.randint(0, 256, (4, 128), generator=g)
    test = torch.randint(0, 256, (2, 64), generator=g)
    prompt = [list(range(40, 50))]
    ref = model(test)
    ref_gen = generate(model, prompt, 16).outputs
    with pytest.raises(CvtError, match="int8 KV cache needs calibrated"):
        model.new_cache(1, 8, quant="int8")
    with pytest.raises(CvtError, match="needs calibrated fp8 KV-cache scales and this model has none"):
        model.new_cache(1, 8, quant="fp8")
    with pytest.raises(CvtError, match="not supported"):
        model.new_cache(1, 8, quant="int4")

    scales = K.calibrate_kv_scales(model, calib)
    K.attach_kv_cache_scales(model, scales)
    try:
        q = model(test)
        assert cosine(q, ref) > 0.999
        assert generate(model, prompt, 16).outputs == ref_gen
        cache = model.new_cache(2, 64)
        fcache = model.new_cache(2, 64, quant=None)
        assert all(isinstance(c, Int8KVCache) and c.k.dtype == c.v.dtype == torch.int8 for c in cache)
        assert type(fcache[0]) is KVCache
        a = model.args
        assert cache[0].nbytes == 2 * 2 * a.kv_heads * 64 * a.dim_head == fcache[0].nbytes // 4
        full = model.new_cache(2, 64)
        torch.testing.assert_close(model(test, 0, full), q, rtol=0, atol=0)     # same matmuls
        # incremental decode: see assert_same_int8_contents
        steps = [model(test[:, :30], 0, cache)] + [model(test[:, p:p + 1], p, cache) for p in range(30, 64)]
        inc = torch.cat(steps, dim=1)
        assert_same_int8_contents(cache, full)
        torch.testing.assert_close(model(test, 0, replaying(cache)), inc, rtol=1e-5,
                                   atol=1e-5 * inc.abs().max().item())
    finally:
        K.detach_kv_cache_scales(model)


def test_attach_refuses_bad_sets(qwen3):
    model = qwen3
    good = K.calibrate_kv_scales(model, torch.randint(0, 256, (1, 32)))
    name = "model.layers.0.self_attn.k_proj.kv_cache_scale"
    with pytest.raises(CvtError, match="missing"):
        K.attach_kv_cache_scales(model, {n: t for n, t in good.items() if n != name})
    with pytest.raises(CvtError, match="shape"):
        K.attach_kv_cache_scales(model, {**good, name: good[name][:-1]})
    off = name.replace("scale", "offset")
    with pytest.raises(CvtError, match="symmetric"):
        K.attach_kv_cache_scales(model, {**good, off: torch.ones_like(good[off])})
    with pytest.raises(CvtError, match="no place"):
        K.attach_kv_cache_scales(model, {**good, "model.layers.9.self_attn.k_proj.kv_cache_scale": good[name]})
    with pytest.raises(CvtError, match="non-positive"):
        K.attach_kv_cache_scales(model, {**good, name: torch.zeros_like(good[name])})
    with pytest.raises(CvtError, match="no calibration tokens|no tokens"):
        K.calibrate_kv_scales(model, torch.zeros(1, 0, dtype=torch.long))
    assert not K.has_kv_cache_scales(model)
    # offsets are optional (compressed-tensors has none)
    K.attach_kv_cache_scales(model, {n: t for n, t in good.items() if n.endswith("scale")})
    assert K.has_kv_cache_scales(model)
    K.detach_kv_cache_scales(model)


# ------------------------------------------------------------------- compressed-tensors
def test_compressed_tensors_conversion(qwen3):
    model, a = qwen3, qwen3.args
    scales = K.calibrate_kv_scales(model, torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(3)))
    per_tensor = K.to_compressed_tensors(scales, model, "tensor")
    per_head = K.to_compressed_tensors(scales, model, "attn_head")
    for i in range(a.num_hidden_layers):
        for kv, proj in (("k", "k_proj"), ("v", "v_proj")):
            ch = scales[f"model.layers.{i}.self_attn.{proj}.kv_cache_scale"]
            t = per_tensor[f"model.layers.{i}.self_attn.{kv}_scale"]
            h = per_head[f"model.layers.{i}.self_attn.{kv}_scale"]
            assert t.shape == (1,) and t.item() == ch.max().item()
            assert h.shape == (a.kv_heads, 1, 1)
            assert torch.equal(h.flatten(), ch.view(a.kv_heads, a.dim_head).amax(1))
            assert (t >= ch).all() and (h.view(-1, 1) >= ch.view(a.kv_heads, -1)).all()   # never clips
    # the way back is an exact broadcast, and a model loads either set
    back = K.from_compressed_tensors(per_head, model)
    name = "model.layers.1.self_attn.v_proj.kv_cache_scale"
    assert torch.equal(back[name], per_head["model.layers.1.self_attn.v_scale"].view(-1, 1)
                       .expand(a.kv_heads, a.dim_head).reshape(-1))
    K.attach_kv_cache_scales(model, per_tensor)
    try:
        cache = model.new_cache(1, 4)
        k0 = per_tensor["model.layers.0.self_attn.k_scale"]
        assert torch.equal(cache[0].k_scale, k0.expand(cache[0].k_scale.shape))
    finally:
        K.detach_kv_cache_scales(model)
    with pytest.raises(CvtError, match="mix"):
        K.attach_kv_cache_scales(model, {**scales, **per_tensor})
    with pytest.raises(CvtError, match="asymmetric"):
        K.from_compressed_tensors({"model.layers.0.self_attn.k_zero_point": torch.ones(1)}, model)
    assert K.compressed_tensors_kv_cache_scheme("tensor") == {
        "num_bits": 8, "type": "int", "strategy": "tensor", "symmetric": True, "dynamic": False}
    ct = pytest.importorskip("compressed_tensors.quantization")
    args = ct.QuantizationArgs(**K.compressed_tensors_kv_cache_scheme("attn_head"))
    assert args.strategy == ct.QuantizationStrategy.ATTN_HEAD and args.num_bits == 8


@pytest.mark.slow
def test_compressed_tensors_conversion_mla(dsv3):
    scales = K.calibrate_kv_scales(dsv3, byte_tokens(CALIB_TEXT[:512]))
    ct = K.to_compressed_tensors(scales, dsv3)
    latent = scales["model.layers.2.self_attn.fa_k.scale"]
    k = ct["model.layers.2.self_attn.k_scale"]
    assert k.shape == (1,) and k.item() == latent.item()  # the one scale of the cached latent
    assert torch.equal(ct["model.layers.2.self_attn.v_scale"], k)
    with pytest.raises(CvtError, match="attention heads"):
        K.to_compressed_tensors(scales, dsv3, "attn_head")
    back = K.from_compressed_tensors(ct, dsv3)
    assert set(back) == {f"model.layers.{i}.self_attn.fa_k.scale" for i in range(dsv3.args.num_hidden_layers)}
    assert torch.equal(back["model.layers.2.self_attn.fa_k.scale"], latent)


# ------------------------------------------------------------------------- FP8 (vLLM)
@pytest.mark.parametrize("family", ["gqa", pytest.param("mla", marks=pytest.mark.slow)])
def test_fp8_cache_matches_the_float_cache(family, qwen3, dsv3):
    """compressed-tensors w8a8c8: vLLM's FP8 (e4m3) cache with per-tensor k_scale / v_scale
    (amax / 448). cvt's runtime runs the same cache: incremental decode through it and the full
    forward quantize the same tensors; against the float cache the logits move by e4m3 rounding
    only (3 mantissa bits: relative step 2**-4 per element, averaging out in the attention)."""
    model = qwen3 if family == "gqa" else dsv3
    test = byte_tokens(HELD_OUT_TEXT)[None] if family == "mla" else torch.randint(0, 256, (1, 48),
                                                                                  generator=torch.Generator().manual_seed(2))
    ref = model(test)
    scales = K.calibrate_kv_scales(model, test, codec="fp8")
    n = model.args.num_hidden_layers
    assert set(scales) == {f"model.layers.{i}.self_attn.{kv}_scale" for i in range(n) for kv in "kv"}
    assert all(t.shape == (1,) and t.dtype == torch.float32 for t in scales.values())
    K.attach_kv_cache_scales(model, scales, codec="fp8")
    try:
        assert K.kv_codec(model) == "fp8"
        cache = model.new_cache(1, test.shape[1])
        assert all(c.quant == "fp8" for c in cache)
        field = "kv" if family == "mla" else "k"
        assert getattr(cache[0], field).dtype == torch.float8_e4m3fn
        q = model(test, 0, cache)  # prefill through the fp8 cache = the full forward: the same matmuls
        torch.testing.assert_close(model(test), q, rtol=0, atol=0)
        # e4m3 keeps 3 mantissa bits (relative step up to 2**-4), per tensor: measured on the
        # trained fixture cosine 0.9993, top-1 97.5% (int8 FAKQuant there: 0.99998, 99.4%)
        assert cosine(q, ref) > 0.995 and not torch.equal(q, ref)
        if family == "mla":  # trained weights: top-1 means something (the random GQA model's are near ties)
            assert (q.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
        got = K.get_kv_cache_scales(model)
        assert all(torch.equal(got[k], scales[k]) for k in scales)
    finally:
        K.detach_kv_cache_scales(model)
    if family == "gqa":  # MLA: Ascend names with fp8 are FAKQuant's Ascend 950 cache (test_ascend_fp8_fakquant_cache)
        with pytest.raises(CvtError, match="Ascend GQA KV-cache scales .* are int8"):
            K.attach_kv_cache_scales(model, K.calibrate_kv_scales(model, test), codec="fp8")


@pytest.mark.slow
def test_ascend_fp8_fakquant_cache(dsv3):
    """Ascend 950 FAKQuant (vllm-ascend attention/mla_v1.py: the latent cached float8_e4m3fn on A5,
    ``c_kv_scale = 1 / fa_k.scale`` in npu_kv_rmsnorm_rope_cache, read back times ``fak_descale_float``;
    k_pe kept in the compute dtype): the Ascend names with fp8 scales (amax / 448); the latent is
    stored e4m3, the rope key float, and prefill through the cache equals the full forward."""
    model = dsv3
    test = byte_tokens(HELD_OUT_TEXT)[None]
    ref = model(test)
    scales = K.calibrate_kv_scales(model, test)
    fp8 = {n: (t * K.SCALE_DIVISOR / K.FP8_MAX).clamp_min(kv_tensors.SCALE_MIN) if n.endswith("scale") else t
           for n, t in scales.items()}
    K.attach_kv_cache_scales(model, fp8, codec="fp8")
    try:
        assert K.kv_codec(model) == "fp8"
        cache = model.new_cache(1, test.shape[1])
        assert cache[0].kv.dtype == torch.float8_e4m3fn and cache[0].pe.dtype.is_floating_point
        assert cache[0].pe.dtype not in (torch.float8_e4m3fn, torch.int8)
        q = model(test, 0, cache)
        torch.testing.assert_close(model(test), q, rtol=0, atol=0)
        assert cosine(q, ref) > 0.995
        got = K.get_kv_cache_scales(model)  # written back under the Ascend names
        assert set(got) == set(scales) and torch.equal(got["model.layers.0.self_attn.fa_k.scale"],
                                                       fp8["model.layers.0.self_attn.fa_k.scale"])
    finally:
        K.detach_kv_cache_scales(model)


def test_compressed_tensors_kv_scheme_is_one_vllm_loads():
    """The kv_cache_scheme cvt writes: compressed-tensors' own QuantizationArgs accepts it, and it
    is the combination vLLM accepts (vLLM model_executor/layers/quantization/compressed_tensors/
    compressed_tensors.py: CompressedTensorsConfig._validate_kv_cache_scheme / kv cache method:
    only ``type: float``, 8 bits, ``strategy: tensor`` are loaded; ``type: int`` fails for GQA)."""
    from cvt.qtensor.formats.compressed_tensors import kv_cache_fp8

    scheme = kv_cache_fp8()
    assert (scheme["type"], scheme["num_bits"], scheme["strategy"], scheme["dynamic"]) == ("float", 8, "tensor", False)
    ct = pytest.importorskip("compressed_tensors.quantization")
    args = ct.QuantizationArgs(**scheme)
    assert args.type == ct.QuantizationType.FLOAT and args.strategy == ct.QuantizationStrategy.TENSOR
