"""The `db` post-processing op: a DB text detector's probability map as text boxes.

A Differentiable Binarization detector (PaddleOCR's det models, DBNet) outputs a map of the
probability that each pixel is text, ``[1, 1, H, W]`` at the input's size. PaddleOCR turns it
into boxes with ``DBPostProcess`` (quad boxes, the "fast" score); this does the same, step by
step, with OpenCV:

1. the map above ``thresh`` is the text bitmap; its contours (at most ``max_candidates``);
2. each contour's minimum-area rectangle; one with a short side under 3 pixels is dropped;
3. its score: the map's mean inside the rectangle (its pixels as ``fillPoly`` draws them); a
   box under ``box_thresh`` is dropped;
4. the rectangle grown by ``area * unclip_ratio / perimeter`` on every side (the detector is
   trained on shrunk text regions) and its minimum-area rectangle again; one with a short
   side under 5 pixels is dropped;
5. the four corners (top-left, top-right, bottom-right, bottom-left) in source-image pixels
   where a geometry is known, else the map's, rounded and clipped to the image.

PaddleOCR grows the rectangle with pyclipper, which takes its corners truncated to integers
and gives an integer polygon; here the corners are truncated the same way, swept round by the
disc (the offset polygon's hull, all a minimum-area rectangle sees) and the points rounded as
pyclipper rounds, so the boxes are PaddleOCR's to a pixel. No pyclipper: OpenCV only.
The op replaces the output by ``boxes`` (int32 ``[n, 4, 2]``, x then y) and ``scores``
(float32 ``[n]``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from agent.models.resize import Geometry, to_source_points

__all__ = ["TextBoxSpec", "decode_text_boxes"]

Array = npt.NDArray[Any]

MIN_SIZE = 3  # pixels of a box's short side, before growing (PaddleOCR's min_size)
_ANGLES = np.linspace(0, 2 * np.pi, 360, endpoint=False)
_DISC = np.stack([np.cos(_ANGLES), np.sin(_ANGLES)], axis=1)  # a unit disc's rim


@dataclass(frozen=True)
class TextBoxSpec:
    """One `db` op, checked at load (agent.models.postprocess)."""

    output: str
    thresh: float
    box_thresh: float
    unclip_ratio: float
    max_candidates: int


def decode_text_boxes(
    spec: TextBoxSpec, outputs: dict[str, Any], geometry: Geometry | None, cv2: Any
) -> dict[str, Any]:
    """`outputs` with the map replaced by `boxes` and `scores`; ValueError where it is not
    one image's map."""
    pred = _one_map(np.asarray(outputs[spec.output]), spec.output).astype(np.float32)
    bitmap = ((pred > spec.thresh) * 255).astype(np.uint8)
    contours, _ = cv2.findContours(bitmap, cv2.RETR_LIST, cv2.CHAIN_APPROX_SIMPLE)
    boxes, scores = [], []
    for contour in contours[: spec.max_candidates]:
        corners, short = _mini_box(cv2, contour)
        if short < MIN_SIZE:
            continue
        score = _box_score(cv2, pred, corners)
        if score < spec.box_thresh:
            continue
        grown, short = _mini_box(cv2, _grown(cv2, corners, spec.unclip_ratio))
        if short < MIN_SIZE + 2:
            continue
        boxes.append(grown)
        scores.append(score)
    quads = np.array(boxes, dtype=np.float32).reshape(-1, 4, 2)
    result = {k: v for k, v in outputs.items() if k != spec.output}
    result["boxes"] = _in_pixels(quads, geometry, pred.shape)
    result["scores"] = np.array(scores, dtype=np.float32)
    return result


def _one_map(maps: Array, name: str) -> Array:
    """`[1, 1, H, W]`, `[1, H, W]` or `[H, W]` as `[H, W]`."""
    while maps.ndim > 2 and maps.shape[0] == 1:
        maps = maps[0]
    if maps.ndim != 2:
        raise ValueError(
            f"db: {name} has shape {list(np.shape(maps))}: one image's map, [1, 1, H, W], "
            "is what it takes"
        )
    return maps


def _mini_box(cv2: Any, points: Array) -> tuple[Array, float]:
    """The minimum-area rectangle of `points`: its corners top-left, top-right, bottom-right,
    bottom-left (PaddleOCR's `get_mini_boxes`) and its short side."""
    rect = cv2.minAreaRect(points.reshape(-1, 1, 2).astype(np.float32))
    corners = sorted(cv2.boxPoints(rect).tolist(), key=lambda p: p[0])
    left = corners[:2] if corners[0][1] < corners[1][1] else corners[1::-1]
    right = corners[2:] if corners[2][1] < corners[3][1] else corners[:1:-1]
    ordered = np.array([left[0], right[0], right[1], left[1]], dtype=np.float32)
    return ordered, float(min(rect[1]))


def _box_score(cv2: Any, pred: Array, corners: Array) -> float:
    """The map's mean inside the rectangle, as PaddleOCR's `box_score_fast` takes it."""
    height, width = pred.shape
    xmin = max(0, min(math.floor(float(corners[:, 0].min())), width - 1))
    xmax = max(0, min(math.ceil(float(corners[:, 0].max())), width - 1))
    ymin = max(0, min(math.floor(float(corners[:, 1].min())), height - 1))
    ymax = max(0, min(math.ceil(float(corners[:, 1].max())), height - 1))
    mask = np.zeros((ymax - ymin + 1, xmax - xmin + 1), dtype=np.uint8)
    shifted = corners - np.array([xmin, ymin], dtype=np.float32)
    cv2.fillPoly(mask, shifted.reshape(1, -1, 2).astype(np.int32), 1)
    return float(cv2.mean(pred[ymin : ymax + 1, xmin : xmax + 1], mask)[0])


def _grown(cv2: Any, corners: Array, unclip_ratio: float) -> Array:
    """The rectangle grown by `area * unclip_ratio / perimeter` as pyclipper grows it for
    PaddleOCR: its corners truncated to integers, each swept round by a disc of that radius
    (the offset polygon's hull), the points rounded half away from zero."""
    closed = corners.reshape(-1, 1, 2)
    distance = float(cv2.contourArea(closed) * unclip_ratio / cv2.arcLength(closed, True))
    base = np.trunc(corners).astype(np.float64)
    swept = (base[:, None, :] + distance * _DISC[None, :, :]).reshape(-1, 2)
    rounded: Array = np.where(swept < 0, np.trunc(swept - 0.5), np.trunc(swept + 0.5))
    return rounded


def _in_pixels(quads: Array, geometry: Geometry | None, shape: tuple[int, ...]) -> Array:
    """Corners in source-image pixels (or the map's), rounded and clipped to the image."""
    if geometry is not None:
        out = np.rint(to_source_points(quads, geometry))
    else:
        height, width = shape
        out = np.rint(quads)
        np.clip(out[..., 0], 0, width, out=out[..., 0])
        np.clip(out[..., 1], 0, height, out=out[..., 1])
    pixels: Array = out.astype(np.int32)
    return pixels
