"""Helpers of the SQLite ledger backend that are not the ledger: block-id lists as BLOBs, and the failpoint
a test arms to stall a transaction. Only `sqlite_ledger.py` uses them."""

from __future__ import annotations

import os
import time
from array import array
from collections.abc import Sequence
from pathlib import Path

from steadfast.env import failpoint, failpoint_dir

_hits: dict[str, int] = {}


def stall(name: str) -> None:
    """A failpoint: when a test armed `name`, leave a marker and stall here (inside the transaction)."""
    armed = failpoint(name)
    if armed is None:
        return
    seconds, on_hit = armed
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] != on_hit:
        return
    folder = failpoint_dir()
    if folder:
        Path(folder, f"{name}.{os.getpid()}").write_text(str(time.time()))
    time.sleep(seconds)


def ids_blob(values: Sequence[int]) -> bytes:
    return array("q", values).tobytes()


def ids_of(blob: bytes) -> list[int]:
    out = array("q")
    out.frombytes(blob)
    return out.tolist()
