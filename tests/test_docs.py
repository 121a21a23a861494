"""docs/config.md documents every config key, and the shipped configs parse."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from polar_fast.config import Config, load_config

ROOT = Path(__file__).resolve().parents[1]


def test_every_config_key_is_documented():
    text = (ROOT / "docs" / "config.md").read_text()
    sections = dict(re.findall(r"^## \[(\w+)\]\n(.*?)(?=^## |\Z)", text, re.M | re.S))
    for section in msgspec.structs.fields(Config):
        assert section.name in sections, f"docs/config.md has no [{section.name}] section"
        documented = set(re.findall(r"^\| `(\w+)` \|", sections[section.name], re.M))
        keys = {f.name for f in msgspec.structs.fields(section.type)}
        assert keys == documented, f"[{section.name}]: missing {keys - documented}, stale {documented - keys}"


@pytest.mark.parametrize("path", ["run.toml", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "examples").glob("*.toml"))])
def test_shipped_configs_parse(path):
    load_config(ROOT / path)
