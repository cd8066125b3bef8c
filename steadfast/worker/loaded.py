"""What a worker computes with: the served model built (model/loader.py) with its tokenizer and length
limit, and the step cost its warm-up measured; and an arena for one engine alone (tests, the zygote's
warm-up, a worker started without a pool)."""

from __future__ import annotations

from dataclasses import dataclass

from steadfast.config import Config
from steadfast.kv.arena.arena import KVArena
from steadfast.kv.arena.spec import arena_spec
from steadfast.model.gguf_meta import LlamaConfig
from steadfast.model.llama import LlamaModel
from steadfast.model.loader import build_model
from steadfast.model.tokenizer import GGUFTokenizer
from steadfast.worker.core.step_cost import StepCost


@dataclass(frozen=True)
class LoadedModel:
    model_cfg: LlamaConfig
    model: LlamaModel
    tokenizer: GGUFTokenizer
    max_model_len: int
    # What a step of it cost in a warm-up on this machine (the zygote's, for the workers it forks):
    # the scheduler's first estimate, until the worker's own steps take over.
    step_cost: StepCost | None = None


def load_model(cfg: Config, weights_dir: str = "") -> LoadedModel:
    """The model this worker computes with (model/loader.py builds it; `weights_dir`: see there)."""
    return LoadedModel(*build_model(cfg, weights_dir))


def private_arena(cfg: Config, model_cfg: LlamaConfig, path: str) -> KVArena:
    """An arena for one engine alone: a /dev/shm file at `path` on the CPU, device memory on a GPU."""
    spec = arena_spec(cfg, model_cfg)
    device = cfg.model.resolved_device
    return KVArena.create(path, spec) if device == "cpu" else KVArena.create_device(spec, device)
