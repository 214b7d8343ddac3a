"""README.md is the short front page a newcomer reads in five minutes (issue 36): at most 200
lines, a Quick start of exactly two commands, a walkthrough whose five commands run on the demo's
model, a support matrix equal to the one the registries give (`cvt.support`), and links into
docs/ that resolve. The rest of the documentation is docs/ (tests/test_docs.py)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from cvt import support
from cvt.tests.conftest import run_cvt
from cvt.tests.test_docs import DOCS, commands_in, command_problems

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def section(text: str, title: str) -> str:
    head = re.search(rf"^## {re.escape(title)}\s*$", text, flags=re.M)
    assert head, f"README.md has no '## {title}' section"
    end = re.search(r"^## ", text[head.end():], flags=re.M)
    return text[head.end(): head.end() + end.start() if end else len(text)]


def test_the_readme_is_at_most_200_lines():
    n = len(README.read_text().splitlines())
    assert n <= 200, f"README.md has {n} lines; move the detail into docs/"


def test_the_quick_start_is_exactly_two_commands():
    blocks = re.findall(r"^```sh\n(.*?)^```", section(README.read_text(), "Quick start"), flags=re.M | re.S)
    assert len(blocks) == 1, blocks
    commands = [ln.split("#", 1)[0].strip() for ln in blocks[0].splitlines() if ln.split("#", 1)[0].strip()]
    assert commands == ["make demo", "make test"]


@pytest.mark.parametrize("path", [README, DOCS / "index.md"], ids=lambda p: p.name)
def test_the_support_matrix_is_the_registries(path):
    """The matrix between the markers is what `python -m cvt.support --markdown` prints now: a
    registry change (a scheme, a layout, an architecture, a refusal) without re-running
    `python -m cvt.support --update README.md docs/index.md` fails here."""
    got = support.block(path.read_text())
    assert got is not None, f"{path.name}: no {support.BEGIN!r} ... {support.END!r} markers"
    assert got == support.markdown(), f"{path.name}: run `python -m cvt.support --update README.md docs/index.md`"


def test_the_support_matrix_follows_the_registries(monkeypatch):
    """The matrix is computed, not copied: a layout the stage no longer accepts, or a family's new
    refusal, changes its cells."""
    from cvt.qtensor.formats import get_format

    before = support.markdown()
    ct = type(get_format("compressed-tensors"))
    monkeypatch.setattr(ct, "refused_models", {**ct.refused_models, "qwen3_moe": "a test"})
    rows = {r.model_types: r for r in support.matrix()}
    assert all(c.target != "vllm" for cells in rows[("qwen3_moe",)].cells for c in cells)
    assert support.markdown() != before


def _links(text: str) -> list[str]:
    return re.findall(r"\]\((docs/[^)\s]+)\)", text)


def _slug(heading: str) -> str:
    from markdown.extensions.toc import slugify

    return slugify(re.sub(r"[`*]", "", heading), "-")


def test_every_link_into_docs_resolves():
    links = _links(README.read_text())
    assert len(links) >= 20, links
    for link in links:
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.is_file(), f"README.md links to {link}, which is not a file"
        if anchor:
            heads = re.findall(r"^#{1,6} (.+?)\s*$", target.read_text(), flags=re.M)
            assert anchor in {_slug(h) for h in heads}, f"README.md links to {link}: no such heading there"


def test_the_walkthrough_is_five_real_commands():
    lines = commands_in(section(README.read_text(), "Walkthrough on the demo model"))
    assert len(lines) == 5, lines
    assert not [p for ln in lines for p in command_problems(ln)]


@pytest.mark.slow
def test_the_walkthrough_runs_on_the_demo_model(demo_weights, tmp_path, monkeypatch):
    """The five commands, as written, from a folder holding what `make demo` writes first (its
    trained FP8 release and its BF16 conversion): each exits 0, and verify's gates pass."""
    from cvt.demo_model import write_demo_release

    write_demo_release(tmp_path / "cvt-demo" / "source-fp8")
    monkeypatch.chdir(tmp_path)
    assert run_cvt("fp8-to-bf16", "cvt-demo/source-fp8", "cvt-demo/bf16", "--quiet").rc == 0
    for line in commands_in(section(README.read_text(), "Walkthrough on the demo model")):
        r = run_cvt(*shlex.split(line)[1:])
        assert r.rc == 0, (line, r.err)
        if line.startswith("cvt verify"):
            assert "result: PASSED" in r.out, r.out
    assert (tmp_path / "w8a8-tp2-ep2" / "rank-00001").is_dir()
