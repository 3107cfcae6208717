"""Instance outlines of a YOLO segmentation model (`detect` with `masks`), as Ultralytics makes
them.

A YOLOv8/11-seg export has two outputs: the detections, each box followed by its class scores
and ``nm`` mask coefficients, and the mask prototypes ``[1, nm, mh, mw]`` (a quarter of the
input's size). For each box kept by NMS, as Ultralytics' ``process_mask(upsample=True)`` and
``masks2segments(strategy="largest")`` do: its coefficients times the prototypes, upsampled
bilinearly to the input's size, above 0 (a probability above a half) and inside the box, is
its mask; the mask's largest outer contour (the most points) is its outline, an ``[m, 2]``
float32 array of x, y, mapped to the source image's pixels like the boxes. Outlines are sent,
not masks: a few hundred bytes an instance instead of the image's size in bytes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from agent.models.resize import Geometry, to_source_points

__all__ = ["outlines"]

Array = npt.NDArray[Any]
PROTOTYPE_STRIDE = 4  # input pixels a prototype pixel, where no geometry tells the input's size


def outlines(
    cv2: Any,
    coefficients: Array,
    prototypes: Array,
    boxes: Array,
    geometry: Geometry | None,
) -> list[Array]:
    """Each instance's outline (`coefficients` `[n, nm]`, `prototypes` `[nm, mh, mw]`, `boxes`
    `[n, 4]` xyxy in input pixels), in source-image pixels where `geometry` is known."""
    count, height, width = prototypes.shape
    if geometry is not None:
        input_h, input_w = geometry.input
    else:
        input_h, input_w = height * PROTOTYPE_STRIDE, width * PROTOTYPE_STRIDE
    logits = coefficients.astype(np.float32) @ prototypes.reshape(count, -1).astype(np.float32)
    found = []
    for row, box in zip(logits.reshape(-1, height, width), boxes, strict=True):
        upsampled = cv2.resize(row, (input_w, input_h), interpolation=cv2.INTER_LINEAR)
        mask = _inside(upsampled > 0, box).astype(np.uint8)
        contours = cv2.findContours(mask, cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_SIMPLE)[0]
        if contours:
            largest = contours[int(np.argmax([len(c) for c in contours]))]
            points = largest.reshape(-1, 2).astype(np.float32)
        else:
            points = np.zeros((0, 2), np.float32)
        found.append(to_source_points(points, geometry) if geometry is not None else points)
    return found


def _inside(mask: Array, box: Array) -> Array:
    """`mask` zeroed outside `box` (columns x1 <= c < x2, rows y1 <= r < y2)."""
    x1, y1, x2, y2 = (float(v) for v in box)
    columns = np.arange(mask.shape[1], dtype=np.float32)
    rows = np.arange(mask.shape[0], dtype=np.float32)
    keep: Array = mask & ((columns >= x1) & (columns < x2))[None, :]
    keep &= ((rows >= y1) & (rows < y2))[:, None]
    return keep
