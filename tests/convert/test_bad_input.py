"""Bad input to `cvt fp8-to-bf16` (and `cvt inspect`), through the real CLI.

Every case corrupts a private copy of the tiny FP8 release (`fp8_release`) and checks the
CLI contract: a non-zero exit, exactly one stderr line `cvt: error: ...` naming the
offending file and/or tensor, no traceback (unless `--debug`), and a DST holding nothing
that looks complete (no manifest, index or config.json; finished shards of a resumable
run may remain, half-written temp files may not).
"""

from __future__ import annotations

import json
import resource
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from cvt.tests.conftest import run_cvt

INDEX = "model.safetensors.index.json"
COMPLETE_MARKERS = ("cvt_manifest.json", INDEX, "config.json")


# ----------------------------------------------------------------------------------------
# helpers


def weight_map(src: Path) -> dict[str, str]:
    return json.loads((src / INDEX).read_text())["weight_map"]


def file_of(src: Path, tensor: str) -> Path:
    return src / weight_map(src)[tensor]


def edit_index(src: Path, fn) -> None:
    index = json.loads((src / INDEX).read_text())
    fn(index["weight_map"])
    (src / INDEX).write_text(json.dumps(index, indent=2))


def edit_config(src: Path, fn) -> None:
    cfg = json.loads((src / "config.json").read_text())
    fn(cfg)
    (src / "config.json").write_text(json.dumps(cfg, indent=2))


def read_raw(path: Path) -> tuple[dict, bytes]:
    """(header JSON, data buffer) of a safetensors file, at the byte level."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def write_raw(path: Path, header: dict, body: bytes) -> None:
    """Write a header (8-byte length kept consistent with the JSON) followed by `body`."""
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + body)


def rewrite_shard(path: Path, fn) -> None:
    """Load a shard with the safetensors library, let `fn` edit the dict, save it back."""
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def fp8_weights(src: Path) -> list[str]:
    return sorted(n[: -len("_scale_inv")] for n in weight_map(src) if n.endswith("_scale_inv"))


def moved_scale_weight(src: Path) -> str:
    """An FP8 weight whose scale lives in a different shard (the fixture has one)."""
    wm = weight_map(src)
    return next(w for w in fp8_weights(src) if wm[w] != wm[w + "_scale_inv"])


def same_file_scale_weight(src: Path) -> str:
    wm = weight_map(src)
    return next(w for w in fp8_weights(src) if wm[w] == wm[w + "_scale_inv"])


def assert_one_line_error(res, *names: str) -> str:
    """rc != 0, stderr is one `cvt: error:` line mentioning every name, no traceback."""
    assert res.rc != 0, f"expected failure, got rc 0\nstdout: {res.out}\nstderr: {res.err}"
    assert "Traceback" not in res.err, res.err
    lines = res.err.strip().splitlines()
    assert len(lines) == 1, f"stderr should be exactly one line, got {len(lines)}:\n{res.err}"
    line = lines[0]
    assert line.startswith("cvt: error:"), line
    for name in names:
        assert str(name) in line, f"{name!r} not named in: {line}"
    return line


def assert_nothing_complete(dst: Path) -> None:
    """DST holds nothing a loader could take for a finished conversion."""
    if not dst.exists():
        return
    present = [m for m in COMPLETE_MARKERS if (dst / m).exists()]
    assert not present, f"{dst} looks complete after a failed run: {present} ({sorted(p.name for p in dst.iterdir())})"
    leftovers = sorted(p.name for p in dst.glob(".*.tmp"))
    assert not leftovers, f"half-written temp files left in {dst}: {leftovers}"


def convert_fails(src, dst, *names: str, extra=()) -> str:
    res = run_cvt("fp8-to-bf16", src, dst, *extra)
    line = assert_one_line_error(res, *names)
    assert_nothing_complete(Path(dst))
    return line


@pytest.fixture
def dst(tmp_path) -> Path:
    return tmp_path / "out"


# ----------------------------------------------------------------------------------------
# broken safetensors files


def test_truncated_shard(fp8_release, dst):
    shard = fp8_release / "model-00002-of-00003.safetensors"
    header, body = read_raw(shard)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - len(body) // 2])  # cut in the middle of the data
    convert_fails(fp8_release, dst, shard.name)


def test_header_length_past_eof(fp8_release, dst):
    shard = fp8_release / "model-00001-of-00003.safetensors"
    data = bytearray(shard.read_bytes())
    data[:8] = (len(data) + 4096).to_bytes(8, "little")
    shard.write_bytes(bytes(data))
    convert_fails(fp8_release, dst, shard.name)


def test_data_offsets_past_eof(fp8_release, dst):
    shard = fp8_release / "model-00002-of-00003.safetensors"
    header, body = read_raw(shard)
    names = [n for n in header if n != "__metadata__"]
    victim = names[len(names) // 2]
    a, _ = header[victim]["data_offsets"]
    header[victim]["data_offsets"] = [a, len(body) + 1024]  # ends beyond the file
    write_raw(shard, header, body)
    convert_fails(fp8_release, dst, shard.name, victim)


# ----------------------------------------------------------------------------------------
# FP8 weights and their scales


@pytest.mark.parametrize("which", ["scale-in-same-file", "scale-in-other-file"])
def test_fp8_weight_without_scale(fp8_release, dst, which):
    weight = (same_file_scale_weight if which == "scale-in-same-file" else moved_scale_weight)(fp8_release)
    scale = weight + "_scale_inv"
    rewrite_shard(file_of(fp8_release, scale), lambda t: t.pop(scale))
    edit_index(fp8_release, lambda wm: wm.pop(scale))
    convert_fails(fp8_release, dst, weight)


def test_scale_of_wrong_shape(fp8_release, dst):
    import torch

    weight = same_file_scale_weight(fp8_release)
    scale = weight + "_scale_inv"

    def grow(t):
        s = t[scale]
        t[scale] = torch.ones(s.shape[0], s.shape[1] + 1, dtype=s.dtype)

    rewrite_shard(file_of(fp8_release, scale), grow)
    convert_fails(fp8_release, dst, scale)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_scale(fp8_release, dst, bad):
    scale = moved_scale_weight(fp8_release) + "_scale_inv"

    def poison(t):
        s = t[scale].clone()
        s.view(-1)[-1] = bad
        t[scale] = s

    rewrite_shard(file_of(fp8_release, scale), poison)
    convert_fails(fp8_release, dst, scale)


# ----------------------------------------------------------------------------------------
# the index


def test_index_lists_missing_file(fp8_release, dst):
    gone = fp8_release / "model-00002-of-00003.safetensors"
    gone.unlink()
    convert_fails(fp8_release, dst, gone.name)


@pytest.mark.parametrize("kind", ["dotdot", "absolute"])
def test_index_path_outside_checkpoint(fp8_release, dst, tmp_path, kind):
    # the path points at a real, valid shard outside SRC: it must be refused, not read
    victim = "model-00003-of-00003.safetensors"
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copy(fp8_release / victim, outside)
    rel = "../elsewhere.safetensors" if kind == "dotdot" else str(outside)
    edit_index(fp8_release, lambda wm: wm.update({k: rel for k, v in wm.items() if v == victim}))
    (fp8_release / victim).unlink()
    convert_fails(fp8_release, dst, rel)


def test_tensor_listed_twice_in_index(fp8_release, dst):
    name = "model.norm.weight"
    assert name in weight_map(fp8_release)
    text = (fp8_release / INDEX).read_text()
    opening = '"weight_map": {'
    assert text.count(opening) == 1
    # raw JSON: a second entry for the same key (json.loads would silently keep the last one)
    (fp8_release / INDEX).write_text(text.replace(opening, f'{opening}\n    "{name}": "model-00001-of-00003.safetensors",'))
    convert_fails(fp8_release, dst, name)


@pytest.mark.parametrize("with_index", [True, False], ids=["with-index", "no-index"])
def test_tensor_stored_in_two_files(fp8_release, dst, with_index):
    name = "model.norm.weight"
    home = file_of(fp8_release, name)
    other = next(p for p in sorted(fp8_release.glob("*.safetensors")) if p != home)
    value = load_file(home)[name]
    rewrite_shard(other, lambda t: t.update({name: value.clone()}))
    if not with_index:
        (fp8_release / INDEX).unlink()
    convert_fails(fp8_release, dst, name)


# ----------------------------------------------------------------------------------------
# pickles are never unpickled


class _Trap:
    """Unpickling this creates `marker` (proof that something unpickled the file)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("payload", ["torch-save-trap", "random-bytes"])
def test_pickle_only_checkpoint_is_refused(fp8_release, tmp_path, dst, payload):
    import torch

    src = tmp_path / "pickled"
    src.mkdir()
    shutil.copy(fp8_release / "config.json", src / "config.json")
    marker = tmp_path / "UNPICKLED"
    if payload == "torch-save-trap":
        torch.save({"model.embed_tokens.weight": torch.zeros(4, 4), "x": _Trap(str(marker))}, src / "pytorch_model.bin")
    else:
        (src / "pytorch_model.bin").write_bytes(bytes(range(256)) * 64)
    convert_fails(src, dst, "pytorch_model.bin")
    assert not marker.exists(), "the .bin was unpickled"


# ----------------------------------------------------------------------------------------
# what the source is


def test_plain_bf16_source_is_refused(tmp_path, dst):
    import torch

    from cvt.testing.checkpoints import random_weights, tiny_deepseek_config, write_release

    cfg = tiny_deepseek_config()
    del cfg["quantization_config"]
    src = write_release(tmp_path / "bf16", cfg, {k: v.to(torch.bfloat16) for k, v in random_weights(cfg).items()})
    line = convert_fails(src, dst, "not an FP8")
    assert "no quantization_config" in line or "float" in line, line


def test_compressed_tensors_source_is_refused(fp8_release, dst):
    edit_config(fp8_release, lambda c: c.update(quantization_config={
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed"}))
    convert_fails(fp8_release, dst, "compressed-tensors", "not an FP8")


def test_unknown_model_type(fp8_release, dst):
    edit_config(fp8_release, lambda c: c.update(model_type="mystery_lm"))
    convert_fails(fp8_release, dst, "mystery_lm")


def test_unmapped_tensor(fp8_release, dst):
    import torch

    name = "model.layers.0.mystery.weight"
    shard = fp8_release / "model-00001-of-00003.safetensors"
    rewrite_shard(shard, lambda t: t.update({name: torch.zeros(8, 8, dtype=torch.bfloat16)}))
    edit_index(fp8_release, lambda wm: wm.update({name: shard.name}))
    convert_fails(fp8_release, dst, name)


# ----------------------------------------------------------------------------------------
# the destination


@pytest.mark.parametrize("where", ["under-a-file", "is-a-file"])
def test_dst_not_writable(fp8_release, tmp_path, where):
    afile = tmp_path / "afile"
    afile.write_text("not a directory\n")
    dst = afile / "out" if where == "under-a-file" else afile
    res = run_cvt("fp8-to-bf16", fp8_release, dst)
    assert_one_line_error(res, str(dst) if where == "under-a-file" else afile.name)
    assert afile.read_text() == "not a directory\n"


def test_dst_with_unrelated_files(fp8_release, dst):
    dst.mkdir()
    (dst / "notes.txt").write_text("mine\n")
    convert_fails(fp8_release, dst, str(dst), "--overwrite")
    assert (dst / "notes.txt").read_text() == "mine\n"
    res = run_cvt("fp8-to-bf16", fp8_release, dst, "--overwrite", "--quiet")
    assert res.rc == 0, res.err
    assert (dst / "cvt_manifest.json").is_file()


def _limit_file_size(limit: int):
    def preexec():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return preexec


@pytest.mark.parametrize("quiet", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["quiet", "progress-bar"])
def test_disk_full_then_resume(fp8_release, dst, quiet):
    limit = 500_000  # the single output shard is ~3 MB
    args = ("fp8-to-bf16", fp8_release, dst, *(["--quiet"] if quiet else []))
    res = run_cvt(*args, preexec_fn=_limit_file_size(limit))
    if quiet:
        assert_one_line_error(res, "model-00001-of-00001.safetensors")
    else:
        # the progress bar (stderr) may have drawn before the failure; the error is still one
        # line, the last one, and nothing else but the bar is printed
        assert res.rc != 0 and "Traceback" not in res.err, res.err
        lines = [ln for ln in res.err.strip().splitlines() if ln.strip()]
        assert lines[-1].startswith("cvt: error:") and "model-00001-of-00001.safetensors" in lines[-1], res.err
        assert all(ln.startswith("fp8-to-bf16:") for ln in lines[:-1]), res.err
    assert_nothing_complete(dst)
    assert not list(dst.glob("*.safetensors")), "a shard larger than the limit cannot be complete"

    res = run_cvt(*args)
    assert res.rc == 0, res.err
    manifest = json.loads((dst / "cvt_manifest.json").read_text())
    index = json.loads((dst / INDEX).read_text())
    assert not list(dst.glob(".*.tmp")) and not (dst / ".cvt-state.json").exists()
    seen = set()
    for fname in sorted(set(index["weight_map"].values())):
        with safe_open(dst / fname, framework="pt") as f:
            for k in f.keys():
                seen.add(k)
                f.get_tensor(k)
    assert seen == set(index["weight_map"])
    assert {f["path"] for f in manifest["files"]} >= set(index["weight_map"].values())


# ----------------------------------------------------------------------------------------
# inspect, --debug


def test_inspect_truncated_file(fp8_release):
    shard = fp8_release / "model-00003-of-00003.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    assert_one_line_error(run_cvt("inspect", fp8_release), shard.name)


def test_debug_shows_traceback(fp8_release, dst):
    shard = fp8_release / "model-00002-of-00003.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    res = run_cvt("fp8-to-bf16", fp8_release, dst, "--debug")
    assert res.rc != 0
    assert "Traceback" in res.err, res.err
    last = res.err.strip().splitlines()[-1]
    assert last.startswith("cvt: error:") and shard.name in last, last
    assert_nothing_complete(dst)
