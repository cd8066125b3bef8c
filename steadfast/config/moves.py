"""Config sections of KV moves and of speculation: cross-node transfer, live migration, speculative decoding."""

from __future__ import annotations

from dataclasses import dataclass, field

from steadfast.config.base import ConfigError


@dataclass(frozen=True)
class TransferConfig:
    """KV streamed from a prefill worker to a decode worker on another node."""

    # Host the decode workers' KV receivers bind (each takes free ports): one address per path.
    listen_host: str = "127.0.0.1"
    # Paths per receiver, tried in order: the primary, then alternates (another port; on a real host,
    # bind alternates to another interface). After the last, the decode worker recomputes the prompt.
    paths: int = 2
    # Per attempt: how long the sender waits for the receiver's acknowledgement of a commit.
    timeout: float = field(default=2.0, metadata={"duration": True})
    # Resends on a path (missing or corrupt chunks, no answer) before the next path; backoff doubles.
    retries: int = 3
    backoff: float = field(default=0.05, metadata={"duration": True})
    # Stream each layer as soon as the forward pass wrote it (true), or the whole prompt at the end.
    layerwise: bool = True
    # The chain's last step, after every path failed: the decode worker computes the prompt itself
    # (true), or the request ends with an error saying why (false).
    recompute: bool = True
    # Fault drill (tests, chaos), e.g. "drop_every=2,path=primary". Keys: on the sending side delay_s,
    # drop_every, corrupt_every, stall_every, stall_s; on the receiving side drop_acks (COMMIT acks lost per
    # session), hold_s (a session's stage held this long); path. Empty: STEADFAST_TRANSFER_FAULTS, if set.
    faults: str = ""
    # A file holding the same text, read again at the start of every transfer (a drill can change it
    # while the server runs); wins over `faults`. Empty: STEADFAST_TRANSFER_FAULTS_FILE, if set.
    faults_file: str = ""
    # Authenticate the wire with ZeroMQ CURVE (keys made per deployment by the launcher; only its senders
    # get in). Off only on a network where every host that can reach the receivers is trusted.
    curve: bool = True
    # Moves a decode worker's receiver holds at once before they commit (one prefill worker at its
    # scheduler's max_num_seqs fits); more are refused (ABORT busy) without reserving.
    max_incoming: int = 128
    # The share of the node's arena those moves may reserve together; beyond: ABORT no_room, so that made-up
    # or stalled moves never drain the pool the running requests grow into.
    max_reserved_fraction: float = 0.5

    def __post_init__(self) -> None:
        if self.paths < 1 or self.retries < 0:
            raise ConfigError("transfer.paths must be >= 1 and transfer.retries >= 0")
        if self.max_incoming < 1 or not 0 < self.max_reserved_fraction <= 1:
            raise ConfigError("transfer.max_incoming must be >= 1 and transfer.max_reserved_fraction in (0, 1]")
        if self.timeout <= 0 or self.backoff < 0:
            raise ConfigError("transfer.timeout must be positive and transfer.backoff >= 0")


@dataclass(frozen=True)
class MigrationConfig:
    """Moving a running request to another worker (drain, rollout, an operator's `migrate`)."""

    # Migrations in progress at once (each holds a reservation on its destination until it commits).
    max_concurrent: int = 4
    # Across nodes: copy stages of sealed blocks while the request keeps decoding, before the final
    # stop-and-copy (stage k sends what was sealed since stage k-1).
    max_stages: int = 4
    # Across nodes: stop copying in stages once at most this many blocks remain unsent; the final stage
    # then pauses the request and sends them with the partial block.
    final_stage_blocks: int = 2
    # A migration not committed within this long is aborted; the request keeps running where it was.
    timeout: float = field(default=10.0, metadata={"duration": True})

    def __post_init__(self) -> None:
        if self.max_concurrent < 1 or self.max_stages < 0 or self.final_stage_blocks < 0:
            raise ConfigError("migration.max_concurrent must be >= 1, max_stages and final_stage_blocks >= 0")
        if self.timeout <= 0:
            raise ConfigError("migration.timeout must be positive")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding by prompt lookup: draft tokens copied from where the request's own text
    repeats, all verified in one forward pass; outputs are the same with it on or off."""

    # "ngram": draft from the request's prompt and output; "off": one token per step.
    method: str = "off"
    # The most draft tokens a request verifies in a step (each costs one token of the step's budget);
    # how many it does is decided per step from its acceptance rate and the measured cost of a position.
    num_draft_tokens: int = 4
    # The longest and shortest suffix matched against the earlier text, longest first.
    ngram_max: int = 4
    ngram_min: int = 2

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "off"):
            raise ConfigError(f"speculative.method must be ngram or off, got {self.method!r}")
        if self.num_draft_tokens < 1:
            raise ConfigError("speculative.num_draft_tokens must be >= 1")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError("speculative.ngram_min and ngram_max must satisfy 1 <= ngram_min <= ngram_max")
