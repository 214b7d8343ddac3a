"""The manifest's JSON Schema file is generated from the typed model and rejects bad manifests."""

from __future__ import annotations

import json

import jsonschema
import pytest
from pydantic import ValidationError

from cvt.schemas import HERE, SCHEMAS, load_schema, schema_json
from cvt.schemas.manifest import Manifest


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_checked_in_schema_matches_the_model(name):
    assert (HERE / name).read_text() == schema_json(SCHEMAS[name]), "run `python -m cvt.schemas` and commit"


GOOD = {
    "manifest_version": 1,
    "tool": {"name": "cvt", "version": "0.1.0"},
    "source": {"kind": "hub", "repo_id": "deepseek-ai/DeepSeek-V3", "revision": "a" * 40, "config_sha256": None,
               "index_sha256": None, "format": "fp8-block"},
    "stages": [{"name": "fp8-to-bf16", "tool_version": "0.1.0", "parameters": {"weight_block_size": [128, 128]}}],
    "format": "hf-bf16",
    "plan_id": "x",
    "tensor_count": 1,
    "total_size": 2,
    "files": [{"path": "model-00001-of-00001.safetensors", "size": 10, "sha256": "0" * 64, "tensors": 1}],
}


def test_good_manifest_passes_both():
    jsonschema.validate(GOOD, load_schema("manifest.schema.json"))
    Manifest.model_validate(GOOD)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda m: m.update(surprise=1),
        lambda m: m["tool"].update(name="other"),
        lambda m: m["files"][0].update(sha256="xyz"),
        lambda m: m["files"][0].update(size=-1),
        lambda m: m["source"].update(kind="ftp"),
        lambda m: m.update(manifest_version=2),
        lambda m: m.pop("files"),
    ],
    ids=["unknown-key", "wrong-tool", "bad-sha", "negative-size", "bad-source-kind", "future-version", "no-files"],
)
def test_bad_manifests_rejected_by_schema_and_model(mutate):
    bad = json.loads(json.dumps(GOOD))
    mutate(bad)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, load_schema("manifest.schema.json"))
    with pytest.raises(ValidationError):
        Manifest.model_validate(bad)


def test_local_source_needs_a_path():
    bad = json.loads(json.dumps(GOOD))
    bad["source"] = {"kind": "local", "format": "bf16"}
    with pytest.raises(ValidationError, match="needs its path"):
        Manifest.model_validate(bad)
