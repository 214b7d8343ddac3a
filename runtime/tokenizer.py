"""Text <-> token ids: the checkpoint's tokenizer.json through the `tokenizers` library, or
a byte-level fallback (id = byte value) for tiny test models without one."""

from __future__ import annotations

import json
import stat
from pathlib import Path

from cvt.convert.reader import file_kind
from cvt.errors import CvtError, OptionError


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


def input_ids_problem(text: str) -> str | None:
    """Why one --input-ids value ("1,2,3"; spaces and empty items between commas ignored) is no
    list of token ids, starting with the value; None when it is one. The CLI's option type says it
    (exit 2) before anything is read; the vocabulary bound needs the model (`prompt_ids`)."""
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        return f"{text!r}: expected comma-separated integers"
    if not ids:
        return f"{text!r}: no token id in it (expected comma-separated integers, e.g. 1,2,3)"
    if min(ids) < 0:
        return f"{text!r}: token id {min(ids)} is negative"
    return None


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
        why = input_ids_problem(text)
        if why is not None:
            raise OptionError(f"--input-ids {why}")
        ids.append([int(x) for x in text.replace(" ", "").split(",") if x])
    if not ids:
        raise CvtError("give --prompt TEXT or --input-ids 1,2,3")
    given = [None] * len(prompts) + list(input_ids)  # the --input-ids text of each list (None: a --prompt's)
    for seq, text in zip(ids, given):
        bad = [i for i in seq if not 0 <= i < vocab]
        if bad:
            raise CvtError(("" if text is None else f"--input-ids {text!r}: ")
                           + f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
    return ids


def load_tokenizer(folder, config: dict) -> Tokenizer:
    return Tokenizer(Path(folder), config)


# What one --calib / --data file may make cvt read: a file, or a .jsonl line, whose first 64 MiB
# give fewer tokens than the run uses is refused rather than read (and held) without bound.
MAX_TEXT_CHARS = 64 << 20
# Tokens dropped at the cut of a partly read text: the last word's tokens may depend on what
# follows it; so many more than needed keep the used ids equal to the whole text's.
_CUT_SLACK = 64


def read_ids(tok: "Tokenizer", path: Path, need: int, *, option: str, skip_blank: bool = False) -> tuple[list[int], int]:
    """(token ids, texts used) of a --calib / --data file, reading only what is used.

    A .jsonl file holds one text per line (a "text" field), anything else is one text; each
    text is tokenized with the tokenizer's BOS and the ids concatenated, as if every text were
    read whole, until there are `need` ids (fewer when the file ends first). A text is read and
    tokenized in doubling prefixes (the first ~16 characters per needed token): a 60 MB line
    costs what its used part costs. `skip_blank` drops texts of only whitespace. CvtError
    naming the option and file: not a regular file (a FIFO, /dev/zero), not UTF-8, a bad JSON
    line, or more than MAX_TEXT_CHARS to read before `need` ids."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise CvtError(f"{option} {path}: cannot read: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        raise CvtError(f"{option} {path}: not a regular file ({file_kind(path)}); give a text or .jsonl file")
    ids: list[int] = []
    used = read = 0

    def bounded(chunk: str, more: bool) -> str:
        nonlocal read
        read += len(chunk)
        if read > MAX_TEXT_CHARS and more:
            raise CvtError(f"{option} {path}: {len(ids)} of the {need} tokens used after {MAX_TEXT_CHARS >> 20} MiB "
                           "of text; cvt reads no more of a calibration / evaluation file (shorten its lines)")
        return chunk

    try:
        with open(path, encoding="utf-8") as f:  # text mode: newlines as Path.read_text reads them
            if path.suffix != ".jsonl":
                # never more than the bound at once (a read of 16 x 10**9 characters allocates that much)
                blank, got = _encode_prefix(tok, lambda k: bounded(f.read(min(k, MAX_TEXT_CHARS + 1 - read)), True),
                                            need)
                if not (skip_blank and blank):
                    ids, used = got, 1
                return ids, used
            line_no = 0
            while len(ids) < need:
                line = bounded(f.readline(MAX_TEXT_CHARS - read + 1), True)
                if not line:
                    break
                line_no += 1
                if not line.strip():
                    continue
                text = _json_text(line, path, line_no)
                if skip_blank and not text.strip():
                    continue
                pos = 0

                def part(k: int) -> str:
                    nonlocal pos
                    pos += k
                    return text[pos - k:pos]

                ids += _encode_prefix(tok, part, need - len(ids))[1]
                used += 1
    except UnicodeDecodeError as exc:
        raise CvtError(f"{option} {path}: cannot read as UTF-8 text: {exc}") from None
    except OSError as exc:
        raise CvtError(f"{option} {path}: cannot read: {exc.strerror or exc}") from None
    return ids, used


def _encode_prefix(tok: "Tokenizer", more, need: int) -> tuple[bool, list[int]]:
    """(blank, ids): the text that `more(k)` hands out (up to k more characters a call, fewer at
    its end) tokenized, its first `need` ids when it is longer: prefixes of doubling length are
    tokenized until one gives `need` ids plus the cut's slack. blank: all of it read, whitespace."""
    text, n = "", max(4096, 16 * need)
    while True:
        want = n - len(text)
        chunk = more(want)
        text += chunk
        ids = tok.encode(text)
        if len(chunk) < want:
            return not text.strip(), ids
        if len(ids) >= need + _CUT_SLACK:
            return False, ids[:need]
        n *= 2


def _json_text(line: str, path: Path, i: int) -> str:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise CvtError(f"{path}:{i}: not a JSON line: {exc}") from None
    except RecursionError:  # e.g. 50,000 nested arrays: Python's parser runs out of stack
        raise CvtError(f'{path}:{i}: JSON nested too deeply (expected an object with a "text" string)') from None
    if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
        raise CvtError(f'{path}:{i}: expected an object with a "text" string')
    return obj["text"]


