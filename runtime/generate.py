"""Prefill + decode with a KV cache; greedy or temperature / top-p sampling; batches.

Prompts of equal length run as one batch (the models take no padding mask, so prompts of
different lengths form separate batches). Timing separates prefill from decode so that
`cvt run` can report decode tokens/s.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from cvt.errors import CvtError


@dataclass
class GenerationResult:
    prompts: list[list[int]]
    outputs: list[list[int]]  # generated ids only, per prompt, in prompt order
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    finished: list[bool] = field(default_factory=list)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> torch.Tensor:
    """logits [b, V] -> ids [b]. temperature 0 is greedy (argmax); top_p < 1 keeps the smallest
    set of tokens whose probability reaches top_p."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p  # always keeps the most likely token
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


def _finite(logits: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """`logits`, or CvtError when the last position's are not all finite: a model with NaN/Inf
    weights (or one that overflows in its dtype) must not print argmax-of-NaN tokens and exit 0."""
    last = logits[:, -1]
    if not bool(torch.isfinite(last).all()):
        bad = int((~torch.isfinite(last)).any(-1).nonzero()[0])
        raise CvtError(f"the model produced non-finite logits (NaN/Inf) for sequence {bad} at positions "
                       f"{start}..{start + n - 1}: its weights hold NaN/Inf or overflow in this dtype "
                       "(`cvt verify` against the reference says where)")
    return logits


@torch.no_grad()
def generate(model, prompts: list[list[int]], max_new_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0,
             seed: int = 0, eos_id: int | None = None, device=None, quiet: bool = True) -> GenerationResult:
    """Greedy or sampled continuations of `prompts` (module doc); `quiet=False` shows a bar of the
    decode steps (max_new_tokens per batch of equal-length prompts)."""
    from cvt.progress import make_progress

    if not prompts or any(len(p) == 0 for p in prompts):
        raise CvtError("every prompt needs at least one token")
    if max_new_tokens < 0:
        raise CvtError("--max-new-tokens must be >= 0")
    # what the CLI's option types refuse, refused for a library caller too (NaN passes every comparison)
    if not (math.isfinite(temperature) and temperature >= 0):
        raise CvtError(f"--temperature {temperature!r}: must be a finite number >= 0")
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise CvtError(f"--top-p {top_p!r}: must be a finite number in (0, 1]")
    if not (isinstance(seed, int) and 0 <= seed < 2**64):
        raise CvtError(f"--seed {seed!r}: must be an integer in 0 .. 2**64-1")
    limit = getattr(model, "max_positions", None)
    longest = max(len(p) for p in prompts)
    if limit is not None and longest + max_new_tokens > limit:
        raise CvtError(f"a prompt of {longest} tokens plus {max_new_tokens} new tokens exceeds the model's "
                       f"{limit} positions (max_position_embeddings)")
    device = device or next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    result = GenerationResult(prompts=prompts, outputs=[[] for _ in prompts], finished=[False] * len(prompts))
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(len(p), []).append(i)
    with make_progress(max_new_tokens * len(groups), "generate", quiet, unit="token") as bar:
        for length, idx in groups.items():
            tokens = torch.tensor([prompts[i] for i in idx], dtype=torch.long, device=device)
            cache = model.new_cache(len(idx), length + max_new_tokens, device=device)
            t0 = time.perf_counter()
            logits = _finite(model(tokens, start_pos=0, cache=cache), 0, length)
            result.prefill_seconds += time.perf_counter() - t0
            result.prefill_tokens += tokens.numel()
            done = torch.zeros(len(idx), dtype=torch.bool)
            t0 = time.perf_counter()
            for step in range(max_new_tokens):
                nxt = sample(logits[:, -1], temperature, top_p, gen)
                for j, i in enumerate(idx):
                    if not done[j]:
                        result.outputs[i].append(int(nxt[j]))
                        if eos_id is not None and int(nxt[j]) == eos_id:
                            done[j] = True
                            result.finished[i] = True
                if bool(done.all()) or step == max_new_tokens - 1:
                    bar.update(max_new_tokens - step)  # this batch's remaining steps: none will run
                    break
                logits = _finite(model(nxt.view(-1, 1), start_pos=length + step, cache=cache), length + step, 1)
                result.decode_tokens += len(idx)
                bar.update(1)
            result.decode_seconds += time.perf_counter() - t0
    return result
