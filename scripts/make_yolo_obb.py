#!/usr/bin/env python3
"""Dev-only: ``tests/fixtures/real/yolo_obb/``, an Ultralytics YOLOv8 OBB model exported to ONNX.

Not run by CI, never a runtime dependency. Needs Ultralytics besides the export stack (see
scripts/make_vision_models.py), and reads the test images of ``yolo/`` that it made::

    .venv-export/bin/python scripts/make_yolo_obb.py [--out tests/fixtures/real]

Ultralytics' own ``yolov8-obb.yaml`` at the narrow width of the other fixtures (3 classes, one
angle, random seeded weights with the head sharpened, nothing downloaded), exported by
Ultralytics' exporter at 160 x 160: output ``[1, 4 + 3 + 1, 525]``. ``reference.npz``: per
image, the oriented boxes (``xywhr``), scores and classes of Ultralytics' own pipeline
(``LetterBox``, the torch model, ``non_max_suppression(rotated=True)``, and its OBB
predictor's ``scale_boxes(xywh=True)``); ``reference.json``: the threshold, halfway across the
widest gap between the scores of both images where 10 to 40 of the JPEG's pass.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
from make_vision_models import (  # this script's folder
    IMGSZ,
    IOU,
    LABELS,
    MAX_DET,
    YOLO_YAML,
    check_onnx,
    export_yolo,
    fixture_main,
    fresh_folder,
    nms_meta,
    raw_outputs,
    sized_boxes,
    spread_head,
    test_sources,
    widest_gap,
    write_reference,
)

PASSING = (10, 40)
OBB_YAML = YOLO_YAML.replace("Detect, [nc]]", "OBB, [nc, 1]]")
ANGLE_STD = 1.0  # the angle head's last layers: angles that differ from box to box


def spread_obb_head(net: Any) -> None:
    """The detection head sharpened as for the detector (`spread_head`) but its boxes sized
    by `sized_boxes`, and the angle head's last layers (seeded) so the boxes turn."""
    import torch

    spread_head(net)
    sized_boxes(net.model[-1], (4, 1, 4, 1))  # long boxes: their turn shows
    with torch.no_grad():
        for conv in net.model[-1].cv4:
            conv[-1].weight.normal_(0.0, ANGLE_STD)


def make(out: Path) -> None:
    import torch
    from ultralytics.utils.nms import non_max_suppression
    from ultralytics.utils.ops import scale_boxes

    folder = fresh_folder(out, "yolo_obb")
    model = export_yolo(OBB_YAML, "yolov8t-obb.yaml", spread_obb_head, folder)
    net = model.model.eval()  # type: ignore[union-attr]
    sources = test_sources(out)
    raw = raw_outputs(net, sources)
    scores = {k: v[0, 4 : 4 + len(LABELS), :].max(axis=0) for k, v in raw.items()}
    threshold, margin = widest_gap(scores, PASSING)
    if margin < 1e-4:
        sys.exit(f"yolo_obb: a score lies {margin:.2g} from the threshold; pick another seed")
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    for kind, pred in raw.items():
        det = non_max_suppression(
            torch.from_numpy(pred), threshold, IOU, max_det=MAX_DET, nc=len(LABELS), rotated=True
        )[0]
        rboxes = torch.cat([det[:, :4], det[:, -1:]], dim=-1)  # as the OBB predictor does
        rboxes[:, :4] = scale_boxes((IMGSZ, IMGSZ), rboxes[:, :4], sources[kind].shape, xywh=True)
        arrays[f"{kind}.boxes"] = rboxes.numpy().astype(np.float32)
        arrays[f"{kind}.scores"] = det[:, 4].numpy().astype(np.float32)
        arrays[f"{kind}.classes"] = det[:, 5].numpy().astype(np.int64)
        print(f"yolo_obb {kind}: {len(det)} boxes over {threshold:.6g} (margin {margin:.2g})")
    check_onnx(folder / "model.onnx", raw, sources, "yolo_obb")
    write_reference(folder, arrays, nms_meta(threshold))


def main() -> None:
    fixture_main(make, __doc__)


if __name__ == "__main__":
    main()
