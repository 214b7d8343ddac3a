"""The output file plan (`cvt.convert.writer.plan_shards`): greedy up to --max-shard-size, and a
small output cut into balanced files so that workers hash them in parallel."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
from safetensors import safe_open

from cvt.convert import writer
from cvt.convert.buffers import Countdown
from cvt.convert.fp8_to_bf16 import fp8_to_bf16
from cvt.convert.writer import BALANCED_FILES, MIN_BALANCED_SHARD, plan_shards
from cvt.errors import CvtError
from cvt.tests.conftest import run_cvt

MB = 10**6


def tensors(*sizes: int) -> list:
    return [SimpleNamespace(spec=SimpleNamespace(nbytes=s), i=i) for i, s in enumerate(sizes)]


def runs(plan) -> list[list[int]]:
    return [[t.i for t in ts] for _, ts in plan]


def test_small_outputs_stay_greedy():
    # under 2 x 256 MiB there is no second balanced file: one file, as before
    assert runs(plan_shards(tensors(*[50 * MB] * 10), 5 * 10**9, balanced=4)) == [list(range(10))]
    # balanced=1 (cvt shard's rank files): greedy whatever the size
    assert runs(plan_shards(tensors(*[100 * MB] * 12), 5 * 10**9)) == [list(range(12))]
    # greedy already gives enough files
    assert runs(plan_shards(tensors(*[100 * MB] * 12), 300 * MB, balanced=4)) == [
        [0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]


def test_balanced_runs():
    # 1.2 GB: 4 files of 3 x 100 MB (1.2e9 // 256 MiB = 4)
    plan = plan_shards(tensors(*[100 * MB] * 12), 5 * 10**9, balanced=4)
    assert runs(plan) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert [rel for rel, _ in plan] == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    # 0.6 GB: only two files reach 256 MiB
    assert runs(plan_shards(tensors(*[100 * MB] * 6), 5 * 10**9, balanced=4)) == [[0, 1, 2], [3, 4, 5]]
    # a tensor larger than a share sits alone; the share it spans leaves no empty file
    assert runs(plan_shards(tensors(1000 * MB, 10 * MB, 10 * MB, 10 * MB), 5 * 10**9, balanced=4)) == [
        [0], [1, 2, 3]]
    # each tensor goes where its middle byte falls: 400 | 300 300 | 400 ...
    assert runs(plan_shards(tensors(400 * MB, 300 * MB, 300 * MB, 400 * MB), 5 * 10**9, balanced=2)) == [
        [0, 1], [2, 3]]


def test_balanced_plans_keep_order_and_the_size_limit():
    rng = random.Random(0)
    for _ in range(300):
        sizes = [rng.choice([1, 10, 50, 150, 400, 900]) * MB for _ in range(rng.randint(1, 40))]
        limit = rng.choice([300, 1000, 5000]) * MB
        greedy = plan_shards(tensors(*sizes), limit)
        plan = plan_shards(tensors(*sizes), limit, balanced=BALANCED_FILES)
        assert [i for r in runs(plan) for i in r] == list(range(len(sizes)))
        assert all(ts for _, ts in plan)
        assert all(len(ts) == 1 or sum(t.spec.nbytes for t in ts) <= limit for _, ts in plan)
        assert len(greedy) <= len(plan) <= max(len(greedy), BALANCED_FILES)
        if len(plan) > len(greedy):  # balanced: every file but a lone large tensor's holds about a share
            assert len(plan) <= sum(sizes) // MIN_BALANCED_SHARD
            share = sum(sizes) / len(plan)
            assert all(sum(t.spec.nbytes for t in ts) <= share + max(sizes) for _, ts in plan)


def test_help_states_the_balancing():
    out = run_cvt("quantize", "--help").out
    assert f"up to {BALANCED_FILES}" in " ".join(out.split()) and "256 MiB" in out
    assert MIN_BALANCED_SHARD == 256 << 20


def test_a_balanced_checkpoint_holds_the_same_tensors(fp8_release, tmp_path, monkeypatch):
    """The tiny release cut into balanced files (threshold lowered): the same tensors as one
    file, an index that maps each to its file, and a rerun of the same command resumes nothing
    left to do (the plan depends on the arguments only, not on --workers)."""
    monkeypatch.setattr(writer, "MIN_BALANCED_SHARD", 1)
    bal = fp8_to_bf16(fp8_release, tmp_path / "bal", quiet=True, workers=1)
    monkeypatch.setattr(writer, "MIN_BALANCED_SHARD", 10**15)
    one = fp8_to_bf16(fp8_release, tmp_path / "one", quiet=True)
    files = sorted(p.name for p in (tmp_path / "bal").glob("*.safetensors"))
    assert files == [f"model-0000{i}-of-0000{BALANCED_FILES}.safetensors" for i in range(1, BALANCED_FILES + 1)]
    assert [p.name for p in (tmp_path / "one").glob("*.safetensors")] == ["model-00001-of-00001.safetensors"]
    index = json.loads((tmp_path / "bal" / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(tmp_path / "one" / "model-00001-of-00001.safetensors", "pt") as ref:
        assert sorted(index) == sorted(ref.keys())
        for name in files:
            with safe_open(tmp_path / "bal" / name, "pt") as f:
                for k in f.keys():
                    assert index[k] == name
                    assert f.get_tensor(k).equal(ref.get_tensor(k)), k
    monkeypatch.setattr(writer, "MIN_BALANCED_SHARD", 1)
    again = fp8_to_bf16(fp8_release, tmp_path / "bal", quiet=True, workers=2)
    assert again.written_files == 0 and again.skipped_files == BALANCED_FILES
    assert one.bytes_out == bal.bytes_out
    # the file assignment is part of the plan: the same command with another cut (here: one
    # file) must not mix into the balanced output, whose files hold other tensors
    monkeypatch.setattr(writer, "MIN_BALANCED_SHARD", 10**15)
    with pytest.raises(CvtError, match="different run"):
        fp8_to_bf16(fp8_release, tmp_path / "bal", quiet=True)


@pytest.mark.parametrize("scheme", ["w8a8", "w4a16"])
def test_quantize_writes_balanced_files(fp8_release, tmp_path, monkeypatch, scheme):
    from cvt.quant.stage import quantize

    monkeypatch.setattr(writer, "MIN_BALANCED_SHARD", 1)
    kw = {"group_size": 32} if scheme == "w4a16" else {}
    r = quantize(fp8_release, tmp_path / "q", scheme=scheme, quiet=True, **kw)
    weights = sorted((tmp_path / "q").glob("*.safetensors"))
    assert len(weights) == BALANCED_FILES and r.written_files == BALANCED_FILES
    index = json.loads((tmp_path / "q" / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(set(index.values())) == [p.name for p in weights]


def test_countdown_runs_its_action_once_after_the_last_done():
    """`Countdown`: the one latch behind a buffer's charge and shard's release of a source tensor's
    pages; `done` from many threads, the action exactly once, on the n-th call."""
    import threading

    calls = []
    c = Countdown(64, lambda: calls.append(c.left))
    threads = [threading.Thread(target=lambda: [c.done() for _ in range(8)]) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [0]

