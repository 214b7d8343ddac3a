"""--calib / --data files are read only as far as their tokens are used (issue 24 item 5): a huge
line or file costs what its used part costs, /dev/zero and FIFOs are refused with one line,
and the ids are those of tokenizing each text whole."""

from __future__ import annotations

import json
import os
import random

import pytest

from cvt.testing.checkpoints import byte_tokenizer, tiny_qwen3_config
from cvt.errors import CvtError
from cvt.quant.methods import calib_tokens
from cvt.runtime.tokenizer import MAX_TEXT_CHARS, load_tokenizer, read_ids


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """The tiny models' byte-level BPE tokenizer.json through the `tokenizers` library."""
    d = tmp_path_factory.mktemp("tok")
    (d / "tokenizer.json").write_text(json.dumps(byte_tokenizer()))
    t = load_tokenizer(d, tiny_qwen3_config())
    assert t.kind == "tokenizers"
    return t


def _words(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(["int x;", "héllo", " wörld", "\r\n", "\n\n", "  ", "{}", "∑∂"]) for _ in range(n))


def test_prefix_ids_equal_whole_text(tok, tmp_path):
    text = _words(60000)
    p = tmp_path / "big.txt"
    p.write_bytes(text.encode())  # CRLF kept on disk: read as text mode reads it ("\n")
    whole = tok.encode(p.read_text(encoding="utf-8"))
    for need in (1, 17, 300, 5000):
        ids, used = read_ids(tok, p, need, option="--data")
        assert (ids[:need], used) == (whole[:need], 1)
    t = calib_tokens(tok, p, seq_len=64, max_sequences=3)
    assert t.flatten().tolist() == whole[:192]


def test_jsonl_stops_at_what_is_used(tok, tmp_path):
    texts = [_words(300, seed=i) for i in range(40)] + [" \t"]
    p = tmp_path / "c.jsonl"
    p.write_text("\n".join(json.dumps({"text": t}) for t in texts) + "\n")
    whole = [i for t in texts if t.strip() for i in tok.encode(t)]
    ids, used = read_ids(tok, p, 1000, option="--calib", skip_blank=True)
    assert ids[:1000] == whole[:1000]
    assert used < 10  # the later lines are not read
    assert read_ids(tok, p, 10 ** 9, option="--calib", skip_blank=True) == (whole, 40)


def test_huge_sparse_file_reads_only_the_prefix(tok, tmp_path):
    """A 64 GiB file of NULs (sparse: no disk): the first 256 tokens need the first few KiB."""
    p = tmp_path / "zeros.txt"
    with open(p, "wb") as f:
        f.truncate(64 << 30)
    t = calib_tokens(tok, p, seq_len=128, max_sequences=2)
    assert t.tolist() == [[256] + [0] * 127, [0] * 128]


def test_huge_jsonl_line_refused(tok, tmp_path):
    p = tmp_path / "zeros.jsonl"
    with open(p, "wb") as f:
        f.truncate(MAX_TEXT_CHARS + 4096)
    with pytest.raises(CvtError, match=r"--data .*zeros.jsonl: 0 of the 512 tokens used after 64 MiB"):
        read_ids(tok, p, 512, option="--data")


@pytest.mark.parametrize("kind", ["fifo", "chardev", "dir"])
def test_not_regular_refused(tok, tmp_path, kind):
    p = {"chardev": "/dev/zero", "dir": str(tmp_path)}.get(kind, str(tmp_path / "f.txt"))
    if kind == "fifo":
        os.mkfifo(p)
    what = {"fifo": "a FIFO", "chardev": "a character device", "dir": "a directory"}[kind]
    with pytest.raises(CvtError, match=f"--calib {p}: not a regular file \\({what}\\)"):
        calib_tokens(tok, p)
