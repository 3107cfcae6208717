"""What a build is asked for: :class:`BuildOptions`, optimization profiles, the cache folder.

Validated when made (a bad ``--profile`` or ``--max-batch`` is a ``ValueError`` before any
TensorRT work); :meth:`BuildOptions.key_fields` says which of them change the plan.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "BuildOptions",
    "EngineBuildError",
    "Profile",
    "Shape",
    "ShapeRange",
    "default_cache_dir",
    "parse_profile",
]


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
    other dynamic dim needs an explicit profile, except a decoder's, whose default profiles
    cover past length 0 up to ``context`` (None: from ``config.json`` beside the ONNX file;
    :mod:`.decoder_profile`). ``workspace_bytes``: builder workspace
    limit (None: TensorRT's default, all device memory). ``activation_resize``: the engine
    lets a run's activation memory follow its shapes, not its profile's largest (TensorRT's
    ``RUNTIME_ACTIVATION_RESIZE_10_10`` preview feature, 10.10+; an older TensorRT builds
    without it, and says so), for contexts given their memory by each run (decision 0038).
    ``cache_dir``, ``timing_cache``, ``force`` and ``progress`` are not part of the key.
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
    context: int | None = None  # a decoder's context length (None: config.json's)
    activation_resize: bool = False

    def __post_init__(self) -> None:
        if self.workspace_bytes is not None and self.workspace_bytes <= 0:
            raise ValueError(f"workspace_bytes must be > 0, got {self.workspace_bytes}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.context is not None and self.context < 1:
            raise ValueError(f"context must be >= 1, got {self.context}")

    def key_fields(self) -> dict[str, Any]:
        """What of these options changes the plan (goes into the cache key and build.json).
        ``context`` only where given: keys of builds that do not give it stay as they were."""
        fields: dict[str, Any] = {
            "fp16": self.fp16,
            "int8": self.int8,
            "workspace_bytes": self.workspace_bytes,
            "max_batch": self.max_batch,
            "profiles": [
                {name: r.describe() for name, r in sorted(p.items())} for p in self.profiles
            ],
        }
        if self.context is not None:
            fields["context"] = self.context
        if self.activation_resize:  # only where asked, as `context`
            fields["activation_resize"] = True
        return fields


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
