#!/usr/bin/env python3
"""Dev-only: ``tests/fixtures/real/yolo_seg/``, an Ultralytics YOLOv8 segmentation model exported
to ONNX.

Not run by CI, never a runtime dependency. Needs Ultralytics besides the export stack (see
scripts/make_vision_models.py), and reads the test images of ``yolo/`` that it made::

    .venv-export/bin/python scripts/make_yolo_seg.py [--out tests/fixtures/real]

Ultralytics' own ``yolov8-seg.yaml`` at the narrow width of the other fixtures (3 classes,
32 prototypes, random seeded weights with the head sharpened, nothing downloaded), exported by
Ultralytics' exporter at 160 x 160: ``output0`` ``[1, 4 + 3 + 32, 525]`` and the prototypes
``output1`` ``[1, 32, 40, 40]``. ``reference.npz``: per image, the boxes, scores and classes of
Ultralytics' own pipeline (``LetterBox``, the torch model, ``non_max_suppression`` with the
coefficients carried, ``scale_boxes``), and each instance's outline from its
``process_mask(upsample=True)``, ``masks2segments(strategy="largest")`` and
``scale_coords`` (``N.outline`` for instance N); ``reference.json``: the threshold, halfway
across the widest gap between the scores of both images where 5 to 20 of the JPEG's pass.
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
    export_yolo,
    fixture_main,
    fresh_folder,
    letterboxed,
    nms_meta,
    sized_boxes,
    spread_head,
    test_sources,
    widest_gap,
    write_reference,
)

PASSING = (5, 20)
COEFFICIENT_STD, COEFFICIENT_BIAS = 1.0, 0.5
BOX_PEAK = 3  # each box side's distribution peaks at 3 strides: boxes of tens of pixels
SEG_YAML = YOLO_YAML.replace("Detect, [nc]]", "Segment, [nc, 32, 64]]")


def spread_segment_head(net: Any) -> None:
    """The detection head sharpened as for the detector (`spread_head`) but its box
    distributions set by their biases alone (the features would make every box a pixel
    wide), and the mask coefficients' last layers (seeded) so masks fill part of their box."""
    import torch

    spread_head(net)
    with torch.no_grad():
        head = net.model[-1]
        sized_boxes(head, (BOX_PEAK,) * 4)
        for conv in head.cv4:
            conv[-1].weight.normal_(0.0, COEFFICIENT_STD)
            conv[-1].bias.fill_(COEFFICIENT_BIAS)


def make(out: Path) -> None:
    import torch
    from ultralytics.utils.nms import non_max_suppression
    from ultralytics.utils.ops import masks2segments, process_mask, scale_boxes, scale_coords

    folder = fresh_folder(out, "yolo_seg")
    model = export_yolo(SEG_YAML, "yolov8t-seg.yaml", spread_segment_head, folder)
    net = model.model.eval()  # type: ignore[union-attr]
    sources = test_sources(out)
    raw: dict[str, tuple[Any, Any]] = {}
    for kind, bgr in sources.items():
        with torch.no_grad():  # in eval: ((detections, prototypes), the training outputs)
            detections, prototypes = net(torch.from_numpy(letterboxed(bgr)))[0]
        raw[kind] = (detections, prototypes)
    scores = {k: v[0][0, 4 : 4 + len(LABELS), :].max(dim=0).values.numpy() for k, v in raw.items()}
    threshold, margin = widest_gap(scores, PASSING)
    if margin < 1e-4:
        sys.exit(f"yolo_seg: a score lies {margin:.2g} from the threshold; pick another seed")
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    for kind, (pred, prototypes) in raw.items():
        det = non_max_suppression(pred, threshold, IOU, max_det=MAX_DET, nc=len(LABELS))[0]
        shape = sources[kind].shape[:2]
        masks = process_mask(prototypes[0], det[:, 6:], det[:, :4], (IMGSZ, IMGSZ), upsample=True)
        outlines = masks2segments(masks, strategy="largest")
        for n, outline in enumerate(outlines):
            scaled = scale_coords((IMGSZ, IMGSZ), torch.from_numpy(outline), shape)
            arrays[f"{kind}.{n}.outline"] = scaled.numpy().astype(np.float32)
        boxes = scale_boxes((IMGSZ, IMGSZ), det[:, :4].clone(), shape)
        arrays[f"{kind}.boxes"] = boxes.numpy().astype(np.float32)
        arrays[f"{kind}.scores"] = det[:, 4].numpy().astype(np.float32)
        arrays[f"{kind}.classes"] = det[:, 5].numpy().astype(np.int64)
        print(f"yolo_seg {kind}: {len(det)} instances over {threshold:.6g} (margin {margin:.2g})")
    check_outputs(folder / "model.onnx", raw, sources)
    write_reference(folder, arrays, nms_meta(threshold))


def check_outputs(
    path: Path, raw: dict[str, tuple[Any, Any]], sources: dict[str, np.ndarray[Any, Any]]
) -> None:
    """The export gives the torch model's detections and prototypes (to float tolerance)."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    for kind, bgr in sources.items():
        got = session.run(None, {name: letterboxed(bgr)})
        for mine, theirs in zip(got, raw[kind], strict=True):
            error = float(np.max(np.abs(mine - theirs.numpy())))
            if error > 1e-3:
                sys.exit(f"yolo_seg {kind}: onnxruntime differs from torch by {error}")


def main() -> None:
    fixture_main(make, __doc__)


if __name__ == "__main__":
    main()
