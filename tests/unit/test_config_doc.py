"""docs/operations.md's configuration reference is the code's: every key of `config.py`, with its default."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from steadfast.config import Config
from steadfast.ops import config_doc

pytestmark = pytest.mark.unit

DOC = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
FIX = "run python -m steadfast.ops.config_doc --write docs/operations.md"


def keys(obj: object, prefix: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        out += keys(value, f"{prefix}{f.name}.") if dataclasses.is_dataclass(value) else [prefix + f.name]
    return out


def test_every_config_key_is_in_the_operations_doc_with_its_default():
    text = DOC.read_text()
    section = config_doc.current(text)
    assert section, "docs/operations.md has lost its config reference markers"
    missing = [k for k in keys(Config()) if f"| `{k}` |" not in section]
    assert not missing, f"config keys not in docs/operations.md: {missing}; {FIX}"
    assert section == config_doc.reference(), f"the reference is not what config.py says now: {FIX}"


def test_a_key_added_to_the_code_fails_the_check():
    @dataclasses.dataclass(frozen=True)
    class Extra:
        brand_new_key: int = 3  # what it does

    rows = config_doc.rows(Extra(), "server.")
    assert rows == [("server.brand_new_key", "`3`", "what it does")]
    assert "| `server.brand_new_key` |" not in config_doc.current(DOC.read_text())
