"""Takeover: continue a request a dead worker was serving, choosing per request how its KV comes back
(ARCHITECTURE.md §3). A takeover is a move whose source was fenced: nothing is copied, the sealed
blocks whose hashes verify change owner in one ledger transaction (adopt), the rest is recomputed.
"""

from __future__ import annotations

import logging

from steadfast.kv.ledger.interface import LedgerError
from steadfast.util.log import about
from steadfast.wire.worker import RequestOutput, Route
from steadfast.worker.core.block_manager import BlockManager
from steadfast.worker.core.request import Request
from steadfast.worker.kv.ledger_sync import LedgerSync
from steadfast.worker.kv.offload import Offloader

log = logging.getLogger("steadfast.worker.engine")


def report_recovery(request: Request, out: RequestOutput, step_start: float) -> None:
    """The first output after a takeover or a move says its route and what it cost."""
    assert request.recovery is not None
    out.route, out.adopted_tokens = request.recovery
    # Handed-over KV is not in the prefix-cache count (that is the prefill worker's).
    moved = out.route in (Route.HANDOFF, Route.TRANSFER, Route.MIGRATED)
    have = out.adopted_tokens if moved else request.num_cached
    out.recomputed_tokens = request.resume_tokens - have
    if out.route is Route.MIGRATED:
        out.resumed_at = step_start
    request.recovery = None


def recover(
    mode: str, sync: LedgerSync | None, blocks: BlockManager, request: Request, offload: Offloader | None = None
) -> tuple[Route, int]:
    """Pick the takeover route for `request`; return it and how many tokens of KV were adopted.

    ledger_first adopts the dead worker's sealed, hash-verified blocks and recomputes only the tail;
    blocks it had offloaded (the pool's) are adopted from the tier too and fetched back before the
    request is admitted;
    rebuild recomputes prompt and delivered tokens. auto adopts whenever anything verifies (hashing a
    block costs far less than recomputing it). Any disagreement between ledger and arena means
    rebuild: suspect bytes are never adopted.
    """
    if sync is None or mode == "rebuild":
        return Route.REBUILD, 0
    bs = blocks.block_size
    ids = request.all_ids
    names = blocks.chain(ids, (len(ids) - 1) // bs)
    # Blocks whose content this worker already caches (or its tier holds) need no adoption.
    have = {pos for pos, name in enumerate(names) if blocks.is_cached(name) or (offload and name in offload.index)}
    plan = sync.adoptable(names, lambda pos: pos in have)
    if plan is None:
        return Route.REBUILD, 0
    if plan:
        try:
            sync.adopt([(b, h) for _, b, h in plan], blocks)
        except LedgerError as exc:  # taken by someone else meanwhile: recompute rather than share
            log.warning(
                "request %s: adoption refused (%s); rebuilding",
                request.request_id,
                exc,
                extra=about(request.request_id),
            )
            return Route.REBUILD, 0
        blocks.adopt(ids, [(pos, b) for pos, b, _ in plan])
    adopted = [pos for pos, _, _ in plan]
    if offload is not None:  # what the arena lacks may be in the tier, offloaded by the dead worker
        adopted += offload.adopt(request.request_id, names, have | set(adopted))
    if not adopted:
        return Route.REBUILD, 0
    return Route.LEDGER_FIRST, (max(adopted) + 1) * bs
