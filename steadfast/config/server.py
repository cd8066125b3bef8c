"""The server's section: processes, roles, addresses, keys."""

from __future__ import annotations

from dataclasses import dataclass, field

from steadfast.config.base import ConfigError


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # the router's HTTP address (0.0.0.0: every interface)
    port: int = 8000  # the router's HTTP port: /v1, /health, /metrics, /dashboard, /admin
    workers: int = 1  # mixed workers: prefill and decode their own requests
    # Disaggregation (both or neither): prefill workers compute prompts, then hand each request's KV
    # to a decode worker of the node, chosen by load and KV headroom, which streams the rest.
    prefill_workers: int = 0
    decode_workers: int = 0
    # "same": decode workers share the prefill workers' node (KV changes owner in place). "separate":
    # they get a node of their own (a second kvpool with its own arena and ledger, standing in for
    # another host), and each request's KV is streamed there (see `transfer`).
    decode_node: str = "same"
    # Seconds a worker may take to load the model and say ready.
    startup_timeout_s: float = 180.0
    # How often workers report their load to the router.
    status_interval_s: float = 0.5
    # Intra-op threads per worker, fixed; 0 = STEADFAST_THREADS, else the worker chooses: the machine's
    # cores shared among the workers that compute (mixed, prefill and decode; not standbys, which compute
    # only in place of one), fewer while other processes keep cores busy (worker/threads.py).
    threads_per_worker: int = 0
    # The router's CPU niceness. 0: every token passes its event loop, and niced it starved beside a
    # busy worker (two CPU-bound processes besides: a burst's admitted TTFT p99 989-1,484 ms at 10,
    # 426-600 ms at 0). The worker's thread count leaves the router's core to it (worker/threads.py).
    router_nice: int = 0
    # Hot standbys per node: loaded, arena mapped, no traffic until a worker of their node dies and
    # one takes its requests (adopting its KV from that node's arena).
    standby_workers: int = 1
    # Access (vLLM's --api-key): when set, every /v1 route needs `Authorization: Bearer <api_key>`
    # (or STEADFAST_API_KEY). /admin/* needs `admin_api_key` when set, else is served to loopback
    # clients only. /health and /metrics stay open unless `open_metrics` is false (then: the API key).
    # Keys never travel on a child's command line (visible to every local user): see `public()`.
    api_key: str = ""
    admin_api_key: str = ""
    open_metrics: bool = True
    # Limits on what one client may send, so nobody can starve the others.
    max_body_bytes: int = 4 * 2**20  # request body; 413 beyond
    max_messages: int = 1024  # chat messages per request
    max_n: int = 8  # choices per request (`n`): each is a request of its own to the workers
    max_prompt_chars: int = 1_000_000  # characters of prompt (all messages' text) and stop strings per request
    # Requests admitted and not finished, over all workers; beyond, new ones get 429 + Retry-After.
    max_pending_requests: int = 1024
    # HTTP requests being served at once (streams included); beyond, 429 + Retry-After.
    max_connections: int = 2048
    # A request that receives no token for this long is moved to another worker, or failed.
    request_timeout: float = field(default=60.0, metadata={"duration": True})
    # SIGTERM / Ctrl-C to `steadfast serve`: new requests are refused (503) and those in flight get this
    # long to finish; the rest then end with an error event saying the server shut down.
    shutdown_timeout: float = field(default=30.0, metadata={"duration": True})
    # An SSE stream with nothing to send this long gets a comment line (`: keep-alive`, ignored by SSE
    # clients), so a request that waits (queued, moved to another worker, a resume waiting its turn)
    # keeps its connection through proxies and clients that drop idle ones (60 s at nginx and most load
    # balancers, less at some), even when the busy router writes it a few seconds late.
    sse_keepalive: float = field(default=10.0, metadata={"duration": True})
    # A nemesis soak's JSON report (`steadfast chaos soak --json FILE`) the dashboard shows, with the
    # timeline PNG beside it (same name, .png); read when the dashboard asks, so a new soak shows at once.
    soak_report: str = ""

    @property
    def computing_workers(self) -> int:
        """Workers that run forward passes at the same time (standbys compute only in a dead one's place)."""
        return self.workers + self.prefill_workers + self.decode_workers

    def __post_init__(self) -> None:
        for name in (
            "max_body_bytes",
            "max_messages",
            "max_n",
            "max_prompt_chars",
            "max_pending_requests",
            "max_connections",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"server.{name} must be >= 1")
        if self.request_timeout <= 0:
            raise ConfigError("server.request_timeout must be positive")
        if self.shutdown_timeout < 0:
            raise ConfigError("server.shutdown_timeout must be >= 0")
        if not 0 <= self.port < 65536:
            raise ConfigError("server.port must be in 0..65535")
        if self.standby_workers < 0:
            raise ConfigError("server.standby_workers must be >= 0")
        if not 0 <= self.router_nice <= 19:
            raise ConfigError("server.router_nice must be in 0..19")
        if min(self.workers, self.prefill_workers, self.decode_workers) < 0:
            raise ConfigError("server.workers, prefill_workers and decode_workers must be >= 0")
        if (self.prefill_workers > 0) != (self.decode_workers > 0):
            raise ConfigError("server.prefill_workers and server.decode_workers go together: set both or neither")
        if self.decode_node not in ("same", "separate"):
            raise ConfigError(f"server.decode_node must be same or separate, got {self.decode_node!r}")
        if self.decode_node == "separate" and not self.decode_workers:
            raise ConfigError("server.decode_node: separate needs decode_workers (and prefill_workers)")
        if self.workers + self.prefill_workers + self.decode_workers < 1:
            raise ConfigError("server needs at least one worker (workers, or prefill_workers + decode_workers)")
        if self.startup_timeout_s <= 0 or self.status_interval_s <= 0:
            raise ConfigError("server timeouts must be positive")
        if self.sse_keepalive <= 0:
            raise ConfigError("server.sse_keepalive must be positive")
