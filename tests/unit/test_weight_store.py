"""The node's weight store: built once however many workers ask at the same time, mapped by the rest
with its content hash checked, built again when its bytes were changed or its builder died half-way,
and never mapped as another model or another dtype."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from steadfast.model import store

pytestmark = pytest.mark.unit


@pytest.fixture
def gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not really a model")
    return str(path)


class Builder:
    def __init__(self, seconds: float = 0.0) -> None:
        self.calls, self.seconds = 0, seconds

    def __call__(self) -> dict[str, torch.Tensor]:
        self.calls += 1
        time.sleep(self.seconds)
        g = torch.Generator().manual_seed(7)
        return {
            "embed": torch.randn(5, 3, generator=g),
            "0.qkv.t": torch.randn(3, 7, generator=g).to(torch.bfloat16),
            "norm": torch.randn(3, generator=g),  # 12 bytes: the next tensor starts aligned after padding
            "last": torch.arange(6, dtype=torch.float32).view(2, 3),
        }


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_workers_starting_together_build_it_once(tmp_path, gguf):
    build = Builder(seconds=0.3)
    got: list[dict[str, torch.Tensor]] = []
    threads = [
        threading.Thread(target=lambda: got.append(store.open_layout(str(tmp_path), gguf, "float32", build)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert build.calls == 1 and len(got) == 3
    assert all(same(g, Builder()()) for g in got)
    assert all(t.data_ptr() % store.ALIGN == 0 for g in got for t in g.values())
    files = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("model-"))
    assert [f.rsplit(".", 1)[1] for f in files] == ["bin", "json", "lock"]
    assert all(os.stat(tmp_path / f).st_mode & 0o077 == 0 for f in files)  # ours alone


def test_changed_bytes_are_caught_and_the_store_built_again(tmp_path, gguf):
    build = Builder()
    store.open_layout(str(tmp_path), gguf, "float32", build)
    (binary,) = tmp_path.glob("model-*.bin")
    data = bytearray(binary.read_bytes())
    data[10] ^= 0xFF
    binary.write_bytes(bytes(data))
    again = store.open_layout(str(tmp_path), gguf, "float32", build)
    assert build.calls == 2 and same(again, Builder()())


def test_a_builder_that_died_half_way_leaves_nothing_that_maps(tmp_path, gguf):
    key = store.store_key(gguf, "float32")
    (tmp_path / f"model-{key}.bin").write_bytes(b"half")  # no index: never finished
    build = Builder()
    assert same(store.open_layout(str(tmp_path), gguf, "float32", build), Builder()()) and build.calls == 1


def test_another_dtype_or_a_changed_file_is_another_store(tmp_path, gguf):
    first = store.store_key(gguf, "float32")
    assert store.store_key(gguf, "bfloat16") != first
    os.utime(gguf, ns=(1, 1))
    assert store.store_key(gguf, "float32") != first


def test_a_folder_without_room_for_the_store_leaves_the_worker_its_own_copy(tmp_path, monkeypatch, caplog):
    from steadfast.config import Config
    from steadfast.kv.arena.files import ArenaSpaceError
    from steadfast.worker import loaded as engine

    def no_room(folder, nbytes, what="the KV arena"):
        raise ArenaSpaceError(f"{what} needs {nbytes} bytes; {folder} has 0 free")

    monkeypatch.setattr(store, "check_space", no_room)
    loaded = engine.load_model(Config().replace(model={"dtype": "float32"}), str(tmp_path))
    assert loaded.model.embed.shape[0] == loaded.model_cfg.vocab_size
    assert "weight store not usable" in caplog.text and not list(tmp_path.glob("model-*.bin"))
