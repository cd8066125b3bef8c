"""Configuration: defaults, YAML, overrides and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from steadfast.config import Config, ConfigError, load_config

pytestmark = pytest.mark.unit


def test_defaults_and_yaml_with_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model: {dtype: float32}\nscheduler: {max_num_seqs: 8}\ncache: {num_blocks: 64}\n")
    cfg = load_config(str(f), {"server": {"port": 9001}})
    assert cfg.model.dtype == "float32"
    assert cfg.scheduler.max_num_seqs == 8
    assert cfg.cache.num_blocks == 64
    assert cfg.server.port == 9001
    assert Config().cache.block_size == 16


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("modle: {}\n", "unknown config section"),
        ("model: {dtyp: float32}\n", "unknown key(s) in model: dtyp"),
        ("model: {dtype: int8}\n", "model.dtype"),
        ("cache: {block_size: 15}\n", "power of two"),
        ("scheduler: {max_num_seqs: 'many'}\n", "scheduler.max_num_seqs must be an integer"),
        ("server: {port: 70000}\n", "server.port"),
        ("model: {device: tpu}\n", "model.device"),
        ("server: {prefill_workers: 1}\n", "go together"),
        ("model: {decode_attention: fast}\n", "model.decode_attention must be auto or torch"),
        ("server: {decode_node: remote}\n", "server.decode_node must be same or separate"),
        ("server: {decode_node: separate}\n", "separate needs decode_workers"),
        ("fault_recovery: {kv_cache: {ledger_url: 'sqlite:///a.db', ledger_path: b.db}}\n", "not both"),
        ("fault_recovery: {kv_cache: {ledger_url: 'etcd://etcd-1/steadfast'}}\n", "ledger_url: ledger"),
        ("fault_recovery: {kv_cache: {ledger_url: 'redis://x/0'}}\n", "unknown scheme 'redis'"),
        ("- a list\n", "mapping"),
    ],
)
def test_bad_config_is_refused_with_the_key_named(tmp_path, text, fragment):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(str(f))
    assert fragment in str(err.value)


SEED_BLOCK = """
fault_recovery:
  lease:
    renew_interval_ms: 500        # heartbeat / renewal period
    lease_timeout_ms: 5000        # lease expiry
    version_check: true           # fencing epochs against split brain
  kv_cache:
    external_ledger: true
    snapshot_interval_steps: 128
    recovery_mode: ledger_first
  request:
    idempotency_window: 60s
    resume_checkpoint: true
"""


def test_seed_fault_recovery_block_is_accepted_verbatim_and_is_the_default(tmp_path):
    f = tmp_path / "seed.yaml"
    f.write_text(SEED_BLOCK)
    cfg = load_config(str(f))
    fr = cfg.fault_recovery
    assert (fr.lease.renew_interval_ms, fr.lease.lease_timeout_ms, fr.lease.version_check) == (500, 5000, True)
    assert (fr.kv_cache.external_ledger, fr.kv_cache.snapshot_interval_steps) == (True, 128)
    assert fr.kv_cache.recovery_mode == "ledger_first"
    assert (fr.request.idempotency_window, fr.request.resume_checkpoint) == (60.0, True)
    assert cfg == Config()


def test_the_ledger_is_configured_by_url_or_by_its_older_file_path():
    def url(**kv_cache: str) -> str:
        return Config().replace(fault_recovery={"kv_cache": kv_cache}).fault_recovery.kv_cache.resolved_ledger_url

    assert url() == ""  # a file in the server's run directory
    assert url(ledger_url="sqlite:///var/lib/steadfast/ledger.db") == "sqlite:///var/lib/steadfast/ledger.db"
    assert url(ledger_path="/var/lib/steadfast/ledger.db") == "/var/lib/steadfast/ledger.db"


def test_nested_override_keeps_sibling_keys():
    cfg = Config().replace(fault_recovery={"lease": {"renew_interval_ms": 100, "lease_timeout_ms": 300}})
    assert cfg.fault_recovery.lease.version_check is True
    assert cfg.fault_recovery.kv_cache.snapshot_interval_steps == 128


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("fault_recovery: {lease: {renew_interval_ms: 500, lease_timeout_ms: 1400}}", "at least 3 x renew_interval_ms"),
        ("fault_recovery: {lease: {renew_ms: 5}}", "unknown key(s) in fault_recovery.lease: renew_ms"),
        ("fault_recovery: {kv_cache: {recovery_mode: guess}}", "recovery_mode must be one of"),
        ("fault_recovery: {kv_cache: {snapshot_interval_steps: 0}}", "snapshot_interval_steps must be >= 1"),
        ("fault_recovery: {request: {idempotency_window: soon}}", "idempotency_window must be a duration"),
        ("fault_recovery: {lease: 5}", "must be a mapping"),
        ("fault_recovery: {lease: {version_check: false}}", "fencing is always on"),
    ],
)
def test_bad_fault_recovery_values_are_refused(tmp_path, text, fragment):
    f = tmp_path / "c.yaml"
    f.write_text(text + "\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(f))
    assert fragment in str(err.value)


@pytest.mark.parametrize("text, seconds", [("60s", 60.0), ("500ms", 0.5), ("2m", 120.0), ("1h", 3600.0), (15, 15.0)])
def test_durations(text, seconds):
    from steadfast.config import parse_duration

    assert parse_duration(text, "x") == seconds


def test_dtype_auto_is_bf16_only_where_the_cpu_computes_it_fast(monkeypatch):
    from steadfast.config import engine as config_module  # where ModelConfig looks the probe up

    flags = Path("/proc/cpuinfo").read_text()
    assert config_module.cpu_computes_bf16() == (" avx512bw" in flags or " avx512_bf16" in flags)
    cpu = Config().replace(model={"device": "cpu"})
    assert cpu.model.dtype == "auto"
    for fast, want in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(config_module, "cpu_computes_bf16", lambda fast=fast: fast)
        assert cpu.model.resolved_dtype == want
    assert cpu.replace(model={"dtype": "bfloat16"}).model.resolved_dtype == "bfloat16"  # as asked, always


def test_workers_share_the_cores_by_default(monkeypatch):
    """Two workers each on every core wait at each other's OpenMP barriers (3-4x slower measured): by
    default the cores this process may use are shared among the workers that compute, standbys aside."""
    from steadfast.config.env import torch_threads

    monkeypatch.delenv("STEADFAST_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    server = Config().replace(server={"workers": 2, "prefill_workers": 1, "decode_workers": 1, "standby_workers": 3})
    assert server.server.computing_workers == 4
    assert torch_threads(server.server.computing_workers) == 2
    assert torch_threads(16) == 1  # at least one each
    assert torch_threads(Config().server.computing_workers) == 8  # one worker: every core
    monkeypatch.setenv("STEADFAST_THREADS", "3")
    assert torch_threads(4) == 3  # the operator's word wins
