"""SIGHUP: which keys of a reloaded configuration a running agent takes over.

Applied at once: log level and format, the QoS of replies, events, status and telemetry,
the telemetry period, the input limits, the allowed reply prefixes, the drain timeout,
`scheduler.inline_max_ms` and `systemd.stuck_after_s`. Everything else (broker connection,
models, workers, queue, spool, metrics endpoint, the request subscription's QoS) keeps its
old value until a restart, and is listed as such.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from agent.config import AgentConfig


@dataclass(frozen=True)
class ReloadReport:
    applied: list[str]  # dotted keys that changed and now have their new value
    restart_required: list[str]  # dotted keys that changed but keep the old value


# Keys (or whole sections) a running agent can take over from a reloaded configuration.
RELOADABLE = (
    "log_level",
    "log_format",
    "mqtt.qos.reply",
    "mqtt.qos.event",
    "mqtt.qos.status",
    "mqtt.qos.telemetry",
    "mqtt.allowed_reply_prefixes",
    "telemetry.interval_s",
    "limits",
    "scheduler.drain_timeout_s",
    "scheduler.inline_max_ms",
    "systemd.stuck_after_s",
)


def plan_reload(old: AgentConfig, new: AgentConfig) -> tuple[AgentConfig, list[str], list[str]]:
    """The configuration to run with after a reload, the keys applied, the keys not applied."""
    applied: list[str] = []
    restart: list[str] = []

    def merge(a: Any, b: Any, prefix: str) -> Any:
        update = {}
        for name in type(a).model_fields:
            key = f"{prefix}{name}"
            va, vb = getattr(a, name), getattr(b, name)
            if va == vb:
                continue
            if key in RELOADABLE:
                update[name] = vb
                applied.extend(_changed_keys(va, vb, key))
            elif isinstance(va, BaseModel) and any(r.startswith(f"{key}.") for r in RELOADABLE):
                update[name] = merge(va, vb, f"{key}.")
            else:
                restart.extend(_changed_keys(va, vb, key))
        return a.model_copy(update=update) if update else a

    merged: AgentConfig = merge(old, new, "")
    return merged, applied, restart


def _changed_keys(a: Any, b: Any, key: str) -> list[str]:
    if isinstance(a, BaseModel) and isinstance(b, BaseModel):
        keys: list[str] = []
        for name in type(a).model_fields:
            keys += _changed_keys(getattr(a, name), getattr(b, name), f"{key}.{name}")
        return keys
    return [key] if a != b else []
