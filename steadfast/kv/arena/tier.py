"""An offload tier: a file of block-sized slots behind the arena, made by the kvpool and mapped by its
workers, so that what is written there outlives the worker that wrote it.

Two kinds behind the one interface, differing only in where the file lives: `host`, a shared-memory
file beside the arena (/dev/shm: RAM, not the arena's), and `disk`, a file in `cache.offload_dir`,
memory-mapped (the page cache holds what is hot; the kernel writes the rest back). Layout
`[slots, num_layers, 2, kv_heads, block_size, head_dim]`: a slot is one block's bytes contiguous, in
the order `KVArena.digest` hashes them, so a slot's digest equals the sealed block's it copies.

The pool makes the file (`arena_file.make_tier`, torch-free); `TierFile` is the workers' mapping.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import torch
import xxhash

from steadfast.kv.arena import files as arena_file
from steadfast.kv.arena.arena import KVArena, torch_dtype
from steadfast.kv.arena.spec import ArenaSpec


def _plain(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's bytes in its shape (bf16 seen as int16: numpy has no bf16)."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()]).numpy()


class TierFile:
    """A worker's mapping of a tier. Copies run on the caller's thread (the offloader's own, not the
    engine's). Between host memories they are numpy copies: single-threaded and without the GIL, where a
    torch copy would start a second OpenMP team that fights the forward pass's for the cores."""

    def __init__(self, kind: str, path: str, spec: ArenaSpec, tensor: torch.Tensor) -> None:
        self.kind = kind
        self.path = path
        self.spec = spec
        self.tensor = tensor  # [slots, num_layers, 2, kv_heads, block_size, head_dim]
        self._np = _plain(tensor)

    @property
    def num_slots(self) -> int:
        return self.spec.num_blocks

    @classmethod
    def attach(cls, kind: str, path: str, arena: ArenaSpec) -> TierFile:
        """Map the pool's tier at `path`; refused unless its files are private to us and its slots are
        the arena's blocks."""
        spec, fd = arena_file.open_arena(path, os.O_RDWR)
        try:
            if dataclasses.replace(spec, num_blocks=arena.num_blocks) != arena:
                raise ValueError(f"the offload tier at {path} holds blocks of {spec}, the arena's are {arena}")
            numel = spec.block_numel * spec.num_blocks
            flat = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=numel, dtype=torch_dtype(spec))
        finally:
            os.close(fd)
        shape = (spec.num_blocks, spec.num_layers, 2, spec.num_kv_heads, spec.block_size, spec.head_dim)
        return cls(kind, path, spec, flat.view(shape))

    def write(self, arena: KVArena, pairs: list[tuple[int, int]]) -> list[bytes]:
        """Copy blocks out: (block, slot) each; returns each slot's digest."""
        digests = []
        src = _plain(arena.tensor) if arena.device.type == "cpu" else None
        for block, slot in pairs:
            if src is not None:
                np.copyto(self._np[slot], src[:, :, :, block])
            else:
                self.tensor[slot].copy_(arena.tensor[:, :, :, block])
            digests.append(self.digest(slot))
        return digests

    def read(self, arena: KVArena, pairs: list[tuple[int, int, bytes]]) -> list[bool]:
        """Copy slots back: (slot, block, the slot's recorded digest) each; a slot whose bytes no longer
        hash to its digest is not copied (False), so the arena never takes suspect bytes."""
        ok = []
        dst = _plain(arena.tensor) if arena.device.type == "cpu" else None
        for slot, block, digest in pairs:
            good = self.digest(slot) == digest
            if good and dst is not None:
                np.copyto(dst[:, :, :, block], self._np[slot])
            elif good:
                arena.tensor[:, :, :, block].copy_(self.tensor[slot])
            ok.append(good)
        return ok

    def digest(self, slot: int) -> bytes:
        return xxhash.xxh3_128_digest(self._np[slot])
