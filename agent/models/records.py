"""What the model manager keeps per model and version, and what it hands out.

The records (:class:`ModelRecord`, :class:`VersionRecord`, :class:`LoadedVersion`) are
owned by :class:`agent.models.manager.ModelManager` and changed only under its lock; the
rest of the agent sees them through a :class:`Lease` (one request's hold on a version), a
:class:`Serving` (what ingress checks a request against) and the inventory payload
(:func:`inventory_of`, :func:`summarize`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal

from agent.models.backends.base import Session, TensorSpec
from agent.models.model_config import BatchingConfig, ModelConfig, StreamConfig

__all__ = [
    "Event",
    "Fingerprint",
    "Lease",
    "LoadedVersion",
    "ModelRecord",
    "Serving",
    "State",
    "VersionRecord",
    "inventory_of",
    "summarize",
]

State = Literal["loading", "ready", "failed", "draining", "unloaded"]
Fingerprint = tuple[int, int]
Event = dict[str, Any]


@dataclass
class LoadedVersion:
    """A ready session plus what requests need to run it."""

    model: str
    version: int
    session: Session
    config: ModelConfig
    backend: str
    leases: int = 0
    retired: bool = False
    retired_at: float = 0.0
    closed: bool = False


@dataclass
class VersionRecord:
    """What the inventory says about one version folder."""

    state: State
    backend: str | None
    error: str | None = None
    fingerprint: Fingerprint | None = None
    loaded: LoadedVersion | None = None
    removed: bool = False  # the folder is gone: forget the entry once it is closed


@dataclass
class ModelRecord:
    """One model folder: its config, the version that serves, and every version's record."""

    name: str
    config: ModelConfig = field(default_factory=ModelConfig)
    serving: LoadedVersion | None = None
    versions: dict[int, VersionRecord] = field(default_factory=dict)


@dataclass(frozen=True)
class Serving:
    """What ingress checks a request against: the serving version's inputs and the model's
    stream and batching settings (one read, no lock, for every request)."""

    version: int
    inputs: Sequence[TensorSpec]
    stream: StreamConfig
    batching: BatchingConfig | None  # None: off


class Lease:
    """Holds one version open for the length of a request (a context manager)."""

    def __init__(self, release: Callable[[LoadedVersion], None], loaded: LoadedVersion) -> None:
        self._release_version = release
        self.loaded = loaded
        self._released = False

    @property
    def session(self) -> Session:
        return self.loaded.session

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._release_version(self.loaded)

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def inventory_of(models: Mapping[str, ModelRecord]) -> dict[str, Any]:
    """The retained `ROOT/models` payload of the contract (the caller holds the lock)."""
    payload: dict[str, Any] = {}
    for name, record in sorted(models.items()):
        versions: dict[str, Any] = {}
        for number, entry in sorted(record.versions.items()):
            item: dict[str, Any] = {"state": entry.state, "backend": entry.backend}
            if entry.error:
                item["error"] = entry.error
            if entry.loaded is not None and entry.state == "ready":
                item["providers"] = list(entry.loaded.session.providers)
            versions[str(number)] = item
        payload[name] = {
            "serving": record.serving.version if record.serving else None,
            "versions": versions,
        }
    return {"models": payload}


def summarize(inventory: Mapping[str, Any]) -> str:
    """One line per model for logs and the CLI."""
    lines = []
    for name, model in inventory.get("models", {}).items():
        states = ", ".join(f"v{n}:{v['state']}" for n, v in model["versions"].items())
        lines.append(f"{name}: serving {model['serving']} ({states})")
    return "\n".join(lines)
