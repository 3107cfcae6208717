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

Modules: :mod:`.options` (what a build is asked for: :class:`BuildOptions`, profiles),
:mod:`.plan` (TensorRT: ONNX to serialized plan bytes), :mod:`.progress` (phase lines),
:mod:`.publish` (durable writes, the version folders), :mod:`.build` (:func:`build_engine`:
the cache key, the engine cache, the flow), :mod:`.cli` (``edge-agent build-engine``; also
``python -m agent.models.engine_builder``).

Entry points: :func:`build_engine` (library), :func:`main` / :func:`add_arguments` +
:func:`run_from_args` (``edge-agent build-engine``).
"""

from __future__ import annotations

from agent.models.engine_builder.build import build_engine, cache_key
from agent.models.engine_builder.cli import add_arguments, main, run_from_args
from agent.models.engine_builder.options import (
    BuildOptions,
    EngineBuildError,
    ShapeRange,
    default_cache_dir,
    parse_profile,
)
from agent.models.engine_builder.publish import BUILD_INFO

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
