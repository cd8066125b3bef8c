"""KV arena: layout, and a second process mapping the same bytes."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest
import torch

from steadfast.kv.arena.arena import ArenaSpec, KVArena

pytestmark = pytest.mark.unit


@pytest.fixture
def arena():
    spec = ArenaSpec(num_blocks=8, num_layers=3, block_size=16, num_kv_heads=2, head_dim=8, dtype="bfloat16")
    a = KVArena.create(f"/dev/shm/steadfast-arena-test-{os.getpid()}-{uuid.uuid4().hex[:6]}.kv", spec)
    yield a
    a.unlink()


def test_layout_serves_batched_attention_without_permutes(arena):
    spec = arena.spec
    assert arena.tensor.shape == (3, 2, 2, 8, 16, 8)  # [layers, K/V, kv_heads, blocks, block_size, dim]
    assert spec.block_bytes == 3 * 2 * 2 * 16 * 8 * 2
    k, v = arena.layer(1)
    assert k.shape == (2, 8, 16, 8) and k.is_contiguous()
    k[0, 3, 5] = 1.0
    k[1, 1, 2] = 2.0
    # One index_select over the block ids of two requests gives [kv_heads, requests, tokens, dim] directly.
    gathered = k.view(2, 8, -1).index_select(1, torch.tensor([3, 1])).view(2, 2, 16, 8)
    assert gathered.is_contiguous()
    assert gathered[0, 0, 5].tolist() == [1.0] * 8 and gathered[1, 1, 2].tolist() == [2.0] * 8
    # A block holds every layer's K and V.
    assert arena.block(3).shape == (3, 2, 2, 16, 8)
    assert arena.block(3)[1, 0, 0, 5].tolist() == [1.0] * 8


def test_second_process_reads_what_first_wrote(arena):
    k, v = arena.layer(2)
    k[:, 6, 3] = torch.arange(16, dtype=torch.bfloat16).view(2, 8)
    v[:, 1, 15] = -7.5
    code = (
        "import sys, torch; from steadfast.kv.arena.arena import KVArena\n"
        "a = KVArena.attach(sys.argv[1]); k, v = a.layer(2)\n"
        "print(k[:, 6, 3].float().flatten().tolist()); print(v[:, 1, 15].float().unique().tolist())\n"
        "k[0, 0, 0, 0] = 42\n"  # and write back, for the parent to see
    )
    out = subprocess.run([sys.executable, "-c", code, arena.path], capture_output=True, text=True, check=True)
    lines = out.stdout.strip().splitlines()
    assert lines[0] == str([float(i) for i in range(16)])
    assert lines[1] == "[-7.5]"
    assert arena.layer(2)[0][0, 0, 0, 0].item() == 42.0


def test_attach_refuses_a_missing_or_truncated_arena(arena, tmp_path):
    with pytest.raises(FileNotFoundError):
        KVArena.attach(str(tmp_path / "nothing.kv"))
    os.truncate(arena.path, 100)
    with pytest.raises(ValueError):
        KVArena.attach(arena.path)


def test_spec_for_memory_rounds_down_to_whole_blocks():
    spec = ArenaSpec.for_memory(1 << 20, num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype="bfloat16")
    assert spec.block_bytes == 30 * 2 * 16 * 3 * 64 * 2
    assert spec.num_blocks == (1 << 20) // spec.block_bytes
