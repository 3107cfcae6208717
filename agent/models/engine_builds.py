"""TensorRT engines the agent builds itself, with the build visible in the inventory.

A version whose model says ``backend = "tensorrt"`` but whose folder holds ``model.onnx``
is served from an engine built on the box (``VersionInfo.builds_engine``). The plan goes
into the engine cache only (:func:`agent.models.engine_builder.build.build_into_cache`,
keyed by the ONNX file's sha256, TensorRT, the GPU and the build options); the version
folder is never written, so a signed version stays signed. How to build comes from the
model's ``[backend_options.tensorrt.build]`` (:func:`build_options`).

:class:`EngineBuilds` runs the builds, one at a time, on its own thread (``engine-build``),
so a build of minutes never holds the manager's sync: the version is ``building`` meanwhile
(with ``progress``) and the versions that serve keep serving. When a build ends it calls
``on_done`` (the manager's sync), which then finds the plan cached and loads it. A second
thread (``engine-build-ticker``) republishes the inventory while a build runs: at most once
per ``publish_interval_s`` when its progress moved, and every ``heartbeat_s`` regardless
(the elapsed time). Events: ``engine_build_started`` and ``engine_build_finished``
(``cache: "hit"`` for an engine already built, which never shows ``building``).
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from agent.models.backends.base import BackendOptions, ModelLoadError
from agent.models.backends.tensorrt.runtime import TensorRTOptions
from agent.models.engine_builder.build import CacheEntry, build_into_cache, cache_entry
from agent.models.engine_builder.options import (
    BuildOptions,
    EngineBuildError,
    default_cache_dir,
    parse_profile,
)
from agent.models.engine_builder.progress import PhaseTracker
from agent.models.engine_builder.publish import write_atomic
from agent.models.loading import verify_files
from agent.models.records import Event, Fingerprint
from agent.models.repository import VersionInfo
from agent.models.trust import TrustPolicy
from agent.threads import NamedThread

__all__ = [
    "BUILD_KEYS",
    "DURATIONS_FILE",
    "EngineBuilds",
    "Progress",
    "build_options",
]

log = logging.getLogger(__name__)

BUILD_KEYS = ("fp16", "int8", "workspace_mib", "max_batch", "profiles", "context")
DURATIONS_FILE = "build-seconds.json"  # in the engine cache: model -> its last build's seconds
JOIN_TIMEOUT_S = 5.0

Progress = Callable[[], dict[str, Any]]  # a building version's `progress`, read on each publish
_Default = TypeVar("_Default", bound=int | None)


def _flag(table: Mapping[str, Any], key: str) -> bool:
    value = table.get(key, False)
    if not isinstance(value, bool):
        raise ModelLoadError(f"tensorrt.build.{key} must be true or false, got {value!r}")
    return value


def _count(table: Mapping[str, Any], key: str, default: _Default) -> int | _Default:
    value = table.get(key)
    if value is None:  # TOML has no null: the key is not set
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelLoadError(f"tensorrt.build.{key} must be an integer >= 1, got {value!r}")
    return value


def build_options(options: BackendOptions, *, context: int | None = None) -> BuildOptions:
    """``[backend_options.tensorrt.build]`` (and ``tensorrt.device``) as BuildOptions;
    ModelLoadError naming the key for a bad value, before anything is built. `context`: the
    model's ``[generate] context``, used where ``tensorrt.build.context`` is not set."""
    tensorrt = TensorRTOptions.from_extra(options.extra)  # as the load checks it
    table = TensorRTOptions.table(options.extra).get("build", {})
    if not isinstance(table, Mapping):
        raise ModelLoadError("tensorrt.build must be a table")
    unknown = sorted(set(table) - set(BUILD_KEYS))
    if unknown:
        raise ModelLoadError(
            f"unknown tensorrt.build option(s) {', '.join(map(str, unknown))} "
            f"(known: {', '.join(BUILD_KEYS)})"
        )
    profiles = table.get("profiles", [])
    if not isinstance(profiles, list) or not all(isinstance(p, str) for p in profiles):
        raise ModelLoadError('tensorrt.build.profiles must be a list of "NAME:MIN/OPT/MAX" texts')
    workspace_mib = _count(table, "workspace_mib", None)
    try:
        return BuildOptions(
            fp16=_flag(table, "fp16"),
            int8=_flag(table, "int8"),
            workspace_bytes=None if workspace_mib is None else workspace_mib * 1024 * 1024,
            profiles=tuple(parse_profile(spec) for spec in profiles),
            max_batch=_count(table, "max_batch", 8),
            device=tensorrt.device,
            context=_count(table, "context", context),  # a decoder's (agent.models.engine_builder)
            # a run's activation memory given by the agent: let it follow the run's shapes
            activation_resize=tensorrt.activation_memory == "by_run",
        )
    except ValueError as exc:
        raise ModelLoadError(f"tensorrt.build: {exc}") from None


@dataclass
class _Job:
    """One version's build, from queued to done or failed."""

    model: str
    version: int
    fingerprint: Fingerprint | None
    entry: CacheEntry  # the ONNX file's (hashed once: its key, its checksum, its build)
    options: BuildOptions
    estimate_s: float | None
    tracker: PhaseTracker
    state: Literal["queued", "running", "done", "failed"] = "queued"
    started: float = 0.0
    plan: Path | None = None
    error: str | None = None
    published: tuple[Any, ...] = field(default=())  # what the last publish showed

    def progress(self) -> dict[str, Any]:
        """The inventory's ``progress`` of this version."""
        fraction, phases = self.tracker.snapshot()
        running = self.state == "running"
        return {
            "queued": self.state == "queued",
            "elapsed_s": round(time.monotonic() - self.started, 1) if running else 0.0,
            "estimate_s": self.estimate_s,
            "fraction": None if fraction is None else round(fraction, 3),
            "phases": phases,
        }

    def moved(self) -> tuple[Any, ...]:
        """What must change for the progress to be worth publishing (1 % or a phase)."""
        fraction, phases = self.tracker.snapshot()
        return (
            self.state,
            None if fraction is None else int(fraction * 100),
            tuple(p["name"] for p in phases),
        )


class EngineBuilds:
    """The agent's engine builds: one at a time, off the manager's sync (see the module)."""

    def __init__(
        self,
        *,
        on_event: Callable[[Event], None],
        on_inventory: Callable[[], None],
        on_done: Callable[[], object],
        publish_interval_s: float = 1.0,
        heartbeat_s: float = 10.0,
        trust: TrustPolicy | None = None,
    ) -> None:
        self._trust = trust
        self._on_event = on_event
        self._on_inventory = on_inventory
        self._on_done = on_done
        self._publish_interval_s = publish_interval_s
        self._heartbeat_s = heartbeat_s
        self._cond = threading.Condition()
        self._jobs: dict[tuple[str, int], _Job] = {}
        self._queue: collections.deque[_Job] = collections.deque()
        self._running: _Job | None = None
        self._threads: list[threading.Thread] = []
        self._closing = False
        self._durations: dict[str, float] | None = None  # read from the cache on first use
        self._durations_lock = threading.Lock()

    # -- what the manager asks -------------------------------------------------------------

    def engine(
        self,
        model: str,
        version: VersionInfo,
        fingerprint: Fingerprint | None,
        options: BackendOptions,
        *,
        context: int | None = None,
    ) -> Path | Progress:
        """The cached plan to load for ``version`` (a path), or its progress while it is
        queued or built (a callable). ModelLoadError: bad build options, no TensorRT, or the
        build failed (the reason, one line). `context`: the model's ``[generate] context``."""
        ready = self._finished_job(model, version.version, fingerprint)
        if ready is not None:
            return ready
        assert version.model_file is not None  # version.builds_engine
        options_ = build_options(options, context=context)
        looked_up = time.monotonic()
        try:
            entry = cache_entry(version.model_file, options_)
        except EngineBuildError as exc:
            raise ModelLoadError(str(exc)) from None
        if entry.cached:
            self._event_finished(
                model, version.version, entry.key, ok=True, cache="hit", started=looked_up
            )
            return entry.plan
        # The signature or checksum before a build: the load checks them again, but TensorRT
        # parses only what the box would load, and a tampered file must not cost minutes.
        verify_files(version, self._trust, sha256=entry.onnx_sha256)
        job = _Job(
            model,
            version.version,
            fingerprint,
            entry,
            options_,
            self._last_seconds(model),
            PhaseTracker(
                lambda line: log.info("engine build %s v%d: %s", model, version.version, line)
            ),
        )
        with self._cond:
            if self._closing:
                raise ModelLoadError("not built: the agent is stopping")
            self._jobs[(model, version.version)] = job
            self._queue.append(job)
            self._start_threads()
            self._cond.notify_all()
        return job.progress

    def _finished_job(
        self, model: str, number: int, fingerprint: Fingerprint | None
    ) -> Path | Progress | None:
        """A job of these very files: its progress, its plan (once), or its failure (once)."""
        with self._cond:
            job = self._jobs.get((model, number))
            if job is None or job.fingerprint != fingerprint:
                return None
            if job.state in ("queued", "running"):
                return job.progress
            del self._jobs[(model, number)]
        if job.plan is not None:
            return job.plan
        raise ModelLoadError(job.error or "the engine build failed")

    # -- the threads -----------------------------------------------------------------------

    def _start_threads(self) -> None:
        """Started with the first build (a manager that never builds has no threads)."""
        if self._threads:
            return
        for name, target in (("engine-build", self._work), ("engine-build-ticker", self._tick)):
            # daemon: TensorRT before 10 cannot cancel a build; close() waits JOIN_TIMEOUT_S
            thread = NamedThread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if self._closing:
                    return
                job = self._queue.popleft()
                job.state, job.started, self._running = "running", time.monotonic(), job
                self._cond.notify_all()
            self._build(job)
            with self._cond:
                self._running = None
                if self._closing:
                    return
            try:
                self._on_done()
            except Exception:
                log.exception(
                    "the sync after the engine build of %s v%d failed", job.model, job.version
                )

    def _build(self, job: _Job) -> None:
        self._on_event(
            {
                "type": "engine_build_started",
                "model": job.model,
                "version": job.version,
                "key": job.entry.key,
                "estimate_s": job.estimate_s,
            }
        )
        plan: Path | None = None
        error: str | None = None
        try:
            plan = build_into_cache(job.entry, job.options, job.tracker).plan
        except EngineBuildError as exc:
            error = str(exc)
        except Exception as exc:  # a bug or a binding error: the version fails, the agent lives
            log.exception("engine build of %s v%d", job.model, job.version)
            error = f"engine build failed: {type(exc).__name__}: {exc}"
        with self._cond:
            job.state, job.plan, job.error = ("done" if plan else "failed"), plan, error
            closing = self._closing
        if closing:
            log.info(
                "engine build of %s v%d stopped: the agent is stopping", job.model, job.version
            )
            return
        if plan is not None:
            self._remember_seconds(job.model, time.monotonic() - job.started)
        self._event_finished(
            job.model,
            job.version,
            job.entry.key,
            ok=plan is not None,
            cache="miss",
            started=job.started,
            error=error,
        )

    def _tick(self) -> None:
        """Republish the inventory while a build runs: when its progress moved (at most once
        per interval) or every heartbeat (the elapsed time)."""
        last_publish = time.monotonic()
        with self._cond:
            while not self._closing:
                job = self._running
                if job is None:
                    self._cond.wait()
                    continue
                self._cond.wait(self._publish_interval_s)
                if self._running is not job or self._closing:
                    continue
                moved = job.moved()
                now = time.monotonic()
                if moved == job.published and now - last_publish < self._heartbeat_s:
                    continue
                job.published, last_publish = moved, now
                self._cond.release()
                try:
                    self._on_inventory()
                except Exception:
                    log.exception("publishing the inventory during an engine build")
                finally:
                    self._cond.acquire()

    # -- events and durations ----------------------------------------------------------------

    def _event_finished(
        self,
        model: str,
        version: int,
        key: str,
        *,
        ok: bool,
        cache: str,
        started: float,
        error: str | None = None,
    ) -> None:
        event: Event = {
            "type": "engine_build_finished",
            "model": model,
            "version": version,
            "ok": ok,
            "cache": cache,
            "duration_s": round(time.monotonic() - started, 3),
            "key": key,
        }
        if error is not None:
            event["error"] = error
        self._on_event(event)

    def _last_seconds(self, model: str) -> float | None:
        """The last build's duration for ``model`` (kept in the engine cache, so it survives
        restarts): the estimate shown while the next one runs."""
        with self._durations_lock:
            return self._load_durations().get(model)

    def _load_durations(self) -> dict[str, float]:
        if self._durations is None:
            path = default_cache_dir() / DURATIONS_FILE
            try:
                data = json.loads(path.read_text()) if path.is_file() else {}
            except (OSError, ValueError) as exc:
                log.warning("ignoring %s: %s", path, exc)
                data = {}
            self._durations = {
                str(k): float(v)
                for k, v in (data.items() if isinstance(data, dict) else ())
                if isinstance(v, int | float) and not isinstance(v, bool)
            }
        return self._durations

    def _remember_seconds(self, model: str, seconds: float) -> None:
        path = default_cache_dir() / DURATIONS_FILE
        with self._durations_lock:
            durations = self._load_durations()
            durations[model] = round(seconds, 3)
            try:
                write_atomic(path, json.dumps(durations, sort_keys=True).encode())
            except OSError as exc:  # costs the next build its estimate, nothing else
                log.warning("cannot write %s: %s", path, exc.strerror or exc)

    # -- shutdown ----------------------------------------------------------------------------

    def close(self) -> None:
        """Cancel the running build (TensorRT 10+ stops at its next step), drop the queued
        ones, join the threads (a build TensorRT cannot cancel is left after a timeout)."""
        with self._cond:
            self._closing = True
            self._queue.clear()
            running = self._running
            if running is not None:
                running.tracker.cancel()
            self._cond.notify_all()
            threads, self._threads = self._threads, []
        if running is not None:
            log.info(
                "engine build %s v%d: cancelled, the agent is stopping",
                running.model,
                running.version,
            )
        for thread in threads:
            thread.join(JOIN_TIMEOUT_S)
            if thread.is_alive():
                log.warning(
                    "%s still runs an engine build TensorRT cannot cancel; not waiting for it",
                    thread.name,
                )
