"""Helpers of the SQLite ledger backend that are not the ledger: block-id lists as BLOBs. Only
`sqlite_ledger.py` uses them."""

from __future__ import annotations

from array import array
from collections.abc import Sequence


def ids_blob(values: Sequence[int]) -> bytes:
    return array("q", values).tobytes()


def ids_of(blob: bytes) -> list[int]:
    out = array("q")
    out.frombytes(blob)
    return out.tolist()
