"""The README's configuration reference lists every key of the schema with its default."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from hicache.config import HicacheConfig, to_plain

README = Path(__file__).resolve().parents[1] / "README.md"
ROW = re.compile(r"^\| `([a-z0-9_.]+)` \| `([^`]*)` \|", re.MULTILINE)


def leaves(obj: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Every configurable key (dotted) and its default; a mapping is one key."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from leaves(getattr(obj, f.name), f"{path}.{f.name}" if path else f.name)
    else:
        yield path, obj


def test_every_key_is_documented_with_its_default() -> None:
    rows = dict(ROW.findall(README.read_text()))
    for key, default in leaves(HicacheConfig()):
        assert key in rows, f"README configuration reference lacks `{key}`"
        if isinstance(default, Mapping):
            continue  # model.components / sidecars: documented per sub-key
        assert yaml.safe_load(rows[key]) == to_plain(default), (key, rows[key], default)


def test_quick_start_is_the_two_commands() -> None:
    text = README.read_text()
    block = text.split("## Quick start", 1)[1].split("```", 2)[1]
    assert block.strip().splitlines() == ["./scripts/bootstrap.sh serve", "./scripts/bootstrap.sh test"]
