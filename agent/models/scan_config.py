"""The `[scan]` and `[defaults]` tables of a model's config.toml (kept apart from
`agent.models.model_config`, which holds the rest of the schema and imports these).

`[scan]` describes how a `mode = "scan"` model sees a long signal: windows of `window`
samples along `axis`, advancing `hop` samples, with `lead` zeros before the first (window k
covers `[k*hop - lead, k*hop - lead + window)`; see `agent.inference.windows`).

`[defaults]` gives an input's value when a request leaves it out (`sr = 16000`). TOML values
only are checked here (numbers, booleans, text, rectangular arrays of them); whether a value
fits its input's dtype and shape is known only once the model is loaded
(`agent.models.defaults`).
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["MAX_DEFAULT_ELEMENTS", "ScanConfig", "check_default_values"]

MAX_DEFAULT_ELEMENTS = 65536  # per [defaults] value: constants, not data


class ScanConfig(BaseModel):
    """`[scan]`: the windows a `scan` model runs on, and how long a session is kept."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    input: str = Field(min_length=1)  # the long input, cut into windows
    axis: int = -1  # the axis of that input the windows run along
    window: int = Field(ge=1, le=1 << 24)  # samples one run sees, context included
    hop: int = Field(ge=1)  # samples the window advances
    lead: int = Field(default=0, ge=0)  # zeros before the signal (the first window's context)
    tail: Literal["drop", "pad"] = "drop"  # the last partial window: dropped or zero-padded
    windows_per_chunk: int = Field(default=1, ge=1, le=65536)
    session_ttl_s: float = Field(default=30.0, gt=0, le=86400)

    @model_validator(mode="after")
    def _fits(self) -> ScanConfig:
        if self.hop > self.window:
            raise ValueError(f"hop {self.hop} is more than window {self.window} (samples skipped)")
        if self.lead >= self.window:
            raise ValueError(f"lead {self.lead} must be less than window {self.window}")
        return self


def check_default_values(defaults: dict[str, Any]) -> dict[str, Any]:
    """`[defaults]` values are numbers, booleans, text or rectangular arrays of one of
    those (no tables, no dates), of at most MAX_DEFAULT_ELEMENTS elements."""
    for name, value in defaults.items():
        problem = _value_problem(value)
        if problem is not None:
            raise ValueError(f"{name}: {problem}")
    return defaults


def _value_problem(value: Any) -> str | None:
    try:
        array = np.array(value, dtype=object)
    except ValueError:
        return "arrays must be rectangular"
    items = list(array.flat) if array.ndim else [value]
    kinds = {type(item) for item in items}
    if not kinds <= {bool, int, float, str}:
        return "values are numbers, booleans, text or rectangular arrays of them"
    if len(kinds) > 1 and kinds != {int, float}:
        return "an array mixes " + " and ".join(sorted({_kind_name(k) for k in kinds}))
    if array.size > MAX_DEFAULT_ELEMENTS:
        return f"more than {MAX_DEFAULT_ELEMENTS} elements"
    return None


def _kind_name(kind: type) -> str:
    return {bool: "booleans", int: "numbers", float: "numbers", str: "text"}[kind]
