"""The docs site (docs/, mkdocs.yml) against the code: it builds strictly (a broken link, an unknown
anchor or a page missing from the nav fails), every option of every verb is on that verb's built
page, every `cvt ...` command in a code block names a real verb and only its options, and the
`cvt inspect` sample is what the command prints on the demo's source (issue 23, issue 36)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest

from cvt.cli import cli
from cvt.tests.conftest import run_cvt

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
COMMON = {"--help", "-h"}  # click's own; --quiet and --debug are every verb's and listed on each page


def verbs(group: click.Group = cli, prefix: tuple[str, ...] = ()):
    """(words, command) of every leaf verb: ("quantize",), ("export", "onnx"), ..."""
    for name, cmd in sorted(group.commands.items()):
        if isinstance(cmd, click.Group):
            yield from verbs(cmd, prefix + (name,))
        else:
            yield prefix + (name,), cmd


def page(verb: tuple[str, ...]) -> Path:
    """The docs page of a verb: docs/quantize.md, docs/export-onnx.md, ..."""
    return DOCS / ("-".join(verb) + ".md")


def option_names(cmd: click.Command, hidden: bool = False) -> set[str]:
    """Every spelling of every option a verb takes (``--resume`` and ``--no-resume`` both); with
    `hidden`, also those its --help leaves out (a deprecated alias)."""
    return {o for p in cmd.params if isinstance(p, click.Option) and (hidden or not p.hidden)
            for o in (*p.opts, *p.secondary_opts)} - COMMON


def commands_in(text: str) -> list[str]:
    """The `cvt ...` command lines of the Markdown `text`'s code blocks (``$ `` prompts and ``\\``
    continuations joined, comments cut)."""
    out = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S):
        block = re.sub(r"\s*\\\n\s*", " ", block)
        for line in block.splitlines():
            line = line.strip().removeprefix("$ ")
            if line.startswith("cvt "):
                out.append(line.split(" #", 1)[0].strip())
    return out


def command_problems(line: str) -> list[str]:
    """What is wrong with the command line `line` (`cvt VERB ... --opt ...`): an unknown verb, or
    an option the verb does not take."""
    words = shlex.split(line)[1:]
    cmd: click.Command = cli
    while isinstance(cmd, click.Group) and words and not words[0].startswith("-"):
        name = words.pop(0)
        if name not in cmd.commands:
            return [f"{line}: no verb {name!r}"]
        cmd = cmd.commands[name]
    if isinstance(cmd, click.Group):
        return [f"{line}: names a group, not a verb"]
    known = option_names(cmd, hidden=True) | COMMON
    return [f"{line}: {cmd.name} has no option {w.split('=', 1)[0]}"
            for w in words if w.startswith("--") and w.split("=", 1)[0] not in known]


@pytest.fixture(scope="session")
def site(tmp_path_factory) -> Path:
    """The site built from mkdocs.yml in strict mode (as `make docs`), once per session."""
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[docs]'; the test extra has it)")
    pytest.importorskip("material", reason="mkdocs-material is not installed (the docs / test extras have it)")
    pytest.importorskip("mkdocs_click", reason="mkdocs-click is not installed (the docs / test extras have it)")
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    out = tmp_path_factory.mktemp("site")
    build(load_config(str(ROOT / "mkdocs.yml"), site_dir=str(out), strict=True))  # Abort on any warning
    return out


def test_every_verb_has_a_page_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    for verb, _ in verbs():
        assert page(verb).is_file(), f"cvt {' '.join(verb)}: no {page(verb).relative_to(ROOT)}"
        assert f": {page(verb).name}" in nav, f"mkdocs.yml: {page(verb).name} is not in the nav"


@pytest.mark.parametrize("verb", [v for v, _ in verbs()], ids=" ".join)
def test_every_option_is_on_its_verbs_built_page(site, verb):
    """Each verb's page carries the reference mkdocs-click generates from the command itself, so
    an option added to the CLI shows up there (and a page without the reference fails here)."""
    cmd = dict(verbs())[verb]
    html = (site / page(verb).with_suffix(".html").name).read_text()
    missing = sorted(o for o in option_names(cmd) if o not in html)
    assert not missing, f"cvt {' '.join(verb)}: {missing} not on {page(verb).name}"


def test_the_site_loads_nothing_from_the_network(site):
    """No web fonts, scripts or styles from elsewhere: the site works offline."""
    found = sorted({m for f in site.rglob("*.html")
                    for m in re.findall(r'(?:src|href)="(https?://[^"]+\.(?:js|css)[^"]*|https?://fonts\.[^"]+)"',
                                        f.read_text())})
    assert not found, found


def test_every_command_in_the_docs_is_a_real_verb_with_its_options():
    found, problems = 0, []
    for md in sorted([*DOCS.glob("*.md"), ROOT / "README.md"]):
        for line in commands_in(md.read_text()):
            found += 1
            problems += [f"{md.relative_to(ROOT)}: {p}" for p in command_problems(line)]
    assert found > 40, found  # the walk found the commands
    assert not problems, "\n".join(problems)


def test_command_problems_finds_what_it_must():
    assert command_problems("cvt quantize A B --scheme w8a8 --format=ascend") == []
    assert command_problems("cvt export onnx A B --int4-op qdq") == []
    assert command_problems("cvt quantise A B") == ["cvt quantise A B: no verb 'quantise'"]
    assert command_problems("cvt shard A B --no-such-flag 3") == ["cvt shard A B --no-such-flag 3: shard has no option "
                                                                   "--no-such-flag"]
    assert commands_in("x\n```sh\n$ cvt run M \\\n   --prompt hi   # c\n```\n") == ["cvt run M --prompt hi"]


def test_the_inspect_sample_is_the_real_output(tmp_path):
    """The sample on the inspect page is the command's output on what `cvt demo` writes first (its
    FP8 source, `write_fp8_release`), the path shown as .../cvt-demo/source-fp8."""
    from cvt.testing.checkpoints import write_fp8_release

    text = page(("inspect",)).read_text()
    block = re.search(r"```\n\$ cvt inspect (cvt-demo/source-fp8)[^\n]*\n(.*?)```", text, re.S)
    assert block, "docs/inspect.md: no `$ cvt inspect cvt-demo/source-fp8` sample"
    src = write_fp8_release(tmp_path / "cvt-demo" / "source-fp8")
    r = run_cvt("inspect", src)
    assert r.rc == 0, r.err
    assert r.out.replace(str(tmp_path) + "/", ".../") == block.group(2)


def test_the_development_page_names_every_module_and_folder():
    """The repository map on docs/development.md names every module of cvt/ and every folder the
    package is built from, so a new module (cvt/world.py was once left out) cannot go unmentioned."""
    text = (DOCS / "development.md").read_text()
    block = re.search(r"## The repository\n+```\n(.*?)```", text, re.S).group(1)
    modules = [p.stem for p in (ROOT / "cvt").glob("*.py") if p.stem not in ("__init__", "__main__")]
    missing = [m for m in modules if not re.search(rf"\b{m}\b", block)]
    folders = [p.name for p in (ROOT / "cvt").iterdir() if p.is_dir() and p.name != "__pycache__"]
    missing += [f"{f}/" for f in folders if f"{f}/" not in block]
    assert not missing, f"docs/development.md's repository map leaves out {missing}"
