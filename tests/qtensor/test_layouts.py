"""The README's table of quantized layouts ("Quantized layouts") is the registry's: every entry
of `cvt.qtensor.layouts.LAYOUTS` is there, and nothing else."""

from __future__ import annotations

import re
from pathlib import Path

from cvt.qtensor.layouts import LAYOUTS

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_tables_every_registered_layout():
    text = README.read_text()
    block = text[text.index("### Quantized layouts"):text.index("## What cvt refuses")]
    rows = set(re.findall(r"^((?:ascend|ct)-[a-z0-9-]+(?:\(-row\))?)\s", block, re.M))
    stems = {r.replace("(-row)", "") for r in rows}
    names = set(LAYOUTS.names())
    assert all(n in stems or n.removesuffix("-row") in stems or n.rsplit("-", 1)[0] in stems for n in names), \
        names - stems
    assert all(any(n == s or n.startswith(s + "-") for n in names) for s in stems), stems - names
