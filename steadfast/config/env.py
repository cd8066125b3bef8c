"""Environment variables: the one module of Steadfast that reads them (STYLE; mini-sglang `config/env.py`).

A leaf: standard library only at run time (and `config_base`, itself a leaf), so any module, config
included, may import it and the router stays free of torch. Each variable is read when its function is
called, not at import.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from steadfast.config.base import ConfigError


def model_path() -> str:
    """STEADFAST_MODEL: the GGUF file served when no --model is given; empty if unset."""
    return os.environ.get("STEADFAST_MODEL", "")


def log_level() -> str:
    """STEADFAST_LOG_LEVEL, upper-cased; INFO if unset."""
    return os.environ.get("STEADFAST_LOG_LEVEL", "INFO").upper()


def log_format() -> str:
    """STEADFAST_LOG_FORMAT: "json" for one JSON object a line, else text (the default)."""
    return "json" if os.environ.get("STEADFAST_LOG_FORMAT", "").strip().lower() == "json" else "text"


def failpoint(name: str) -> tuple[float, int] | None:
    """(seconds to stall, on which hit) for the named failpoint, from STEADFAST_FAILPOINTS="name=seconds[@hit],…".

    Test hooks only: nothing sets this variable outside fault-injection tests.
    """
    for item in os.environ.get("STEADFAST_FAILPOINTS", "").split(","):
        key, _, value = item.partition("=")
        if key.strip() == name and value:
            seconds, _, hit = value.partition("@")
            return float(seconds), int(hit or 1)
    return None


def failpoint_dir() -> str | None:
    """Where a reached failpoint leaves a marker file, so a test knows the fault really happened."""
    return os.environ.get("STEADFAST_FAILPOINT_DIR")


def etcd_password() -> str:
    """The password of the etcd user an `etcd://user@...` ledger URL names (never in the URL)."""
    return os.environ.get("STEADFAST_ETCD_PASSWORD", "")


def ledger_journal() -> str:
    """A folder where every ledger a process opens records its calls (a fault test's history); unset: none."""
    return os.environ.get("STEADFAST_LEDGER_JOURNAL", "")


def torch_threads(computing_workers: int = 1) -> int:
    """Threads for intra-op parallelism in a worker: STEADFAST_THREADS, else the cores this process may
    run on shared among the workers that compute at once (at least one each). Two workers each on every
    core wait at each other's OpenMP barriers: 2 workers x 2 threads on 2 cores served 30 tok/s and a
    TPOT p99 of 340-400 ms, 1 thread each 91-118 tok/s and 47-54 ms."""
    return threads_override() or max(1, len(os.sched_getaffinity(0)) // max(1, computing_workers))


def threads_override() -> int:
    """STEADFAST_THREADS: a fixed thread count for every worker (0: unset, the workers choose)."""
    value = os.environ.get("STEADFAST_THREADS")
    return int(value) if value else 0


def kernel_cache_dir() -> Path:
    """Where compiled kernels are kept: STEADFAST_KERNEL_DIR, else the user's cache directory."""
    value = os.environ.get("STEADFAST_KERNEL_DIR")
    if value:
        return Path(value)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "steadfast" / "kernels"


def api_key() -> str:
    """STEADFAST_API_KEY: the key every /v1 route asks for when `server.api_key` is unset."""
    return os.environ.get("STEADFAST_API_KEY", "")


def compare_api_key() -> str:
    """STEADFAST_COMPARE_API_KEY: the key `steadfast bench --compare` sends to the second server (never
    STEADFAST_API_KEY: that is the first server's secret, and the second may be anyone's)."""
    return os.environ.get("STEADFAST_COMPARE_API_KEY", "")


# Bounds on STEADFAST_API_KEYS before it is parsed (the config then checks each key).
MAX_API_KEYS_CHARS = 256 * 1024


def api_keys() -> list[dict[str, object]]:
    """STEADFAST_API_KEYS: a JSON list of client keys, each `{name, key, max_priority, max_concurrent}`,
    used when `access.keys` is empty. ConfigError when it is not such a list."""
    value = os.environ.get("STEADFAST_API_KEYS", "").strip()
    if not value:
        return []
    if len(value) > MAX_API_KEYS_CHARS:
        raise ConfigError(f"STEADFAST_API_KEYS is longer than {MAX_API_KEYS_CHARS} characters")
    try:
        listed = json.loads(value)
    except ValueError as exc:
        raise ConfigError(f"STEADFAST_API_KEYS is not JSON: {exc}") from None
    if not isinstance(listed, list) or not all(isinstance(item, dict) for item in listed):
        raise ConfigError('STEADFAST_API_KEYS must be a JSON list of {"name", "key", "max_priority"} objects')
    return listed


def admin_api_key() -> str:
    """STEADFAST_ADMIN_KEY: the key /admin/* asks for when `server.admin_api_key` is unset."""
    return os.environ.get("STEADFAST_ADMIN_KEY", "")


# The shortest resume key accepted: 128 bits, the strength of the tokens it signs (resume_token.py).
MIN_RESUME_KEY_BYTES = 16


def resume_key() -> bytes:
    """STEADFAST_RESUME_KEY (hex): the deployment's key for resume tokens. The launcher makes one per
    deployment and hands it to its router through the environment, so a restarted router accepts the
    event ids its predecessor sent. Empty if unset (a router started alone makes its own). ConfigError
    when it is not hex or shorter than MIN_RESUME_KEY_BYTES: a short key lets anyone who guesses it
    resume (read) every client's stream."""
    value = os.environ.get("STEADFAST_RESUME_KEY", "").strip()
    if not value:
        return b""
    try:
        key = bytes.fromhex(value)
    except ValueError:
        raise ConfigError("STEADFAST_RESUME_KEY must be hex digits (make one: openssl rand -hex 32)") from None
    if len(key) < MIN_RESUME_KEY_BYTES:
        raise ConfigError(
            f"STEADFAST_RESUME_KEY is {len(key)} bytes; it must be at least {MIN_RESUME_KEY_BYTES} bytes "
            f"({2 * MIN_RESUME_KEY_BYTES} hex digits; make one: openssl rand -hex 32)"
        )
    return key


def export_keys(api_key: str, admin_api_key: str, resume: bytes, client_keys: list[dict[str, object]]) -> None:
    """Put the deployment's keys in this process's environment, for the children it starts to inherit."""
    if client_keys:
        os.environ["STEADFAST_API_KEYS"] = json.dumps(client_keys)
    if api_key:
        os.environ["STEADFAST_API_KEY"] = api_key
    if admin_api_key:
        os.environ["STEADFAST_ADMIN_KEY"] = admin_api_key
    os.environ["STEADFAST_RESUME_KEY"] = resume.hex()
