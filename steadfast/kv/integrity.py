"""A node's integrity check, callable at any time: the ledger agrees with itself, with the arena's bytes,
and with the block tables workers hold."""

from __future__ import annotations

from steadfast.kv.arena.arena import KVArena
from steadfast.kv.arena.tier import TierFile
from steadfast.kv.ledger.interface import BlockState, Ledger


def check_node(
    ledger: Ledger,
    arena: KVArena,
    tables: dict[str, dict[str, list[int]]] | None = None,
    tier: TierFile | None = None,
) -> list[str]:
    """Every disagreement found; empty when consistent. `tables`: worker → request → block ids;
    `tier`: the node's offload tier, whose offloaded slots' bytes are checked against their hashes."""
    problems = ledger.check_integrity()
    if tier is not None:
        slots = ledger.slots(tier.kind)
        if len(slots) != tier.num_slots:
            problems.append(f"the ledger has {len(slots)} slots of tier {tier.kind}, the tier {tier.num_slots}")
        for s in slots:
            if s.state == BlockState.OFFLOADED and s.hash and tier.digest(s.slot) != s.hash:
                problems.append(f"{tier.kind} slot {s.slot}: its bytes no longer match its hash")
    blocks = {b.block_id: b for b in ledger.blocks()}
    if len(blocks) != arena.spec.num_blocks:
        problems.append(f"the ledger has {len(blocks)} blocks, the arena {arena.spec.num_blocks}")
    for b in blocks.values():
        if b.state == BlockState.SEALED and b.hash and arena.digest(b.block_id) != b.hash:
            problems.append(f"sealed block {b.block_id}: its bytes no longer match its hash")
    seen: dict[int, str] = {}
    for worker, requests in (tables or {}).items():
        for request, ids in requests.items():
            for block_id in ids:
                b = blocks.get(block_id)
                if b is None or b.owner != worker or b.state not in (BlockState.OWNED, BlockState.SEALED):
                    problems.append(f"{worker}/{request} uses block {block_id}, which the ledger does not give it")
                other = seen.get(block_id)
                if other is not None and other.split("/")[0] != worker:
                    problems.append(f"block {block_id} is in the tables of {other} and {worker}/{request}")
                seen[block_id] = f"{worker}/{request}"
    return problems
