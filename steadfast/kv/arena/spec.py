"""The arena's shape: how many blocks, of what size, for which model. Torch-free, so the router and the
supervisor can size and describe an arena without importing torch (arena.py maps it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from steadfast.config import Config

DTYPE_BYTES = {"bfloat16": 2, "float32": 4, "float16": 2}


class ModelShape(Protocol):
    """What the arena needs to know of a model (gguf_meta.LlamaConfig has it)."""

    @property
    def num_layers(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...


@dataclass(frozen=True)
class ArenaSpec:
    num_blocks: int
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_kv_heads, self.num_blocks, self.block_size, self.head_dim)

    @property
    def block_numel(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.block_size * self.head_dim

    @property
    def block_bytes(self) -> int:
        return self.block_numel * DTYPE_BYTES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.block_bytes * self.num_blocks

    @classmethod
    def for_memory(
        cls, memory_bytes: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: str
    ) -> ArenaSpec:
        one = cls(1, num_layers, block_size, num_kv_heads, head_dim, dtype)
        return cls(max(1, memory_bytes // one.block_bytes), num_layers, block_size, num_kv_heads, head_dim, dtype)


def arena_spec(cfg: Config, model: ModelShape) -> ArenaSpec:
    """The arena `cfg.cache` asks for: `num_blocks` when set, else as many as `kv_memory_mb` holds."""
    c = cfg.cache
    shape = (model.num_layers, c.block_size, model.num_kv_heads, model.head_dim, cfg.model.resolved_dtype)
    if c.num_blocks:
        layers, bs, heads, dim, dtype = shape
        return ArenaSpec(c.num_blocks, layers, bs, heads, dim, dtype)
    return ArenaSpec.for_memory(c.kv_memory_mb << 20, *shape)
