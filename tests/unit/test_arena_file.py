"""The arena's files: ours alone (0600), never made over or through an existing path, opened only while
still private, and their space reserved when made, with a clear error when it does not fit."""

from __future__ import annotations

import dataclasses
import errno
import os
import stat

import pytest

from steadfast.kv.arena.arena import ArenaSpec, KVArena

pytestmark = pytest.mark.unit

SPEC = ArenaSpec(num_blocks=8, num_layers=2, block_size=16, num_kv_heads=2, head_dim=8, dtype="float32")


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_arena_files_are_ours_alone_and_reserved(tmp_path):
    arena = KVArena.create(str(tmp_path / "a.kv"), SPEC)
    assert mode(arena.path) == 0o600 and mode(arena.path + ".json") == 0o600
    assert os.stat(arena.path).st_blocks * 512 >= SPEC.nbytes  # backed now, not sparse


@pytest.mark.parametrize("there", ["a file", "a symlink", "a dangling symlink", "a symlink as its spec"])
def test_create_never_writes_over_or_through_what_is_at_the_path(tmp_path, there):
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    path = tmp_path / "a.kv"
    if there == "a file":
        path.write_bytes(b"old")
    elif there == "a symlink":
        path.symlink_to(victim)
    elif there == "a dangling symlink":
        path.symlink_to(tmp_path / "nowhere")
    else:
        (tmp_path / "a.kv.json").symlink_to(victim)
    with pytest.raises(FileExistsError):
        KVArena.create(str(path), SPEC)
    assert victim.read_bytes() == b"keep" and not (tmp_path / "nowhere").exists()
    if there == "a file":
        assert path.read_bytes() == b"old"
    if there == "a symlink as its spec":
        assert not path.exists()  # the half-made arena is not left behind


def test_attach_refuses_files_that_are_not_ours_alone(tmp_path):
    arena = KVArena.create(str(tmp_path / "a.kv"), SPEC)
    link = tmp_path / "link.kv"
    link.symlink_to(arena.path)
    (tmp_path / "link.kv.json").symlink_to(arena.path + ".json")
    with pytest.raises(PermissionError, match="symbolic link"):
        KVArena.attach(str(link))
    os.chmod(arena.path, 0o644)
    with pytest.raises(PermissionError, match="0644"):
        KVArena.attach(arena.path)
    os.chmod(arena.path, 0o600)
    os.chmod(arena.path + ".json", 0o640)
    with pytest.raises(PermissionError, match="0640"):
        KVArena.attach(arena.path)
    os.chmod(arena.path + ".json", 0o600)
    if os.geteuid() == 0:  # only root can give a file away
        os.chown(arena.path, 12345, 12345)
        with pytest.raises(PermissionError, match="uid 12345"):
            KVArena.attach(arena.path)
        os.chown(arena.path, 0, 0)
    assert KVArena.attach(arena.path).spec == SPEC


def test_an_arena_larger_than_the_free_space_is_refused_when_made(tmp_path):
    from steadfast.kv.arena.files import ArenaSpaceError, free_bytes

    spec = dataclasses.replace(SPEC, num_blocks=2 * free_bytes(str(tmp_path)) // SPEC.block_bytes + 1)
    with pytest.raises(ArenaSpaceError) as refused:
        KVArena.create(str(tmp_path / "big.kv"), spec)
    assert f"{spec.nbytes / 2**20:.0f} MiB needed" in str(refused.value)
    assert "MiB free" in str(refused.value) and str(tmp_path) in str(refused.value)
    assert list(tmp_path.iterdir()) == []


def test_no_room_found_while_reserving_is_reported_and_leaves_nothing(tmp_path, monkeypatch):
    """The filesystem fills between the free-space check and the reservation (another process)."""
    from steadfast.kv.arena.files import ArenaSpaceError

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    spec = dataclasses.replace(SPEC, num_blocks=1024)  # 4 MiB
    with pytest.raises(ArenaSpaceError, match="4 MiB needed"):
        KVArena.create(str(tmp_path / "a.kv"), spec)
    assert list(tmp_path.iterdir()) == []
