#!/usr/bin/env python3
"""Dev-only: ``tests/fixtures/real/yolo26_end2end/``, a YOLO26 exported with its NMS-free head.

Not run by CI, never a runtime dependency. Needs Ultralytics besides the export stack (see
scripts/make_vision_models.py), and reads the test images of ``yolo/`` that it made::

    .venv-export/bin/python scripts/make_yolo_end2end.py [--out tests/fixtures/real]

Ultralytics' own ``yolo26.yaml`` at a narrow width (3 classes, random seeded weights, nothing
downloaded), exported by Ultralytics' exporter with ``nms=False``: the one-to-one head, whose
ONNX output ``[1, 300, 6]`` holds the final detections (``x1, y1, x2, y2, score, class``, best
first). ``reference.npz``: per image, the boxes, scores and classes of Ultralytics' own
pipeline (``LetterBox``, the torch model, ``non_max_suppression(..., end2end=True)``,
``scale_boxes``); ``reference.json``: the threshold, set halfway across the widest gap
between the scores of both images where 30 to 60 of the JPEG's detections pass, so the ONNX
and torch runs cannot fall on different sides of it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
from make_vision_models import (  # this script's folder
    IMGSZ,
    LABELS,
    MAX_DET,
    check_onnx,
    export_yolo,
    fixture_main,
    fresh_folder,
    letterboxed,
    test_sources,
    widest_gap,
    write_reference,
)

BOX_STD = 0.5  # the one-to-one head's last layers, sharpened (spread_head)
CLASS_STD = 100.0
PASSING = (30, 60)  # detections of the JPEG over the threshold
YOLO26_YAML = """\
nc: 3
end2end: True
reg_max: 1
scales:
  t: [0.33, 0.0625, 512]
backbone:
  - [-1, 1, Conv, [64, 3, 2]]
  - [-1, 1, Conv, [128, 3, 2]]
  - [-1, 2, C3k2, [256, False, 0.25]]
  - [-1, 1, Conv, [256, 3, 2]]
  - [-1, 2, C3k2, [512, False, 0.25]]
  - [-1, 1, Conv, [512, 3, 2]]
  - [-1, 2, C3k2, [512, True]]
  - [-1, 1, Conv, [1024, 3, 2]]
  - [-1, 2, C3k2, [1024, True]]
  - [-1, 1, SPPF, [1024, 5, 3, True]]
  - [-1, 2, C2PSA, [1024]]
head:
  - [-1, 1, nn.Upsample, [None, 2, "nearest"]]
  - [[-1, 6], 1, Concat, [1]]
  - [-1, 2, C3k2, [512, True]]
  - [-1, 1, nn.Upsample, [None, 2, "nearest"]]
  - [[-1, 4], 1, Concat, [1]]
  - [-1, 2, C3k2, [256, True]]
  - [-1, 1, Conv, [256, 3, 2]]
  - [[-1, 13], 1, Concat, [1]]
  - [-1, 2, C3k2, [512, True]]
  - [-1, 1, Conv, [512, 3, 2]]
  - [[-1, 10], 1, Concat, [1]]
  - [-1, 1, C3k2, [1024, True, 0.5, True]]
  - [[16, 19, 22], 1, Detect, [nc]]
"""


def spread_head(net: Any) -> None:
    """Random weights give every anchor nearly the same box and a tiny score: sharpen the
    one-to-one head's last layers (seeded) so boxes differ and scores spread over (0, 1)."""
    import torch

    detect = net.model[-1]
    with torch.no_grad():
        for module in net.modules():  # He-initialised convolutions: activations that live
            if isinstance(module, torch.nn.Conv2d):
                fan_in = module.weight[0].numel()
                module.weight.normal_(0.0, (2.0 / fan_in) ** 0.5)
        for conv in detect.one2one_cv2:  # box distances
            conv[-1].weight.normal_(0.0, BOX_STD)
        for conv in detect.one2one_cv3:  # class logits
            conv[-1].weight.normal_(0.0, CLASS_STD)
            conv[-1].bias.fill_(-2.0)


def make(out: Path) -> None:
    import torch
    from ultralytics.utils.nms import non_max_suppression
    from ultralytics.utils.ops import scale_boxes

    folder = fresh_folder(out, "yolo26_end2end")
    model = export_yolo(YOLO26_YAML, "yolo26t.yaml", spread_head, folder, nms=False)
    net = model.model.eval()  # type: ignore[union-attr]
    net.end2end = True
    raw: dict[str, np.ndarray[Any, Any]] = {}
    sources = test_sources(out)
    for kind, bgr in sources.items():
        with torch.no_grad():
            pred = net(torch.from_numpy(letterboxed(bgr)))
        raw[kind] = (pred[0] if isinstance(pred, (list, tuple)) else pred).numpy()
        if raw[kind].shape != (1, MAX_DET, 6):
            sys.exit(f"yolo26 {kind}: the torch model gave {raw[kind].shape}, not end-to-end")
    threshold, margin = widest_gap({k: v[0, :, 4] for k, v in raw.items()}, PASSING)
    if margin < 1e-4:
        sys.exit(f"yolo26: a score lies {margin:.2g} from the threshold; pick another seed")
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    for kind, pred in raw.items():
        rows = torch.from_numpy(pred)
        found = non_max_suppression(rows, threshold, max_det=MAX_DET, end2end=True)
        det = found[0]
        boxes = scale_boxes((IMGSZ, IMGSZ), det[:, :4].clone(), sources[kind].shape[:2])
        arrays[f"{kind}.boxes"] = boxes.numpy().astype(np.float32)
        arrays[f"{kind}.scores"] = det[:, 4].numpy().astype(np.float32)
        arrays[f"{kind}.classes"] = det[:, 5].numpy().astype(np.int64)
        print(f"yolo26 {kind}: {len(det)} detections over {threshold:.6g} (margin {margin:.2g})")
    check_onnx(folder / "model.onnx", raw, sources, "yolo26")
    write_reference(
        folder,
        arrays,
        {
            "imgsz": IMGSZ,
            "score_threshold": threshold,
            "max_detections": MAX_DET,
            "labels": list(LABELS),
            "export": "nms=False (the NMS-free one-to-one head), simplify=False, dynamic=False",
        },
    )


def main() -> None:
    fixture_main(make, __doc__)


if __name__ == "__main__":
    main()
