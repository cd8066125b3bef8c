"""The configuration reference of `docs/operations.md`, made from the config package itself: every key (dotted, as
in YAML), its default and what the source says of it (the comment on its line or the comments just above).

    python -m steadfast.ops.config_doc --write docs/operations.md   # rewrite the reference in place

The reference lies between two markers in the file; `tests/unit/test_config_doc.py` fails when it is not
what this module makes from the code now (a key added, removed, renamed or given another default).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import inspect
import json
import re
import sys
from pathlib import Path
from typing import Any

from steadfast.config import Config

BEGIN = "<!-- config reference: made by `python -m steadfast.ops.config_doc --write docs/operations.md` -->"
END = "<!-- end of the config reference -->"
FIELD = re.compile(r"^\s+(\w+)\s*:\s*[^=]+?(?:=\s*(.*?))?\s*$")


def _comments(cls: type, prefix: str) -> dict[str, str]:
    """Field name → the comment on its line, else the comment block above it; the keys that follow a
    block's first key with no blank line or comment between share it ("as `first key`")."""
    out: dict[str, str] = {}
    block: list[str] = []  # comment lines being read
    first = ""  # the key the current block was written for
    for line in inspect.getsource(cls).splitlines()[1:]:
        stripped = line.strip()
        if not stripped:
            block, first = [], ""
            continue
        if stripped.startswith("#"):
            if first:  # a new block after fields
                block, first = [], ""
            block.append(stripped.lstrip("#").strip())
            continue
        code, _, trailing = line.partition("  # ")
        m = FIELD.match(code)
        if not m or stripped.startswith(("def ", "@", "return", '"""')):
            block, first = [], ""
            continue
        name = m.group(1)
        if trailing.strip():
            out[name] = trailing.strip()
        elif block and not first:
            out[name], first = " ".join(block), name
        elif first:
            out[name] = f"as `{prefix}{first}`"
    return out


def _show(value: Any) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, str):
        return f'`"{value}"`' if value else '`""`'
    return f"`{json.dumps(value)}`"


def rows(obj: Any = None, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, default, description) for every key under `obj` (the default config), depth first."""
    obj = Config() if obj is None else obj
    notes = _comments(type(obj), prefix)
    out = []
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            out += rows(value, key + ".")
        else:
            out.append((key, _show(value), notes.get(f.name, "")))
    return out


def reference() -> str:
    lines = [BEGIN, "", "| key | default | what it does |", "|---|---|---|"]
    for key, default, note in rows():
        lines.append(f"| `{key}` | {default} | {note.replace('|', '/')} |")
    return "\n".join([*lines, "", END])


def current(text: str) -> str:
    """The reference as it stands in a document ('' when it has none)."""
    start, end = text.find(BEGIN), text.find(END)
    return text[start : end + len(END)] if 0 <= start < end else ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", metavar="FILE", help="replace the reference between the markers in FILE")
    args = p.parse_args(argv)
    if not args.write:
        print(reference())
        return 0
    path = Path(args.write)
    text = path.read_text()
    old = current(text)
    if not old:
        print(f"{path} has no config reference markers", file=sys.stderr)
        return 1
    path.write_text(text.replace(old, reference()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
