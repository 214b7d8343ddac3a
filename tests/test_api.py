"""The public API (`cvt.api`, re-exported by `cvt`): the docs' example (docs/api.md) runs as written, the
options objects refuse what the CLI refuses, and `import cvt` stays cheap."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import cvt
from cvt.errors import CvtError

API_PAGE = Path(__file__).resolve().parents[1] / "docs" / "api.md"


def _readme_example() -> str:
    text = API_PAGE.read_text()
    section = text[text.index("# Python API"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
def test_the_readme_example_runs(tmp_path, monkeypatch, capsys):
    from cvt.testing.checkpoints import write_fp8_release

    write_fp8_release(tmp_path / "cvt-demo" / "source-fp8")
    monkeypatch.chdir(tmp_path)
    exec(compile(_readme_example(), "docs/api.md", "exec"), {})
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("w8a8 ") and int(out[0].split()[1]) > 0
    assert (tmp_path / "out/w8a8/quant_model_description.json").is_file()
    assert (tmp_path / "out/w8a8-ep2/cvt_manifest.json").is_file()
    assert (tmp_path / "out/report/report.html").is_file()
    assert out[-1].startswith("def main(")


def test_options_refuse_unknown_fields_and_bad_values():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        cvt.QuantizeOptions(src="a", dst="b", scheme="w8a8", sheme="w8a8")
    with pytest.raises(CvtError, match="unknown scheme 'w9a9'"):
        cvt.QuantizeOptions(src="a", dst="b", scheme="w9a9")
    with pytest.raises(CvtError, match="unknown output format"):
        cvt.QuantizeOptions(src="a", dst="b", scheme="w8a8", format="gguf")
    with pytest.raises(CvtError, match="not a size"):
        cvt.ShardOptions(src="a", dst="b", max_shard_size="lots")
    with pytest.raises(ValidationError):
        cvt.LayoutOptions(ep=0)
    o = cvt.QuantizeOptions(src="a", dst="b", scheme="w4a16", format="ascend", max_shard_size="1GB",
                            expert_memory="2GiB")
    assert (o.fmt, o.max_shard_size, o.expert_memory) == ("ascend", 10**9, 2 * 2**30)
    with pytest.raises(CvtError, match="expected QuantizeOptions"):
        cvt.quantize(cvt.ShardOptions(src="a", dst="b"))


def test_keywords_replace_fields_of_an_options_object(tmp_path):
    """`quantize(opts, dst=...)`: the object with those fields replaced, validated again."""
    from cvt.api import QuantizeOptions, _build

    base = QuantizeOptions(src="a", dst="b", scheme="w8a8")
    assert _build(QuantizeOptions, base, {"dst": "c"}).dst == "c"
    assert _build(QuantizeOptions, base, {"format": "ascend"}).fmt == "ascend"  # by its alias too
    with pytest.raises(CvtError, match="unknown scheme"):
        _build(QuantizeOptions, base, {"scheme": "nope"})


def test_importing_cvt_imports_neither_torch_nor_the_api():
    code = ("import sys, cvt; print(sorted(m for m in ('torch', 'pydantic', 'cvt.api', 'click') "
            "if m in sys.modules)); from cvt import QuantizeOptions; print('cvt.api' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "[]" and out[1] == "True"
