"""Shared fixtures: the default model, the small model (the default cut to a few layers), an fp32
engine, the transformers reference, arenas."""

from __future__ import annotations

import functools
import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from steadfast.config import Config, ConfigError, default_model_path
from steadfast.kv.arena.arena import KVArena
from steadfast.kv.arena.files import make_tier, remove_tier, tier_spec
from steadfast.kv.arena.spec import arena_spec
from steadfast.kv.arena.tier import TierFile
from steadfast.worker.engine import Engine
from steadfast.worker.loaded import LoadedModel, load_model
from tests.small_gguf import truncate

SMALL_LAYERS = 4  # enough for every code path (layer-wise transfer, prefix blocks), a seventh of the compute


def wait_until(predicate: Callable[[], object], timeout: float, what: str, pause: Callable[[], object] | None = None):
    """Poll until `predicate()` is truthy and return its value; fail naming `what` after `timeout` seconds.
    `pause` runs between polls (by default a 50 ms sleep; a test may drain a worker's outputs instead)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if pause is not None:
            pause()
        else:
            time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


# Eight chat prompts of different lengths and kinds (the correctness set).
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "1, 2, 3, 4,",
    "Once upon a time in a land far away, there lived a",
    "Explain quantum computing in simple terms to a ten year old who loves football and pizza.",
    "Hi",
    "The quick brown fox jumps over the lazy dog. " * 3 + "What animal jumped?",
]


def kernel_or_skip(load: Callable[[], object | None], what: str):  # noqa: ANN201 - the kernel's own type
    """A C kernel (`load()` of its module), or the test skipped where it does not run here."""
    k = load()
    if k is None:
        pytest.skip(f"the {what} kernel does not run here (no C compiler or no AVX-512)")
    return k


@pytest.fixture(scope="session")
def model_path() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def fp32_config() -> Config:
    # On the CPU even where a GPU exists: exactness against `transformers` is defined on the CPU.
    return Config().replace(model={"dtype": "float32", "device": "cpu"}, cache={"num_blocks": 512})


@pytest.fixture(scope="session")
def fp32_model(fp32_config: Config) -> LoadedModel:
    return load_model(fp32_config)


@pytest.fixture(scope="session")
def small_model_path(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> str:
    """The default model cut to its first layers, for the fault and protocol tests that compare a
    server with the in-process engine rather than with `transformers`: the same tokenizer, weights
    and code paths at a fraction of the cost (the suite's time goes to these tests)."""
    out = tmp_path_factory.mktemp("small-model") / f"SmolLM2-135M-Instruct-{SMALL_LAYERS}-layers.gguf"
    truncate(model_path, str(out), SMALL_LAYERS)
    return str(out)


@pytest.fixture(scope="session")
def small_config(small_model_path: str) -> Config:
    return Config().replace(
        model={"path": small_model_path, "dtype": "float32", "device": "cpu"}, cache={"num_blocks": 512}
    )


@pytest.fixture(scope="session")
def small_model(small_config: Config) -> LoadedModel:
    return load_model(small_config)


def deterministic(cfg: Config) -> Config:
    """`cfg` in the default dtype (bf16) with `model.deterministic` (issue 21): the same tokens whatever
    the batch, the chunking, a takeover or a migration."""
    return cfg.replace(model={"dtype": "bfloat16", "deterministic": True})


def load_deterministic(cfg: Config) -> LoadedModel:
    """The model of a `deterministic` config; the test is skipped where the mode's kernels do not run
    (no AVX-512 or no C compiler: the load refuses the mode)."""
    try:
        return load_model(cfg)
    except ConfigError as exc:
        pytest.skip(f"model.deterministic does not run here: {exc}")


@pytest.fixture(scope="session")
def small_deterministic_config(small_config: Config) -> Config:
    return deterministic(small_config)


@pytest.fixture(scope="session")
def small_deterministic_model(small_deterministic_config: Config) -> LoadedModel:
    return load_deterministic(small_deterministic_config)


@pytest.fixture
def make_arena() -> Iterator:
    made: list[KVArena] = []

    def make(cfg: Config, loaded: LoadedModel) -> KVArena:
        arena = KVArena.create(
            f"/dev/shm/steadfast-test-{os.getpid()}-{uuid.uuid4().hex[:8]}.kv", arena_spec(cfg, loaded.model_cfg)
        )
        made.append(arena)
        return arena

    yield make
    for arena in made:
        arena.unlink()


@pytest.fixture
def make_engine(make_arena) -> Iterator:
    def make(cfg: Config, loaded: LoadedModel) -> Engine:
        return Engine(cfg, loaded, make_arena(cfg, loaded))

    yield make


@pytest.fixture
def make_tier_file(tmp_path):
    """`make(kind, arena, slots)`: an offload tier for an engine without a pool (host: in /dev/shm;
    disk: in the test's folder), removed after the test."""
    made = []

    def make(kind: str, arena: KVArena, slots: int) -> TierFile:
        folder = "/dev/shm" if kind == "host" else str(tmp_path)
        path = str(Path(folder) / f"steadfast-test-{os.getpid()}-{uuid.uuid4().hex[:8]}.tier")
        make_tier(path, tier_spec(arena.spec, slots))
        made.append(path)
        return TierFile.attach(kind, path, arena.spec)

    yield make
    for path in made:
        remove_tier(path)


@pytest.fixture(scope="session")
def hf_model(model_path: str):
    transformers = pytest.importorskip("transformers")
    import gguf

    path = Path(model_path)
    # transformers builds gguf's name map once per submodule (397 times, ~4 s of the ~20 s load); it is
    # a pure function of its arguments, so one per (arch, layers) gives the same mapping.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    model.eval()
    return model


@pytest.fixture(scope="session")
def hf_tokenizer(model_path: str):
    transformers = pytest.importorskip("transformers")
    path = Path(model_path)
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
