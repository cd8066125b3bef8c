"""Unit-test fixtures: ledgers opened by URL, parametrised over every ledger backend.

A test that takes `ledger_factory` (or `ledger_backend`) runs once per backend in `LEDGER_BACKENDS`;
a new backend joins by adding its name here and a case to `ledger_url_in`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from steadfast.kv.ledger import Ledger
from steadfast.kv.ledger_url import open_ledger, sqlite_url

LEDGER_BACKENDS = ["sqlite"]


def ledger_url_in(backend: str, folder: Path, name: str = "ledger") -> str:
    """The URL of a fresh test ledger called `name`, its files (if any) under `folder`."""
    if backend == "sqlite":
        return sqlite_url(folder / f"{name}.db")
    raise ValueError(f"no test ledger for backend {backend!r}")


@pytest.fixture(params=LEDGER_BACKENDS)
def ledger_backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def ledger_factory(ledger_backend: str, tmp_path: Path) -> Iterator[Callable[..., Ledger]]:
    """`make(name="ledger", clock=...)`: a ledger of this test; the same name opens the same ledger
    again. Every ledger it opened is closed after the test."""
    opened: list[Ledger] = []

    def make(name: str = "ledger", clock: Callable[[], float] = time.monotonic) -> Ledger:
        ledger = open_ledger(ledger_url_in(ledger_backend, tmp_path, name), clock=clock)
        opened.append(ledger)
        return ledger

    yield make
    for ledger in opened:
        ledger.close()
