"""Turning a camera frame or an image into a model input: resize, colour, normalise, layout.

Declared per model in its ``config.toml``, so every source feeding that model (and every
box serving it) prepares frames the same way::

    [preprocess]
    input = "image"            # the model input the frame feeds (default: its only input)
    resize = [32, 32]          # [height, width]
    interpolation = "linear"   # nearest | linear | area | cubic
    color = "rgb"              # rgb | bgr | gray (OpenCV decodes to BGR; converted here)
    scale = "1/255"            # a number, or a fraction as text (TOML has no 1/255)
    mean = [0.485, 0.456, 0.406]
    std = [0.229, 0.224, 0.225]
    layout = "NCHW"            # NCHW | NHWC | CHW | HWC
    dtype = "float32"

The work is arranged so a frame is copied as few times as possible: the resize (OpenCV,
where installed) makes the one unavoidable copy, the channel swap and the layout change are
views, and normalisation, layout and the dtype cast are one pass of numpy into the output
buffer (``(x * scale - mean) / std`` is folded into ``x * a + b`` per channel).
"""

from __future__ import annotations

import importlib
from fractions import Fraction
from types import ModuleType
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["PreprocessConfig", "PreprocessError", "load_cv2", "preprocess"]

Array = npt.NDArray[Any]

_INTERPOLATION = {"nearest": "INTER_NEAREST", "linear": "INTER_LINEAR"}
_INTERPOLATION |= {"area": "INTER_AREA", "cubic": "INTER_CUBIC"}
_GRAY_WEIGHTS_RGB = np.array([0.299, 0.587, 0.114], dtype=np.float32)
_MAX_SIDE = 16384


class PreprocessError(ValueError):
    """A frame that cannot be prepared for the model (one line, says what was wrong)."""


def load_cv2() -> ModuleType | None:
    """OpenCV if it is installed, else None; imported lazily, it is an optional dependency."""
    try:
        return importlib.import_module("cv2")
    except ImportError:
        return None


class PreprocessConfig(BaseModel):
    """A model's ``[preprocess]`` section (see the module docstring for every key)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    input: str | None = Field(default=None, min_length=1)
    resize: list[int] | None = None
    interpolation: Literal["nearest", "linear", "area", "cubic"] = "linear"
    color: Literal["rgb", "bgr", "gray"] = "rgb"
    scale: float = 1.0
    mean: list[float] | None = None
    std: list[float] | None = None
    layout: Literal["NCHW", "NHWC", "CHW", "HWC"] = "NCHW"
    dtype: Literal["float32", "float16", "float64", "uint8", "int8"] = "float32"

    @field_validator("scale", mode="before")
    @classmethod
    def _fraction(cls, value: Any) -> Any:
        """TOML has no `1/255`: accept it as text, exactly."""
        if isinstance(value, str):
            try:
                return float(Fraction(value.replace(" ", "")))
            except (ValueError, ZeroDivisionError):
                raise ValueError(
                    f'must be a number or a fraction like "1/255", got {value!r}'
                ) from None
        if isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        return value

    @field_validator("resize")
    @classmethod
    def _size(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (len(value) != 2 or not all(1 <= v <= _MAX_SIDE for v in value)):
            raise ValueError(f"must be [height, width], each 1..{_MAX_SIDE}")
        return value

    @field_validator("std")
    @classmethod
    def _positive(cls, value: list[float] | None) -> list[float] | None:
        if value is not None and not all(v > 0 for v in value):
            raise ValueError("every std must be > 0")
        return value

    @model_validator(mode="after")
    def _channels(self) -> PreprocessConfig:
        for key in ("mean", "std"):
            values = getattr(self, key)
            if values is not None and len(values) not in (1, 3) and self.color != "gray":
                raise ValueError(f"{key}: give 1 value or 3 (one per channel)")
            if values is not None and self.color == "gray" and len(values) != 1:
                raise ValueError(f'{key}: color = "gray" has one channel: give 1 value')
        integer = np.issubdtype(np.dtype(self.dtype), np.integer)
        if integer and (self.mean or self.std or self.scale != 1.0):
            raise ValueError(f"scale, mean and std need a float dtype, not {self.dtype}")
        return self

    @property
    def channels_first(self) -> bool:
        return self.layout in ("NCHW", "CHW")

    @property
    def batched(self) -> bool:
        return self.layout.startswith("N")


def _resize(frame: Array, height: int, width: int, interpolation: str) -> Array:
    cv2 = load_cv2()
    if cv2 is not None:
        flag = getattr(cv2, _INTERPOLATION[interpolation])
        source = frame if frame.flags.c_contiguous else np.ascontiguousarray(frame)
        try:
            out: Array = cv2.resize(source, (width, height), interpolation=flag)
        except cv2.error as e:
            raise PreprocessError(f"cannot resize a {frame.dtype} frame: {e}") from None
        return out if out.ndim == frame.ndim else out[:, :, None]
    if interpolation != "nearest":
        raise PreprocessError(
            f'resize with interpolation "{interpolation}" needs OpenCV '
            '(pip install opencv-python-headless); interpolation = "nearest" works without it'
        )
    rows = (np.arange(height) * frame.shape[0]) // height
    cols = (np.arange(width) * frame.shape[1]) // width
    resized: Array = frame[rows][:, cols]
    return resized


def _to_gray(frame: Array, bgr: bool) -> Array:
    channels = frame.shape[2]
    if channels == 1:
        return frame
    if channels not in (3, 4):
        raise PreprocessError(f"cannot convert a {channels}-channel frame to gray")
    weights = _GRAY_WEIGHTS_RGB[::-1] if bgr else _GRAY_WEIGHTS_RGB
    gray = np.tensordot(frame[:, :, :3], weights, axes=([2], [0]))  # float32, H x W
    if np.issubdtype(frame.dtype, np.integer):
        gray = np.rint(gray, out=gray)
    result: Array = gray[:, :, None]
    return result


def preprocess(frame: Array, config: PreprocessConfig, *, bgr: bool = False) -> Array:
    """`frame` (H x W or H x W x C, any numeric dtype) as the model input `config` declares.

    `bgr`: the frame's channels are in OpenCV's order (video frames, decoded images); other
    frames (arrays from files, pipes) are taken to be RGB already.
    """
    if not isinstance(frame, np.ndarray) or frame.ndim not in (2, 3):
        shape = getattr(frame, "shape", None)
        raise PreprocessError(f"expected an image H x W or H x W x C, got shape {shape}")
    if frame.dtype.kind not in "uif" or 0 in frame.shape:
        raise PreprocessError(f"cannot preprocess a {frame.dtype} frame of shape {frame.shape}")
    image = frame if frame.ndim == 3 else frame[:, :, None]
    if config.resize is not None and tuple(image.shape[:2]) != tuple(config.resize):
        image = _resize(image, config.resize[0], config.resize[1], config.interpolation)
    if config.color == "gray":
        image = _to_gray(image, bgr)
    elif image.shape[2] >= 3:
        if image.shape[2] > 3:
            image = image[:, :, :3]  # drop alpha (a view)
        if bgr != (config.color == "bgr"):
            image = image[:, :, ::-1]  # swap red and blue (a view)
    channels = image.shape[2]
    view = image.transpose(2, 0, 1) if config.channels_first else image
    dtype = np.dtype(config.dtype)
    alpha, beta = _affine(config, channels)
    if alpha is None and view.dtype == dtype:
        result: Array = view  # nothing to compute: no copy at all
    else:
        result = np.empty(view.shape, dtype=dtype)
        if alpha is None:
            np.copyto(result, view, casting="unsafe")
        else:
            shape = (channels, 1, 1) if config.channels_first else (1, 1, channels)
            compute = dtype if dtype.itemsize >= 4 else np.dtype(np.float32)
            np.multiply(view, alpha.astype(compute).reshape(shape), out=result, casting="unsafe")
            if beta is not None:
                np.add(result, beta.astype(compute).reshape(shape), out=result, casting="unsafe")
    return result[None] if config.batched else result


def _affine(config: PreprocessConfig, channels: int) -> tuple[Array | None, Array | None]:
    """`x * scale - mean) / std` as `x * alpha + beta`, per channel; None where it is a no-op."""
    mean = _per_channel(config.mean, channels, "mean", 0.0)
    std = _per_channel(config.std, channels, "std", 1.0)
    alpha = config.scale / std
    beta = -mean / std
    no_alpha = bool(np.all(alpha == 1.0))
    no_beta = bool(np.all(beta == 0.0))
    if no_alpha and no_beta:
        return None, None
    return alpha, None if no_beta else beta


def _per_channel(values: list[float] | None, channels: int, key: str, default: float) -> Array:
    if values is None:
        return np.full(channels, default, dtype=np.float64)
    if len(values) not in (1, channels):
        raise PreprocessError(f"{key} has {len(values)} values for a {channels}-channel frame")
    result: Array = np.broadcast_to(np.asarray(values, dtype=np.float64), (channels,)).copy()
    return result
