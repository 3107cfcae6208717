"""Loaded model versions: loading, leases, the serving version, drain and unload.

Invariants this module keeps:

1. A version is never closed while a request holds a lease on it: retiring a version only
   marks it; the last lease to end closes it (or the drain timeout does, at shutdown).
2. A broken version never replaces a working one: a new version is loaded, checked and
   warmed up before the serving pointer moves, and a failure leaves the old one serving.

`sync()` makes the loaded state match the repository on disk. It is idempotent, so the
watcher (or a timer) may call it as often as it likes; loading happens outside the state
lock, so requests keep leasing the serving version while a new one warms up.

The records it keeps and the leases it hands out are :mod:`agent.models.records`; what a
version must pass to serve is :mod:`agent.models.loading`; when its files count as
complete is :mod:`agent.models.settling`; how a version is retired, drained and closed is
:mod:`agent.models.retirement`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agent.config import ModelsConfig
from agent.models.backends.base import (
    BackendOptions,
    ModelLoadError,
    TensorSpec,
    release_idle_memory,
)
from agent.models.engine_builds import EngineBuilds
from agent.models.loading import open_version
from agent.models.model_config import ModelConfig
from agent.models.records import (
    Event,
    Fingerprint,
    Lease,
    LoadedVersion,
    ModelRecord,
    Serving,
    VersionRecord,
    device_bytes_of,
    inventory_of,
    loaded_versions,
    prefix_caches_of,
    summarize,
)
from agent.models.repository import ModelInfo, VersionInfo, scan_repository
from agent.models.retirement import Retirement
from agent.models.settling import SettleTracker, fingerprint_of, warn_if_replaced
from agent.models.trust import TrustPolicy
from agent.protocol.errors import WireError

# LoadedVersion, Serving and summarize live in agent.models.records; the service and the
# inference package import them from here, next to the manager that makes them.
__all__ = ["LoadedVersion", "ModelManager", "Serving", "summarize"]

log = logging.getLogger(__name__)

# While a version is `failed`, the disk is looked at again this often, file events or not: a
# fixed file is what an operator does next, and its event can be lost (watchdog 6, the one
# Python 3.10 gets, may leave a folder renamed into place unwatched; a network file system
# sends none). A scan of the repository is a few stats and small reads.
FAILED_RECHECK_S = 2.0


class ModelManager:
    """Every model's loaded versions: requests lease them, `sync()` follows the disk."""

    def __init__(
        self,
        repository: Path,
        options: BackendOptions,
        *,
        warmup: bool = True,
        on_event: Callable[[Event], None] = lambda event: None,
        on_inventory: Callable[[], None] = lambda: None,
        settle_s: float = 1.0,
        drain_timeout_s: float = 30.0,
        trust: TrustPolicy | None = None,
    ) -> None:
        self._root = repository
        self._options = options
        self._warmup = warmup
        self._on_event = on_event
        self._on_inventory = on_inventory
        self._lock = threading.Lock()  # guards the records; held only briefly
        self._sync_lock = threading.Lock()  # one sync at a time; held while loading
        self._idle = threading.Condition(self._lock)
        self._models: dict[str, ModelRecord] = {}
        # model -> (serving version, config, what ingress needs of them): rebuilt on a change
        self._serving: dict[str, tuple[LoadedVersion, ModelConfig, Serving]] = {}
        self._closed = False
        self._retirement = Retirement(
            self._lock,
            self._models,
            on_event=on_event,
            on_inventory=on_inventory,
            drain_timeout_s=drain_timeout_s,
        )
        self._settling = SettleTracker(settle_s)
        self._trust = trust  # None: versions need no signature
        self._builds = EngineBuilds(  # TensorRT engines built from ONNX versions, off the sync
            on_event=on_event, on_inventory=on_inventory, on_done=self.sync, trust=trust
        )

    @classmethod
    def for_config(
        cls,
        models: ModelsConfig,
        options: BackendOptions,
        *,
        on_event: Callable[[Event], None],
        on_inventory: Callable[[], None],
    ) -> ModelManager:
        """The agent's manager, as ``[models]`` says. Signatures are checked only with
        ``[models.trust] require_signature``: without it nothing of model-signing is loaded."""
        trust = models.trust
        return cls(
            models.repository,
            options,
            warmup=models.warmup,
            on_event=on_event,
            on_inventory=on_inventory,
            settle_s=models.settle_s,
            drain_timeout_s=models.drain_timeout_s,
            trust=TrustPolicy(trust) if trust.require_signature else None,
        )

    # -- requests --------------------------------------------------------------------------

    def lease(self, model: str, version: int | None = None) -> Lease:
        """Lease the serving version, or a pinned loaded one; raise a WireError otherwise."""
        with self._lock:
            record = self._models.get(model)
            if record is None or (record.serving is None and not record.versions):
                raise WireError("unknown_model", f"no model named '{model}'")
            if version is None:
                loaded = record.serving
                if loaded is None:
                    raise WireError("unknown_model", f"model '{model}' has no ready version")
            else:
                entry = record.versions.get(version)
                loaded = entry.loaded if entry is not None else None
                if loaded is None or loaded.retired:
                    ready = sorted(v for v, r in record.versions.items() if r.state == "ready")
                    raise WireError(
                        "unknown_version",
                        f"version {version} of '{model}' is not loaded (loaded: {ready})",
                    )
            loaded.leases += 1
            return Lease(self._release, loaded)

    def _release(self, loaded: LoadedVersion) -> None:
        close = False
        with self._lock:
            loaded.leases -= 1
            if loaded.retired and loaded.leases == 0 and not loaded.closed:
                loaded.closed = close = True
            self._idle.notify_all()
        if close:
            self._retirement.close_version(loaded)

    def serving_inputs(self, model: str) -> Sequence[TensorSpec] | None:
        """Inputs of the serving version, to reject bad requests before they queue."""
        with self._lock:
            record = self._models.get(model)
            if record is None or record.serving is None:
                return None
            return record.serving.session.inputs

    def has_model(self, model: str) -> bool:
        return model in self._models  # one dict lookup: atomic, no lock needed

    def serving(self, model: str) -> Serving | None:
        """The serving version of `model` as ingress needs it; None without one."""
        record = self._models.get(model)
        loaded = record.serving if record is not None else None
        if record is None or loaded is None:
            return None
        cached = self._serving.get(model)
        if cached is not None and cached[0] is loaded and cached[1] is record.config:
            return cached[2]
        info = Serving.of(loaded, record.config)
        self._serving[model] = (loaded, record.config, info)
        return info

    def ready(self) -> bool:
        with self._lock:
            return all(r.serving is not None for r in self._models.values())

    # -- inventory -------------------------------------------------------------------------

    def inventory(self) -> dict[str, Any]:
        """The retained `ROOT/models` payload of the contract."""
        with self._lock:
            return inventory_of(self._models)

    def device_bytes(self) -> dict[tuple[str, int], int]:
        """GPU memory the loaded versions' sessions hold (`records.device_bytes_of`)."""
        return device_bytes_of(self._open())

    def prefix_caches(self) -> dict[tuple[str, int], tuple[int, int]]:
        """The loaded versions' prefix caches (`records.prefix_caches_of`)."""
        return prefix_caches_of(self._open())

    # -- reconciling with the disk -----------------------------------------------------------

    def sync(self) -> float | None:
        """Load what is new and complete, retire what is gone; never blocks requests.

        Returns the seconds after which another sync is needed because some version's files
        are still settling (written in place, not yet unchanged for `settle_s`), else None.
        """
        with self._sync_lock:
            if self._closed:
                return None
            self._settling.start_round()
            try:
                found = scan_repository(self._root)
            except OSError as e:
                log.error("cannot scan the model repository %s: %s", self._root, e)
                return None
            for name in sorted(set(self._models) - set(found)):
                self._retirement.remove_model(name)
                self._settling.forget_model(name)
            for _, info in sorted(found.items()):
                self._sync_model(info)
            next_check = self._settling.finish_round()
            self._retirement.reap()
            self._release_idle_memory()
            return next_check

    def _release_idle_memory(self) -> None:
        """Sessions idle for `base.IDLE_RELEASE_S` give back what they keep for runs to come
        (TensorRT: their buffers; ONNX Runtime: its arena, by one run of inputs it kept)."""
        for version in self._open():
            try:
                release_idle_memory(version.session)
            except Exception:  # a CUDA error: the version's next run reports it
                log.exception(
                    "%s v%d: releasing idle memory failed", version.model, version.version
                )

    def _open(self) -> list[LoadedVersion]:
        """The loaded versions not closed yet, as they are now."""
        with self._lock:
            return [v for v in loaded_versions(self._models) if not v.closed]

    def recheck_s(self) -> float | None:
        """How soon the disk should be looked at again, file events or not: FAILED_RECHECK_S
        while a version is failed, else None (the watcher's rescan suffices)."""
        with self._lock:
            failed = any(
                entry.state == "failed"
                for record in self._models.values()
                for entry in record.versions.values()
            )
        return FAILED_RECHECK_S if failed else None

    def mark_complete(self, version_folder: Path) -> None:
        """A version folder was renamed into place: its files are complete at once."""
        self._settling.mark_complete(version_folder)

    def _sync_model(self, info: ModelInfo) -> None:
        with self._lock:
            record = self._models.setdefault(info.name, ModelRecord(info.name))
            new = [n for n in info.versions if n not in record.versions]
            for number in new:
                record.versions[number] = VersionRecord("unloaded", info.versions[number].backend)
        changed = bool(new)
        if info.config_error is not None:
            for version in info.versions.values():  # tried again once the config is fixed
                changed |= self._mark_failed(record, version, info.config_error, files=False)
            if changed:
                self._on_inventory()
            return
        config = info.config or ModelConfig()
        with self._lock:
            record.config = config
        # Versions whose folders are gone: drain and unload.
        for number in sorted(set(record.versions) - set(info.versions)):
            self._fall_back_from(record, number, info, config)
            self._retirement.retire(record, number, removed=True)
            self._settling.forget(info.path / str(number))
            changed = True
        if self._choose_and_load(record, info, config) or changed:
            self._on_inventory()

    def _fall_back_from(
        self, record: ModelRecord, number: int, info: ModelInfo, config: ModelConfig
    ) -> None:
        """Version `number` goes: where it serves, the policy's next loaded version serves
        before it is retired, so that no inventory shows none serving while one is ready."""
        if record.serving is None or record.serving.version != number:
            return
        for candidate in config.policy.candidates(info.versions):
            entry = record.versions.get(candidate)
            if entry is not None and entry.state == "ready" and entry.loaded is not None:
                self._swap(record, entry.loaded)
                return
        record.served_before = number  # the next version to serve says it took over

    def _choose_and_load(self, record: ModelRecord, info: ModelInfo, config: ModelConfig) -> bool:
        """Bring the serving version to the policy's choice. True when anything changed."""
        changed = False
        for number in config.policy.candidates(info.versions):
            entry = record.versions[number]
            version = info.versions[number]
            fingerprint = fingerprint_of(version)
            if entry.state == "ready" and entry.loaded is not None:
                warn_if_replaced(record.name, entry, fingerprint)
                if record.serving is not entry.loaded:
                    self._swap(record, entry.loaded)
                    changed = True
                break
            if entry.state == "failed" and entry.fingerprint == fingerprint:
                continue  # the same broken files: do not retry until they change
            if entry.state == "draining":
                continue  # retired, still held by a request: not a candidate
            if not self._settling.settled(version, fingerprint):
                continue  # still being written: a lower ready version keeps serving meanwhile
            if version.problem is not None:  # found by the scan (no model file, ...): no load
                changed |= self._mark_failed(record, version, version.problem)
                continue
            engine = None
            if version.builds_engine:
                engine = self._engine(record, version, fingerprint)
                if engine is None:
                    changed = True  # being built, or its build failed: a lower version serves
                    continue
            loaded = self._load(record, version, fingerprint, engine)
            changed = True
            if loaded is not None:
                self._swap(record, loaded)
                break
        changed |= self._retirement.trim(record, config.policy.keep_loaded)
        return changed

    def _engine(
        self, record: ModelRecord, version: VersionInfo, fingerprint: Fingerprint | None
    ) -> Path | None:
        """The plan built from an ONNX version (agent.models.engine_builds); None while it is
        built (the version is `building`, with its progress) or when that failed (`failed`)."""
        options = record.config.backend_options.apply(self._options)
        try:
            generate = record.config.generate
            context = generate.context if generate is not None else None
            found = self._builds.engine(record.name, version, fingerprint, options, context=context)
        except ModelLoadError as e:
            self._mark_failed(record, version, str(e))
            return None
        if isinstance(found, Path):
            return found
        with self._lock:
            entry = record.versions[version.version]
            entry.state, entry.error, entry.fingerprint = "building", None, fingerprint
            entry.progress = found
        return None

    def _load(
        self,
        record: ModelRecord,
        version: VersionInfo,
        fingerprint: Fingerprint | None,
        engine: Path | None = None,
    ) -> LoadedVersion | None:
        entry = record.versions[version.version]
        with self._lock:
            entry.state, entry.error, entry.fingerprint = "loading", None, fingerprint
            entry.signed = None
        self._on_inventory()
        started = time.monotonic()
        try:
            opened = open_version(
                record,
                version,
                self._options,
                warmup=self._warmup,
                trust=self._trust,
                engine=engine,
            )
        except ModelLoadError as e:
            self._mark_failed(record, version, str(e))
            return None
        session, warmed = opened.session, opened.warmup
        loaded = LoadedVersion(
            record.name, version.version, session, record.config, version.backend or "?"
        )
        loaded.postprocess = opened.postprocess
        loaded.generation = opened.generation
        loaded.text = opened.text
        loaded.audio = opened.audio
        loaded.processor_preprocess = opened.preprocess
        with self._lock:
            entry.state, entry.loaded, entry.backend = "ready", loaded, loaded.backend
            entry.warmup, entry.signed = warmed, opened.signed
        seconds = time.monotonic() - started
        log.info(
            "model %s v%d ready (%s, providers %s) in %.2f s",
            record.name,
            version.version,
            loaded.backend,
            ",".join(session.providers),
            seconds,
        )
        self._on_event(
            {
                "type": "model_loaded",
                "model": record.name,
                "version": version.version,
                "backend": loaded.backend,
                "providers": list(session.providers),
                "warmup": warmed,
                "load_s": round(seconds, 4),
            }
        )
        return loaded

    def _mark_failed(
        self, record: ModelRecord, version: VersionInfo, error: str, *, files: bool = True
    ) -> bool:
        """`files`: the version's own files are at fault, so it is tried again once they
        change (else, a config error: at the next sync that finds the config good)."""
        fingerprint = fingerprint_of(version) if files else None
        with self._lock:
            entry = record.versions.setdefault(
                version.version, VersionRecord("unloaded", version.backend)
            )
            if (
                entry.state == "failed"
                and entry.error == error
                and entry.fingerprint == fingerprint
            ):
                return False
            if entry.loaded is not None and entry.state == "ready":
                return False  # a ready version stays ready; a broken config only stops new loads
            entry.state, entry.error, entry.fingerprint = "failed", error, fingerprint
        log.error("model %s v%d failed to load: %s", record.name, version.version, error)
        self._on_event(
            {
                "type": "model_load_failed",
                "model": record.name,
                "version": version.version,
                "error": error,
            }
        )
        return True

    def _swap(self, record: ModelRecord, loaded: LoadedVersion) -> None:
        with self._lock:
            previous, record.serving = record.serving, loaded
            before = previous.version if previous is not None else record.served_before
            record.served_before = None
        if before is not None and previous is not loaded:
            log.info("model %s: serving v%d (was v%d)", record.name, loaded.version, before)
            self._on_event(
                {
                    "type": "model_swapped",
                    "model": record.name,
                    "from": before,
                    "to": loaded.version,
                }
            )

    # -- shutdown ----------------------------------------------------------------------------

    def close(self, drain_timeout: float = 10.0) -> None:
        """Retire everything, wait for leases up to `drain_timeout`, then close all sessions."""
        self._builds.close()  # first: its thread's sync after a build takes the sync lock
        with self._sync_lock:
            self._closed = True
            deadline = time.monotonic() + drain_timeout
            with self._lock:
                while any(v.leases for v in loaded_versions(self._models)):
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._idle.wait(remaining)
                loaded = [v for v in loaded_versions(self._models) if not v.closed]
                for item in loaded:
                    item.closed = item.retired = True
                for record in self._models.values():
                    record.serving = None
            for item in loaded:
                try:
                    item.close_sessions()
                except Exception:
                    log.exception("model %s v%d: close failed", item.model, item.version)
