"""Loading the configuration: the TOML file, `EDGE_AGENT__...` environment overrides,
validation errors as one line per key naming the file or the variable, and paths resolved
against the file's folder (secrets also among systemd credentials).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from agent.config.schema import AgentConfig
from agent.ops.systemd import credential_path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 (JetPack 6)
    import tomli as tomllib

ENV_PREFIX = "EDGE_AGENT__"


class ConfigError(Exception):
    """One or more problems with the configuration; each line of `problems` names a key."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def load_config(path: Path | None, environ: Mapping[str, str] | None = None) -> AgentConfig:
    """Read `path` (None: defaults only), apply `EDGE_AGENT__...` overrides, validate.

    Relative paths in the file resolve against the file's folder, so a service started from
    any working directory finds the same models.
    """
    environ = os.environ if environ is None else environ
    source = str(path) if path is not None else "<defaults>"
    data: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError([f"{source}: file not found"]) from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError([f"{source}: invalid TOML: {e}"]) from None
        except UnicodeDecodeError as e:  # TOML is UTF-8: a Latin-1 comment, a binary file
            raise ConfigError([f"{source}: not UTF-8 text (byte {e.start})"]) from None
        except OSError as e:
            raise ConfigError([f"{source}: cannot read: {e.strerror}"]) from None
    problems = _apply_environment(data, environ)
    if problems:
        raise ConfigError(problems)
    try:
        config = AgentConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError([_describe(err, source, environ) for err in e.errors()]) from None
    base = path.parent.resolve() if path is not None else Path.cwd()
    config = _resolve_paths(config, base, environ)
    problems = [f"{source}: {p}" for p in config.models.trust.file_problems()]
    if problems:
        raise ConfigError(problems)
    return config


def _apply_environment(data: dict[str, Any], environ: Mapping[str, str]) -> list[str]:
    """`EDGE_AGENT__MQTT__PORT=1884` sets `[mqtt] port`; values parse as TOML when they can."""
    problems = []
    for name, raw in sorted(environ.items()):
        if not name.startswith(ENV_PREFIX):
            continue
        keys = [k.lower() for k in name[len(ENV_PREFIX) :].split("__")]
        if not all(keys):
            problems.append(f"environment {name}: empty key level")
            continue
        target = data
        for key in keys[:-1]:
            child = target.setdefault(key, {})
            if not isinstance(child, dict):
                problems.append(f"environment {name}: '{key}' is not a section")
                break
            target = child
        else:
            target[keys[-1]] = _parse_env_value(raw)
    return problems


def _parse_env_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _describe(err: Any, source: str, environ: Mapping[str, str]) -> str:
    key = ".".join(str(p) for p in err["loc"])
    env_name = ENV_PREFIX + "__".join(str(p).upper() for p in err["loc"])
    origin = f"environment {env_name}" if env_name in environ else source
    if err["type"] == "extra_forbidden":
        return f"{origin}: unknown key '{key}'"
    return f"{origin}: {key}: {str(err['msg']).removeprefix('Value error, ')}"


def _resolve_paths(
    config: AgentConfig, base: Path, environ: Mapping[str, str] | None = None
) -> AgentConfig:
    def resolve(p: Path | None) -> Path | None:
        if p is None:
            return None
        p = p.expanduser()
        return p if p.is_absolute() else (base / p)

    def resolve_secret(p: Path | None) -> Path | None:
        # Under systemd, a relative name may be a LoadCredential= credential.
        found = credential_path(p, environ or {}) if p is not None else None
        return found or resolve(p)

    tls = config.mqtt.tls.model_copy(
        update={
            "ca_file": resolve_secret(config.mqtt.tls.ca_file),
            "cert_file": resolve_secret(config.mqtt.tls.cert_file),
            "key_file": resolve_secret(config.mqtt.tls.key_file),
        }
    )
    mqtt = config.mqtt.model_copy(
        update={"tls": tls, "password_file": resolve_secret(config.mqtt.password_file)}
    )
    trust = config.models.trust
    trust = trust.model_copy(
        update={
            "public_keys": [resolve(k) for k in trust.public_keys],
            "certificate_chain": [resolve(c) for c in trust.certificate_chain],
        }
    )
    models = config.models.model_copy(
        update={"repository": resolve(config.models.repository), "trust": trust}
    )
    state_dir = resolve(config.state_dir)
    assert state_dir is not None
    spool = config.spool.model_copy(
        update={"path": resolve(config.spool.path) or state_dir / "spool.sqlite"}
    )
    sources = [  # "-" is standard input (a pipe source), not a file name
        s
        if s.path is None or str(s.path) == "-"
        else s.model_copy(update={"path": resolve(s.path)})
        for s in config.sources
    ]
    return config.model_copy(
        update={
            "mqtt": mqtt,
            "models": models,
            "state_dir": state_dir,
            "spool": spool,
            "sources": sources,
        }
    )
