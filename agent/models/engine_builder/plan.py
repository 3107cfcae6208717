"""TensorRT's part of a build: parse the ONNX file, set the profiles and flags, build the plan.

The network's inputs decide the profiles (the given ones checked against it, or a default
that runs a dynamic batch dim 1..``max_batch``, or a decoder's prefill and steps profiles); a
timing cache file is loaded before and saved after, so rebuilds of the same layers are much
faster. Every failure is an :class:`EngineBuildError` carrying what TensorRT logged.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from agent.models.backends import cuda
from agent.models.backends.external_data import external_data_problem
from agent.models.backends.tensorrt import process_logger, tensorrt_version
from agent.models.engine_builder.decoder_profile import (
    decoder_context,
    decoder_profiles,
    is_decoder,
)
from agent.models.engine_builder.options import BuildOptions, EngineBuildError, Shape, ShapeRange
from agent.models.engine_builder.progress import Progress, progress_monitor
from agent.models.engine_builder.publish import write_atomic

__all__ = ["build_in_context"]

log = logging.getLogger(__name__)


def _network_inputs(network: Any) -> dict[str, Shape]:
    shapes: dict[str, Shape] = {}
    for i in range(int(network.num_inputs)):
        tensor = network.get_input(i)
        shapes[str(tensor.name)] = tuple(int(tensor.shape[j]) for j in range(len(tensor.shape)))
    return shapes


def _resolve_profiles(
    inputs: Mapping[str, Shape], options: BuildOptions, onnx_path: Path
) -> list[dict[str, ShapeRange]]:
    """The profiles to build: the given ones checked against the network, or the default
    (a decoder's: :mod:`.decoder_profile`)."""
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
    if is_decoder(inputs):
        return decoder_profiles(inputs, decoder_context(onnx_path, options.context))
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
        write_atomic(path, bytes(cache.serialize()))
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
    if options.activation_resize:
        features = getattr(trt, "PreviewFeature", None)
        feature = getattr(features, "RUNTIME_ACTIVATION_RESIZE_10_10", None)
        if feature is None:
            say(
                f"TensorRT {getattr(trt, '__version__', '?')} cannot size activations by the "
                "run's shapes (RUNTIME_ACTIVATION_RESIZE_10_10 came in 10.10): by the profile"
            )
        else:
            trt_config.set_preview_feature(feature, True)


def _build_plan(
    trt: Any, onnx_path: Path, options: BuildOptions, timing_cache: Path, progress: Progress
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
    outside = external_data_problem(onnx_path, refuse_unreadable=False)  # the parser reads it
    if outside is not None:
        raise EngineBuildError(f"{onnx_path.name}: {outside}")
    if not parser.parse_from_file(str(onnx_path)):
        problems = [str(parser.get_error(i)) for i in range(int(parser.num_errors))]
        raise EngineBuildError(
            f"{onnx_path.name}: ONNX parser: {'; '.join(problems) or _errors(logger)}"
        )
    trt_config = builder.create_builder_config()
    _configure(trt, builder, trt_config, options, progress.phase)
    for profile in _resolve_profiles(_network_inputs(network), options, onnx_path):
        trt_profile = builder.create_optimization_profile()
        for name, r in profile.items():
            trt_profile.set_shape(name, r.min, r.opt, r.max)
        if trt_config.add_optimization_profile(trt_profile) < 0:
            raise EngineBuildError(f"optimization profile refused: {_errors(logger)}")
        progress.phase("profile " + ", ".join(f"{n} {r.describe()}" for n, r in profile.items()))
    _load_timing_cache(trt_config, timing_cache, progress.phase)
    monitor = progress_monitor(trt, progress)
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


def build_in_context(
    trt: Any, onnx_path: Path, options: BuildOptions, timing: Path, progress: Progress
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
