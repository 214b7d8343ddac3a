"""Text every machine with Python has: slices of the running interpreter's standard library source.

Three disjoint, fixed file lists under ``sysconfig.get_paths()["stdlib"]``, each read in the listed
order, so a slice is the same text on every run of one Python installation:

* ``training``: Python modules the demo model (`cvt.demo_model`) is trained on;
* ``heldout``: other modules, never trained on: the demo's perplexity check and verify data;
* ``calibration``: the text of ``pydoc_data/topics.py`` (the language reference's prose, code
  samples included, as pydoc shows it) and modules in neither list above, interleaved a few KB at a time so that any prefix mixes
  English and code: the built-in calibration set of ``cvt quantize`` (`cvt.quant.methods.data`).

The modules are single files present in CPython 3.10 to 3.13 (no package that was a module in one
of them, nothing PEP 594 removed). Their text differs between Python versions, so anything derived
from it (a trained model, a calibration plan id) is keyed by `digest` of the text it read; a file
missing from an unusual installation is skipped, and a slice with too little text left is a
`CvtError` naming the directory.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

from cvt.errors import CvtError

TRAINING = (
    "argparse.py", "ast.py", "calendar.py", "configparser.py", "contextlib.py", "dataclasses.py", "difflib.py",
    "dis.py", "enum.py", "fractions.py", "functools.py", "gettext.py", "gzip.py", "heapq.py", "inspect.py",
    "ipaddress.py", "optparse.py", "pickle.py", "pprint.py", "random.py", "shutil.py", "socket.py",
    "statistics.py", "subprocess.py", "tarfile.py", "tempfile.py", "textwrap.py", "threading.py", "tokenize.py",
    "traceback.py", "typing.py", "uuid.py", "warnings.py", "weakref.py",
)
HELDOUT = ("bisect.py", "fnmatch.py", "glob.py", "queue.py", "sched.py", "shlex.py", "string.py")
TOPICS = "pydoc_data/topics.py"
CALIBRATION = (
    TOPICS, "codecs.py", "locale.py", "imaplib.py", "mimetypes.py", "os.py", "platform.py",
    "plistlib.py", "pstats.py", "smtplib.py", "socketserver.py", "trace.py", "webbrowser.py", "zipimport.py",
)
SLICES = {"training": TRAINING, "heldout": HELDOUT, "calibration": CALIBRATION}
MIN_CHARS = {"training": 200_000, "heldout": 20_000, "calibration": 200_000}
CHUNK = 4096  # characters: the calibration slice alternates sources about this often
CALIB_TOKENS = 32768
"""``cvt quantize --calib-tokens``' default (128 sequences x 256, llm-compressor's GPTQ budget at
that length), a bound: the calibration slice gives more with any tokenizer, and a shorter
``--calib`` file is used whole with a warning. A count the user gives is a demand (more than the
text gives is refused: `cvt.quant.methods.data`)."""


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _read(names: tuple[str, ...]) -> list[str]:
    root = stdlib_dir()
    texts = []
    for name in names:
        try:
            body = (root / name).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # an installation without that module (or with a damaged one): the slice is shorter
        texts.append(_prose(body) if name == TOPICS else body)
    return texts


def _prose(source: str) -> str:
    """pydoc's ``topics = {name: text}`` module as the text itself (topics in name order): English
    with code samples, not string literals. The source as it is when it has no such dict."""
    import ast

    try:
        for node in ast.parse(source).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "topics" for t in node.targets):
                topics = ast.literal_eval(node.value)
                return "".join(str(topics[k]).rstrip("\n") + "\n\n" for k in sorted(topics))
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        pass
    return source


def chunks(text: str, size: int) -> list[str]:
    """`text` cut at line ends into pieces of about `size` characters (lines kept whole)."""
    out, start = [], 0
    while start < len(text):
        end = text.find("\n", start + size)
        end = len(text) if end < 0 else end + 1
        out.append(text[start:end])
        start = end
    return out


def text(slice_: str) -> str:
    """The whole text of one slice ("training", "heldout" or "calibration")."""
    texts = _read(SLICES[slice_])
    if slice_ == "calibration":
        # round robin over the sources, a chunk of each in turn: every prefix is a mix
        pieces = [chunks(t, CHUNK) for t in texts]
        merged = [p[i] for i in range(max(map(len, pieces), default=0)) for p in pieces if i < len(p)]
        body = "".join(merged)
    else:
        body = "".join(texts)
    if len(body) < MIN_CHARS[slice_]:
        raise CvtError(f"{stdlib_dir()}: only {len(body)} characters of Python standard library source found for "
                       f"the {slice_} text (need {MIN_CHARS[slice_]}); this Python installation ships without "
                       "its .py sources")
    return body


def digest(body: str) -> str:
    return hashlib.sha256(body.encode("utf-8")).hexdigest()
