"""The demo's trained model (`cvt.demo_model`) and the standard-library text it is built from
(`cvt.corpus`): trained weights far better than the random ones on held-out Python, training
deterministic, the cache used, the FP8 release what the demo needs, and quantization losses that
rank the schemes."""

from __future__ import annotations

import json
import math

import pytest
import torch

from cvt import corpus, demo_model
from cvt.convert.inspect import inspect_checkpoint
from cvt.testing.checkpoints import random_weights
from cvt.runtime.generate import generate
from cvt.runtime.loader import load_model
from cvt.runtime.models.deepseek_v3 import Args, Model


def heldout_ppl(model, seq_len: int = 128, sequences: int = 16) -> float:
    """Perplexity of `model` on the held-out slice: <bos> + its UTF-8 bytes, cut into sequences."""
    ids = [256] + list(corpus.text("heldout").encode("utf-8"))
    n = min(sequences, len(ids) // seq_len)
    x = torch.tensor(ids[: n * seq_len]).view(n, seq_len)
    logits = model(x)
    return math.exp(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten()).item())


def model_of(config, weights) -> Model:
    m = Model(Args.from_config(config), dtype=torch.float32)
    m.load_state_dict(weights)
    return m


def test_slices_are_disjoint_and_fixed():
    assert not set(corpus.TRAINING) & set(corpus.HELDOUT)
    assert not set(corpus.CALIBRATION) & (set(corpus.TRAINING) | set(corpus.HELDOUT))
    assert corpus.text("heldout") == corpus.text("heldout")  # read in the listed order, nothing random
    prose = corpus.text("calibration")
    assert "Assignment statements" in prose and "topics = {" not in prose  # pydoc's text, not its literals
    assert "\nimport " in prose[:200_000]  # modules interleaved early, not only after the prose


@pytest.mark.slow
def test_trained_model_is_far_better_than_the_random_one(demo_weights):
    config, weights, _ = demo_weights
    trained = heldout_ppl(model_of(config, weights))
    untrained = heldout_ppl(model_of(config, random_weights(config, demo_model.RECIPE["seed"])))
    # byte-level: the random model is near uniform over 300 ids or worse; the trained one is far below
    assert untrained > 100
    assert trained < 0.1 * untrained and trained < 20, (trained, untrained)


def test_training_is_deterministic():
    """Two trainings of the same (short) recipe give the same bits; a different seed does not."""
    recipe = {**demo_model.RECIPE, "steps": 3, "batch": 2, "seq_len": 32, "warmup": 2}
    text = corpus.text("heldout")
    config = demo_model.demo_config()
    a = demo_model.train(config, text, recipe)
    b = demo_model.train(config, text, recipe)
    assert a.keys() == b.keys() == random_weights(config).keys()
    assert all(torch.equal(a[n], b[n]) for n in a)
    c = demo_model.train(config, text, {**recipe, "seed": 1})
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])
    # trained: the decoder's weights moved from the initialisation, the MTP layer's did not
    init = random_weights(config)
    assert not torch.equal(a["model.layers.1.self_attn.q_a_proj.weight"], init["model.layers.1.self_attn.q_a_proj.weight"])
    assert torch.equal(a["model.layers.3.eh_proj.weight"], init["model.layers.3.eh_proj.weight"])


@pytest.mark.slow
def test_cached_weights_are_reused(demo_weights):
    config, weights, key = demo_weights
    folder = demo_model.cache_root() / f"demo-dsv3-{key}"
    assert json.loads((folder / "recipe.json").read_text()) == {"key": key, "recipe": demo_model.RECIPE}
    assert not list(demo_model.cache_root().glob(f".tmp-demo-dsv3-{key}-*"))  # no half-written folder left
    again = demo_model.trained_weights()  # read from the cache: no training (this call takes a moment)
    assert again[2] == key and all(torch.equal(again[1][n], weights[n]) for n in weights)
    # the key follows the text and the recipe
    assert demo_model.recipe_key(corpus.text("training") + "#") != key
    assert demo_model.recipe_key(corpus.text("training"), {**demo_model.RECIPE, "steps": 1}) != key


@pytest.mark.slow
def test_demo_release_writes_python_and_ranks_the_schemes(demo_weights, tmp_path):
    """The FP8 release the demo starts from: a valid fp8-block checkpoint, text that looks like
    Python, and W8A8 close to BF16 while W4A16 is measurably worse."""
    from cvt.convert.fp8_to_bf16 import fp8_to_bf16
    from cvt.quant.stage import quantize
    from cvt.runtime.tokenizer import load_tokenizer
    from cvt.runtime.verify import verify

    src = demo_model.write_demo_release(tmp_path / "fp8")
    report = inspect_checkpoint(src)
    assert report.problems == [] and report.source_format == "fp8-block"
    assert "Python's standard" in (src / "README.md").read_text()
    bf16 = tmp_path / "bf16"
    fp8_to_bf16(src, bf16, quiet=True)
    loaded = load_model(bf16, dtype=torch.float32)
    assert heldout_ppl(loaded.model) < 20  # FP8 rounding keeps the trained model trained
    tok = load_tokenizer(bf16, loaded.config)
    text = tok.decode(generate(loaded.model, [tok.encode("def __init__(self")], 64, temperature=0.8).outputs[0])
    printable = sum(c.isprintable() or c in "\n\t" for c in text)
    assert printable >= 0.95 * len(text) and any(c in text for c in "():=_"), text

    data = tmp_path / "heldout.txt"
    data.write_text(corpus.text("heldout"))
    kl = {}
    for scheme, fmt in (("w8a8", "ascend"), ("w4a16", "compressed-tensors")):
        quantize(bf16, tmp_path / scheme, scheme=scheme, fmt=fmt, quiet=True)
        kl[scheme] = verify(tmp_path / scheme, bf16, tmp_path / f"rep-{scheme}", data=data, seq_len=128,
                            max_sequences=4).report.logits.kl_mean
    assert kl["w8a8"] < 0.01 and kl["w4a16"] > 3 * kl["w8a8"], kl


@pytest.mark.slow
def test_the_bf16_checkpoint_is_bf16(demo_weights, tmp_path):
    """`write_demo_bf16` drops the release's FP8 quantization_config (it once wrote BF16 weights
    under a config saying fp8, which inspect and every stage read as an FP8 release)."""
    from cvt.convert.inspect import inspect_checkpoint
    from cvt.demo_model import write_demo_bf16

    path = write_demo_bf16(tmp_path / "bf16")
    assert "quantization_config" not in json.loads((path / "config.json").read_text())
    report = inspect_checkpoint(path)
    assert report.to_dict()["source_format"] == "bf16" and not report.problems


def test_two_demo_runs_at_once_train_once_and_share_the_weights(tmp_path, monkeypatch):
    """Two runs that find no cached model: the second waits on the cache's lock for the first's
    model and loads it (was: both trained, and the second wrote its own, different, weights)."""
    import threading
    import time

    import torch

    calls = []

    def slow_train(config, text, recipe, quiet=True):  # the real one takes minutes: a stand-in that differs per call
        calls.append(1)
        time.sleep(0.5)
        return {"w": torch.full((4,), float(len(calls)))}

    monkeypatch.setattr(demo_model, "train", slow_train)
    got = [None, None]

    def run(i):
        got[i] = demo_model.trained_weights(cache=tmp_path)[1]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(calls) == 1
    assert torch.equal(got[0]["w"], got[1]["w"])
    assert demo_model.model_file(tmp_path, demo_model.recipe_key(corpus.text("training"))).is_file()
