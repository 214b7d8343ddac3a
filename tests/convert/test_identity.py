"""SRC's content identity (`cvt.convert.identity`): what resumable state is keyed on."""

from __future__ import annotations

import os
import shutil

import torch

from cvt.convert.identity import SAMPLES, WHOLE, file_identity, source_identity
from cvt.convert.reader import open_checkpoint
from cvt.testing.checkpoints import tiny_qwen3_config, write_bf16_checkpoint, write_safetensors


def _big(path, values: torch.Tensor):
    write_safetensors(path, {"w": values})
    assert path.stat().st_size > WHOLE  # sampled, not hashed whole
    return path


def test_a_large_file_is_known_by_its_header_and_sampled_blocks(tmp_path):
    base = torch.arange(1 << 19, dtype=torch.float32)  # 2 MiB of data
    a = _big(tmp_path / "a.safetensors", base)
    same = _big(tmp_path / "same.safetensors", base.clone())
    scaled = _big(tmp_path / "scaled.safetensors", base * 3)          # same size, other bytes
    renamed = tmp_path / "renamed.safetensors"
    write_safetensors(renamed, {"v": base})                            # same data, other header
    ident = file_identity(a)
    assert file_identity(same) == ident
    assert file_identity(scaled) != ident
    assert file_identity(renamed) != ident
    assert file_identity(a, "recorded-sha") != ident                   # a cvt manifest's sha256 counts
    st = a.stat()
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))          # touched: same content
    assert file_identity(a) == ident
    # one changed block at a sampled offset is seen (the first sample is the data's first block)
    data = a.read_bytes()
    base_at = 8 + int.from_bytes(data[:8], "little")
    with open(a, "r+b") as f:
        f.seek(base_at)
        f.write(b"\xff" * 4)
    assert file_identity(a) != ident
    assert SAMPLES > 1


def test_source_identity_follows_content_not_mtimes(tmp_path):
    a = write_bf16_checkpoint(tmp_path / "a", tiny_qwen3_config(moe=True), seed=0)
    b = tmp_path / "b"
    shutil.copytree(a, b)
    for p in b.iterdir():
        st = p.stat()
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    tuned = write_bf16_checkpoint(tmp_path / "tuned", tiny_qwen3_config(moe=True), seed=1)  # same names and sizes
    with open_checkpoint(a) as ca, open_checkpoint(b) as cb, open_checkpoint(tuned) as ct:
        ia = source_identity(ca)
        assert set(ia) == {"config.json", "model.safetensors.index.json", *(p.name for p in ca.weight_files)}
        assert source_identity(cb) == ia
        it = source_identity(ct)
        assert it != ia and {k for k in ia if ia[k] != it[k]} == {p.name for p in ca.weight_files}
