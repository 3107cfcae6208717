"""Turning a camera frame or an image into a model input: resize, colour, normalise, layout.

Declared per model in its ``config.toml``, so every source feeding that model (and every
box serving it) prepares frames the same way::

    [preprocess]
    input = "image"            # the model input the frame feeds (default: its only input)
    resize = [32, 32]          # [height, width]
    resize_mode = "stretch"    # stretch | letterbox | limit_side | fit_height | crop
                               # (agent.models.resize)
    shortest_edge = 256        # crop: the shorter side resized to this, then the centre
                               # resize = [h, w] kept
    limit_side = 960           # limit_side: the side's bound; limit_type = "max" | "min"
    multiple_of = 32           # round each side to a multiple (detectors with dynamic input)
    pad_value = 114            # letterbox: the padding, in the frame's own pixel values
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
import os
from collections.abc import Sequence
from fractions import Fraction
from types import ModuleType
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from agent.models.resize import Geometry, ResizePlan, plan_resize
from agent.protocol.errors import Limits

__all__ = [
    "PreprocessConfig",
    "PreprocessError",
    "image_input",
    "load_cv2",
    "preprocess",
    "preprocess_image",
]

Array = npt.NDArray[Any]

_INTERPOLATION = {"nearest": "INTER_NEAREST", "linear": "INTER_LINEAR"}
_INTERPOLATION |= {"area": "INTER_AREA", "cubic": "INTER_CUBIC"}
_GRAY_WEIGHTS_RGB = np.array([0.299, 0.587, 0.114], dtype=np.float32)
_MAX_SIDE = 16384
# Pixels an image may be resized to before its crop or pad (a 1 x 10000 strip resized to a
# shortest edge of 256 would be 256 x 2,560,000: 2 GB of float32).
MAX_RESIZED_PIXELS = 1 << 26


class PreprocessError(ValueError):
    """A frame that cannot be prepared for the model (one line, says what was wrong)."""


def load_cv2() -> ModuleType | None:
    """OpenCV if it is installed, else None; imported lazily, it is an optional dependency."""
    # OpenCV's own bound on a decoded image, read when it is first imported: the header check
    # of an encoded input (agent.protocol.images) is the guard, this one a second line should
    # OpenCV ever read a size the header walk did not.
    os.environ.setdefault("OPENCV_IO_MAX_IMAGE_PIXELS", str(Limits.max_image_pixels))
    try:
        return importlib.import_module("cv2")
    except ImportError:
        return None


class PreprocessConfig(BaseModel):
    """A model's ``[preprocess]`` section (see the module docstring for every key)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    input: str | None = Field(default=None, min_length=1)
    resize: list[int] | None = None
    resize_mode: Literal["stretch", "letterbox", "limit_side", "fit_height", "crop"] = "stretch"
    shortest_edge: int | None = Field(default=None, ge=1, le=_MAX_SIDE)
    limit_side: int | None = Field(default=None, ge=1, le=_MAX_SIDE)
    limit_type: Literal["max", "min"] = "max"
    multiple_of: int | None = Field(default=None, ge=1, le=1024)
    pad_value: float = 0.0
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
        self._check_resize_mode()
        integer = np.issubdtype(np.dtype(self.dtype), np.integer)
        if integer and (self.mean or self.std or self.scale != 1.0):
            raise ValueError(f"scale, mean and std need a float dtype, not {self.dtype}")
        return self

    def _check_resize_mode(self) -> None:
        if (self.resize_mode == "crop") != (self.shortest_edge is not None):
            raise ValueError('resize_mode = "crop" and shortest_edge = N go together')
        edge, crop = self.shortest_edge, self.resize
        if edge is not None and crop is not None and edge < max(crop):
            raise ValueError("shortest_edge must be at least the crop, resize = [h, w]")
        if self.resize_mode in ("letterbox", "fit_height", "crop") and self.resize is None:
            raise ValueError(f'resize_mode = "{self.resize_mode}" needs resize = [height, width]')
        if self.resize_mode == "fit_height" and "pad_value" in self.model_fields_set:
            raise ValueError(
                'resize_mode = "fit_height" pads with zeros after normalising, as PaddleOCR '
                "does: drop pad_value"
            )
        if (self.resize_mode == "limit_side") != (self.limit_side is not None):
            raise ValueError('resize_mode = "limit_side" and limit_side = N go together')
        if self.resize_mode == "limit_side" and self.resize is not None:
            raise ValueError('resize_mode = "limit_side" sizes the image itself: drop resize')

    @property
    def channels_first(self) -> bool:
        return self.layout in ("NCHW", "CHW")

    @property
    def batched(self) -> bool:
        return self.layout.startswith("N")


def image_input(config: PreprocessConfig | None, specs: Sequence[Any]) -> str | None:
    """The input `[preprocess]` prepares: its `input`, else the model's only input; None
    without a `[preprocess]` (or with several inputs and none named)."""
    if config is None:
        return None
    if config.input is not None:
        return config.input
    return specs[0].name if len(specs) == 1 else None


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
    return preprocess_image(frame, config, bgr=bgr)[0]


def preprocess_image(
    frame: Array, config: PreprocessConfig, *, bgr: bool = False
) -> tuple[Array, Geometry]:
    """:func:`preprocess`, and where the frame's pixels landed in the input (its geometry)."""
    if not isinstance(frame, np.ndarray) or frame.ndim not in (2, 3):
        shape = getattr(frame, "shape", None)
        raise PreprocessError(f"expected an image H x W or H x W x C, got shape {shape}")
    if frame.dtype.kind not in "uif" or 0 in frame.shape:
        raise PreprocessError(f"cannot preprocess a {frame.dtype} frame of shape {frame.shape}")
    image = frame if frame.ndim == 3 else frame[:, :, None]
    image, plan, geometry = _placed(image, config)
    if config.color == "gray":
        image = _to_gray(image, bgr)
    elif image.shape[2] < 3:  # a gray frame (and its alpha) for a color model: its gray thrice
        image = np.repeat(image[:, :, :1], 3, axis=2)
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
    if config.resize_mode == "fit_height" and plan.padded:
        result = _zero_padded(result, plan.canvas, config.channels_first)
    return (result[None] if config.batched else result), geometry


def _zero_padded(result: Array, canvas: tuple[int, int], channels_first: bool) -> Array:
    """`result` (normalised, H x w) at the left of a zero canvas of `canvas` (H x W)."""
    width = result.shape[2] if channels_first else result.shape[1]
    if channels_first:
        out = np.zeros((result.shape[0], *canvas), dtype=result.dtype)
        out[:, :, :width] = result
    else:
        out = np.zeros((*canvas, result.shape[2]), dtype=result.dtype)
        out[:, :width] = result
    return out


def _placed(image: Array, config: PreprocessConfig) -> tuple[Array, ResizePlan, Geometry]:
    """The image resized (and padded, but for `fit_height`: after normalising) as `config`
    says, where it was placed, and its geometry."""
    height, width = image.shape[:2]
    plan = plan_resize(
        height,
        width,
        mode=config.resize_mode,
        resize=(config.resize[0], config.resize[1]) if config.resize is not None else None,
        limit_side=config.limit_side,
        limit_type=config.limit_type,
        multiple_of=config.multiple_of,
        shortest_edge=config.shortest_edge,
    )
    if plan.height * plan.width > MAX_RESIZED_PIXELS:  # a strip, for a shortest-edge resize
        raise PreprocessError(
            f"an image of {height} x {width} would be resized to {plan.height} x {plan.width}: "
            "its sides are too far apart for this model"
        )
    if (plan.height, plan.width) != (height, width):
        image = _resize(image, plan.height, plan.width, config.interpolation)
    if plan.cropped:  # a view of the resized image's centre
        top, left = -plan.top, -plan.left
        image = image[top : top + plan.canvas[0], left : left + plan.canvas[1]]
    elif plan.padded and config.resize_mode != "fit_height":
        image = _pad(image, plan.canvas, plan.top, plan.left, config.pad_value)
    return image, plan, plan.geometry(height, width)


def _pad(image: Array, canvas: tuple[int, int], top: int, left: int, value: float) -> Array:
    """`image` on a `canvas`-sized frame filled with `value` (one allocation)."""
    out = np.empty((canvas[0], canvas[1], image.shape[2]), dtype=image.dtype)
    height, width = image.shape[:2]
    fill = np.asarray(value).astype(image.dtype)
    out[:top] = fill
    out[top + height :] = fill
    out[top : top + height, :left] = fill
    out[top : top + height, left + width :] = fill
    out[top : top + height, left : left + width] = image
    return out


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
