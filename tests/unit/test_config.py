"""Configuration: defaults, YAML, overrides and clear errors."""

from __future__ import annotations

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
        ("- a list\n", "mapping"),
    ],
)
def test_bad_config_is_refused_with_the_key_named(tmp_path, text, fragment):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(str(f))
    assert fragment in str(err.value)
