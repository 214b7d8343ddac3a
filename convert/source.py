"""Resolve SRC: a local directory, or a Hugging Face hub repo id (through huggingface-hub).

Hub downloads take only what a conversion reads or copies (weights, JSON configs, tokenizer
files, remote-code .py files and README), never pickles. `HF_HUB_OFFLINE=1` is honoured by
huggingface-hub itself: an id already in the cache resolves without network.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from cvt.errors import CheckpointError

HUB_PATTERNS = [
    "*.safetensors",
    "*.json",
    "tokenizer*",
    "*.tiktoken",
    "*.model",
    "*.py",
    "*.txt",
    "*.jinja",
    "README*",
    "LICENSE*",
]
# what a verb that reads config.json alone (`cvt plan`) takes from the hub: the config, and a cvt
# output's manifest (its own scheme, format and target)
CONFIG_PATTERNS = ["config.json", "cvt_manifest.json"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


@dataclass(frozen=True)
class Source:
    """Where a checkpoint came from: a local path, or a hub id at a resolved commit."""

    path: Path
    repo_id: str | None = None
    revision: str | None = None

    @property
    def kind(self) -> str:
        return "hub" if self.repo_id else "local"

    def describe(self) -> str:
        return f"{self.repo_id}@{self.revision}" if self.repo_id else str(self.path)

    @property
    def confine_root(self) -> Path:
        """What the checkpoint's files must resolve inside (`cvt.convert.paths`): the directory,
        or for a hub snapshot (``.../models--o--n/snapshots/<commit>``, files symlinked into
        ``../../blobs``) the repository's cache folder."""
        if self.repo_id and self.path.parent.name == "snapshots":
            return self.path.parent.parent
        return self.path


def resolve(src: str | Path, revision: str | None = None, patterns: list[str] = HUB_PATTERNS) -> Source:
    """SRC as a local directory, or a hub repo id's snapshot with the files `patterns` match."""
    path = Path(src).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"{path}: not a directory (SRC is a checkpoint directory or a hub repo id)")
        if revision:
            raise CheckpointError(f"{path}: --revision applies to hub repo ids, not local directories")
        return Source(path.resolve())
    text = str(src)
    if not _REPO_ID.match(text) or text.startswith((".", "/", "~")):
        raise CheckpointError(f"{src}: no such directory (and not a hub repo id of the form owner/name)")
    return _download(text, revision, patterns)


def _download(repo_id: str, revision: str | None, patterns: list[str]) -> Source:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            HfHubHTTPError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError as exc:  # pragma: no cover - a declared dependency
        raise CheckpointError(f"{repo_id}: huggingface-hub is needed for hub ids ({exc})") from exc
    try:
        folder = Path(snapshot_download(repo_id=repo_id, revision=revision, allow_patterns=patterns))
    except LocalEntryNotFoundError as exc:
        raise CheckpointError(
            f"{repo_id}@{revision or 'main'}: not a local directory, and not available from the hub cache "
            f"(offline, or the hub cannot be reached; HF_HUB_OFFLINE / HF_HOME decide): {_first_line(exc)}"
        ) from exc
    except RevisionNotFoundError as exc:
        raise CheckpointError(f"{repo_id}: revision {revision!r} not found on the hub") from exc
    except RepositoryNotFoundError as exc:
        raise CheckpointError(f"{repo_id}: no such hub repository (or it needs a token)") from exc
    except (HfHubHTTPError, OSError) as exc:
        raise CheckpointError(f"{repo_id}: download failed: {_first_line(exc)}") from exc
    # snapshot folders are named by the commit they hold
    return Source(folder, repo_id=repo_id, revision=folder.name)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
