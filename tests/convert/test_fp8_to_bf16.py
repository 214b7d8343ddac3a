"""`cvt fp8-to-bf16` end to end on tiny synthetic releases, with safetensors as the referee."""

from __future__ import annotations

import hashlib
import json
import re

import jsonschema
import blake3
import numpy as np
import pytest
from safetensors import safe_open

from cvt.convert.fp8_to_bf16 import fp8_to_bf16
from cvt.testing.checkpoints import release_tensors, tiny_deepseek_config, write_fp8_release, write_release
from cvt.schemas import load_schema
from cvt.tests.conftest import run_cvt
from cvt.tests.convert.fp8_reference import decode_scale, dequant


def read_all(folder):
    """name -> (dtype string, shape, raw bytes as numpy uint8) for every tensor, via safetensors."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    out = {}
    for fname in sorted(set(index["weight_map"].values())):
        # numpy cannot hold bf16/fp8: take raw bytes through the header offsets, and let the
        # safetensors library confirm that the file parses and lists the same tensors
        raw = (folder / fname).read_bytes()
        hlen = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8 : 8 + hlen])
        header.pop("__metadata__", None)
        with safe_open(folder / fname, framework="pt") as f:
            assert set(f.keys()) == set(header)
        for name, info in header.items():
            a, b = info["data_offsets"]
            out[name] = (info["dtype"], tuple(info["shape"]), np.frombuffer(raw[8 + hlen + a : 8 + hlen + b], np.uint8))
    return out, index


def reference_output(src):
    tensors, _ = read_all(src)
    out = {}
    for name, (dtype, shape, raw) in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        if dtype == "F8_E4M3":
            sdtype, _, sraw = tensors[name + "_scale_inv"]
            block = (128, 128)
            scale = decode_scale(sraw, sdtype).reshape(tensors[name + "_scale_inv"][1])
            bits = dequant(raw.reshape(shape), scale, block)
            out[name] = ("BF16", shape, bits.view(np.uint8).reshape(-1))
        else:
            out[name] = (dtype, shape, raw)
    return out


@pytest.mark.parametrize("scale_dtype", ["F32", "BF16", "F8_E8M0"])
def test_output_equals_independent_reference(tmp_path, scale_dtype):
    src = write_fp8_release(tmp_path / "src", scale_dtype=scale_dtype, seed=1)
    result = fp8_to_bf16(src, tmp_path / "out", quiet=True)
    got, index = read_all(tmp_path / "out")
    want = reference_output(src)
    assert set(got) == set(want)
    for name, (dtype, shape, raw) in want.items():
        gdtype, gshape, graw = got[name]
        assert (gdtype, gshape) == (dtype, shape), name
        assert np.array_equal(graw, raw), f"{name} differs from the reference"
    assert result.extra["dequantized"] == sum(1 for n in want if want[n][0] == "BF16" and n + "_scale_inv" in read_all(src)[0])
    assert not any(n.endswith("_scale_inv") for n in index["weight_map"])


def test_structure_of_the_output(fp8_release, tmp_path):
    dst = tmp_path / "out"
    fp8_to_bf16(fp8_release, dst, quiet=True, max_shard_size=1_000_000)
    src_tensors, src_index = read_all(fp8_release)
    out_tensors, index = read_all(dst)

    # the fixture stores at least one scale in a different shard from its weight
    wm = src_index["weight_map"]
    assert any(wm[n] != wm[n + "_scale_inv"] for n in wm if n + "_scale_inv" in wm)

    # non-FP8 tensors pass through byte-identical, F32 router bias stays F32, MTP layer kept
    for name, (dtype, shape, raw) in src_tensors.items():
        if dtype != "F8_E4M3" and not name.endswith("_scale_inv"):
            assert out_tensors[name][0] == dtype and np.array_equal(out_tensors[name][2], raw), name
    assert out_tensors["model.layers.1.mlp.gate.e_score_correction_bias"][0] == "F32"
    n_layers = json.loads((fp8_release / "config.json").read_text())["num_hidden_layers"]
    assert f"model.layers.{n_layers}.eh_proj.weight" in out_tensors
    assert out_tensors[f"model.layers.{n_layers}.eh_proj.weight"][0] == "BF16"

    # shards: bounded, HF names, {"format": "pt"}, a correct index
    files = sorted(p.name for p in dst.glob("*.safetensors"))
    assert len(files) > 1 and all(re.fullmatch(rf"model-\d{{5}}-of-{len(files):05d}\.safetensors", f) for f in files)
    for f in files:
        with safe_open(dst / f, framework="pt") as h:
            assert h.metadata() == {"format": "pt"}
        n_tensors = len(json.loads((dst / f).read_bytes()[8 : 8 + int.from_bytes((dst / f).read_bytes()[:8], "little")])) - 1
        if n_tensors > 1:
            assert (dst / f).stat().st_size <= 1_000_000 + 8 + 4096
    assert index["metadata"]["total_size"] == sum(raw.nbytes for _, _, raw in out_tensors.values())
    assert set(index["weight_map"].values()) == set(files)

    # config.json rewritten; side files copied unchanged
    cfg = json.loads((dst / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["torch_dtype"] == "bfloat16"
    for side in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "configuration_deepseek.py", "README.md"):
        assert (dst / side).read_bytes() == (fp8_release / side).read_bytes(), side
    assert not list(dst.glob(".*"))  # no temp or state files left


def test_outputs_load_with_torch_through_safetensors(fp8_release, tmp_path):
    import torch
    from safetensors.torch import load_file

    dst = tmp_path / "out"
    fp8_to_bf16(fp8_release, dst, quiet=True)
    for f in dst.glob("*.safetensors"):
        for name, t in load_file(f).items():
            assert t.dtype in (torch.bfloat16, torch.float32), name


def test_manifest_validates_and_matches_files(fp8_release, tmp_path):
    dst = tmp_path / "out"
    fp8_to_bf16(fp8_release, dst, quiet=True)
    manifest = json.loads((dst / "cvt_manifest.json").read_text())
    jsonschema.validate(manifest, load_schema("manifest.schema.json"))
    assert manifest["source"]["kind"] == "local" and manifest["source"]["path"] == str(fp8_release.resolve())
    assert manifest["source"]["config_sha256"] == hashlib.sha256((fp8_release / "config.json").read_bytes()).hexdigest()
    assert manifest["source"]["index_sha256"] == hashlib.sha256(
        (fp8_release / "model.safetensors.index.json").read_bytes()).hexdigest()
    assert [s["name"] for s in manifest["stages"]] == ["fp8-to-bf16"]
    assert manifest["stages"][0]["parameters"]["weight_block_size"] == [128, 128]
    listed = {f["path"]: f for f in manifest["files"]}
    on_disk = {p.name for p in dst.iterdir()} - {"cvt_manifest.json"}
    assert set(listed) == on_disk
    for name, info in listed.items():
        data = (dst / name).read_bytes()
        assert info["size"] == len(data) and info["blake3"] == blake3.blake3(data).hexdigest()
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert manifest["tensor_count"] == len(index["weight_map"])
    assert manifest["total_size"] == index["metadata"]["total_size"]
    assert manifest["summary"]["counts"]["dequantized"] == manifest["summary"]["counts"]["scales_dropped"] > 0


def test_workers_do_not_change_the_bytes(fp8_release, tmp_path):
    for w in (1, 3):
        fp8_to_bf16(fp8_release, tmp_path / f"w{w}", quiet=True, workers=w, max_shard_size=700_000)
    for p in (tmp_path / "w1").iterdir():
        assert p.read_bytes() == (tmp_path / "w3" / p.name).read_bytes(), p.name


def test_direct_and_buffered_writes_give_the_same_files(fp8_release, tmp_path, monkeypatch):
    """Weight files are written with O_DIRECT where the filesystem takes it, else (and with
    CVT_DIRECT_IO=0) buffered: the same files either way, several shards and workers."""
    for d in ("1", "0"):
        monkeypatch.setenv("CVT_DIRECT_IO", d)
        fp8_to_bf16(fp8_release, tmp_path / f"d{d}", quiet=True, workers=2, max_shard_size=700_000)
    names = sorted(p.name for p in (tmp_path / "d1").iterdir() if p.name != "cvt_manifest.json")
    assert len([n for n in names if n.endswith(".safetensors")]) > 1
    for n in names:
        assert (tmp_path / "d1" / n).read_bytes() == (tmp_path / "d0" / n).read_bytes(), n
    # each way hashes chunk by chunk as it writes: the recorded blake3 is the file's
    for d in ("d1", "d0"):
        for f in json.loads((tmp_path / d / "cvt_manifest.json").read_text())["files"]:
            data = (tmp_path / d / f["path"]).read_bytes()
            assert f["size"] == len(data) and f["blake3"] == blake3.blake3(data).hexdigest(), (d, f["path"])


def test_quantization_config_under_text_config(tmp_path):
    cfg = tiny_deepseek_config()
    qc = cfg.pop("quantization_config")
    wrapper = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
               "text_config": {**cfg, "quantization_config": qc}}
    # the Kimi-K2.5 release layout: every text tensor under language_model. (a wrapper without it
    # is refused: tests/test_catalog_reliability.py)
    tensors = release_tensors(cfg | {"quantization_config": qc})
    src = write_release(tmp_path / "src", wrapper, {f"language_model.{k}": v for k, v in tensors.items()})
    fp8_to_bf16(src, tmp_path / "out", quiet=True)
    out_cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in out_cfg["text_config"] and "quantization_config" not in out_cfg


def test_kimi_k2_model_type(tmp_path):
    src = write_fp8_release(tmp_path / "src", config=tiny_deepseek_config(model_type="kimi_k2"))
    r = fp8_to_bf16(src, tmp_path / "out", quiet=True)
    assert r.extra["dequantized"] > 0


def test_single_file_checkpoint_without_index(tmp_path):
    src = write_fp8_release(tmp_path / "src", n_shards=1)
    (src / "model.safetensors.index.json").unlink()
    (src / "model-00001-of-00001.safetensors").rename(src / "model.safetensors")
    fp8_to_bf16(src, tmp_path / "out", quiet=True)
    manifest = json.loads((tmp_path / "out" / "cvt_manifest.json").read_text())
    assert manifest["source"]["index_sha256"] is None


def test_cli_summary_and_progress(fp8_release, tmp_path):
    r = run_cvt("fp8-to-bf16", fp8_release, tmp_path / "out")
    assert r.rc == 0, r.err
    assert re.search(r"dequantized \d+ FP8 tensors, passed \d+ through, dropped \d+ scales", r.out)
    assert "B/s" in r.err  # the tqdm bar shows bytes/s
    q = run_cvt("fp8-to-bf16", fp8_release, tmp_path / "out2", "--quiet")
    assert q.rc == 0 and q.out == "" and q.err == ""


def test_writer_takes_numpy_arrays_holding_the_planned_bits():
    """Producers may return numpy arrays (the torch-free fast paths): of the planned dtype, or an
    unsigned array of the same item size holding the bits of a dtype numpy lacks (BF16 as
    uint16, F8 as uint8). Anything else is an internal error naming the tensor, not bytes
    written under the wrong dtype."""
    import numpy as np

    from cvt.convert.safetensors_io import TensorSpec
    from cvt.convert.fileset import _as_buffer

    bf16 = np.arange(6, dtype=np.uint16).reshape(2, 3)
    assert bytes(_as_buffer(bf16, TensorSpec("a", "BF16", (2, 3)))) == bf16.tobytes()
    f32 = np.ones((2, 3), dtype=np.float32)[:, ::-1]  # not contiguous: copied in order
    assert bytes(_as_buffer(f32, TensorSpec("b", "F32", (2, 3)))) == np.ascontiguousarray(f32).tobytes()
    e4m3 = np.zeros(4, dtype=np.uint8)
    assert len(_as_buffer(e4m3, TensorSpec("c", "F8_E4M3", (4,)))) == 4
    for arr, spec in [(bf16, TensorSpec("d", "BF16", (3, 2))), (f32, TensorSpec("e", "I32", (2, 3))),
                      (bf16.view(np.int16), TensorSpec("f", "BF16", (2, 3))), (f32, TensorSpec("g", "F16", (2, 3))),
                      (f32.view(np.uint32), TensorSpec("h", "F32", (2, 3))),  # unsigned stands in for BF16 / F8 only
                      (np.ones((2, 3), dtype=">f4"), TensorSpec("i", "F32", (2, 3)))]:  # safetensors is little-endian
        with pytest.raises(RuntimeError, match=f"internal: {spec.name} produced numpy"):
            _as_buffer(arr, spec)
