"""docs/configuration.md is generated from the config dataclass and must be current."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from sglang_unicache.policy.config import UniCacheConfig
from tools.config_doc import render

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_configuration_reference_is_current():
    assert DOC.read_text() == render(), (
        "docs/configuration.md is stale: python -m tools.config_doc > "
        "docs/configuration.md")


def test_every_field_is_documented_with_its_default():
    text = render()
    for field in dataclasses.fields(UniCacheConfig):
        assert f"| `{field.name}` | `{field.default!r}` |" in text, field.name


def test_every_meaning_fits_one_table_cell():
    for field in dataclasses.fields(UniCacheConfig):
        meaning = field.metadata.get("doc", "")
        assert "\n" not in meaning and "|" not in meaning, field.name
