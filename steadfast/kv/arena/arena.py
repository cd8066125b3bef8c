"""The KV arena: one file-backed shared-memory region holding every KV block.

The arena is a file (in /dev/shm by default) mapped MAP_SHARED, so any process of ours on the node that
knows its path can map the same bytes: the engine that fills blocks is not the owner of the memory. Its
files are private to our user and fully reserved when made (`files.py`), and each process's mapping
of them is populated on a background thread (`resident.py`), so no step pays for a page's first touch.
A kvpool's arena is made as it is used (`grants.py`): a worker populates what it is granted.

Physical layout: `[num_layers, 2 (K, V), num_kv_heads, num_blocks, block_size, head_dim]`.
A block id names the same slot in every (layer, K/V, head) plane, so a block holds K and V of every
layer; its bytes are `num_layers * 2 * num_kv_heads` strips of `block_size * head_dim`. The layout is
chosen for attention: one `index_select` over a request batch's block ids yields
`[kv_heads, requests, tokens, head_dim]`, exactly what a batched matmul with the queries wants, with
no permute copy of K or V.

On CUDA the arena is one device allocation made by the process that owns it (the kvpool daemon) and
shared with workers by CUDA IPC handles (`export_ipc` / `attach_ipc`): the same interface, the same
layout, no file. Unlike the /dev/shm file, device memory lives only as long as its owning process.

This module never decides who owns a block: that is the block manager's (and later the pool's) job.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import torch
import xxhash

from steadfast.kv.arena import files as arena_file
from steadfast.kv.arena.grants import Populated
from steadfast.kv.arena.resident import make_resident
from steadfast.kv.arena.spec import ArenaSpec
from steadfast.wire.pool import CudaIpcHandle, PoolReply

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def torch_dtype(spec: ArenaSpec) -> torch.dtype:
    return TORCH_DTYPES[spec.dtype]


def _spec_path(path: str) -> Path:
    return Path(arena_file.spec_path(path))


class KVArena:
    """A mapped arena. `create` makes the file and `attach` maps one another process made;
    `create_device` allocates on a GPU, `export_ipc` / `attach_ipc` share that allocation."""

    def __init__(self, path: str, spec: ArenaSpec, tensor: torch.Tensor) -> None:
        self.path = path  # "" for a device arena
        self.spec = spec
        # tensor: [num_layers, 2, kv_heads, num_blocks, block_size, head_dim]
        self.tensor = tensor
        self.prefix: Populated | None = None  # a pool's arena made as it is used: what is populated here
        self._made = 0  # ...and how far the pool has made it, as it last said

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    @classmethod
    def create_device(cls, spec: ArenaSpec, device: str | torch.device) -> KVArena:
        """A device-memory arena. Zeroed, so that a block's digest is defined before anyone writes it."""
        return cls("", spec, torch.zeros(spec.shape, dtype=torch_dtype(spec), device=device))

    def export_ipc(self) -> CudaIpcHandle:
        """A handle another process opens with `attach_ipc` to map this CUDA arena (no copy).
        The allocation stays valid while this process keeps the arena."""
        if self.device.type != "cuda":
            raise ValueError(f"only a CUDA arena can be shared by IPC handle, this one is on {self.device}")
        storage = self.tensor.untyped_storage()
        device, handle, size, offset, counter, counter_offset, event, sync = storage._share_cuda_()
        return CudaIpcHandle(
            device=device,
            handle=handle,
            size_bytes=size,
            offset_bytes=offset,
            ref_counter_handle=counter,
            ref_counter_offset=counter_offset,
            event_handle=event or b"",
            event_sync_required=bool(sync),
            spec_json=json.dumps(asdict(self.spec)),
        )

    @classmethod
    def attach_ipc(cls, h: CudaIpcHandle) -> KVArena:
        """Map the CUDA arena another process exported. Fails in the exporting process itself (CUDA IPC)."""
        spec = ArenaSpec(**json.loads(h.spec_json))
        if h.size_bytes - h.offset_bytes < spec.nbytes:
            raise ValueError(f"CUDA IPC allocation of {h.size_bytes} bytes cannot hold a {spec.nbytes}-byte arena")
        torch.cuda.init()
        storage = torch.UntypedStorage._new_shared_cuda(
            h.device,
            h.handle,
            h.size_bytes,
            h.offset_bytes,
            h.ref_counter_handle,
            h.ref_counter_offset,
            h.event_handle or None,
            h.event_sync_required,
        )
        tensor = torch.empty((0,), dtype=torch_dtype(spec), device=f"cuda:{h.device}")
        tensor.set_(storage, 0, spec.shape)
        return cls("", spec, tensor)

    @classmethod
    def create(cls, path: str, spec: ArenaSpec) -> KVArena:
        """A new arena file at `path` (mode 0600, its space reserved): ArenaSpaceError if the folder
        cannot hold it, FileExistsError if anything is at `path` already."""
        fd = arena_file.create(path, spec.nbytes)
        try:
            arena_file.write_private(str(_spec_path(path)), json.dumps(asdict(spec)))
            return cls._map(fd, path, spec)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)

    @classmethod
    def attach(cls, path: str) -> KVArena:
        """Map the arena another process of ours made; refused if its files are not private to us."""
        spec, fd = arena_file.open_arena(path, os.O_RDWR)
        try:
            return cls._map(fd, path, spec)
        finally:
            os.close(fd)

    @classmethod
    def _map(cls, fd: int, path: str, spec: ArenaSpec) -> KVArena:
        numel = spec.block_numel * spec.num_blocks
        # Through the descriptor that was checked, so the path cannot be swapped in between.
        flat = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=numel, dtype=torch_dtype(spec))
        arena = cls(path, spec, flat.view(spec.shape))
        if os.fstat(fd).st_blocks * 512 >= spec.nbytes:
            make_resident(flat, fd, path)  # in the background: no later step pays for a first touch
        else:
            # Made as the pool grants its blocks (`grants.py`): populated only as far as the pool has
            # made it, since populating a page the pool has not reserved would take memory it may not have.
            arena.prefix = Populated(flat.data_ptr(), spec, Path(path).name)
        return arena

    @property
    def made_blocks(self) -> int:
        """Blocks whose memory is made: all of them, or as far as the pool last said (made as used)."""
        return self.spec.num_blocks if self.prefix is None else self._made

    def populate_to(self, blocks: int) -> None:
        """The pool has made blocks `[0, blocks)`: where the arena is made as it is used, this process's
        mapping of them is populated in the background, ahead of the steps that touch them."""
        if self.prefix is not None:
            self._made = max(self._made, blocks)
            self.prefix.want(blocks)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer, each a contiguous `[kv_heads, num_blocks, block_size, head_dim]` view."""
        return self.tensor[index, 0], self.tensor[index, 1]

    def layer_kv(self, index: int) -> torch.Tensor:
        """K and V of one layer together: a contiguous `[2, kv_heads, num_blocks, block_size, head_dim]` view."""
        return self.tensor[index]

    def block(self, block_id: int) -> torch.Tensor:
        """A copy of one block's bytes: `[num_layers, 2, kv_heads, block_size, head_dim]`."""
        return self.tensor[:, :, :, block_id].clone()

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's K and V, every layer, to another block."""
        self.tensor[:, :, :, dst].copy_(self.tensor[:, :, :, src])

    def digest(self, block_id: int) -> bytes:
        """Content hash of one block's bytes (every layer's K and V), to seal it and verify it later."""
        data = self.tensor[:, :, :, block_id].contiguous().cpu()
        # xxh3-128: a checksum against corruption and bugs (no adversary writes the arena), ~10x the
        # speed of blake2b, which matters when a takeover verifies a long context's blocks.
        return xxhash.xxh3_128_digest(data.view(torch.uint8).numpy())

    def unlink(self) -> None:
        if not self.path:
            return
        for p in (Path(self.path), _spec_path(self.path)):
            p.unlink(missing_ok=True)


def map_arena(reply: PoolReply) -> KVArena:
    """Map the arena a pool reply names: by CUDA IPC handle for device memory, else by file path."""
    return KVArena.attach_ipc(reply.cuda_ipc) if reply.cuda_ipc else KVArena.attach(reply.arena_path)
