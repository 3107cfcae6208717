"""The `detect` post-processing op: a detector's raw output as boxes, scores, classes, labels.

Layouts (`format`):

- ``yolov8`` (also YOLO11, as Ultralytics exports them): one output ``[1, 4 + C, N]``
  (``cx, cy, w, h`` in input pixels, then C class scores); ``[1, N, 4 + C]`` is taken too (the
  class axis is the shorter one: detectors have far more anchors than classes);
- ``yolov5``: one output ``[1, N, 5 + C]`` (``cx, cy, w, h, objectness``, then C class
  scores; a box's score is objectness times its class score);
- ``boxes_scores``: two outputs, ``output`` the boxes ``[1, N, 4]`` (``box_format``,
  ``xyxy`` unless said otherwise) and ``scores`` ``[1, N, C]``;
- ``obb``: one output ``[1, 4 + C + 1, N]``, oriented boxes (``cx, cy, w, h``, the class
  scores, the angle), as Ultralytics exports YOLOv8/11-obb (agent.models.rotated: their NMS
  and their ``boxes`` ``[n, 5]``, ``xywhr``, differ);
- ``end2end``: one output ``[1, K, 6]`` of final detections, a box (``box_format``, ``xyxy``
  unless said otherwise), its score and its class a row, best first, as Ultralytics exports
  YOLO26's NMS-free head (``nms=False``), a YOLOv8 or YOLO11 with its NMS inside
  (``nms=True``), or RT-DETR (``xywh``, ``normalized``).

Boxes are in input pixels, or with ``normalized`` in fractions of the input's width and height
(RT-DETR): scaled by the input's size where a geometry is known, left as they are otherwise.

With ``keypoints = [K, D]`` (a pose model's ``kpt_shape``, ``yolov8`` only) the last ``K * D``
values of each box are its keypoints, ``x, y`` (and a visibility where ``D`` is 3): they ride
with their box through NMS and come out as ``keypoints`` ``[n, K, D]``, in the source image's
pixels like the boxes.
With ``masks = NAME`` (a segmentation model's prototypes output, ``yolov8`` only) the last
``nm`` values of each box are its mask coefficients: they ride with it through NMS and make
its outline (agent.models.segments), sent as ``segments``, one ``[m, 2]`` array an instance.

Then, as Ultralytics' ``non_max_suppression`` does it (without multi-label): each box keeps its
best class; boxes scoring at most ``score_threshold`` are dropped; the rest, best first (at
most 30000), go through greedy NMS per class (boxes of different classes never suppress each
other: they are shifted apart by class, one NMS for all); at most ``max_detections`` stay.
An ``end2end`` output has had its NMS: its rows scoring above ``score_threshold`` stay, in the
model's order, the first ``max_detections`` of them (Ultralytics' own end-to-end branch).

All in numpy, vectorised: the candidates are filtered, decoded and shifted as whole arrays;
NMS is one vectorised IoU row per kept box (at most ``max_detections`` rows). Written here
rather than taken from a library: OpenCV's ``dnn.NMSBoxesBatched`` would do, but OpenCV is
an optional extra and the op must work without it; torchvision is not a runtime dependency.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from agent.models.resize import Geometry, to_source_boxes, to_source_points
from agent.models.rotated import fast_nms, rotated_candidates, to_source_xywhr
from agent.models.segments import outlines

__all__ = ["DetectSpec", "decode_detections", "nms"]

Array = npt.NDArray[Any]

MAX_CANDIDATES = 30000  # boxes into NMS, as Ultralytics' max_nms
_CLASS_OFFSET = 7680.0  # Ultralytics' max_wh: shifts each class's boxes apart


@dataclass(frozen=True)
class DetectSpec:
    """One `detect` op, checked at load (agent.models.postprocess)."""

    output: str
    format: str  # yolov8 | yolov5 | boxes_scores | end2end | obb
    scores: str | None
    box_format: str  # xywh (centre, size) | xyxy
    score_threshold: float
    iou_threshold: float
    max_detections: int
    labels: tuple[str, ...] | None
    normalized: bool = False  # boxes in fractions of the input's size, not its pixels
    keypoints: tuple[int, int] | None = None  # (K, D): a pose model's last K * D values a box
    masks: str | None = None  # a segmentation model's prototypes output
    # `labels` as an object array, built once here and indexed by each frame's classes
    label_table: Array | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        table = np.array(self.labels, dtype=object) if self.labels is not None else None
        object.__setattr__(self, "label_table", table)


def _squeeze_batch(array: Array, name: str, rank: int = 2) -> Array:
    """`array` without its batch of one (rank `rank` + 1), or as it is (rank `rank`)."""
    if array.ndim == rank + 1:
        if array.shape[0] != 1:
            raise ValueError(f"detect: {name} has a batch of {array.shape[0]}; it takes one image")
        first: Array = array[0]
        return first
    if array.ndim != rank:
        raise ValueError(
            f"detect: {name} has shape {list(array.shape)}, expected rank {rank} or {rank + 1}"
        )
    return array


def _candidates(
    spec: DetectSpec, outputs: dict[str, Any], tail: int
) -> tuple[Array, Array, Array | None]:
    """`(boxes [N, 4], class scores [N, C], the last `tail` values or None)` of every
    anchor, boxes in `box_format`; those values are the keypoints `[N, K * D]` or the mask
    coefficients `[N, nm]`."""
    raw = _squeeze_batch(np.asarray(outputs[spec.output]), spec.output)
    if spec.format == "boxes_scores":
        assert spec.scores is not None
        scores = _squeeze_batch(np.asarray(outputs[spec.scores]), spec.scores)
        if raw.shape[-1] != 4 or scores.shape[0] != raw.shape[0]:
            raise ValueError(
                f"detect: boxes {list(raw.shape)} and scores {list(scores.shape)} do not pair "
                "as [N, 4] and [N, C]"
            )
        return raw, scores, None
    if spec.format == "yolov8" and raw.shape[0] < raw.shape[1]:
        raw = raw.T  # [4 + C, N] -> [N, 4 + C] (a view)
    first = 5 if spec.format == "yolov5" else 4
    last = raw.shape[1] - tail
    if last <= first:
        raise ValueError(
            f"detect: {spec.output} has {raw.shape[1]} values per box, a {spec.format} "
            f"output{' with those keypoints or masks' if last < raw.shape[1] else ''} has "
            f"more than {first + raw.shape[1] - last}"
        )
    scores = raw[:, first:last]
    if spec.format == "yolov5":
        scores = scores * raw[:, 4:5]
    return raw[:, :4], scores, raw[:, last:] if last < raw.shape[1] else None


def _prototypes(spec: DetectSpec, outputs: dict[str, Any]) -> Array:
    """A segmentation model's prototypes, `[nm, mh, mw]`."""
    assert spec.masks is not None
    found = _squeeze_batch(np.asarray(outputs[spec.masks]), spec.masks, rank=3)
    return found


def _to_xyxy(boxes: Array, box_format: str) -> Array:
    out = np.asarray(boxes, dtype=np.float32)
    if box_format == "xyxy":
        return out
    half = out[:, 2:4] * 0.5
    return np.concatenate((out[:, 0:2] - half, out[:, 0:2] + half), axis=1)


def nms(boxes: Array, scores: Array, iou_threshold: float, limit: int) -> Array:
    """Greedy NMS: indices of the boxes kept, best first (boxes suppressed by a better one
    overlapping them with IoU above `iou_threshold`); `boxes` xyxy, `scores` any order."""
    order = np.argsort(-scores, kind="stable")
    x1, y1, x2, y2 = boxes[:, 0], boxes[:, 1], boxes[:, 2], boxes[:, 3]
    areas = (x2 - x1) * (y2 - y1)
    keep: list[int] = []
    while order.size and len(keep) < limit:
        best, rest = order[0], order[1:]
        keep.append(int(best))
        width = np.minimum(x2[best], x2[rest]) - np.maximum(x1[best], x1[rest])
        height = np.minimum(y2[best], y2[rest]) - np.maximum(y1[best], y1[rest])
        inter = np.maximum(width, 0.0) * np.maximum(height, 0.0)  # np.clip: 3x the call cost
        union = areas[best] + areas[rest] - inter
        iou = np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)
        order = rest[iou <= iou_threshold]
    return np.asarray(keep, dtype=np.int64)


def decode_detections(
    spec: DetectSpec, outputs: dict[str, Any], geometry: Geometry | None, cv2: Any = None
) -> dict[str, Any]:
    """`outputs` with the detector's output(s) replaced by `boxes` (xyxy, float32, in the
    source image's pixels where `geometry` is known, else the input's), `scores`, `classes`
    (int64) and, with labels, `labels` (a string tensor); `keypoints` and `segments` where
    the spec has them (`cv2`: OpenCV, which outlines need)."""
    for name in (spec.scores, spec.masks):
        if name is not None and name not in outputs:
            raise ValueError(f"detect: needs output {name!r} too, and it was not chosen")
    if spec.format == "end2end":
        return _detected(spec, outputs, *_final_rows(spec, outputs), geometry)
    if spec.format == "obb":
        return _oriented(spec, outputs, geometry)
    prototypes = _prototypes(spec, outputs) if spec.masks is not None else None
    if spec.keypoints is not None:
        tail = spec.keypoints[0] * spec.keypoints[1]
    else:
        tail = prototypes.shape[0] if prototypes is not None else 0
    boxes, scores, points = _candidates(spec, outputs, tail)
    chosen, classes, best = _best_candidates(scores, spec.score_threshold)
    xyxy = _to_xyxy(boxes[chosen], spec.box_format)
    shifted = xyxy + (classes.astype(np.float32) * _CLASS_OFFSET)[:, None]
    keep = nms(shifted, best, spec.iou_threshold, spec.max_detections)
    result = _detected(spec, outputs, xyxy[keep], best[keep], classes[keep], geometry)
    if points is not None and spec.keypoints is not None:
        kept_points = points[chosen][keep].reshape(-1, *spec.keypoints).astype(np.float32)
        in_source = to_source_points(kept_points, geometry) if geometry is not None else kept_points
        result["keypoints"] = in_source
    if points is not None and prototypes is not None:
        result["segments"] = outlines(cv2, points[chosen][keep], prototypes, xyxy[keep], geometry)
    return result


def _best_candidates(scores: Array, threshold: float) -> tuple[Array, Array, Array]:
    """`(chosen, classes, scores)`: the anchors whose best class scores above `threshold`
    (at most `MAX_CANDIDATES`, the best), each one's class (int64) and score (float32)."""
    classes = np.argmax(scores, axis=1)
    best = np.take_along_axis(scores, classes[:, None], axis=1)[:, 0].astype(np.float32)
    chosen = np.flatnonzero(best > threshold)
    if chosen.size > MAX_CANDIDATES:
        chosen = chosen[np.argsort(-best[chosen], kind="stable")[:MAX_CANDIDATES]]
    return chosen, classes[chosen].astype(np.int64), best[chosen]


def _oriented(
    spec: DetectSpec, outputs: dict[str, Any], geometry: Geometry | None
) -> dict[str, Any]:
    """An `obb` output's oriented boxes kept by Ultralytics' rotated NMS (agent.models.rotated)."""
    raw = _squeeze_batch(np.asarray(outputs[spec.output]), spec.output).astype(np.float32)
    boxes, scores, angles = rotated_candidates(raw)
    chosen, classes, best = _best_candidates(scores, spec.score_threshold)
    xywhr = np.concatenate((boxes[chosen], angles[chosen, None]), axis=1)
    shifted = xywhr.copy()
    shifted[:, :2] += (classes.astype(np.float32) * _CLASS_OFFSET)[:, None]
    keep = fast_nms(shifted, best, spec.iou_threshold)[: spec.max_detections]
    in_source = to_source_xywhr(xywhr[keep], geometry)
    return _result(spec, outputs, in_source, best[keep], classes[keep])


def _final_rows(spec: DetectSpec, outputs: dict[str, Any]) -> tuple[Array, Array, Array]:
    """An `end2end` output's detections above the threshold: (boxes, scores, classes)."""
    rows = _squeeze_batch(np.asarray(outputs[spec.output]), spec.output)
    if rows.shape[1] != 6:
        raise ValueError(
            f"detect: {spec.output} has {rows.shape[1]} values per detection, an end2end "
            "output has 6 (a box's four, the score, the class)"
        )
    rows = rows[np.flatnonzero(rows[:, 4] > spec.score_threshold)[: spec.max_detections]]
    boxes = _to_xyxy(rows[:, :4], spec.box_format)
    return boxes, rows[:, 4].astype(np.float32), rows[:, 5].astype(np.int64)


def _detected(
    spec: DetectSpec,
    outputs: dict[str, Any],
    boxes: Array,
    scores: Array,
    classes: Array,
    geometry: Geometry | None,
) -> dict[str, Any]:
    """`outputs` with the detector's output(s) replaced by the kept detections, their xyxy
    `boxes` in the source image's pixels where `geometry` is known."""
    kept = boxes.reshape(-1, 4)
    if geometry is not None:
        if spec.normalized:
            height, width = geometry.input
            kept = kept * np.array([width, height, width, height], dtype=np.float32)
        kept = to_source_boxes(kept, geometry)
    return _result(spec, outputs, kept, scores, classes)


def _result(
    spec: DetectSpec, outputs: dict[str, Any], boxes: Array, scores: Array, classes: Array
) -> dict[str, Any]:
    """`outputs` without the detector's own (its output, scores, prototypes), with the kept
    `boxes`, `scores`, `classes` and, with a label table, `labels`."""
    own = (spec.output, spec.scores, spec.masks)
    result = {k: v for k, v in outputs.items() if k not in own}
    result["boxes"] = boxes
    result["scores"] = scores
    result["classes"] = classes
    if spec.label_table is not None:
        result["labels"] = _labels_of(spec.label_table, classes)
    return result


def _labels_of(table: Array, classes: Array) -> Array:
    """Each class's label (an object array), `str(class)` for a class past the table."""
    known = classes < len(table)
    labels = np.empty(classes.shape, dtype=object)
    labels[known] = table[classes[known]]
    for i in np.flatnonzero(~known):
        labels[i] = str(classes[i])
    return labels
