"""The default optimization profiles of a decoder (a `mode = "generate"` export).

A decoder's inputs are dynamic beyond the batch dim (the sequence and the past), so the
plain default profile (a dynamic batch only) cannot build it. Where the network's inputs are
a decoder's, as `agent.models.decoder_layout` recognises them (`input_ids`, optional
`attention_mask` and `position_ids`, `past_key_values.N.key/value`, optional
`use_cache_branch`), two profiles cover what the agent's generate loop feeds it, one row at a
time (the loop runs each request alone):

- the prefill: a sequence of 1..context tokens with past length 0;
- the steps: one token with a past of 0..context - 1.

A decoder exported without its cache runs the whole sequence every step, so the prefill's
profile alone covers it.

`attention_mask` spans past + sequence, 1..context, in both. One profile with both ranges
would have a maximum that no run can have (a whole context of tokens on a full past) and that
the TensorRT session probes at load (`agent.models.backends.tensorrt`: every profile's
maximum sizes the output buffers), so each profile's maximum is a real run: the longest
prefill, the last step. The session switches to the profile that admits a run's shapes (the
prefill's, then the steps'). The optimum is half the context.

The context is `BuildOptions.context` (``--context``; ``tensorrt.build.context`` in a model's
config.toml), else `config.json` beside the ONNX file (`n_positions`,
`max_position_embeddings`, ...), as for serving. It is part of the cache key only where it is
given; read from `config.json`, it is a property of the export itself (the position table's
size), which the ONNX file's hash already covers.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from agent.models.backends.base import ModelLoadError
from agent.models.decoder_layout import DECODER_INPUTS, PAST_INPUT, context_in, past_axis
from agent.models.engine_builder.options import EngineBuildError, Shape, ShapeRange

__all__ = ["decoder_context", "decoder_profiles", "is_decoder"]

_SEQUENCE_INPUTS = ("input_ids", "position_ids")


def is_decoder(inputs: Mapping[str, Shape]) -> bool:
    """Whether the network's inputs are a decoder's, with or without a cache (names as
    exporters write them)."""
    return "input_ids" in inputs and all(
        name in DECODER_INPUTS or PAST_INPUT.match(name) for name in inputs
    )


def decoder_context(onnx_path: Path, context: int | None) -> int:
    """The context the profile covers: `context` where given, else `config.json`'s."""
    if context is not None:
        return context
    try:
        found = context_in(onnx_path.parent)
    except ModelLoadError as exc:
        raise EngineBuildError(str(exc)) from exc
    if found is None:
        raise EngineBuildError(
            f"{onnx_path.name} takes token ids (a decoder's inputs) but its context length is "
            "unknown (no config.json beside it with n_positions or max_position_embeddings): "
            "give --context N (tensorrt.build.context) or the shapes with --profile"
        )
    return found


def decoder_profiles(inputs: Mapping[str, Shape], context: int) -> list[dict[str, ShapeRange]]:
    """The prefill's and the steps' profiles of a decoder whose inputs are `inputs` (the
    prefill's alone without a cache)."""
    if context < 1:
        raise EngineBuildError(f"the context must be >= 1, got {context}")
    half = max(1, context // 2)
    prefill = _profile(inputs, sequence=(1, half, context), past=(0, 0, 0), context=context)
    if not any(PAST_INPUT.match(name) for name in inputs):
        return [prefill]  # no cache: every step is a prefill of the sequence so far
    steps = _profile(
        inputs, sequence=(1, 1, 1), past=(0, min(half, context - 1), context - 1), context=context
    )
    return [prefill, steps]


def _profile(
    inputs: Mapping[str, Shape],
    *,
    sequence: tuple[int, int, int],
    past: tuple[int, int, int],
    context: int,
) -> dict[str, ShapeRange]:
    span = (1, min(context, sequence[1] + past[1]), context)  # the mask: past + sequence
    profile: dict[str, ShapeRange] = {}
    for name, shape in inputs.items():
        if not any(d < 0 for d in shape):
            continue  # fixed (use_cache_branch [1]): no range to give
        if name in _SEQUENCE_INPUTS:
            profile[name] = _ranged(name, shape, {1: sequence})
        elif name == "attention_mask":
            profile[name] = _ranged(name, shape, {1: span})
        elif PAST_INPUT.match(name):
            axis = past_axis([d < 0 for d in shape])
            if axis is None:
                raise EngineBuildError(
                    f"cache input {name!r} {list(shape)}: expected [batch, ..., past, ...] "
                    "with every other dim fixed; give its shapes with --profile"
                )
            profile[name] = _ranged(name, shape, {axis: past})
        else:
            raise EngineBuildError(
                f"input {name!r} {list(shape)} is dynamic: give its shapes with --profile"
            )
    return profile


def _ranged(name: str, shape: Shape, ranges: Mapping[int, tuple[int, int, int]]) -> ShapeRange:
    """`shape` with batch 1 and `ranges` (axis -> min, opt, max) on its dynamic dims."""
    dims: list[tuple[int, int, int]] = []
    for axis, d in enumerate(shape):
        if axis == 0 and d < 0:
            dims.append((1, 1, 1))  # one row: the generate loop runs each request alone
        elif axis in ranges and d < 0:
            dims.append(ranges[axis])
        elif d < 0:
            raise EngineBuildError(
                f"input {name!r} {list(shape)}: dim {axis} is dynamic where a decoder's is "
                "fixed; give its shapes with --profile"
            )
        else:
            dims.append((d, d, d))
    lows, opts, highs = zip(*dims, strict=True) if dims else ((), (), ())
    return ShapeRange(tuple(lows), tuple(opts), tuple(highs))
