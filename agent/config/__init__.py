"""Typed configuration: a TOML file, environment overrides, validation, masked printing.

Every key has a default, so an empty file is a valid configuration. Unknown keys are an error
that names the key and the file, because a typo in a config that silently falls back to a
default is the worst kind of edge-box bug: it only shows up in the field.

Import from here (`from agent.config import AgentConfig, load_config`); the modules are:
`schema` (the sections and their checks), `loading` (file, environment, errors, paths),
`printing` (masked data, TOML), `state_files` (files under `state_dir`: private modes, atomic
replacement).

May import: pydantic, `agent.ops.systemd` (systemd credentials), `agent.protocol.topics` (the
one topic check, for prefixes). Nothing else of the request path.
"""

from agent.config.loading import ENV_PREFIX, ConfigError, load_config
from agent.config.printing import SECRET_KEYS, SECRET_MASK, masked_dict, to_toml
from agent.config.schema import (
    SOURCE_KEYS_BY_KIND,
    SOURCE_KIND_DEFAULTS,
    SOURCE_KINDS,
    SOURCE_NAME,
    AgentConfig,
    LimitsConfig,
    MetricsConfig,
    ModelsConfig,
    MqttConfig,
    OutboxConfig,
    QosConfig,
    ResendConfig,
    SchedulerConfig,
    SourceConfig,
    SpoolConfig,
    SystemdConfig,
    TelemetryConfig,
    TlsConfig,
    TrustConfig,
)

__all__ = [
    "ENV_PREFIX",
    "SECRET_KEYS",
    "SECRET_MASK",
    "SOURCE_KEYS_BY_KIND",
    "SOURCE_KINDS",
    "SOURCE_KIND_DEFAULTS",
    "SOURCE_NAME",
    "AgentConfig",
    "ConfigError",
    "LimitsConfig",
    "MetricsConfig",
    "ModelsConfig",
    "MqttConfig",
    "OutboxConfig",
    "QosConfig",
    "ResendConfig",
    "SchedulerConfig",
    "SourceConfig",
    "SpoolConfig",
    "SystemdConfig",
    "TelemetryConfig",
    "TlsConfig",
    "TrustConfig",
    "load_config",
    "masked_dict",
    "to_toml",
]
