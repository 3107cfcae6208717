"""Build TensorRT engines from ONNX on the box itself, and publish them as model versions.

An engine (plan) is specific to the TensorRT version and the GPU it was built on, and a
build takes minutes on a Jetson, so:

* every build is cached under a key made of the ONNX file's sha256, ``tensorrt.__version__``,
  the GPU's name and compute capability, and the build options: the same inputs on the same
  box never build twice, across reboots (the cache is a folder on disk, not memory);
* the plan is published into the model repository as a new version ``N+1/model.plan``
  (with ``model.sha256`` and ``build.json`` beside it), written into a hidden temporary
  folder and renamed into place, so the watcher never sees half an engine; a version that
  already holds a plan with the same key is reused instead of adding another;
* a timing cache file makes rebuilds (new ONNX, same layers) much faster;
* progress is shown through ``trt.IProgressMonitor`` where TensorRT has it (10.x), else as a
  log line per phase.

Entry points: :func:`build_engine` (library), :func:`main` / :func:`add_arguments` +
:func:`run_from_args` (``edge-agent build-engine``).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.models.backends import cuda
from agent.models.backends.base import ModelLoadError
from agent.models.backends.tensorrt import (
    import_tensorrt,
    process_logger,
    shutdown,
    tensorrt_version,
)
from agent.models.repository import ModelConfigError, load_model_config

__all__ = [
    "BUILD_INFO",
    "BuildOptions",
    "EngineBuildError",
    "ShapeRange",
    "add_arguments",
    "build_engine",
    "cache_key",
    "default_cache_dir",
    "main",
    "parse_profile",
    "run_from_args",
]

log = logging.getLogger(__name__)

PLAN_FILE = "model.plan"
CHECKSUM_FILE = "model.sha256"
BUILD_INFO = "build.json"
LOCK_FILE = ".build.lock"
VERSION_NAME = re.compile(r"^[1-9][0-9]{0,17}$")
HASH_BLOCK = 1024 * 1024
KEY_FORMAT = 1  # bump when what goes into a plan changes in a way the key does not show


class EngineBuildError(RuntimeError):
    """The engine could not be built or published; the message is one line."""


Shape = tuple[int, ...]


@dataclass(frozen=True)
class ShapeRange:
    """The (min, opt, max) shapes of one input in one optimization profile."""

    min: Shape
    opt: Shape
    max: Shape

    def __post_init__(self) -> None:
        if not len(self.min) == len(self.opt) == len(self.max):
            raise ValueError(f"min, opt and max must have the same rank: {self.describe()}")
        for lo, mid, hi in zip(self.min, self.opt, self.max, strict=True):
            if not 0 <= lo <= mid <= hi:
                raise ValueError(f"need 0 <= min <= opt <= max in every dim: {self.describe()}")

    def describe(self) -> str:
        return "/".join("x".join(map(str, s)) for s in (self.min, self.opt, self.max))


Profile = Mapping[str, ShapeRange]


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/edge-agent/engines`` (``~/.cache/...``): survives reboots."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "edge-agent" / "engines"


@dataclass(frozen=True)
class BuildOptions:
    """How to build. Every field is part of the cache key except where noted.

    ``profiles``: one mapping per optimization profile, input name -> ShapeRange. Empty:
    one profile where a dynamic leading (batch) dim runs 1..``max_batch`` (opt 1); any
    other dynamic dim needs an explicit profile. ``workspace_bytes``: builder workspace
    limit (None: TensorRT's default, all device memory). ``cache_dir``, ``timing_cache``,
    ``force`` and ``progress`` are not part of the key.
    """

    fp16: bool = False
    int8: bool = False
    workspace_bytes: int | None = None
    profiles: tuple[Profile, ...] = ()
    max_batch: int = 8
    cache_dir: Path | None = None
    timing_cache: Path | None = None
    force: bool = False
    progress: Callable[[str], None] | None = field(default=None, compare=False)
    device: int = 0

    def __post_init__(self) -> None:
        if self.workspace_bytes is not None and self.workspace_bytes <= 0:
            raise ValueError(f"workspace_bytes must be > 0, got {self.workspace_bytes}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")

    def key_fields(self) -> dict[str, Any]:
        """What of these options changes the plan (goes into the cache key and build.json)."""
        return {
            "fp16": self.fp16,
            "int8": self.int8,
            "workspace_bytes": self.workspace_bytes,
            "max_batch": self.max_batch,
            "profiles": [
                {name: r.describe() for name, r in sorted(p.items())} for p in self.profiles
            ],
        }


# --------------------------------------------------------------------------- identity


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(HASH_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def _gpu_identity(ordinal: int) -> cuda.DeviceIdentity:
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


# --------------------------------------------------------------------------- files


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_atomic(path: Path, data: bytes) -> None:
    """Temporary file in the same folder, fsync, rename: readers see old or new, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        _write_file(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def _locked(model_dir: Path) -> Iterator[None]:
    """One build per model folder at a time on this box (a hidden lock file, flock)."""
    model_dir.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not Linux
        yield
        return
    with (model_dir / LOCK_FILE).open("a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _versions(model_dir: Path) -> list[int]:
    if not model_dir.is_dir():
        return []
    return sorted(int(p.name) for p in model_dir.iterdir() if VERSION_NAME.match(p.name))


def _published(model_dir: Path, key: str) -> Path | None:
    """A version folder already holding the plan for ``key`` (intact), if any."""
    for number in reversed(_versions(model_dir)):
        folder = model_dir / str(number)
        try:
            info = json.loads((folder / BUILD_INFO).read_text())
            plan = folder / PLAN_FILE
            if (
                info.get("key") == key
                and plan.is_file()
                and _sha256_file(plan) == info.get("plan_sha256")
            ):
                return plan
        except (OSError, ValueError, AttributeError):
            continue
    return None


def _publish(model_dir: Path, plan: bytes, info: dict[str, Any]) -> Path:
    """Write ``N+1/`` into a hidden temporary folder, then rename it into place.

    The repository scanner skips hidden and ``*.tmp`` names, so the version appears whole
    or not at all. Called with the model folder locked; the rename still refuses to land
    on a folder that appeared meanwhile (another tool): it then takes the next number.
    """
    digest = hashlib.sha256(plan).hexdigest()
    info = {**info, "plan_sha256": digest}
    tmp = model_dir / f".build-{info['key'][:12]}-{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _write_file(tmp / PLAN_FILE, plan)
        _write_file(tmp / CHECKSUM_FILE, f"{digest}  {PLAN_FILE}\n".encode())
        _write_file(tmp / BUILD_INFO, (json.dumps(info, indent=2, sort_keys=True) + "\n").encode())
        _fsync_dir(tmp)
        number = (_versions(model_dir) or [0])[-1] + 1
        while True:
            target = model_dir / str(number)
            if not target.exists():
                try:
                    os.rename(tmp, target)
                    break
                except OSError:
                    if not target.exists():
                        raise
            number += 1
        _fsync_dir(model_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target / PLAN_FILE


def _warn_about_config(model_dir: Path) -> None:
    """A model whose config.toml pins ``backend = "onnxruntime"`` would refuse the plan."""
    config_path = model_dir / "config.toml"
    if not config_path.exists():
        return
    try:
        config = load_model_config(config_path)
    except ModelConfigError as exc:
        log.warning("%s", exc)
        return
    if config.backend == "onnxruntime":
        log.warning(
            '%s says backend = "onnxruntime": the new model.plan version will be marked '
            'failed until that line is removed or set to "tensorrt"',
            config_path,
        )


# --------------------------------------------------------------------------- progress


class _Progress:
    """Turns phases into lines: at most one line per phase start/finish, plus a step line
    at most every 2 s, so a 10-minute Jetson build says it is alive without flooding."""

    def __init__(self, sink: Callable[[str], None]) -> None:
        self._sink = sink
        self._lock = threading.Lock()
        self._depth: dict[str, int] = {}
        self._started: dict[str, float] = {}
        self._last_step = 0.0

    def start(self, phase: str, parent: str | None, steps: int) -> None:
        with self._lock:
            depth = self._depth.get(parent, -1) + 1 if parent else 0
            self._depth[phase] = depth
            self._started[phase] = time.monotonic()
        self._sink(f"{'  ' * depth}{phase} ({steps} step{'s' if steps != 1 else ''})")

    def step(self, phase: str, step: int) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last_step < 2.0:
                return
            self._last_step = now
            depth = self._depth.get(phase, 0)
        self._sink(f"{'  ' * depth}{phase}: step {step + 1}")

    def finish(self, phase: str) -> None:
        with self._lock:
            depth = self._depth.pop(phase, 0)
            started = self._started.pop(phase, time.monotonic())
        self._sink(f"{'  ' * depth}{phase} done in {time.monotonic() - started:.1f} s")

    def phase(self, text: str) -> None:
        self._sink(text)


def _progress_monitor(trt: Any, progress: _Progress) -> Any:
    """A ``trt.IProgressMonitor`` feeding ``progress`` (TensorRT 10+), or None."""
    base = getattr(trt, "IProgressMonitor", None)
    if base is None:
        return None

    class Monitor(base):  # type: ignore[misc, valid-type]
        """TensorRT calls this from its builder threads; _Progress is thread-safe."""

        def __init__(self) -> None:
            base.__init__(self)  # type: ignore[misc]  # pybind11 needs the base initialised

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            progress.start(phase_name, parent_phase, num_steps)

        def step_complete(self, phase_name: str, step: int) -> bool:
            progress.step(phase_name, step)
            return True  # never cancel

        def phase_finish(self, phase_name: str) -> None:
            progress.finish(phase_name)

    return Monitor()


# --------------------------------------------------------------------------- profiles


def parse_profile(spec: str) -> dict[str, ShapeRange]:
    """``"x:1x16/4x16/8x16,h:1x32/4x32/8x32"`` -> {name: ShapeRange}.

    Inputs are separated by ``,``; the name ends at the last ``:`` (TensorFlow-style names
    such as ``input:0`` work); dims are separated by ``x``.
    """
    profile: dict[str, ShapeRange] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        name, sep, shapes = part.rpartition(":")
        pieces = shapes.split("/")
        if not sep or not name or len(pieces) != 3:
            raise ValueError(f"{part!r}: expected NAME:MIN/OPT/MAX such as x:1x16/4x16/8x16")
        try:
            dims = [tuple(int(d) for d in piece.split("x")) for piece in pieces]
        except ValueError:
            raise ValueError(f"{part!r}: dims are integers separated by 'x'") from None
        if name in profile:
            raise ValueError(f"{name!r} appears twice in one profile")
        profile[name] = ShapeRange(dims[0], dims[1], dims[2])
    if not profile:
        raise ValueError("an empty profile")
    return profile


def _network_inputs(network: Any) -> dict[str, Shape]:
    shapes: dict[str, Shape] = {}
    for i in range(int(network.num_inputs)):
        tensor = network.get_input(i)
        shapes[str(tensor.name)] = tuple(int(tensor.shape[j]) for j in range(len(tensor.shape)))
    return shapes


def _resolve_profiles(
    inputs: Mapping[str, Shape], options: BuildOptions
) -> list[dict[str, ShapeRange]]:
    """The profiles to build: the given ones checked against the network, or the default."""
    dynamic = {name: shape for name, shape in inputs.items() if any(d < 0 for d in shape)}
    if options.profiles:
        profiles = [dict(p) for p in options.profiles]
        for index, profile in enumerate(profiles):
            for name in profile:
                if name not in inputs:
                    raise EngineBuildError(
                        f"profile {index} names {name!r}, not an input ({', '.join(inputs)})"
                    )
            for name, shape in inputs.items():
                chosen = profile.get(name)
                if chosen is None:
                    if name in dynamic:
                        raise EngineBuildError(
                            f"profile {index} has no shapes for dynamic input {name!r}"
                        )
                    continue
                _check_range(index, name, shape, chosen)
        return profiles
    if not dynamic:
        return []
    default: dict[str, ShapeRange] = {}
    for name, shape in dynamic.items():
        if any(d < 0 for d in shape[1:]):
            raise EngineBuildError(
                f"input {name!r} {list(shape)} is dynamic beyond the batch dim: "
                "give its shapes with --profile NAME:MIN/OPT/MAX"
            )
        rest = shape[1:]
        default[name] = ShapeRange((1, *rest), (1, *rest), (options.max_batch, *rest))
    return [default]


def _check_range(index: int, name: str, shape: Shape, chosen: ShapeRange) -> None:
    if len(chosen.min) != len(shape):
        raise EngineBuildError(
            f"profile {index}: {name!r} has rank {len(shape)} {list(shape)}, "
            f"got {chosen.describe()}"
        )
    for dim, want in enumerate(shape):
        if want >= 0 and not chosen.min[dim] == chosen.opt[dim] == chosen.max[dim] == want:
            raise EngineBuildError(
                f"profile {index}: {name!r} dim {dim} is fixed at {want}, got {chosen.describe()}"
            )


# --------------------------------------------------------------------------- building


def _errors(logger: Any) -> str:
    taken = list(logger.take_errors()) or list(logger.recent)
    return "; ".join(taken) or "TensorRT logged no reason"


def _load_timing_cache(trt_config: Any, path: Path, say: Callable[[str], None]) -> None:
    data = b""
    if path.is_file():
        try:
            data = path.read_bytes()
        except OSError as exc:
            say(f"timing cache {path} unreadable ({exc.strerror}); starting empty")
    cache = trt_config.create_timing_cache(data)
    if cache is None and data:
        say(f"timing cache {path} is not usable; starting empty")
        cache = trt_config.create_timing_cache(b"")
    if cache is None:
        raise EngineBuildError("TensorRT could not create a timing cache")
    if not trt_config.set_timing_cache(cache, ignore_mismatch=False):
        say(f"timing cache {path} is from another TensorRT or GPU; starting empty")
        trt_config.set_timing_cache(trt_config.create_timing_cache(b""), ignore_mismatch=False)
    elif data:
        say(f"timing cache {path} loaded ({len(data)} bytes)")


def _save_timing_cache(trt_config: Any, path: Path) -> None:
    cache = trt_config.get_timing_cache()
    if cache is None:
        return
    try:
        _write_atomic(path, bytes(cache.serialize()))
    except OSError as exc:
        log.warning("cannot write the timing cache %s: %s", path, exc.strerror or exc)


def _configure(
    trt: Any, builder: Any, trt_config: Any, options: BuildOptions, say: Callable[[str], None]
) -> None:
    if options.workspace_bytes is not None:
        trt_config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, options.workspace_bytes)
    if options.fp16:
        if not getattr(builder, "platform_has_fast_fp16", True):
            say("this GPU has no fast FP16; FP16 kernels may be slower than FP32")
        trt_config.set_flag(trt.BuilderFlag.FP16)
    if options.int8:
        trt_config.set_flag(trt.BuilderFlag.INT8)
        say(
            "INT8 without a calibrator: only explicitly quantized (Q/DQ) layers run in INT8, "
            "the rest fall back to FP16/FP32"
        )


def _build_plan(
    trt: Any, onnx_path: Path, options: BuildOptions, timing_cache: Path, progress: _Progress
) -> bytes:
    """Parse the ONNX file and build a serialized engine; EngineBuildError on failure."""
    logger = process_logger(trt)
    logger.take_errors()
    builder = trt.Builder(logger)
    flags = 0
    if tensorrt_version(trt) < (10, 0):  # explicit batch: required before 10, the only mode after
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    progress.phase(f"parsing {onnx_path}")
    if not parser.parse_from_file(str(onnx_path)):
        problems = [str(parser.get_error(i)) for i in range(int(parser.num_errors))]
        raise EngineBuildError(
            f"{onnx_path.name}: ONNX parser: {'; '.join(problems) or _errors(logger)}"
        )
    trt_config = builder.create_builder_config()
    _configure(trt, builder, trt_config, options, progress.phase)
    for profile in _resolve_profiles(_network_inputs(network), options):
        trt_profile = builder.create_optimization_profile()
        for name, r in profile.items():
            trt_profile.set_shape(name, r.min, r.opt, r.max)
        if trt_config.add_optimization_profile(trt_profile) < 0:
            raise EngineBuildError(f"optimization profile refused: {_errors(logger)}")
        progress.phase("profile " + ", ".join(f"{n} {r.describe()}" for n, r in profile.items()))
    _load_timing_cache(trt_config, timing_cache, progress.phase)
    monitor = _progress_monitor(trt, progress)
    if monitor is not None:
        trt_config.progress_monitor = monitor
    else:
        progress.phase(
            "building the engine (no progress steps before TensorRT 10; minutes on a Jetson)"
        )
    serialized = builder.build_serialized_network(network, trt_config)
    if serialized is None:
        raise EngineBuildError(f"TensorRT could not build the engine: {_errors(logger)}")
    _save_timing_cache(trt_config, timing_cache)
    return bytes(serialized)


def build_engine(
    onnx_path: Path | str, out_repository_model_dir: Path | str, options: BuildOptions | None = None
) -> Path:
    """Build (or reuse) the plan for ``onnx_path`` and return the ``model.plan`` in the
    repository: ``out_repository_model_dir/N+1/model.plan``, or the existing version that
    already holds the same build. Raises :class:`EngineBuildError` (one line)."""
    options = options or BuildOptions()
    onnx_path, model_dir = Path(onnx_path), Path(out_repository_model_dir)
    progress = _Progress(options.progress or (lambda line: log.info("build-engine: %s", line)))
    try:
        onnx_sha = _sha256_file(onnx_path)
    except OSError as exc:
        raise EngineBuildError(f"cannot read {onnx_path}: {exc.strerror or exc}") from exc
    try:
        trt = import_tensorrt()
    except ModelLoadError as exc:
        raise EngineBuildError(str(exc)) from exc
    gpu = _gpu_identity(options.device)
    version = str(trt.__version__)
    key = cache_key(onnx_sha, version, gpu, options)
    cache_dir = options.cache_dir or default_cache_dir()
    cached_plan = cache_dir / f"{key}.plan"
    with _locked(model_dir):
        existing = None if options.force else _published(model_dir, key)
        if existing is not None:
            progress.phase(f"already built: {existing} (key {key[:12]})")
            return existing
        started = time.monotonic()
        plan = None if options.force else _read_cached(cached_plan)
        if plan is not None:
            progress.phase(f"cache hit: {cached_plan}")
        else:
            timing = options.timing_cache or cache_dir / f"timing-{version}-{gpu.slug}.cache"
            plan = _build_with_context(trt, onnx_path, options, timing, progress)
            try:
                _write_atomic(cached_plan, plan)
            except OSError as exc:  # a full cache disk costs a rebuild later, not this build
                log.warning("cannot cache the engine in %s: %s", cache_dir, exc.strerror or exc)
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
        _warn_about_config(model_dir)
        try:
            target = _publish(model_dir, plan, info)
        except OSError as exc:
            raise EngineBuildError(f"cannot write the version into {model_dir}: {exc}") from exc
    progress.phase(f"wrote {target} ({len(plan)} bytes)")
    return target


def _read_cached(path: Path) -> bytes | None:
    try:
        return path.read_bytes() if path.is_file() else None
    except OSError:
        return None


def _build_with_context(
    trt: Any, onnx_path: Path, options: BuildOptions, timing: Path, progress: _Progress
) -> bytes:
    """Build with the process's CUDA context current where pycuda is there (the runtime
    would bind the same primary context anyway; this keeps one rule for every thread)."""
    try:
        device = cuda.get_device(options.device)
    except cuda.CudaError:
        return _build_plan(trt, onnx_path, options, timing, progress)
    with device.activate():
        try:
            return _build_plan(trt, onnx_path, options, timing, progress)
        except BaseException as exc:
            traceback.clear_frames(exc.__traceback__)  # free builder objects here, in context
            raise


# --------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``build-engine`` arguments, for a subcommand parser of ``edge-agent``."""
    parser.add_argument("onnx", type=Path, help="the ONNX model to build from")
    parser.add_argument(
        "--into",
        type=Path,
        metavar="MODEL_DIR",
        help="model folder of the repository to add the version to "
        "(default: the model folder the ONNX file is in, for models/NAME/N/model.onnx)",
    )
    parser.add_argument("--fp16", action="store_true", help="allow FP16 kernels")
    parser.add_argument("--int8", action="store_true", help="allow INT8 (Q/DQ models)")
    parser.add_argument("--workspace-mib", type=int, metavar="MIB", help="builder workspace limit")
    parser.add_argument(
        "--profile",
        action="append",
        default=[],
        metavar="SPEC",
        help="an optimization profile, NAME:MIN/OPT/MAX[,NAME:...] such as x:1x16/4x16/8x16; "
        "repeat for several profiles",
    )
    parser.add_argument(
        "--max-batch", type=int, default=8, help="batch maximum of the default profile (default 8)"
    )
    parser.add_argument(
        "--cache-dir", type=Path, help=f"engine cache (default {default_cache_dir()})"
    )
    parser.add_argument(
        "--timing-cache", type=Path, help="timing cache file (default: in the cache dir)"
    )
    parser.add_argument("--device", type=int, default=0, help="CUDA device ordinal")
    parser.add_argument("--force", action="store_true", help="build again even if cached")
    parser.add_argument("--quiet", "-q", action="store_true", help="print only the result path")


def _default_model_dir(onnx: Path) -> Path | None:
    version = onnx.resolve().parent
    return version.parent if VERSION_NAME.match(version.name) else None


def run_from_args(args: argparse.Namespace) -> int:
    """Run ``build-engine`` from parsed arguments; 0 on success, 1 on a build error, 2 on
    bad arguments. Prints the path of the model.plan on stdout."""
    model_dir = args.into or _default_model_dir(args.onnx)
    if model_dir is None:
        print(
            "error: --into MODEL_DIR is needed for an ONNX file outside a version folder",
            file=sys.stderr,
        )
        return 2
    try:
        profiles = tuple(parse_profile(spec) for spec in args.profile)
        options = BuildOptions(
            fp16=args.fp16,
            int8=args.int8,
            workspace_bytes=None
            if args.workspace_mib is None
            else args.workspace_mib * 1024 * 1024,
            profiles=profiles,
            max_batch=args.max_batch,
            cache_dir=args.cache_dir,
            timing_cache=args.timing_cache,
            force=args.force,
            device=args.device,
            progress=None
            if args.quiet
            else (lambda line: print(line, file=sys.stderr, flush=True)),
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        plan = build_engine(args.onnx, model_dir, options)
    except EngineBuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        shutdown()  # a CLI process: hand the GPU's primary context back before exiting
    print(plan)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m agent.models.engine_builder ONNX [options]``: ``edge-agent build-engine``."""
    parser = argparse.ArgumentParser(
        prog="edge-agent build-engine",
        description="Build a TensorRT engine from ONNX; add it to the repository as a version.",
    )
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
