"""README.md against the code: every verb's documented option list is its `--help`'s, and the
`cvt inspect` sample is what the command prints on the demo's source (issue 23)."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest

from cvt.cli import cli
from cvt.tests.conftest import run_cvt

README = Path(__file__).resolve().parents[1] / "README.md"
COMMON = {"--help", "--quiet", "--debug"}  # every verb's, said once in the README's Usage


def _verbs(group: click.Group, prefix: tuple[str, ...] = ()):
    for name, cmd in sorted(group.commands.items()):
        if isinstance(cmd, click.Group):
            yield from _verbs(cmd, prefix + (name,))
        else:
            yield prefix + (name,)


def _help_options(verb: tuple[str, ...]) -> list[str]:
    """The long options `cvt VERB --help` prints, in its order (``--x / --no-x``: both)."""
    r = run_cvt(*verb, "--help")
    assert r.rc == 0, r.err
    found = []
    for line in r.out.split("\nOptions:", 1)[1].splitlines():
        m = re.match(r"^\s{1,4}(?:-\w, )?(--[a-z][\w-]*)(?:\s*/\s*(--[a-z][\w-]*))?", line)
        if m:
            found += [o for o in m.groups() if o]
    return found


def _section(text: str, verb: tuple[str, ...]) -> str:
    head = re.search(rf"^### `cvt {' '.join(verb)}\b.*$", text, flags=re.M)
    assert head, f"README.md has no '### `cvt {' '.join(verb)} ...`' section"
    end = re.search(r"^#{2,3} ", text[head.end():], flags=re.M)
    return text[head.end(): head.end() + end.start() if end else len(text)]


@pytest.mark.parametrize("verb", list(_verbs(cli)), ids=" ".join)
def test_readme_documents_each_verbs_options(verb):
    """Each verb's README section has an `Options:` paragraph listing exactly what --help lists."""
    section = _section(README.read_text(), verb)
    para = re.search(r"^Options: (.*?)(?:\n\n|\Z)", section, flags=re.M | re.S)
    assert para, f"cvt {' '.join(verb)}: no 'Options:' paragraph in its README section"
    documented = re.findall(r"`(--[a-z][\w-]*)`", para.group(1))
    assert sorted(documented) == sorted(set(_help_options(verb)) - COMMON), " ".join(verb)


def test_readme_inspect_sample_is_the_real_output(tmp_path):
    """The sample under `cvt inspect PATH` is the command's output on what `cvt demo` writes first
    (its FP8 source, `write_fp8_release`), the path shown as .../cvt-demo/source-fp8."""
    from cvt.testing.checkpoints import write_fp8_release

    block = re.search(r"```\n\$ cvt inspect (cvt-demo/source-fp8)[^\n]*\n(.*?)```", README.read_text(), re.S)
    assert block, "README.md: no `$ cvt inspect cvt-demo/source-fp8` sample"
    src = write_fp8_release(tmp_path / "cvt-demo" / "source-fp8")
    r = run_cvt("inspect", src)
    assert r.rc == 0, r.err
    assert r.out.replace(str(tmp_path) + "/", ".../") == block.group(2)
