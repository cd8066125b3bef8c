"""A stand-in for the kvpool's grant/release in unit tests (the real daemon is exercised in tests/chaos)."""

from __future__ import annotations


class FakePool:
    """Blocks of one arena handed out in order and taken back; every call recorded."""

    def __init__(self, total: int) -> None:
        self.free = list(range(total))
        self.calls: list[tuple[str, list[int]]] = []

    def grant(self, count: int) -> list[int]:
        got, self.free = self.free[:count], self.free[count:]
        self.calls.append(("grant", got))
        return got

    def release(self, block_ids: list[int]) -> None:
        self.free.extend(block_ids)
        self.calls.append(("release", list(block_ids)))
