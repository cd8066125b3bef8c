"""The etcd ledger's offload-tier slots (see `Ledger`'s "offload tiers"): records in groups per tier,
written in the same kind of transaction and under the same lease checks as blocks. A part of
`EtcdLedger`, kept apart so that each module stays one job; it uses the ledger's transaction helpers."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from steadfast.kv.ledger.etcd_records import GROUP, Keys, SlotRec, encode, slots_of
from steadfast.kv.ledger.interface import BlockState, LedgerError, SlotRecord, SlotSeal

if TYPE_CHECKING:
    from steadfast.kv.ledger.etcd_tx import Tx

T = TypeVar("T")

_OWNED, _OFFLOADED, _FREE = BlockState.OWNED.value, BlockState.OFFLOADED.value, BlockState.FREE.value


class EtcdSlots:
    """Mixed into `EtcdLedger`, which provides `keys`, `_run`, `_check_lease`, `_live`, `_lease_parts`,
    `_format`, `_in_parts` and `_fenced_record`."""

    keys: Keys
    _run: Callable[..., object]

    def format_tier(self, tier: str, num_slots: int) -> None:
        self._format(
            self.keys.tier(tier),
            lambda g: self.keys.slot_group(tier, g),
            num_slots,
            lambda: SlotRec(_FREE),
            f"slots of tier {tier}",
        )

    def _slot_groups(self, tx: Tx, tier: str, slots: Sequence[int]) -> dict[int, list[SlotRec]]:
        wanted = sorted({s // GROUP for s in slots if s >= 0})
        raws = tx.get_many(self.keys.slot_group(tier, g) for g in wanted)
        groups = {g: slots_of(raw) for g, raw in zip(wanted, raws, strict=True) if raw is not None}
        for s in slots:
            if s < 0 or s // GROUP not in groups or s % GROUP >= len(groups[s // GROUP]):
                raise LedgerError(f"no slot {s} in tier {tier}")
        return groups

    def _all_slots(self, tx: Tx, tier: str) -> dict[int, SlotRec]:
        found = tx.scan(self.keys.slots(tier))
        return {int(k[-8:]) * GROUP + i: s for k, v in found for i, s in enumerate(slots_of(v))}

    def _put_slot_groups(self, tx: Tx, tier: str, groups: dict[int, list[SlotRec]], slots: Sequence[int]) -> None:
        for g in sorted({s // GROUP for s in slots}):
            tx.put(self.keys.slot_group(tier, g), encode(groups[g]))

    def _origin_live(self, tx: Tx, origin: str | None) -> bool:
        return origin is not None and self._lease_parts(tx, origin)[1] is not None

    def reserve_slots(self, worker: str, epoch: int, tier: str, count: int) -> list[int]:
        if count < 0:
            raise LedgerError("cannot reserve a negative number of slots")

        def reserve(tx: Tx) -> list[int]:
            self._check_lease(tx, worker, epoch)
            every = self._all_slots(tx, tier)  # untracked: only the slots taken must still be as read
            picked = sorted(i for i, s in every.items() if s.state == _FREE)[:count]
            # Then the slots of origins that are gone, nobody having adopted them.
            for i in sorted(i for i, s in every.items() if s.state == _OFFLOADED):
                if len(picked) == count:
                    break
                if every[i].origin != worker and not self._origin_live(tx, every[i].origin):
                    picked.append(i)
            groups = self._slot_groups(tx, tier, picked)
            for i in picked:
                groups[i // GROUP][i % GROUP] = SlotRec(_OWNED, worker, epoch)
            self._put_slot_groups(tx, tier, groups, picked)
            return picked

        return self._run("reserve_slots", reserve)

    def _change(
        self,
        name: str,
        worker: str,
        epoch: int,
        tier: str,
        slots: Sequence[int],
        fn: Callable[[Tx, int, SlotRec], None],
    ) -> None:
        """Under the worker's lease, `fn(tx, slot, record)` for each slot (it changes the record or raises)."""

        def change(tx: Tx) -> None:
            self._check_lease(tx, worker, epoch)
            groups = self._slot_groups(tx, tier, slots)
            for slot in slots:
                fn(tx, slot, groups[slot // GROUP][slot % GROUP])
            self._put_slot_groups(tx, tier, groups, slots)

        self._run(name, change)

    def store_slots(self, worker: str, epoch: int, tier: str, seals: Sequence[SlotSeal]) -> None:
        named = {slot: (digest, name) for slot, digest, name in seals}

        def store(tx: Tx, slot: int, s: SlotRec) -> None:
            if s.state != _OWNED or s.owner != worker or s.epoch != epoch:
                raise LedgerError(f"{tier} slot {slot} is {s.state} by {s.owner}: {worker} did not reserve it")
            digest, name = named[slot]
            if not digest or not name:
                raise LedgerError(f"{tier} slot {slot}: an offloaded slot needs a hash and a name")
            s.state, s.owner, s.epoch, s.origin, s.hash, s.content = _OFFLOADED, None, None, worker, digest, name

        self._change("store_slots", worker, epoch, tier, [s for s, _, _ in seals], store)

    def free_slots(self, worker: str, epoch: int, tier: str, slots: Sequence[int]) -> None:
        def free(tx: Tx, slot: int, s: SlotRec) -> None:
            mine = (s.state == _OWNED and s.owner == worker and s.epoch == epoch) or (
                s.state == _OFFLOADED and s.origin == worker
            )
            if not mine:
                raise LedgerError(f"{tier} slot {slot} is {s.state} (origin {s.origin}): not {worker}'s to free")
            s.state, s.owner, s.epoch, s.origin, s.hash, s.content = _FREE, None, None, None, None, None

        self._change("free_slots", worker, epoch, tier, slots, free)

    def adopt_slots(self, worker: str, epoch: int, tier: str, slots: Sequence[tuple[int, bytes]]) -> None:
        digests = dict(slots)

        def adopt(tx: Tx, slot: int, s: SlotRec) -> None:
            if s.state != _OFFLOADED or s.hash != digests[slot]:
                raise LedgerError(f"{tier} slot {slot} is {s.state} with another hash: not adoptable")
            if s.origin == worker:
                return
            if self._origin_live(tx, s.origin):
                raise LedgerError(f"{tier} slot {slot} is counted by {s.origin}, who is alive: not adoptable")
            s.origin = worker

        self._change("adopt_slots", worker, epoch, tier, [s for s, _ in slots], adopt)

    def release_slots_of(self, worker: str) -> None:
        """In a fenced worker's reclaim: the slots it was writing hold bytes nobody may trust, so they
        are freed; those it offloaded stay (adoptable)."""
        for tier in self.tiers():

            def release(tx: Tx, keys: list[bytes]) -> None:
                self._fenced_record(tx, worker)
                for key, raw in zip(keys, tx.get_many(keys), strict=True):
                    recs = slots_of(raw or b"\x90")
                    for i, s in enumerate(recs):
                        if s.state == _OWNED and s.owner == worker:
                            recs[i] = SlotRec(_FREE)
                    tx.put(key, encode(recs))

            found = self._run("reclaim", lambda tx, tier=tier: tx.scan(self.keys.slots(tier)))
            keys = [k for k, v in found if any(s.state == _OWNED and s.owner == worker for s in slots_of(v))]
            self._in_parts("reclaim", keys, release)

    def offloaded_with_content(self, tier: str, contents: Sequence[bytes]) -> list[SlotRecord]:
        names = set(contents)
        return [s for s in self.slots(tier) if s.state == BlockState.OFFLOADED and s.content in names]

    def slots(self, tier: str) -> list[SlotRecord]:
        every = self._run("slots", lambda tx: self._all_slots(tx, tier))
        return [
            SlotRecord(tier, i, BlockState(s.state), s.owner, s.epoch, s.origin, s.hash, s.content)
            for i, s in sorted(every.items())
        ]

    def tiers(self) -> list[str]:
        found = self._run("tiers", lambda tx: tx.scan(self.keys.tier_dir))
        return sorted(self.keys.name_in(self.keys.tier_dir, k) for k, _ in found)
