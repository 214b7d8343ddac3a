"""Text <-> token ids: the checkpoint's tokenizer.json through the `tokenizers` library, or
a byte-level fallback (id = byte value) for tiny test models without one."""

from __future__ import annotations

import json
from pathlib import Path

from cvt.errors import CvtError


class Tokenizer:
    def __init__(self, folder: Path, config: dict):
        self.bos_id = _first_id(config.get("bos_token_id"))
        self.eos_id = _first_id(config.get("eos_token_id"))
        self.vocab_size = int(config.get("vocab_size") or 0)
        path = Path(folder) / "tokenizer.json"
        self._tok = None
        if path.is_file():
            try:
                from tokenizers import Tokenizer as HFTokenizer
            except ImportError as exc:  # pragma: no cover - a declared dependency
                raise CvtError(f"{path}: the `tokenizers` package is needed to read it ({exc})") from exc
            try:
                self._tok = HFTokenizer.from_file(str(path))
            except Exception as exc:  # the library raises its own exception type
                raise CvtError(f"{path}: cannot load: {exc}") from exc
        elif self.vocab_size < 256:
            raise CvtError(f"{folder}: no tokenizer.json, and a vocabulary of {self.vocab_size} is too small for bytes")
        self.kind = "tokenizers" if self._tok is not None else "bytes"

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text).ids if self._tok is not None else list(text.encode("utf-8"))
        if self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int]) -> str:
        ids = [i for i in ids if i not in (self.bos_id, self.eos_id)]
        if self._tok is not None:
            return self._tok.decode(ids, skip_special_tokens=True)
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def _first_id(v):
    if isinstance(v, list):
        return v[0] if v else None
    return v


def prompt_ids(tok: "Tokenizer", prompts, input_ids, vocab: int) -> list[list[int]]:
    """Token ids of `cvt run`'s --prompt texts and --input-ids lists ("1,2,3"), each id checked
    against the vocabulary; CvtError naming the bad option value or id."""
    for p in prompts:
        try:
            p.encode("utf-8")  # a non-UTF-8 argv arrives as lone surrogates (surrogateescape)
        except UnicodeEncodeError as exc:
            shown = p.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
            raise CvtError(f"--prompt '{shown}': not UTF-8 text (character {exc.start})") from None
    ids = [tok.encode(p) for p in prompts]
    for text in input_ids:
        try:
            ids.append([int(x) for x in text.replace(" ", "").split(",") if x])
        except ValueError:
            raise CvtError(f"--input-ids {text!r}: expected comma-separated integers") from None
    if not ids:
        raise CvtError("give --prompt TEXT or --input-ids 1,2,3")
    for seq in ids:
        bad = [i for i in seq if not 0 <= i < vocab]
        if bad:
            raise CvtError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
    return ids


def load_tokenizer(folder, config: dict) -> Tokenizer:
    return Tokenizer(Path(folder), config)


def read_texts(path: Path) -> list[str]:
    """Calibration / evaluation text: a .jsonl file (a "text" field per line) or plain text."""
    path = Path(path)
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CvtError(f"{path}: cannot read as UTF-8 text: {exc}") from exc
    if path.suffix == ".jsonl":
        texts = []
        for i, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CvtError(f"{path}:{i}: not a JSON line: {exc}") from exc
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise CvtError(f'{path}:{i}: expected an object with a "text" string')
            texts.append(obj["text"])
        return texts
    return [raw]
