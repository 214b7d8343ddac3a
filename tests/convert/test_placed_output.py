"""Kernel outputs written without a staging copy or fresh-page zeroing: the page-aligned output
pool (`cvt.convert.buffers.OutputPool`, `place`) and `DirectFile`'s straight O_DIRECT writes from
a placed buffer; the stages' bytes stay those of the unfused / torch reference paths."""

from __future__ import annotations

import gc
import os
import threading

import blake3
import numpy as np
import pytest

from cvt.convert import buffers as B
from cvt.convert import durable as D
from cvt.convert.durable import AtomicFile


@pytest.fixture
def small_pool(monkeypatch):
    """Pool from 1 MiB up (whatever `POOLED_MIN` is tuned to)."""
    monkeypatch.setattr(B, "POOLED_MIN", 1 << 20)


@pytest.mark.slow
def test_pool_places_arrays_within_a_page_and_recycles_a_block_once_its_last_view_is_gone(small_pool):
    pool = B.OutputPool(max_idle=64 << 20)
    a = pool.array((700, 1000), np.uint16, phase=1234)
    assert a.shape == (700, 1000) and a.dtype == np.uint16 and a.flags["C_CONTIGUOUS"] and a.flags["WRITEABLE"]
    assert a.ctypes.data % 4096 == 1234
    addr = a.ctypes.data
    a[:] = 7
    keep = a[3:].view(np.int16)  # a view still holds the block: not handed out again
    del a
    gc.collect()
    other = pool.array((700, 1000), np.uint16, phase=1234)
    assert pool.idle == 0 and other.ctypes.data != addr
    del keep
    gc.collect()
    assert pool.idle > 0
    b = pool.array((700, 1000), np.uint16, phase=1234)
    assert b.ctypes.data == addr and pool.reused == 1  # the same pages: no fault, no zeroing
    del b
    gc.collect()
    c = pool.array((1400, 500), np.uint16, phase=0)  # another shape of the same bytes shares the block
    assert c.ctypes.data == addr - 1234
    assert pool.array((10, 10), np.float32).base is None  # small: plain np.empty, not pooled


def test_pool_hands_out_the_smallest_idle_block_that_holds_the_request(small_pool):
    """Best fit over every idle block (their pages are faulted in: a larger one costs nothing),
    a fresh block only when none holds it."""
    pool = B.OutputPool(max_idle=64 << 20)
    small, big = pool.array((2 << 20,), np.uint8, phase=0), pool.array((6 << 20,), np.uint8, phase=0)
    at = {"small": small.ctypes.data, "big": big.ctypes.data}
    del small, big
    gc.collect()
    a = pool.array((3 << 20,), np.uint8, phase=100)  # only the 6 MiB block holds it
    b = pool.array((1 << 20,), np.uint8, phase=5)  # the 2 MiB one
    assert (a.ctypes.data - 100, b.ctypes.data - 5) == (at["big"], at["small"]) and pool.reused == 2
    c = pool.array((1 << 20,), np.uint8, phase=0)  # none idle: fresh
    assert c.ctypes.data not in at.values() and pool.reused == 2


def test_below_the_pool_arrays_are_placed_slices_of_malloc_memory():
    """Between `PLACED_MIN` and `POOLED_MIN`: malloc's memory (which it reuses itself), a page
    larger, sliced so the array sits at its phase; no pool block."""
    pool = B.OutputPool()
    for phase in (0, 1, 4095, 2222):
        a = pool.array((300, 500), np.float32, phase=phase)
        assert a.ctypes.data % 4096 == phase and a.shape == (300, 500) and a.flags["C_CONTIGUOUS"]
        a[:] = 1.5
        assert float(a.sum()) == 225_000.0
    assert pool.reused == 0 and pool.idle == 0


def test_pool_idle_bytes_stay_under_the_cap_least_recently_used_freed(small_pool):
    pool = B.OutputPool(max_idle=3 << 20)
    arrays = [pool.array((1 << 20,), np.uint8, phase=0) for _ in range(4)]  # 1 MiB blocks
    addrs = [x.ctypes.data for x in arrays]
    for i in range(4):
        arrays[i] = None  # given back in this order
    gc.collect()
    assert pool.idle == 3 << 20  # the first one given back was freed
    again = [pool.array((1 << 20,), np.uint8, phase=0) for _ in range(3)]
    assert {x.ctypes.data for x in again} == set(addrs[1:]) and pool.idle == 0


def test_place_sets_this_threads_phase_only(small_pool):
    B.place(4096 * 3 + 99)
    seen = []
    t = threading.Thread(target=lambda: seen.append(B.placed_phase()))
    t.start()
    t.join()
    assert B.placed_phase() == 99 and seen == [0]
    pool = B.OutputPool()
    assert pool.array((300_000,), np.uint8).ctypes.data % 4096 == 99
    B.place(0)


def _placed_everywhere(monkeypatch, pooled_min: int = 16 << 10) -> None:
    """The tiny releases' tensors qualify for straight writes and placed outputs: every size is
    written straight and placed, the larger ones from pool blocks, the others sliced from malloc."""
    monkeypatch.setattr(D, "DIRECT_MIN", 0)
    monkeypatch.setattr(B, "PLACED_MIN", 0)
    monkeypatch.setattr(B, "POOLED_MIN", pooled_min)


def _needs_direct(tmp_path):
    if not D.direct_io_enabled(tmp_path):
        pytest.skip("no O_DIRECT on this filesystem")


@pytest.mark.parametrize("double", [True, False], ids=["disk-thread", "in-place"])
def test_placed_buffers_go_to_disk_straight_from_where_they_are(tmp_path, monkeypatch, double):
    """A buffer whose address sits at its file offset's place within a page: its whole pages are
    written from it (`direct_bytes`), the partial pages around it staged; an unplaced one is
    staged whole. The file and its BLAKE3 digest are the bytes written, in order."""
    _needs_direct(tmp_path)
    if not double:
        monkeypatch.setattr(D.DirectFile, "DOUBLE_BUFFERED", 0)
    pool = B.OutputPool()
    header = os.urandom(1000)
    rng = np.random.default_rng(3)
    placed = pool.array(((20 << 20) + 77,), np.uint8, phase=1000)
    placed[:] = rng.integers(0, 256, placed.shape, dtype=np.uint8)
    unplaced = pool.array((3 << 20,), np.uint8, phase=(1000 + placed.nbytes + 1) % 4096)
    unplaced[:] = rng.integers(0, 256, unplaced.shape, dtype=np.uint8)
    small = rng.integers(0, 256, 5000, dtype=np.uint8)
    pos = 1000 + placed.nbytes + unplaced.nbytes + small.nbytes
    second = pool.array((5 << 20,), np.uint8, phase=pos)  # placed after unplaced and small pieces
    second[:] = rng.integers(0, 256, second.shape, dtype=np.uint8)
    f = AtomicFile(tmp_path / "w.bin", direct=True)
    for part in (header, placed, unplaced, small, second):
        f.write(part)
        # written from the caller's buffer before `write` returns: the caller may reuse it then
        assert not [view for stage, view in f._f._todo if stage is None]
    direct = f._f.direct_bytes
    want = header + placed.tobytes() + unplaced.tobytes() + small.tobytes() + second.tobytes()
    assert f.commit() == (len(want), blake3.blake3(want).hexdigest())
    assert (tmp_path / "w.bin").read_bytes() == want

    def pages(start, n):  # whole pages of [start, start + n) (counted here, independently)
        first = -(-start // 4096) * 4096
        return max(0, (start + n) // 4096 * 4096 - first)

    assert direct == pages(1000, placed.nbytes) + pages(pos, second.nbytes) > 24 << 20


def test_placed_and_unplaced_writes_of_every_size_keep_the_bytes(tmp_path, monkeypatch):
    """Random sequences of placed and unplaced buffers (empty, shorter than the rest of the
    current page -- once written twice --, page-sized, stage-sized), every size going the direct
    way where it can (`DIRECT_MIN` 0): the file is their bytes in order."""
    import random

    _needs_direct(tmp_path)
    _placed_everywhere(monkeypatch, 64 << 10)
    pool = B.OutputPool()
    rng = random.Random(1)
    sizes = [0, 1, 415, 2091, 4095, 4096, 4097, 8192 + 5, 70_000, (2 << 20) - 3, (2 << 20) + 4096]
    for _ in range(12):
        f = AtomicFile(tmp_path / "x.bin", direct=True)
        pos, parts = 0, []
        for _ in range(rng.randint(1, 12)):
            n = rng.choice(sizes)
            a = pool.array((n,), np.uint8, phase=pos if rng.random() < 0.7 else pos + 1)
            a[:] = np.frombuffer(os.urandom(n), np.uint8)
            parts.append(a.tobytes())
            f.write(a)
            pos += n
        want = b"".join(parts)
        assert f.commit() == (len(want), blake3.blake3(want).hexdigest())
        assert (tmp_path / "x.bin").read_bytes() == want


def _direct_bytes(monkeypatch) -> list[int]:
    seen: list[int] = []
    real = D.DirectFile.close

    def close(self):
        if self._fd >= 0:
            seen.append(self.direct_bytes)
        real(self)

    monkeypatch.setattr(D.DirectFile, "close", close)
    return seen


def _files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.safetensors"))}


@pytest.mark.parametrize("scheme,opts", [("w8a8", {}), ("w4a16", {"asym": True, "group_size": 32}), ("fp4", {})])
def test_quantize_writes_kernel_outputs_straight_and_the_reference_bytes(fp8_release_session, tmp_path, monkeypatch,
                                                                         scheme, opts):
    """The fused kernels' packed weights land in placed pool buffers and go out through O_DIRECT
    without a staging copy (the tiny release's tensors are small: the size thresholds are lowered
    so that they qualify, both placements used), and the files are the unfused reference's
    (tests/quant/test_qkernel_stage.py::test_stage_writes_the_reference_bytes: CVT_QUANT_KERNEL=reference)."""
    import cvt.quant.stage.outputs as ST
    from cvt.quant import qkernel as QK
    from cvt.quant.stage import quantize

    _needs_direct(tmp_path)
    pieces = []  # the FP8 tensors kept float: BF16 in pieces, as fp8-to-bf16 writes them
    real_pieces = ST.dequantized_pieces
    monkeypatch.setattr(ST, "dequantized_pieces", lambda ck, n, *a, **k: pieces.append(n) or real_pieces(ck, n, *a, **k))
    QK._c_kernel.cache_clear()
    if QK._c_kernel() is None:
        pytest.skip("C quantize kernel not built")
    _placed_everywhere(monkeypatch)
    try:
        monkeypatch.setenv("CVT_QUANT_KERNEL", "reference")
        QK._c_kernel.cache_clear()
        quantize(fp8_release_session, tmp_path / "ref", scheme=scheme, fmt="compressed-tensors", quiet=True, **opts)
        monkeypatch.setenv("CVT_QUANT_KERNEL", "")
        QK._c_kernel.cache_clear()
        seen = _direct_bytes(monkeypatch)
        quantize(fp8_release_session, tmp_path / "fused", scheme=scheme, fmt="compressed-tensors", quiet=True, **opts)
    finally:
        QK._c_kernel.cache_clear()
    assert _files(tmp_path / "ref") == _files(tmp_path / "fused")
    assert seen and sum(seen) > 0
    assert pieces and all(n.endswith(".weight") for n in pieces)


@pytest.mark.parametrize("piece_bytes", [8 << 20, 1], ids=["default", "one-block-row-per-piece"])
def test_fp8_to_bf16_writes_kernel_outputs_straight_and_the_torch_bytes(fp8_release_session, tmp_path, monkeypatch,
                                                                        piece_bytes):
    """fp8-to-bf16 with the C kernel writes each weight in pieces of whole FP8 block rows
    (`PIECE_BYTES`; 1: one block row a piece, several per weight of the tiny release), each
    placed and written straight; the files are the torch kernel's (CVT_FP8_KERNEL=torch, one
    whole tensor per weight)."""
    from cvt.convert import fp8 as F
    from cvt.convert import fp8_to_bf16 as S
    from cvt.convert.fp8_to_bf16 import fp8_to_bf16

    monkeypatch.setattr(S, "PIECE_BYTES", piece_bytes)
    made = []
    real_np = S.dequant_fp8_counted_np
    monkeypatch.setattr(S, "dequant_fp8_counted_np", lambda *a, **k: made.append(a[1]) or real_np(*a, **k))

    _needs_direct(tmp_path)
    F._c_kernel.cache_clear()
    if F._c_kernel() is None:
        pytest.skip("C FP8 kernel not built")
    _placed_everywhere(monkeypatch)
    try:
        monkeypatch.setenv("CVT_FP8_KERNEL", "torch")
        F._c_kernel.cache_clear()
        fp8_to_bf16(fp8_release_session, tmp_path / "torch", quiet=True)
        monkeypatch.setenv("CVT_FP8_KERNEL", "")
        F._c_kernel.cache_clear()
        seen = _direct_bytes(monkeypatch)
        fp8_to_bf16(fp8_release_session, tmp_path / "c", quiet=True)
    finally:
        F._c_kernel.cache_clear()
    assert _files(tmp_path / "torch") == _files(tmp_path / "c")
    assert seen and sum(seen) > 0
    assert B.OUTPUTS.idle == 0 and not B.OUTPUTS._free  # nothing kept past the stage
    assert made and (max(r for r, _ in made) <= 128) == (piece_bytes == 1)  # the tiny release's blocks: 128 rows


def test_a_block_given_back_inside_the_pools_lock_does_not_deadlock():
    """The last view of a pooled array can go inside the garbage collector on a thread that holds
    the pool's lock (any allocation there may collect a cycle): giving the block back takes no lock."""
    import threading

    pool = B.OutputPool(max_idle=64 << 20)
    a = pool.array((4 << 20,), "uint8")
    done = []

    def drop_under_the_lock():
        with pool._lock:
            nonlocal a
            del a  # the finalizer runs here, the lock held
        done.append(True)

    t = threading.Thread(target=drop_under_the_lock, daemon=True)
    t.start()
    t.join(10)
    assert done == [True], "giving the block back waited on the pool's own lock"
    assert pool.idle >= 4 << 20
    b = pool.array((4 << 20,), "uint8")
    assert pool.reused == 1 and b.nbytes == 4 << 20


def test_shard_writes_split_slices_straight_and_reassembles(tmp_path, monkeypatch):
    """`cvt shard`'s dim-1 runs (row-parallel o_proj / down_proj under tp) are copied once into
    pool buffers placed as their first holder file has them, so O_DIRECT writes them with no
    staging copy (thresholds lowered for the tiny model); the rank files still put the source
    back together byte for byte (tests/convert/test_shard.py's reassembly, independent of the
    writer) and nothing stays pooled after the stage."""
    from cvt.convert import shard as SH
    from cvt.convert.placement import make_layout
    from cvt.testing.checkpoints import tiny_deepseek_config, write_bf16_checkpoint
    from cvt.tests.convert.test_shard import assert_reproduces

    _needs_direct(tmp_path)
    cfg = tiny_deepseek_config()
    cfg.pop("quantization_config")
    src = write_bf16_checkpoint(tmp_path / "src", cfg)
    _placed_everywhere(monkeypatch)
    placed = []  # (where the first holder file has the slice, where its buffer starts) within a page
    real = SH._slice

    def spy(ck, n, sp, i, phase=0):
        data = real(ck, n, sp, i, phase)
        if sp.dim == 1:
            placed.append((phase % B.PAGE, np.frombuffer(data, np.uint8).ctypes.data % B.PAGE))
        return data

    monkeypatch.setattr(SH, "_slice", spy)
    seen = _direct_bytes(monkeypatch)
    m = assert_reproduces(src, SH.shard(src, tmp_path / "out", make_layout(world_size=4, tp=2, ep=4), quiet=True).dst)
    assert placed and all(want == got for want, got in placed) and len({w for w, _ in placed}) > 1
    assert m["shard"]["tensors"]["model.layers.0.self_attn.o_proj.weight"]["dim"] == 1
    assert seen and sum(seen) > 0
    assert B.OUTPUTS.idle == 0 and not B.OUTPUTS._free
