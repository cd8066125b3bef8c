"""What the engine client and the ladder share: the registry of workers, the hub (sockets), the requests
in flight and the index of the workers' cached blocks. Made before either, so that each is given the
other's parts at construction: the ladder reads these, and the router's placement reads the ladder."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from steadfast.config.health import RoutingConfig
from steadfast.control.fleet.delivery import Flight
from steadfast.control.fleet.hub import Hub
from steadfast.control.fleet.routing import CacheIndex
from steadfast.control.fleet.workers import WorkerRegistry
from steadfast.wire.curve import KeyFile


@dataclass
class FleetParts:
    registry: WorkerRegistry
    hub: Hub
    index: CacheIndex
    block_size: int
    flights: dict[str, Flight] = field(default_factory=dict)  # by request id

    @classmethod
    def make(cls, output_address: str, keys: KeyFile | None, routing: RoutingConfig, block_size: int) -> FleetParts:
        """`output_address`: where the workers' outputs come in (bound now); `keys`: a router part's."""
        registry = WorkerRegistry()
        return cls(registry, Hub(registry, output_address, keys), CacheIndex(routing.max_index_blocks), block_size)

    def in_flight(self) -> list[Flight]:
        """Every request in flight (admitted, stream open)."""
        return list(self.flights.values())

    def cached_on(self, worker_id: int, prompt: Sequence[int]) -> int:
        return self.index.cached_tokens(worker_id, prompt, self.block_size)
