"""Ledger URLs: which store each names, and a clear error for those this build cannot open."""

from __future__ import annotations

from pathlib import Path

import pytest

from steadfast.config.ledger_url import LedgerUrlError
from steadfast.kv.ledger.etcd import EtcdLedger
from steadfast.kv.ledger.interface import LedgerError, LedgerUnavailableError
from steadfast.kv.ledger.open import open_ledger, sibling_ledger_url, sqlite_url
from steadfast.kv.ledger.sqlite import SqliteLedger

pytestmark = pytest.mark.unit


def _opens_file(url: str, path: Path) -> None:
    ledger = open_ledger(url)
    try:
        assert isinstance(ledger, SqliteLedger) and Path(ledger.path).resolve() == path.resolve()
        ledger.format(2)
        assert len(ledger.blocks()) == 2
    finally:
        ledger.close()
    assert path.exists()


def test_sqlite_urls_absolute_relative_and_plain_paths(tmp_path, monkeypatch):
    _opens_file(f"sqlite://{tmp_path}/abs.db", tmp_path / "abs.db")
    monkeypatch.chdir(tmp_path)
    _opens_file("sqlite:rel.db", tmp_path / "rel.db")
    (tmp_path / "sub").mkdir()
    _opens_file("SQLite:sub/../rel2.db", tmp_path / "rel2.db")  # schemes are case-insensitive
    _opens_file(str(tmp_path / "plain.db"), tmp_path / "plain.db")
    _opens_file("plain2.db", tmp_path / "plain2.db")


def test_sqlite_url_is_absolute_and_siblings_sit_beside_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert sqlite_url("l.db") == f"sqlite://{tmp_path}/l.db"
    assert sibling_ledger_url(f"sqlite://{tmp_path}/l.db", "-node1") == f"sqlite://{tmp_path}/l-node1.db"
    assert sibling_ledger_url("l.db", "") == f"sqlite://{tmp_path}/l.db"


def test_etcd_urls_name_members_and_a_prefix():
    led = open_ledger("etcd://10.0.0.1:2379,[::1]:2380,etcd-2:2379/deploy/node1/")
    try:
        assert isinstance(led, EtcdLedger)
        assert led.client.endpoints == ["http://10.0.0.1:2379", "http://[::1]:2380", "http://etcd-2:2379"]
        assert led.keys.root == b"/deploy/node1/"
    finally:
        led.close()
    tls = open_ledger("etcd+https://a:2379")
    assert tls.client.endpoints == ["https://a:2379"] and tls.keys.root == b"/steadfast/"
    tls.close()
    assert sibling_ledger_url("etcd://a:1,b:2/x", "-node1") == "etcd://a:1,b:2/x-node1"
    named = open_ledger("etcd://alice@a:1,b:2/x")
    assert named.client.user == "alice" and named.client.endpoints == ["http://a:1", "http://b:2"]
    named.close()
    assert sibling_ledger_url("etcd://alice@a:1/x", "-node1") == "etcd://alice@a:1/x-node1"
    with pytest.raises(LedgerUrlError) as err:
        open_ledger("etcd://alice:hunter2@a:1/x")
    assert "hunter2" not in str(err.value)  # a password is never repeated into a message
    assert sibling_ledger_url("etcd://a:1", "") == "etcd://a:1/steadfast"


@pytest.mark.parametrize(
    "url, fragment",
    [
        ("redis://localhost/0", "unknown scheme 'redis'"),
        ("postgres:ledger", "unknown scheme 'postgres'"),
        ("sqlite://host/ledger.db", "sqlite:///absolute/path"),
        ("sqlite:", "names no file"),
        ("sqlite://", "names no file"),
        ("", "empty ledger URL"),
        ("etcd:a:1", "write etcd://[user@]host:port"),
        ("etcd:///x", "names no etcd member"),
        ("etcd://a/x", "is not host:port"),
        ("etcd://a:1/x?y=1", "plain path"),
        ("etcd://alice:pw@a:1/x", "STEADFAST_ETCD_PASSWORD"),
    ],
)
def test_a_url_naming_no_store_is_refused_clearly(url, fragment):
    with pytest.raises(LedgerUrlError) as err:
        open_ledger(url)
    assert fragment in str(err.value)
    assert isinstance(err.value, LedgerError)  # callers catch the interface's errors only


def test_a_file_that_cannot_be_opened_is_the_ledgers_own_error(tmp_path):
    with pytest.raises(LedgerUnavailableError, match="unable to open"):
        open_ledger(sqlite_url(tmp_path / "no-such-dir" / "l.db"))
