"""The resize step of `[preprocess]`: where an image's pixels land in the model input.

Five modes (`resize_mode`):

- ``stretch``: to ``resize = [h, w]`` exactly, the aspect ratio not kept (the default);
- ``letterbox``: scaled by one factor to fit inside ``resize``, the rest padded with
  ``pad_value`` on both sides (centred, as Ultralytics' ``LetterBox`` does: the same
  rounding, so a model exported by it sees the pixels it was validated on);
- ``limit_side``: PaddleOCR's rule: with ``limit_type = "max"`` an image whose longer side
  exceeds ``limit_side`` is scaled down so it is ``limit_side`` (smaller ones are kept);
  with ``"min"`` one whose shorter side is under ``limit_side`` is scaled up to it;
- ``fit_height``: PaddleOCR's text recogniser (``resize_norm_img``): to ``resize[0]`` rows,
  its width ``ceil(rows * w / h)`` (the aspect ratio kept), on a canvas ``resize[1]`` wide or,
  for a longer line, ``int(rows * w / h)`` (at most 3200: a longer line is squeezed to it);
  the rest of the canvas, on the right, is padded after normalising, with zeros
  (``preprocess`` does it);
- ``crop``: torchvision's and Hugging Face's resize-then-centre-crop (CLIP's, DeiT's
  processors): the shorter side to ``shortest_edge``, the longer ``int(shortest_edge * long
  / short)``, then the centre ``resize = [h, w]`` kept (``top = (H - h) // 2``, as
  `transformers`' ``center_crop``); the geometry's ``pad`` is then negative, the crop's
  offset.

``multiple_of = N`` then rounds each side to a multiple of N: ``stretch`` and
``limit_side`` round the resized size to the nearest multiple (at least N, as PaddleOCR's
detector does), ``letterbox`` and ``fit_height`` round the padded canvas up.

Every resize is described by a :class:`Geometry`, which requests and sources send with each
chunk, and which maps a point of the model input back to the source image:
``source = (input - pad) / scale``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["Geometry", "ResizePlan", "plan_resize", "to_source_boxes", "to_source_points"]

Array = npt.NDArray[Any]
FIT_HEIGHT_MAX_WIDTH = 3200  # PaddleX's max_imgW: the widest a fit_height canvas gets


@dataclass(frozen=True)
class Geometry:
    """How the source image maps onto the model input (all in pixels, `[y, x]` order)."""

    source: tuple[int, int]  # the image as it came: [h, w]
    input: tuple[int, int]  # the model input: [h, w]
    scale: tuple[float, float]  # [sy, sx]: input pixels per source pixel
    pad: tuple[int, int]  # [top, left]: input pixels before the image starts

    def as_wire(self) -> dict[str, list[int] | list[float]]:
        """The `geometry` map of a chunk (docs/protocol.md)."""
        return {
            "source": list(self.source),
            "input": list(self.input),
            "scale": [float(self.scale[0]), float(self.scale[1])],
            "pad": list(self.pad),
        }


@dataclass(frozen=True)
class ResizePlan:
    """The image resized to `(height, width)`, then placed at `(top, left)` on a canvas of
    `canvas` (equal to the resized size where nothing is padded), or, `cropped`, the canvas
    cut from it at `(-top, -left)`."""

    height: int
    width: int
    canvas: tuple[int, int]
    top: int
    left: int
    cropped: bool = False  # the canvas is a part of the resized image, at (-top, -left)

    def geometry(self, source_height: int, source_width: int) -> Geometry:
        return Geometry(
            (source_height, source_width),
            self.canvas,
            (self.height / source_height, self.width / source_width),
            (self.top, self.left),
        )

    @property
    def padded(self) -> bool:
        return self.canvas != (self.height, self.width) and not self.cropped


def _round_to(size: int, multiple: int | None) -> int:
    if not multiple:
        return size
    return max(round(size / multiple) * multiple, multiple)


def _ceil_to(size: int, multiple: int | None) -> int:
    if not multiple:
        return size
    return -(-size // multiple) * multiple


def plan_resize(
    height: int,
    width: int,
    *,
    mode: str,
    resize: tuple[int, int] | None,
    limit_side: int | None = None,
    limit_type: str = "max",
    multiple_of: int | None = None,
    shortest_edge: int | None = None,
) -> ResizePlan:
    """Where an image of `height` x `width` goes (see the module docstring for the modes)."""
    if mode == "letterbox" and resize is not None:
        target_h, target_w = resize
        ratio = min(target_h / height, target_w / width)
        # At least a pixel: a 1 x 10000 strip would round to a width of 0 (OpenCV refuses it).
        new_h, new_w = max(1, round(height * ratio)), max(1, round(width * ratio))
        canvas_h, canvas_w = _ceil_to(target_h, multiple_of), _ceil_to(target_w, multiple_of)
        # Ultralytics' LetterBox: half the padding on each side, the odd pixel after.
        top = round((canvas_h - new_h) / 2 - 0.1)
        left = round((canvas_w - new_w) / 2 - 0.1)
        return ResizePlan(new_h, new_w, (canvas_h, canvas_w), top, left)
    if mode == "fit_height" and resize is not None:
        rows, least_width = resize
        ratio = width / height  # PaddleX's OCRReisizeNormImg, its arithmetic kept
        canvas_w = int(rows * max(least_width / rows, ratio))
        if canvas_w > FIT_HEIGHT_MAX_WIDTH:  # a very long line is squeezed into the most
            canvas_w = new_w = FIT_HEIGHT_MAX_WIDTH
        else:
            new_w = min(math.ceil(rows * ratio), canvas_w)
        canvas_w = _ceil_to(canvas_w, multiple_of)
        return ResizePlan(rows, max(new_w, 1), (rows, canvas_w), 0, 0)
    if mode == "crop" and resize is not None and shortest_edge is not None:
        crop_h, crop_w = resize
        short, long = (width, height) if width <= height else (height, width)
        new_long = int(shortest_edge * long / short)
        new_h, new_w = (new_long, shortest_edge) if width <= height else (shortest_edge, new_long)
        top, left = (new_h - crop_h) // 2, (new_w - crop_w) // 2
        return ResizePlan(new_h, new_w, (crop_h, crop_w), -top, -left, cropped=True)
    if mode == "limit_side" and limit_side is not None:
        ratio = 1.0
        if limit_type == "max" and max(height, width) > limit_side:
            ratio = limit_side / max(height, width)
        elif limit_type == "min" and min(height, width) < limit_side:
            ratio = limit_side / min(height, width)
        new_h, new_w = max(1, int(height * ratio)), max(1, int(width * ratio))
    elif resize is not None:
        new_h, new_w = resize
    else:
        new_h, new_w = height, width
    new_h, new_w = _round_to(new_h, multiple_of), _round_to(new_w, multiple_of)
    return ResizePlan(new_h, new_w, (new_h, new_w), 0, 0)


def to_source_boxes(boxes: Array, geometry: Geometry) -> Array:
    """`[n, 4]` xyxy boxes in model-input pixels as source-image pixels, clipped to it."""
    sy, sx = geometry.scale
    top, left = geometry.pad
    height, width = geometry.source
    out = np.empty(boxes.shape, dtype=np.float32)
    np.subtract(boxes[:, 0::2], left, out=out[:, 0::2])
    np.subtract(boxes[:, 1::2], top, out=out[:, 1::2])
    out[:, 0::2] /= sx
    out[:, 1::2] /= sy
    np.clip(out[:, 0::2], 0, width, out=out[:, 0::2])
    np.clip(out[:, 1::2], 0, height, out=out[:, 1::2])
    return out


def to_source_points(points: Array, geometry: Geometry, *, clip: bool = True) -> Array:
    """Points `[..., 2 or more]` (x, then y) in model-input pixels as source-image pixels,
    float32, clipped to the image unless `clip` is false; further columns as they are."""
    sy, sx = geometry.scale
    top, left = geometry.pad
    height, width = geometry.source
    out: Array = points.astype(np.float32, copy=True)
    out[..., 0] = (out[..., 0] - left) / sx
    out[..., 1] = (out[..., 1] - top) / sy
    if clip:
        np.clip(out[..., 0], 0, width, out=out[..., 0])
        np.clip(out[..., 1], 0, height, out=out[..., 1])
    return out
