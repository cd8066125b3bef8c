"""The node's weight store: a model's compute layout made once per node, in shared memory, and mapped
read-only by every worker of the node (ISSUE 15; the second seed article: a replacement finds its
resources already there).

Files in the deployment's arena folder (a private tmpfs folder the launcher makes and removes), named by
a key of the GGUF file's identity (real path, size, mtime) and the dtype, so another model or a changed
file never maps as this one: `model-<key>.lock` (who builds), `model-<key>.bin` (the tensors, each at a
64-byte aligned offset) and `model-<key>.json` (the index and the content's XXH3-128, written last: a
store without it is not finished). The first worker to take the lock builds the store (dequantizes the
GGUF once); the others wait on the lock and map what it made. Every worker checks the content hash of
the bytes it maps before it computes with them: a store whose bytes differ from its index is built
again, never used.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import mmap
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import xxhash

from steadfast.kv.arena.files import check_space

log = logging.getLogger(__name__)

VERSION = 1  # of the layout and the file format: a change makes a new key
ALIGN = 64
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class StoreCorruptError(RuntimeError):
    """A store's bytes are not what its index says (hash or size)."""


def store_key(gguf_path: str, dtype: str) -> str:
    real = os.path.realpath(gguf_path)
    st = os.stat(real)
    return xxhash.xxh3_64_hexdigest(f"{VERSION}|{real}|{st.st_size}|{st.st_mtime_ns}|{dtype}".encode())


def open_layout(
    folder: str, gguf_path: str, dtype: str, build: Callable[[], dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """The compute layout of `gguf_path` in `dtype`, mapped read-only from the store in `folder`; built
    there first (by `build`) if no worker has yet."""
    base = Path(folder) / f"model-{store_key(gguf_path, dtype)}"
    with _locked(base.with_suffix(".lock")):
        if base.with_suffix(".json").exists():
            try:
                return _map(base)
            except StoreCorruptError as exc:
                log.error("weight store %s is damaged, building it again: %s", base.name, exc)
        t0 = time.perf_counter()
        _write(base, build())
        log.info("weight store %s built in %.1fs", base.name, time.perf_counter() - t0)
        return _map(base)


@contextlib.contextmanager
def _locked(path: Path):  # noqa: ANN202 - a context manager
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released when closed, or when this process dies
        yield
    finally:
        os.close(fd)


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().contiguous().view(torch.uint8).reshape(-1).numpy())


def _write(base: Path, tensors: dict[str, torch.Tensor]) -> None:
    index, offset = [], 0
    for name, t in tensors.items():
        offset = -(-offset // ALIGN) * ALIGN
        index.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), offset])
        offset += t.numel() * t.element_size()
    check_space(str(base.parent), offset, "the weight store")
    tmp = base.with_suffix(".bin.tmp")
    tmp.unlink(missing_ok=True)  # a builder that died half-way (we hold the lock)
    digest = xxhash.xxh3_128()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        at = 0
        for (_, _, _, start), t in zip(index, tensors.values(), strict=True):
            pad = bytes(start - at)
            data = _raw(t)
            digest.update(pad)
            digest.update(data)
            os.write(fd, pad)
            while data:
                data = data[os.write(fd, data) :]
            at = start + t.numel() * t.element_size()
    finally:
        os.close(fd)
    os.replace(tmp, base.with_suffix(".bin"))
    meta = {"version": VERSION, "nbytes": offset, "xxh3_128": digest.hexdigest(), "tensors": index}
    tmp_json = base.with_suffix(".json.tmp")
    tmp_json.write_text(json.dumps(meta))
    os.chmod(tmp_json, 0o600)
    os.replace(tmp_json, base.with_suffix(".json"))  # last: the store is finished


def _map(base: Path) -> dict[str, torch.Tensor]:
    meta = json.loads(base.with_suffix(".json").read_text())
    fd = os.open(base.with_suffix(".bin"), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if meta.get("version") != VERSION or size != meta["nbytes"]:
            raise StoreCorruptError(f"{size} bytes, version {meta.get('version')}; its index says {meta['nbytes']}")
        # Read-only: a stray write into a weight faults instead of changing the model for every worker.
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) if size else None
    finally:
        os.close(fd)
    if mm is None:
        raise StoreCorruptError("empty")
    t0 = time.perf_counter()
    if xxhash.xxh3_128_hexdigest(mm) != meta["xxh3_128"]:
        raise StoreCorruptError("its bytes do not hash to its index's XXH3-128")
    out = {}
    with warnings.catch_warnings():  # torch warns on every read-only buffer; these are meant to be
        warnings.simplefilter("ignore", UserWarning)
        for name, dtype, shape, offset in meta["tensors"]:
            dt = DTYPES[dtype]
            count = 1
            for d in shape:
                count *= d
            out[name] = torch.frombuffer(mm, dtype=dt, count=count, offset=offset).view(shape)
    log.info("weight store %s mapped (%d MiB, hash checked in %.2fs)", base.name, size >> 20, time.perf_counter() - t0)
    return out
