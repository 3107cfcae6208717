"""``edge-agent build-engine`` (and ``python -m agent.models.engine_builder``): arguments
to :class:`BuildOptions`, the build, the path of the plan on stdout."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from agent.models.backends.tensorrt import shutdown
from agent.models.engine_builder.build import build_engine
from agent.models.engine_builder.options import (
    BuildOptions,
    EngineBuildError,
    default_cache_dir,
    parse_profile,
)
from agent.models.engine_builder.publish import VERSION_NAME

__all__ = ["add_arguments", "main", "run_from_args"]


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
        "--context",
        type=int,
        metavar="TOKENS",
        help="a decoder's context length: its default profile covers past 0..TOKENS-1 "
        "(default: config.json beside the ONNX file)",
    )
    parser.add_argument(
        "--activation-resize",
        action="store_true",
        help="let a run's activation memory follow its input shapes (TensorRT 10.10+), for "
        'models run with tensorrt.activation_memory = "by_run"',
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
            context=args.context,
            activation_resize=args.activation_resize,
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
