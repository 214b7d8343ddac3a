"""The world is a value (issue 36): `cvt.world` alone reads torchrun's RANK / WORLD_SIZE /
LOCAL_RANK, and the world is read once, at a verb's entry, then passed down.

Checked on the source with `ast` (not a regex: an alias, a subscript or ``os.getenv`` is a read
too, a comment or a docstring is not):

* no module but cvt/world.py reads those variables from the environment (``os.environ[...]``,
  ``os.environ.get(...)``, ``os.getenv(...)``);
* the readers `cvt.world` offers are called only where a verb starts: `from_env` / `expect` in
  cvt/api.py and the CLI, `for_rank_entry` in runtime/launch.py (a rank of ``cvt run --procs``),
  `launched` / `first_rank` / `rank_label` in the CLI; every library function takes the `World` it is given
  (`cvt.world.SINGLE` by default), so the Python API works without torchrun;
* ``current()`` (the old per-call reader) does not come back.

Test-only code is not library: ``cvt/testing`` (its fault injector, armed by tests through
CVT_TEST_KILL_RANK, reads RANK) may read what it likes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("convert", "quant", "qtensor", "runtime", "export", "schemas", "cvt")
VARIABLES = {"RANK", "WORLD_SIZE", "LOCAL_RANK"}
READERS = {  # cvt.world's readers of the environment -> where they may be called
    "from_env": ("cvt/api.py", "cvt/cli/"),
    "expect": ("cvt/api.py", "cvt/cli/"),
    "for_rank_entry": ("runtime/launch.py",),
    "launched": ("cvt/cli/",),
    "first_rank": ("cvt/cli/",),
    "rank_label": ("cvt/cli/",),
    "current": (),
}


def library_files() -> list[Path]:
    """Every library module, each once (cvt/X is a link to X)."""
    out = []
    for top in LIBRARY:
        folder = ROOT / top
        if not folder.is_dir():
            continue
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if any((ROOT / d).is_symlink() for d in Path(rel).parents):  # cvt/X: X itself is walked
                continue
            if rel == "cvt/world.py" or rel.startswith("cvt/testing/"):
                continue
            out.append(path)
    return out




def _key(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def environment_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, variable) of each read of RANK / WORLD_SIZE / LOCAL_RANK from the environment."""
    environ, getenv = {"environ"}, {"getenv"}  # and what `from os import environ as X` calls them
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            environ |= {a.asname for a in node.names if a.name == "environ" and a.asname}
            getenv |= {a.asname for a in node.names if a.name == "getenv" and a.asname}

    def is_environ(n: ast.AST) -> bool:
        return ast.unparse(n).split(".")[-1] in environ

    out = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and is_environ(node.value):
            key = _key(node.slice)
        elif isinstance(node, ast.Call) and node.args:
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in ("get", "pop", "setdefault") and is_environ(f.value):
                key = _key(node.args[0])
            elif ast.unparse(f).split(".")[-1] in getenv:
                key = _key(node.args[0])
        if key in VARIABLES:
            out.append((node.lineno, key))
    return out


def world_reader_calls(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, reader) of each call of one of `READERS` of cvt.world (as ``world.X()``, through an
    alias of the module, or imported by name)."""
    modules, names = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "cvt":
            modules |= {a.asname or a.name for a in node.names if a.name == "world"}
        elif isinstance(node, ast.ImportFrom) and node.module == "cvt.world":
            names.update({a.asname or a.name: a.name for a in node.names if a.name in READERS})
        elif isinstance(node, ast.Import):
            modules |= {a.asname for a in node.names if a.name == "cvt.world" and a.asname}
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in names:
            out.append((node.lineno, names[f.id]))
        elif isinstance(f, ast.Attribute) and f.attr in READERS and (
                (isinstance(f.value, ast.Name) and f.value.id in modules) or ast.unparse(f.value) == "cvt.world"):
            out.append((node.lineno, f.attr))
    return out


def test_only_cvt_world_reads_the_torchrun_environment():
    files = library_files()
    assert any(p.as_posix().endswith("cvt/api.py") for p in files) and len(files) > 100
    bad = [f"{p.relative_to(ROOT)}:{line}: reads {key}" for p in files
           for line, key in environment_reads(ast.parse(p.read_text(), str(p)))]
    assert not bad, "read the world at the verb's entry (cvt.world) and pass it down:\n" + "\n".join(bad)


def test_the_world_is_read_at_a_verbs_entry_only():
    bad = []
    for p in library_files():
        rel = p.relative_to(ROOT).as_posix()
        for line, reader in world_reader_calls(ast.parse(p.read_text(), str(p))):
            if not rel.startswith(READERS[reader]) or not READERS[reader]:
                bad.append(f"{rel}:{line}: cvt.world.{reader}()")
    assert not bad, "take the World as a parameter (cvt.world.SINGLE by default):\n" + "\n".join(bad)


@pytest.mark.parametrize("source, found", [
    ('import os\nn = int(os.environ.get("WORLD_SIZE", "1"))', [(2, "WORLD_SIZE")]),
    ('from os import environ as e\nr = e["RANK"]', [(2, "RANK")]),
    ('import os\nr = os.getenv("LOCAL_RANK")', [(2, "LOCAL_RANK")]),
    ('import os\nos.environ["RANK"] = "0"\nx = os.environ.get("CVT_WORLD_SIZE")', []),  # a write; another name
])
def test_the_environment_check_sees_reads(source, found):
    assert environment_reads(ast.parse(source)) == found


@pytest.mark.parametrize("source, found", [
    ("from cvt import world\nw = world.current()", [(2, "current")]),
    ("from cvt.world import from_env as fe\nw = fe()", [(2, "from_env")]),
    ("import cvt.world as cw\nw = cw.for_rank_entry()", [(2, "for_rank_entry")]),
    ("from cvt import world\nw = world.SINGLE\nworld.stop()", []),
])
def test_the_reader_check_sees_calls(source, found):
    assert world_reader_calls(ast.parse(source)) == found


def test_a_stray_cvt_world_size_is_named_as_the_environment_variable():
    """`CVT_WORLD_SIZE=7` left in the environment of a 1-rank run is named as the variable, not as
    an option the user never gave (issue 37 cause 15)."""
    import pytest

    from cvt import world
    from cvt.errors import CvtError

    with pytest.raises(CvtError, match=r"^CVT_WORLD_SIZE=7 in the environment .* disagrees with torchrun's 1 rank"):
        world.from_env({"CVT_WORLD_SIZE": "7"})
