#!/usr/bin/env python3
"""Dev-only: ``tests/fixtures/real/yolo_pose/``, an Ultralytics YOLOv8 pose model exported to ONNX.

Not run by CI, never a runtime dependency. Needs Ultralytics besides the export stack (see
scripts/make_vision_models.py), and reads the test images of ``yolo/`` that it made::

    .venv-export/bin/python scripts/make_yolo_pose.py [--out tests/fixtures/real]

Ultralytics' own ``yolov8-pose.yaml`` at a narrow width (one class, 17 keypoints of x, y and
visibility, random seeded weights with the head sharpened, nothing downloaded), exported by
Ultralytics' exporter at 160 x 160: output ``[1, 4 + 1 + 51, 525]``. ``reference.npz``: per
image, the boxes, scores, classes and keypoints of Ultralytics' own pipeline (``LetterBox``,
the torch model, ``non_max_suppression`` with the keypoints carried, ``scale_boxes`` and
``scale_coords``); ``reference.json``: the threshold, halfway across the widest gap between
the scores of both images where 10 to 40 of the JPEG's pass.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
from make_vision_models import (  # this script's folder
    IMGSZ,
    IOU,
    MAX_DET,
    YOLO_YAML,
    check_onnx,
    export_yolo,
    fixture_main,
    fresh_folder,
    nms_meta,
    raw_outputs,
    spread_head,
    test_sources,
    widest_gap,
    write_reference,
)

KPT_SHAPE = (17, 3)
PASSING = (10, 40)
POSE_YAML = YOLO_YAML.replace("nc: 3\n", f"nc: 1\nkpt_shape: {list(KPT_SHAPE)}\n").replace(
    "Detect, [nc]]", "Pose, [nc, kpt_shape]]"
)
LABELS = ("person",)


def make(out: Path) -> None:
    import torch
    from ultralytics.utils.nms import non_max_suppression
    from ultralytics.utils.ops import scale_boxes, scale_coords

    folder = fresh_folder(out, "yolo_pose")
    model = export_yolo(POSE_YAML, "yolov8t-pose.yaml", spread_head, folder, LABELS)
    net = model.model.eval()  # type: ignore[union-attr]
    sources = test_sources(out)
    raw = raw_outputs(net, sources)
    threshold, margin = widest_gap({k: v[0, 4, :] for k, v in raw.items()}, PASSING)
    if margin < 1e-4:
        sys.exit(f"yolo_pose: a score lies {margin:.2g} from the threshold; pick another seed")
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    for kind, pred in raw.items():
        found = non_max_suppression(torch.from_numpy(pred), threshold, IOU, max_det=MAX_DET, nc=1)
        det = found[0]
        shape = sources[kind].shape[:2]
        boxes = scale_boxes((IMGSZ, IMGSZ), det[:, :4].clone(), shape)
        points = det[:, 6:].reshape(len(det), *KPT_SHAPE)
        points = scale_coords((IMGSZ, IMGSZ), points.clone(), shape)
        arrays[f"{kind}.boxes"] = boxes.numpy().astype(np.float32)
        arrays[f"{kind}.scores"] = det[:, 4].numpy().astype(np.float32)
        arrays[f"{kind}.classes"] = det[:, 5].numpy().astype(np.int64)
        arrays[f"{kind}.keypoints"] = points.numpy().astype(np.float32)
        print(f"yolo_pose {kind}: {len(det)} people over {threshold:.6g} (margin {margin:.2g})")
    check_onnx(folder / "model.onnx", raw, sources, "yolo_pose")
    write_reference(folder, arrays, nms_meta(threshold, LABELS, keypoints=list(KPT_SHAPE)))


def main() -> None:
    fixture_main(make, __doc__)


if __name__ == "__main__":
    main()
