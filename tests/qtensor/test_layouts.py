"""The docs' table of quantized layouts (docs/formats.md, "Quantized layouts") is the registry's: every entry
of `cvt.qtensor.layouts.LAYOUTS` is there, and nothing else."""

from __future__ import annotations

import re
from pathlib import Path

from cvt.qtensor.layouts import LAYOUTS

FORMATS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "formats.md"


def test_the_docs_table_every_registered_layout():
    text = FORMATS_PAGE.read_text()
    start = text.index("## Quantized layouts")
    end = text.find("\n## ", start + 1)
    block = text[start:end if end > 0 else len(text)]
    rows = set(re.findall(r"^((?:ascend|ct)-[a-z0-9-]+(?:\(-row\))?)\s", block, re.M))
    stems = {r.replace("(-row)", "") for r in rows}
    names = set(LAYOUTS.names())
    assert all(n in stems or n.removesuffix("-row") in stems or n.rsplit("-", 1)[0] in stems for n in names), \
        names - stems
    assert all(any(n == s or n.startswith(s + "-") for n in names) for s in stems), stems - names
