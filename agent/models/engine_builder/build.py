"""``build_engine``: the cache key, the engine cache on disk, and the flow around a build.

An engine is specific to the TensorRT version and the GPU it was built on, and a build
takes minutes on a Jetson, so every plan is cached under :func:`cache_key` (the ONNX file's
sha256, ``tensorrt.__version__``, the GPU's name and compute capability, the build
options): the same inputs on the same box never build twice, across reboots.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.models.backends import cuda
from agent.models.backends.base import ModelLoadError
from agent.models.backends.tensorrt import import_tensorrt
from agent.models.engine_builder.options import BuildOptions, EngineBuildError, default_cache_dir
from agent.models.engine_builder.plan import build_in_context
from agent.models.engine_builder.progress import Progress
from agent.models.engine_builder.publish import (
    locked,
    publish,
    published,
    sha256_file,
    warn_about_config,
    write_atomic,
)

__all__ = [
    "KEY_FORMAT",
    "CacheEntry",
    "build_engine",
    "build_into_cache",
    "cache_entry",
    "cache_key",
    "gpu_identity",
]

log = logging.getLogger(__name__)

KEY_FORMAT = 1  # bump when what goes into a plan changes in a way the key does not show


def gpu_identity(ordinal: int) -> cuda.DeviceIdentity:
    """The GPU the plan will be specific to; without pycuda, the Jetson board model."""
    try:
        return cuda.get_device(ordinal).identity
    except cuda.CudaError as exc:
        model = Path("/proc/device-tree/model")
        name = model.read_text(errors="replace").strip("\x00\n ") if model.exists() else "unknown"
        log.warning(
            "cannot query the GPU (%s); keying the engine cache by %r only, so move the "
            "cache along with the board, never between boards",
            exc,
            name,
        )
        return cuda.DeviceIdentity(
            name=name, compute_capability=(0, 0), total_memory=0, integrated=False
        )


def cache_key(
    onnx_sha256: str, trt_version: str, gpu: cuda.DeviceIdentity, options: BuildOptions
) -> str:
    """sha256 over everything the plan depends on; the name of its cache entry."""
    material = json.dumps(
        {
            "format": KEY_FORMAT,
            "onnx": onnx_sha256,
            "tensorrt": trt_version,
            "gpu": gpu.name,
            "compute_capability": list(gpu.compute_capability),
            "options": options.key_fields(),
        },
        sort_keys=True,
    )
    return hashlib.sha256(material.encode()).hexdigest()


@dataclass(frozen=True)
class CacheEntry:
    """Where the plan for one ONNX file, TensorRT, GPU and set of options lives in the
    engine cache (:func:`cache_entry`); ``plan`` may not exist yet."""

    key: str
    plan: Path
    onnx: Path
    onnx_sha256: str
    onnx_stat: tuple[int, int, int]  # (inode, size, mtime_ns) of the file hashed
    tensorrt: str
    gpu: cuda.DeviceIdentity
    trt: Any  # the imported tensorrt module

    @property
    def cached(self) -> bool:
        return self.plan.is_file()


def cache_entry(onnx_path: Path, options: BuildOptions) -> CacheEntry:
    """Hash the ONNX file, import TensorRT, identify the GPU: the cache entry of the build.
    Raises :class:`EngineBuildError` (one line)."""
    try:
        onnx_stat = _stat(onnx_path)
        onnx_sha = sha256_file(onnx_path)
    except OSError as exc:
        raise EngineBuildError(f"cannot read {onnx_path}: {exc.strerror or exc}") from exc
    try:
        trt = import_tensorrt()
    except ModelLoadError as exc:
        raise EngineBuildError(str(exc)) from exc
    gpu = gpu_identity(options.device)
    version = str(trt.__version__)
    key = cache_key(onnx_sha, version, gpu, options)
    cache_dir = options.cache_dir or default_cache_dir()
    return CacheEntry(
        key, cache_dir / f"{key}.plan", onnx_path, onnx_sha, onnx_stat, version, gpu, trt
    )


def _stat(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns


def _replaced(entry: CacheEntry) -> bool:
    """The ONNX file changed since :func:`cache_entry` hashed it (or cannot be read)."""
    try:
        return _stat(entry.onnx) != entry.onnx_stat
    except OSError:
        return True


def _timing_cache(entry: CacheEntry, options: BuildOptions) -> Path:
    return options.timing_cache or entry.plan.parent / (
        f"timing-{entry.tensorrt}-{entry.gpu.slug}.cache"
    )


def build_into_cache(entry: CacheEntry, options: BuildOptions, progress: Progress) -> CacheEntry:
    """The agent's build of ``entry`` (:func:`cache_entry` of these ``options``): the plan
    into the engine cache only (no version is published; the version folder stays as it
    is). A plan already cached is kept; an ONNX file replaced since it was hashed is hashed
    again, so no plan lands under another file's key. One build at a time per cache folder
    on this box (a lock file). Raises :class:`EngineBuildError` (one line)."""
    if _replaced(entry):
        entry = cache_entry(entry.onnx, options)
    with locked(entry.plan.parent):
        if entry.cached and not options.force:
            return entry
        plan = build_in_context(
            entry.trt, entry.onnx, options, _timing_cache(entry, options), progress
        )
        try:
            write_atomic(entry.plan, plan)
        except OSError as exc:
            raise EngineBuildError(
                f"cannot write the engine cache {entry.plan.parent}: {exc.strerror or exc}"
            ) from exc
    return entry


def build_engine(
    onnx_path: Path | str, out_repository_model_dir: Path | str, options: BuildOptions | None = None
) -> Path:
    """Build (or reuse) the plan for ``onnx_path`` and return the ``model.plan`` in the
    repository: ``out_repository_model_dir/N+1/model.plan``, or the existing version that
    already holds the same build. Raises :class:`EngineBuildError` (one line)."""
    options = options or BuildOptions()
    onnx_path, model_dir = Path(onnx_path), Path(out_repository_model_dir)
    progress = Progress(options.progress or (lambda line: log.info("build-engine: %s", line)))
    entry = cache_entry(onnx_path, options)
    key, onnx_sha, version, gpu = entry.key, entry.onnx_sha256, entry.tensorrt, entry.gpu
    cached_plan = entry.plan
    with locked(model_dir):
        existing = None if options.force else published(model_dir, key)
        if existing is not None:
            progress.phase(f"already built: {existing} (key {key[:12]})")
            return existing
        started = time.monotonic()
        plan = None if options.force else _read_cached(cached_plan)
        if plan is not None:
            progress.phase(f"cache hit: {cached_plan}")
        else:
            plan = build_in_context(
                entry.trt, onnx_path, options, _timing_cache(entry, options), progress
            )
            try:
                write_atomic(cached_plan, plan)
            except OSError as exc:  # a full cache disk costs a rebuild later, not this build
                log.warning(
                    "cannot cache the engine in %s: %s", cached_plan.parent, exc.strerror or exc
                )
        info = {
            "key": key,
            "onnx_file": onnx_path.name,
            "onnx_sha256": onnx_sha,
            "tensorrt": version,
            "gpu": {"name": gpu.name, "compute_capability": list(gpu.compute_capability)},
            "options": options.key_fields(),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "seconds": round(time.monotonic() - started, 3),
        }
        warn_about_config(model_dir)
        try:
            target = publish(model_dir, plan, info)
        except OSError as exc:
            raise EngineBuildError(f"cannot write the version into {model_dir}: {exc}") from exc
    progress.phase(f"wrote {target} ({len(plan)} bytes)")
    return target


def _read_cached(path: Path) -> bytes | None:
    try:
        return path.read_bytes() if path.is_file() else None
    except OSError:
        return None
