"""The demo's model: a tiny DeepSeek-V3 (MLA + MoE) trained in-process on Python source.

`cvt demo`, the README's examples, the benches and the quality tests need a model whose output
means something: generated text that looks like its training text, and quantization losses that
rank the schemes. Random weights give neither. So the model of `cvt.testing.checkpoints
.tiny_deepseek_config` (one dense and two MoE layers, awkward FP8 blocks, an MTP layer) is
trained here on the "training" slice of Python's standard library source (`cvt.corpus`) with a
byte-level tokenizer (id = byte, then <bos> <eos> <pad>), using the runtime's own model
(`cvt.runtime.models.deepseek_v3`), so what is trained is exactly what cvt runs.

Training is deterministic on one machine: fixed seeds, a fixed thread count, deterministic
algorithms, a fixed recipe (`RECIPE`: 200 steps of 16 x 128 bytes on one thread; ~60-75 CPU
seconds on an x86 server core, about 2 minutes measured on a busy 2-core machine) and happens once:
the float32 weights are cached under ``$XDG_CACHE_HOME/cvt`` (default ``~/.cache/cvt``) in a folder
named by a hash of the recipe, the training text, the torch version and the CPU architecture,
written to a temporary folder and renamed into place (two processes training at once both
finish; one folder wins). The MTP layer is not trained (the runtime does not run it); it keeps the
random initialisation, as do the weights of `cvt.testing.checkpoints.random_weights` for the same
seed, which are the starting point: the untrained model is the old random demo model.

`write_demo_release(dst)` writes the trained weights as a DeepSeek-style FP8 release (block
scales, several shards, index, tokenizer.json): the demo's source checkpoint.
`write_demo_bf16(dst)` writes them as a BF16 checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import logging
import math
import os
import platform
import shutil
import tempfile
from pathlib import Path
from typing import Any

from cvt.errors import CvtError

log = logging.getLogger(__name__)

RECIPE: dict[str, Any] = {
    "format": 1,           # bump when the training code changes what it produces
    "config": {},          # overrides of tiny_deepseek_config()
    "seed": 0,
    "steps": 200,
    "batch": 16,
    "seq_len": 128,        # <bos> + 127 bytes, starting at a line start
    "lr": 4e-3,
    "warmup": 20,
    "final_lr": 0.1,       # cosine decay to this fraction of lr
    "betas": [0.9, 0.95],
    "clip": 1.0,
    "bias_update": 0.01,   # DeepSeek-V3's auxiliary-loss-free balancing of e_score_correction_bias
    "threads": 1,          # the same bits every run; and two threads on two busy cores are several times slower
}
README = ("# tiny DeepSeek-V3-style checkpoint written by cvt (cvt.demo_model)\n\n"
          "One dense and two MoE layers (4 routed experts, top 2, 1 shared), MLA, hidden 256, byte-level "
          "tokenizer.\nTrained in-process for {steps} steps of {batch}x{seq_len} bytes on Python's standard "
          "library source\n(recipe {key}); the MTP layer keeps its random initialisation.\n")


def cache_root() -> Path:
    """$XDG_CACHE_HOME/cvt, or ~/.cache/cvt."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "cvt"


def demo_config() -> dict[str, Any]:
    from cvt.testing.checkpoints import tiny_deepseek_config

    return tiny_deepseek_config(**RECIPE["config"])


def recipe_key(text: str, recipe: dict[str, Any] | None = None) -> str:
    """What determines the trained weights on this machine, hashed: the recipe, the training text,
    torch's version (kernels change) and the CPU architecture (float rounding of its kernels)."""
    import torch

    from cvt import corpus

    ident = {"recipe": recipe or RECIPE, "corpus": corpus.digest(text), "torch": torch.__version__,
             "machine": platform.machine()}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def model_file(cache: Path | None = None, key: str | None = None) -> Path:
    """Where the trained weights are cached: `cache` (default `cache_root()`) / demo-dsv3-KEY /
    model.safetensors, KEY the recipe key of this machine (`recipe_key`)."""
    if key is None:
        from cvt import corpus

        key = recipe_key(corpus.text("training"))
    return (Path(cache) if cache is not None else cache_root()) / f"demo-dsv3-{key}" / "model.safetensors"


def model_note(cache: Path | None = None) -> str:
    """What `cvt demo` says of its model before writing it: that it reuses the weights an earlier
    run cached, or what training them takes now (the work, not a time: machines differ)."""
    path = model_file(cache)
    if path.is_file():
        return f"(reusing the model an earlier run trained, cached in {path.parent})"
    r = RECIPE
    return (f"(this first run trains it: {r['steps']} steps of {r['batch']} x {r['seq_len']} bytes on one CPU "
            f"thread, with a progress bar; cached in {path.parent.parent} for the runs after)")


def trained_weights(cache: Path | None = None, quiet: bool = True) -> tuple[dict[str, Any], dict, str]:
    """(config, name -> float32 tensor, recipe key): from the cache, or trained now and cached.

    `cache`: the cache root (default `cache_root()`). `quiet=False` shows a progress bar on stderr
    while training."""
    from cvt import corpus

    text = corpus.text("training")
    key = recipe_key(text)
    path = model_file(cache, key)
    root = path.parent.parent
    config = demo_config()
    if path.is_file():
        return config, _cached(path), key
    with _training_lock(root, key, quiet):  # a second demo run waits for the first's model, then reuses it
        if path.is_file():
            return config, _cached(path), key
        return config, _train_and_cache(config, text, key, path, quiet), key


def _cached(path: Path) -> dict:
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors raises its own types
        raise CvtError(f"{path}: the cached demo model cannot be read ({exc}); delete {path.parent} "
                       "and it is trained again") from exc


@contextlib.contextmanager
def _training_lock(root: Path, key: str, quiet: bool):
    """An exclusive lock on ``ROOT/.demo-dsv3-KEY.lock`` while the model is trained and cached, so
    that two demo runs at once train it once and use the same weights (training in two processes
    at once gave two different models: its float sums follow the threads' timing). No lock where
    the cache cannot be written (the run trains for itself, as before)."""
    try:
        import fcntl

        root.mkdir(parents=True, exist_ok=True)
        fh = open(root / f".demo-dsv3-{key}.lock", "a+")
    except (ImportError, OSError):
        yield
        return
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not quiet:
                log.warning("another cvt demo is training the demo model; waiting for it (%s)", root)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _train_and_cache(config: dict, text: str, key: str, path: Path, quiet: bool) -> dict:
    from safetensors.torch import save_file

    folder, root = path.parent, path.parent.parent
    weights = train(config, text, RECIPE, quiet=quiet)
    tmp = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-demo-dsv3-{key}-", dir=root))
        save_file({n: t.contiguous() for n, t in weights.items()}, str(tmp / "model.safetensors"))
        (tmp / "recipe.json").write_text(json.dumps({"key": key, "recipe": RECIPE}, indent=2) + "\n")
        try:
            os.rename(tmp, folder)  # the folder appears complete or not at all
        except OSError:
            if not path.is_file():  # not a concurrent run's finished folder: a real failure
                raise
    except OSError as exc:  # the weights are here all the same: only the next run trains again
        log.warning("%s: cannot cache the demo model (%s); the next run trains it again (set XDG_CACHE_HOME "
                    "to a writable folder)", root, exc.strerror or exc)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return weights


def train(config: dict[str, Any], text: str, recipe: dict[str, Any], quiet: bool = True) -> dict:
    """The runtime's DeepSeek-V3 model trained on `text` (UTF-8 bytes) as `recipe` says; returns
    name -> float32 tensor for every weight of `config`, the MTP layer's untrained."""
    import torch
    import torch.nn.functional as F

    from cvt.testing.checkpoints import random_weights
    from cvt.runtime.models import deepseek_v3

    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(recipe["threads"])
    torch.use_deterministic_algorithms(True)
    try:
        init = random_weights(config, recipe["seed"])
        model = deepseek_v3.Model(deepseek_v3.Args.from_config(config), dtype=torch.float32, mtp=False)
        state = model.state_dict()
        with torch.no_grad():
            for name, t in state.items():
                t.copy_(init[name])
        params = [p for n, p in model.named_parameters() if not n.endswith("e_score_correction_bias")]
        for p in params:
            p.requires_grad_(True)
        gates = [layer.mlp.gate for layer in model.model.layers if isinstance(layer.mlp, deepseek_v3.MoE)]
        loads: list = []
        hooks = [g.register_forward_hook(lambda mod, args, out: loads.append((mod, out[1]))) for g in gates]
        # Model.forward is a no-grad inference call; its undecorated body is the same math with autograd
        forward = inspect.unwrap(deepseek_v3.Model.forward)
        opt = torch.optim.AdamW(params, lr=recipe["lr"], betas=tuple(recipe["betas"]), weight_decay=0.0)
        data, starts = _training_bytes(text, recipe["seq_len"])
        gen = torch.Generator().manual_seed(recipe["seed"])
        bos, steps = config["bos_token_id"], recipe["steps"]
        from cvt.progress import make_progress

        bar = make_progress(steps, "training the demo model", quiet, unit="step", leave=False)
        for step in range(steps):
            pick = starts[torch.randint(len(starts), (recipe["batch"],), generator=gen)]
            x = data[pick[:, None] + torch.arange(recipe["seq_len"] - 1)]
            x = torch.cat([torch.full((len(x), 1), bos, dtype=torch.long), x], dim=1)      # [b, seq_len]
            lr = recipe["lr"] * min(1.0, (step + 1) / recipe["warmup"])
            lr *= recipe["final_lr"] + (1 - recipe["final_lr"]) * 0.5 * (1 + math.cos(math.pi * step / steps))
            for group in opt.param_groups:
                group["lr"] = lr
            loads.clear()
            logits = forward(model, x)
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, recipe["clip"])
            opt.step()
            with torch.no_grad():
                for gate, idx in loads:  # raise the bias of under-used experts, lower over-used ones'
                    count = torch.bincount(idx.flatten(), minlength=gate.e_score_correction_bias.numel()).float()
                    gate.e_score_correction_bias += recipe["bias_update"] * torch.sign(count.mean() - count)
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
        bar.close()
        for h in hooks:
            h.remove()
        out = {n: t.detach().clone() for n, t in model.state_dict().items()}
        out.update({n: t for n, t in init.items() if n not in out})  # the MTP layer
        return {n: out[n] for n in init}
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def _training_bytes(text: str, seq_len: int):
    """(bytes of `text` as int64 [N], offsets of line starts with seq_len - 1 bytes after them)."""
    import torch

    raw = text.encode("utf-8")
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
    starts = torch.cat([torch.zeros(1, dtype=torch.long), torch.nonzero(data == ord("\n")).flatten() + 1])
    return data, starts[starts <= len(raw) - (seq_len - 1)]


def write_demo_release(dst: Path, cache: Path | None = None, quiet: bool = True, n_shards: int = 3) -> Path:
    """The trained demo model as a DeepSeek-style FP8 release in `dst` (see `cvt.testing.checkpoints
    .write_release`: block-scaled e4m3 linears, BF16 norms/embeddings, F32 router bias, shards)."""
    from cvt.testing.checkpoints import release_tensors, write_release

    config, weights, key = trained_weights(cache, quiet)
    return write_release(dst, config, release_tensors(config, weights=weights), n_shards,
                         readme=README.format(key=key, **RECIPE))


def write_demo_bf16(dst: Path, cache: Path | None = None, quiet: bool = True, n_shards: int = 2) -> Path:
    """The trained demo model as a BF16 checkpoint (router bias F32) in `dst`."""
    from cvt.testing.checkpoints import write_bf16_checkpoint

    config, weights, key = trained_weights(cache, quiet)
    config = {k: v for k, v in config.items() if k != "quantization_config"}  # the release's FP8 config
    return write_bf16_checkpoint(dst, config, n_shards=n_shards, weights=weights,
                                 readme=README.format(key=key, **RECIPE))
