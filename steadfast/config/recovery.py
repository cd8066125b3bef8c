"""Config sections of fault recovery: leases and fencing, the KV ledger, request resumption, takeover."""

from __future__ import annotations

from dataclasses import dataclass, field

from steadfast.config.base import ConfigError
from steadfast.config.ledger_url import LedgerUrlError, check_ledger_url

RECOVERY_MODES = ("ledger_first", "rebuild", "auto")


@dataclass(frozen=True)
class LeaseConfig:
    renew_interval_ms: int = 500  # how often a worker renews its lease with its pool (its heartbeat)
    lease_timeout_ms: int = 5000  # a lease not renewed this long expires: the worker is fenced (>= 3x renew)
    # Fencing epochs: every ledger write names its epoch and a stale one is refused.
    version_check: bool = True
    # The lease is renewed only while the worker's engine loop goes round: one silent this long (a
    # hung step, a deadlock) lets the lease lapse, and the worker is fenced, killed and replaced.
    # Longer than any step may take (a long prefill chunk in bf16 on a loaded CPU).
    engine_stall_ms: int = 15000

    def __post_init__(self) -> None:
        if self.renew_interval_ms < 1:
            raise ConfigError("fault_recovery.lease.renew_interval_ms must be >= 1")
        if self.engine_stall_ms < self.renew_interval_ms:
            raise ConfigError("fault_recovery.lease.engine_stall_ms must be >= renew_interval_ms")
        if not self.version_check:
            # Without epochs a paused-then-resumed worker could overwrite its successor's KV (split brain).
            raise ConfigError("fault_recovery.lease.version_check: false is not supported; fencing is always on")
        if self.lease_timeout_ms < 3 * self.renew_interval_ms:
            # Fewer than three missed renewals would declare a merely slow worker dead.
            raise ConfigError(
                f"fault_recovery.lease.lease_timeout_ms ({self.lease_timeout_ms}) must be at least 3 x "
                f"renew_interval_ms ({self.renew_interval_ms})"
            )


@dataclass(frozen=True)
class LedgerConfig:
    external_ledger: bool = True  # blocks and request checkpoints in the pool's ledger (takeover from adopted KV)
    snapshot_interval_steps: int = 128  # decode steps between a request's checkpoints in the ledger
    recovery_mode: str = "ledger_first"  # ledger_first: adopt the dead worker's KV, else recompute; or recompute
    # The ledger's URL: sqlite:///path/to/ledger.db, or etcd://host:port,host:port,host:port/prefix for
    # a replicated ledger on an etcd cluster (see steadfast.kv.ledger.open); with two nodes on one host the
    # second's is derived from it (a file beside it, or the prefix with -node1). Empty = a SQLite file in
    # the server's run directory.
    ledger_url: str = ""
    # The older spelling: a SQLite file path, the same as ledger_url sqlite:///<path>.
    ledger_path: str = ""

    def __post_init__(self) -> None:
        if self.snapshot_interval_steps < 1:
            raise ConfigError("fault_recovery.kv_cache.snapshot_interval_steps must be >= 1")
        if self.recovery_mode not in RECOVERY_MODES:
            raise ConfigError(f"fault_recovery.kv_cache.recovery_mode must be one of {RECOVERY_MODES}")
        if self.ledger_url and self.ledger_path:
            raise ConfigError("fault_recovery.kv_cache: set ledger_url or ledger_path, not both")
        if self.ledger_url:
            try:
                check_ledger_url(self.ledger_url)
            except LedgerUrlError as exc:
                raise ConfigError(f"fault_recovery.kv_cache.ledger_url: {exc}") from None

    @property
    def resolved_ledger_url(self) -> str:
        """The configured ledger as a URL open_ledger takes (a plain file path is one); empty if none."""
        return self.ledger_url or self.ledger_path


@dataclass(frozen=True)
class RequestRecoveryConfig:
    # Seconds a finished or interrupted request's delivery record is kept for dedup and resumption.
    idempotency_window: float = field(default=60.0, metadata={"duration": True})
    resume_checkpoint: bool = True


@dataclass(frozen=True)
class TakeoverConfig:
    # Requests of dead workers being moved at once; the rest wait their turn, high priority first.
    max_concurrent: int = 32
    # Seconds a dead worker's request may wait for a worker to take it before it fails with an error.
    wait_timeout: float = field(default=120.0, metadata={"duration": True})
    # A promoted standby takes new requests gradually: its in-flight limit ramps from 1 to the
    # scheduler's max_num_seqs over this long (the requests it took over count against it).
    warmup: float = field(default=5.0, metadata={"duration": True})
    # Share of each worker's KV blocks new requests leave free, so requests taken over from a dead
    # worker find room; new requests wait (at most `reserve_wait`) rather than eat into it.
    reserve_fraction: float = 0.1
    reserve_wait: float = field(default=2.0, metadata={"duration": True})

    def __post_init__(self) -> None:
        if self.max_concurrent < 1:
            raise ConfigError("fault_recovery.takeover.max_concurrent must be >= 1")
        if self.wait_timeout <= 0:
            raise ConfigError("fault_recovery.takeover.wait_timeout must be positive")
        if self.warmup < 0:
            raise ConfigError("fault_recovery.takeover.warmup must be >= 0")
        if not 0 <= self.reserve_fraction < 1 or self.reserve_wait < 0:
            raise ConfigError("fault_recovery.takeover.reserve_fraction must be in [0, 1), reserve_wait >= 0")


@dataclass(frozen=True)
class FaultRecoveryConfig:
    lease: LeaseConfig = field(default_factory=LeaseConfig)
    kv_cache: LedgerConfig = field(default_factory=LedgerConfig)
    request: RequestRecoveryConfig = field(default_factory=RequestRecoveryConfig)
    takeover: TakeoverConfig = field(default_factory=TakeoverConfig)
