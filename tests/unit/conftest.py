"""Unit-test fixtures: ledgers opened by URL, parametrised over every ledger backend.

A test that takes `ledger_factory` (or `ledger_backend`) runs once per backend in `LEDGER_BACKENDS`;
a new backend joins by adding its name here and a case to `ledger_url_in`.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from steadfast.kv.ledger.etcd import EtcdLedger
from steadfast.kv.ledger.etcd_records import lease_of
from steadfast.kv.ledger.interface import Ledger
from steadfast.kv.ledger.open import open_ledger, sqlite_url
from tests.etcd_cluster import shared_etcd

LEDGER_BACKENDS = ["sqlite", "etcd"]


def ledger_url_in(backend: str, folder: Path, name: str = "ledger") -> str:
    """The URL of a fresh test ledger called `name`, its files (if any) under `folder`; on etcd, the
    shared test server with a key prefix made of `folder` (unique to the test) and `name`."""
    if backend == "sqlite":
        return sqlite_url(folder / f"{name}.db")
    if backend == "etcd":
        return shared_etcd().ledger_url(f"/test{folder}/{name}")
    raise ValueError(f"no test ledger for backend {backend!r}")


@pytest.fixture(params=LEDGER_BACKENDS)
def ledger_backend(request: pytest.FixtureRequest) -> str:
    if request.param == "etcd" and shutil.which("etcd") is None:
        pytest.skip("etcd (Debian etcd-server) is not installed")
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


def lapse(ledger: Ledger, worker: str, clock: Callable[[], float] | None = None) -> None:
    """Let `worker`'s lease expire, as its store would: SQLite's clock (the test's `clock`, which
    has a `now`) moved past its expiry; on etcd, the etcd lease ended, as etcd's clock does at its TTL."""
    if isinstance(ledger, EtcdLedger):
        rec = lease_of(ledger.client.get(ledger.keys.lease(worker))[0].value)
        ledger.client.lease_revoke(rec.etcd_lease)
        return
    lease = ledger.lease(worker)
    assert lease is not None and clock is not None
    clock.now = max(clock.now, lease.expires + 0.5)  # type: ignore[attr-defined]
