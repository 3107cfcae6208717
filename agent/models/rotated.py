"""Oriented boxes of a YOLO OBB model (`detect` with `format = "obb"`), as Ultralytics makes them.

A YOLOv8/11-obb export outputs ``[1, 4 + C + 1, N]``: each anchor's box centre and size
(``cx, cy, w, h`` in input pixels), its C class scores and its angle (radians). As
Ultralytics' ``non_max_suppression(rotated=True)`` does it: each box keeps its best class;
boxes scoring at most ``score_threshold`` are dropped; the rest, best first (at most 30000),
go through Fast-NMS (a box is dropped where any better box overlaps it by more than
``iou_threshold``, whether or not that one stays) with the probabilistic IoU of the boxes as
Gaussians (``batch_probiou``), classes shifted apart; at most ``max_detections`` stay. Their
centres and sizes are then mapped to the source image's pixels (the angle is unchanged: the
letterbox scales both axes alike) and sent as ``boxes`` ``[n, 5]`` (``cx, cy, w, h, angle``,
Ultralytics' ``xywhr``), with ``scores``, ``classes`` and ``labels``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from agent.models.resize import Geometry, to_source_points

__all__ = ["fast_nms", "probiou", "rotated_candidates", "to_source_xywhr"]

Array = npt.NDArray[Any]
_EPS = 1e-7


def rotated_candidates(raw: Array) -> tuple[Array, Array, Array]:
    """`([N, 4] cx, cy, w, h, [N, C] class scores, [N] angles)` of an `[N, 4 + C + 1]` (or
    transposed) output."""
    if raw.shape[0] < raw.shape[1]:
        raw = raw.T  # [4 + C + 1, N] -> [N, 4 + C + 1]
    if raw.shape[1] < 6:
        raise ValueError(f"detect: {raw.shape[1]} values per box; an obb output has 4 + C + 1")
    return raw[:, :4], raw[:, 4:-1], raw[:, -1]


def probiou(boxes: Array) -> Array:
    """Ultralytics' `batch_probiou` of every pair of `[n, 5]` xywhr boxes: 1 - the Hellinger
    distance of the boxes as Gaussians."""
    x, y = boxes[:, 0:1], boxes[:, 1:2]
    a, b, c = _covariance(boxes)
    x2, y2, a2, b2, c2 = x.T, y.T, a.T, b.T, c.T
    denominator = (a + a2) * (b + b2) - (c + c2) ** 2 + _EPS
    t1 = ((a + a2) * (y - y2) ** 2 + (b + b2) * (x - x2) ** 2) / denominator * 0.25
    t2 = ((c + c2) * (x2 - x) * (y - y2)) / denominator * 0.5
    spread = np.sqrt(np.clip(a * b - c**2, 0, None) * np.clip(a2 * b2 - c2**2, 0, None))
    t3 = np.log(((a + a2) * (b + b2) - (c + c2) ** 2) / (4 * spread + _EPS) + _EPS) * 0.5
    distance = np.clip(t1 + t2 + t3, _EPS, 100.0)
    similarity: Array = 1 - np.sqrt(1.0 - np.exp(-distance) + _EPS)
    return similarity


def _covariance(boxes: Array) -> tuple[Array, Array, Array]:
    """The covariance `[[a, c], [c, b]]` of each box as a Gaussian, each `[n, 1]`."""
    a = boxes[:, 2:3] ** 2 / 12
    b = boxes[:, 3:4] ** 2 / 12
    cos, sin = np.cos(boxes[:, 4:5]), np.sin(boxes[:, 4:5])
    return a * cos**2 + b * sin**2, a * sin**2 + b * cos**2, (a - b) * cos * sin


def fast_nms(boxes: Array, scores: Array, iou_threshold: float) -> Array:
    """Ultralytics' `TorchNMS.fast_nms` with `probiou`: the indices kept, best first."""
    if not len(boxes):
        return np.zeros(0, dtype=np.int64)
    order = np.argsort(-scores, kind="stable")
    overlaps = np.triu(probiou(boxes[order]), k=1)
    kept: Array = order[(overlaps > iou_threshold).sum(axis=0) <= 0]
    return kept


def to_source_xywhr(boxes: Array, geometry: Geometry | None) -> Array:
    """`[n, 5]` xywhr in input pixels as source-image pixels (Ultralytics' `scale_boxes` with
    `xywh=True`: centres less the padding, all four divided by the scale; not clipped)."""
    if geometry is None:
        as_float: Array = boxes.astype(np.float32)
        return as_float
    out = to_source_points(boxes, geometry, clip=False)  # the centres
    sy, sx = geometry.scale
    out[:, 2] /= sx
    out[:, 3] /= sy
    return out
