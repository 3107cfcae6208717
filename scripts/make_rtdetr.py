#!/usr/bin/env python3
"""Dev-only: ``tests/fixtures/real/rtdetr/``, an Ultralytics RT-DETR exported to ONNX.

Not run by CI, never a runtime dependency. Needs Ultralytics besides the export stack (see
scripts/make_vision_models.py), and reads the test images of ``yolo/`` that it made::

    .venv-export/bin/python scripts/make_rtdetr.py [--out tests/fixtures/real]

A small RT-DETR built from a yaml of Ultralytics' own modules (a strided convolution backbone
and Ultralytics' ``RTDETRDecoder``: 32 hidden, 50 queries, one decoder layer; 3 classes,
random seeded weights with its box and score heads sharpened, nothing downloaded), exported by
Ultralytics' exporter at 160 x 160. Its ONNX output ``[1, 50, 6]`` holds the final detections:
``cx, cy, w, h`` in fractions of the input, the score and the class, best first.
``reference.npz``: per image, the boxes, scores and classes of Ultralytics' own predictor
(``model.predict``: its stretching resize, the torch model, the predictor's postprocess);
``reference.json``: the threshold, halfway across the widest gap between the scores of both
images where 10 to 30 of the JPEG's pass.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from make_vision_models import (  # this script's folder
    IMGSZ,
    LABELS,
    fixture_main,
    test_sources,
    widest_gap,
    write_reference,
)

PASSING = (10, 30)
RTDETR_YAML = """\
nc: 3
scales:
  t: [1.0, 1.0, 1024]
backbone:
  - [-1, 1, Conv, [16, 3, 2]]
  - [-1, 1, Conv, [32, 3, 2]]
  - [-1, 1, Conv, [32, 3, 2]]
  - [-1, 1, Conv, [64, 3, 2]]
  - [-1, 1, Conv, [64, 3, 2]]
head:
  - [[2, 3, 4], 1, RTDETRDecoder, [nc, 32, 50, 2, 2, 1, 64]]
"""


def spread_heads(net: Any) -> None:
    """Random weights give every query nearly the same box and score: sharpen the decoder's
    last box and score layers (seeded) so boxes differ in place and size, scores in order."""
    import torch

    decoder = net.model[-1]
    with torch.no_grad():
        for mlp in decoder.dec_bbox_head:
            mlp.layers[-1].weight.normal_(0.0, 0.5)
        for linear in decoder.dec_score_head:
            linear.weight.normal_(0.0, 0.4)


def make(out: Path) -> None:
    import torch
    from ultralytics import RTDETR

    folder = out / "rtdetr"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        yaml_path = Path(tmp) / "rtdetr-t.yaml"
        yaml_path.write_text(RTDETR_YAML)
        model = RTDETR(str(yaml_path))
        model.model.names = dict(enumerate(LABELS))  # type: ignore[union-attr]
        spread_heads(model.model)
        here = Path.cwd()
        os.chdir(tmp)  # the exporter writes beside the working directory
        try:
            exported = model.export(format="onnx", imgsz=IMGSZ, simplify=False, dynamic=False)
        finally:
            os.chdir(here)
        shutil.copyfile(Path(tmp) / exported, folder / "model.onnx")
    (folder / "labels.txt").write_text("\n".join(LABELS) + "\n")
    sources = test_sources(out)
    everything = {kind: _predicted(model, bgr, 0.0) for kind, bgr in sources.items()}
    threshold, margin = widest_gap({k: v[1] for k, v in everything.items()}, PASSING)
    if margin < 1e-4:
        sys.exit(f"rtdetr: a score lies {margin:.2g} from the threshold; pick another seed")
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    for kind, bgr in sources.items():
        boxes, scores, classes = _predicted(model, bgr, threshold)
        arrays[f"{kind}.boxes"], arrays[f"{kind}.scores"] = boxes, scores
        arrays[f"{kind}.classes"] = classes
        print(f"rtdetr {kind}: {len(boxes)} detections over {threshold:.6g} (margin {margin:.2g})")
    write_reference(
        folder,
        arrays,
        {
            "imgsz": IMGSZ,
            "score_threshold": threshold,
            "labels": list(LABELS),
            "export": "simplify=False, dynamic=False",
        },
    )


def _predicted(model: Any, bgr: np.ndarray[Any, Any], conf: float) -> tuple[Any, Any, Any]:
    """Ultralytics' own predictor on a BGR image: (boxes xyxy, scores, classes)."""
    found = model.predict(bgr, imgsz=IMGSZ, conf=conf, max_det=300, verbose=False)[0].boxes
    return (
        found.xyxy.numpy().astype(np.float32),
        found.conf.numpy().astype(np.float32),
        found.cls.numpy().astype(np.int64),
    )


def main() -> None:
    fixture_main(make, __doc__)


if __name__ == "__main__":
    main()
