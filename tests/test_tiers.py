"""The two test tiers (issue 36 item 4): `make test` runs everything, `make test-fast` the rest.

`make test` is what CI runs (.ci/run) and the README's set-up command: it must deselect nothing,
the tests marked slow included. `make test-fast` is the edit loop: the same suite less the tests
marked ``@pytest.mark.slow`` (pyproject.toml declares the marker and says what slow means).
Text checks of the Makefile, .ci/run and pyproject.toml; no make is run.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
# pytest options that leave tests out of a run
DESELECTING = ("-m", "-k", "--deselect", "--ignore", "--ignore-glob", "-x", "--exitfirst", "--maxfail", "--lf",
               "--last-failed", "--sw", "--stepwise")


def _recipe(target: str) -> list[str]:
    """The command lines of TARGET's recipe in the Makefile."""
    makefile = ROOT / "Makefile"
    if not makefile.is_file():
        pytest.skip("needs the source tree (tests run from an installed cvt.tests)")
    lines = makefile.read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if re.match(rf"{re.escape(target)}\s*:(?!=)", line)), None)
    assert start is not None, f"the Makefile has no {target!r} target"
    recipe = []
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        recipe.append(line.strip())
    return recipe


def _pytest_args(target: str) -> list[str]:
    runs = [shlex.split(line) for line in _recipe(target) if "pytest" in line]
    assert len(runs) == 1, f"make {target} should run pytest once: {runs}"
    words = runs[0]
    return words[words.index("pytest") + 1:]


def _deselecting(args: list[str]) -> list[str]:
    return [a for a in args if a.split("=")[0] in DESELECTING or a.startswith("tests/")]


def test_make_test_runs_every_test():
    args = _pytest_args("test")
    assert _deselecting(args) == [], f"make test leaves tests out: {args}"


def test_make_test_fast_leaves_out_only_the_slow_tests():
    args = _pytest_args("test-fast")
    assert _deselecting(args) == ["-m"]
    assert args[args.index("-m") + 1] == "not slow"


def test_the_tiers_share_the_install_step():
    for target in ("test", "test-fast"):
        _recipe(target)
        makefile = (ROOT / "Makefile").read_text()
        assert re.search(rf"^{re.escape(target)}: \$\(STAMP\)$", makefile, re.M), target


def test_pytest_configuration_deselects_nothing():
    """An -m in addopts would make `make test` skip tests without its recipe saying so."""
    if not (ROOT / "pyproject.toml").is_file():
        pytest.skip("needs the source tree (tests run from an installed cvt.tests)")
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert _deselecting(shlex.split(cfg["addopts"])) == []
    assert "--strict-markers" in shlex.split(cfg["addopts"]), "a misspelt @pytest.mark.slow must fail"
    assert any(m.startswith("slow:") for m in cfg["markers"])


def test_ci_runs_make_test():
    ci = ROOT / ".ci" / "run"
    if not ci.is_file():
        pytest.skip("needs the source tree (tests run from an installed cvt.tests)")
    commands = [line.strip() for line in ci.read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert "make test" in commands


def test_the_development_page_lists_every_make_target():
    makefile, page = ROOT / "Makefile", ROOT / "docs" / "development.md"
    if not (makefile.is_file() and page.is_file()):
        pytest.skip("needs the source tree (tests run from an installed cvt.tests)")
    phony = re.search(r"^\.PHONY:(.*)$", makefile.read_text(), re.M).group(1).split()
    assert "test-fast" in phony
    assert [t for t in phony if f"| `make {t}` |" not in page.read_text()] == []
