"""Loading the configuration: errors that name the key and the file, environment overrides,
masked printing."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.config import ConfigError, load_config, masked_dict, to_toml


def test_config_errors_name_key_and_file(tmp_path: Path):
    path = tmp_path / "agent.toml"
    path.write_text('[mqtt]\nport = "x"\nhostt = "a"\n[models]\nrepository = "m"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path, {})
    problems = info.value.problems
    assert f"{path}: unknown key 'mqtt.hostt'" in problems
    assert any(p.startswith(f"{path}: mqtt.port:") for p in problems)


def test_config_environment_overrides_and_masking(tmp_path: Path):
    path = tmp_path / "agent.toml"
    path.write_text(
        'device_id = "box"\n[mqtt]\nport = 1883\nusername = "u"\npassword_file = "pw"\n'
    )
    config = load_config(
        path, {"EDGE_AGENT__MQTT__PORT": "1884", "EDGE_AGENT__MQTT__PROTOCOL": "3.1.1"}
    )
    assert config.mqtt.port == 1884 and config.mqtt.protocol == "3.1.1"
    assert config.mqtt.password_file == tmp_path / "pw"
    text = to_toml(masked_dict(config))
    assert 'password_file = "***"' in text and "pw" not in text.replace("password_file", "")
    with pytest.raises(ConfigError) as info:
        load_config(path, {"EDGE_AGENT__MQTT__NOPE": "1"})
    assert info.value.problems == ["environment EDGE_AGENT__MQTT__NOPE: unknown key 'mqtt.nope'"]


def test_config_rejects_bad_toml_and_missing_file(tmp_path: Path):
    path = tmp_path / "bad.toml"
    path.write_text("device_id = \n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(path, {})
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "missing.toml", {})
