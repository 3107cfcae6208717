#!/usr/bin/env python3
"""Dev-only: the vision fixtures of ``tests/fixtures/real/`` (a YOLO detector, a classifier).

Not run by CI, never a runtime dependency. Needs the export stack plus Ultralytics::

    .venv-export/bin/pip install ultralytics
    .venv-export/bin/python scripts/make_vision_models.py [--out tests/fixtures/real]

- ``yolo/``: Ultralytics' own ``yolov8.yaml`` at a narrow width (3 classes, random seeded
  weights, nothing downloaded), exported by Ultralytics' exporter to ONNX at 160x160
  (output ``[1, 4 + 3, 525]``); a 240x320 JPEG and PNG; ``reference.npz``: per image, the
  boxes, scores and classes of Ultralytics' own pipeline (``LetterBox``, the torch model,
  ``non_max_suppression``, ``scale_boxes``); ``reference.json``: the thresholds used.
- ``classifier/``: a small torch CNN (10 classes) exported with ``torch.onnx``, its
  ``labels.txt``, and ``reference.npz``: ``torch.topk`` of its softmax on the same images,
  resized to 32x32 by OpenCV as ``[preprocess]`` does.

Random weights score every box low; the score threshold is set between two consecutive
scores of the reference image's candidates (about 40 pass), far from both, so the ONNX and
torch runs cannot fall on different sides of it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cv2
import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "tests" / "fixtures" / "real"
MAX_FIXTURE_BYTES = 3 * 1024 * 1024
IMGSZ = 160
IOU = 0.5
BOX_STD = 3.0  # the head's last layers, sharpened (spread_head)
CLASS_STD = 20.0
MAX_DET = 300
LABELS = ("person", "bicycle", "car")
CLASSIFIER_LABELS = tuple(f"label_{i}" for i in range(10))
YOLO_YAML = """\
nc: 3
scales:
  t: [0.33, 0.0625, 512]
backbone:
  - [-1, 1, Conv, [64, 3, 2]]
  - [-1, 1, Conv, [128, 3, 2]]
  - [-1, 3, C2f, [128, True]]
  - [-1, 1, Conv, [256, 3, 2]]
  - [-1, 6, C2f, [256, True]]
  - [-1, 1, Conv, [512, 3, 2]]
  - [-1, 6, C2f, [512, True]]
  - [-1, 1, Conv, [1024, 3, 2]]
  - [-1, 3, C2f, [1024, True]]
  - [-1, 1, SPPF, [1024, 5]]
head:
  - [-1, 1, nn.Upsample, [None, 2, "nearest"]]
  - [[-1, 6], 1, Concat, [1]]
  - [-1, 3, C2f, [512]]
  - [-1, 1, nn.Upsample, [None, 2, "nearest"]]
  - [[-1, 4], 1, Concat, [1]]
  - [-1, 3, C2f, [256]]
  - [-1, 1, Conv, [256, 3, 2]]
  - [[-1, 12], 1, Concat, [1]]
  - [-1, 3, C2f, [512]]
  - [-1, 1, Conv, [512, 3, 2]]
  - [[-1, 9], 1, Concat, [1]]
  - [-1, 3, C2f, [1024]]
  - [[15, 18, 21], 1, Detect, [nc]]
"""


def test_images(folder: Path) -> dict[str, Path]:
    """A seeded 240x320 picture (shapes on a gradient with noise) as JPEG and PNG."""
    rng = np.random.default_rng(7)
    y, x = np.mgrid[0:240, 0:320]
    image = np.stack([x * 255 // 320, y * 255 // 240, (x + y) * 255 // 560], axis=2)
    image = image.astype(np.uint8)
    cv2.rectangle(image, (40, 50), (150, 200), (20, 200, 40), -1)
    cv2.circle(image, (240, 110), 55, (200, 30, 30), -1)
    noise = rng.integers(0, 24, size=image.shape, dtype=np.uint8)
    image = cv2.add(image, noise)
    paths = {"jpeg": folder / "image.jpg", "png": folder / "image.png"}
    cv2.imwrite(str(paths["jpeg"]), image, [cv2.IMWRITE_JPEG_QUALITY, 90])
    cv2.imwrite(str(paths["png"]), image)
    return paths


def make_yolo(out: Path) -> None:
    import torch
    from ultralytics.utils.nms import non_max_suppression
    from ultralytics.utils.ops import scale_boxes

    folder = fresh_folder(out, "yolo")
    model = export_yolo(YOLO_YAML, "yolov8t.yaml", spread_head, folder)
    images = test_images(folder)
    net = model.model.eval()  # type: ignore[union-attr]
    raw: dict[str, np.ndarray[Any, Any]] = {}
    sources: dict[str, np.ndarray[Any, Any]] = {}
    for kind, path in images.items():
        bgr = cv2.imread(str(path))
        sources[kind] = bgr
        with torch.no_grad():
            pred = net(torch.from_numpy(letterboxed(bgr)))
        raw[kind] = (pred[0] if isinstance(pred, (list, tuple)) else pred).numpy()
    threshold = score_threshold(raw["jpeg"], passing=60)
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    for kind, pred in raw.items():
        det = non_max_suppression(torch.from_numpy(pred), threshold, IOU, max_det=MAX_DET)[0]
        boxes = scale_boxes((IMGSZ, IMGSZ), det[:, :4].clone(), sources[kind].shape[:2])
        arrays[f"{kind}.boxes"] = boxes.numpy().astype(np.float32)
        arrays[f"{kind}.scores"] = det[:, 4].numpy().astype(np.float32)
        arrays[f"{kind}.classes"] = det[:, 5].numpy().astype(np.int64)
        arrays[f"{kind}.raw"] = pred.astype(np.float32)
        print(f"yolo {kind}: {len(det)} detections over {threshold:.6g}")
    check_onnx(folder / "model.onnx", raw, sources)
    write_reference(folder, arrays, nms_meta(threshold))


def export_yolo(
    yaml_text: str,
    yaml_name: str,
    spread: Callable[[Any], None],
    folder: Path,
    labels: tuple[str, ...] = LABELS,
    **export: Any,
) -> Any:
    """Ultralytics' model of `yaml_text` (the file name tells Ultralytics its scale), seeded,
    `labels` as its names, its head sharpened by `spread`, exported by Ultralytics' exporter to
    ONNX at `IMGSZ` (`export`: more of its arguments) as `folder/model.onnx`, with
    `labels.txt`; the YOLO object."""
    import torch
    from ultralytics import YOLO

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        yaml_path = Path(tmp) / yaml_name
        yaml_path.write_text(yaml_text)
        model = YOLO(str(yaml_path))
        model.model.names = dict(enumerate(labels))  # type: ignore[union-attr]
        spread(model.model)
        here = Path.cwd()
        os.chdir(tmp)  # the exporter writes beside the working directory
        try:
            exported = model.export(
                format="onnx", imgsz=IMGSZ, simplify=False, dynamic=False, **export
            )
        finally:
            os.chdir(here)
        shutil.copyfile(Path(tmp) / exported, folder / "model.onnx")
    (folder / "labels.txt").write_text("\n".join(labels) + "\n")
    return model


def letterboxed(bgr: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Ultralytics' own preprocessing of a BGR image: letterbox, RGB, CHW, [0, 1]."""
    from ultralytics.data.augment import LetterBox

    boxed = LetterBox(new_shape=(IMGSZ, IMGSZ), auto=False)(image=bgr)
    x = np.ascontiguousarray(boxed[..., ::-1].transpose(2, 0, 1))[None] / np.float32(255)
    return x.astype(np.float32)


def spread_head(net: Any) -> None:
    """Random weights give every anchor nearly the same box and a tiny score: sharpen the
    head's last layers (seeded) so boxes differ in size and scores spread over (0, 1)."""
    import torch

    detect = net.model[-1]
    with torch.no_grad():
        for module in net.modules():  # He-initialised convolutions: activations that live
            if isinstance(module, torch.nn.Conv2d):
                fan_in = module.weight[0].numel()
                module.weight.normal_(0.0, (2.0 / fan_in) ** 0.5)
        for conv in detect.cv2:  # box distributions (DFL logits)
            conv[-1].weight.normal_(0.0, BOX_STD)
        for conv in detect.cv3:  # class logits
            conv[-1].weight.normal_(0.0, CLASS_STD)
            conv[-1].bias.fill_(-2.0)


def score_threshold(pred: np.ndarray[Any, Any], passing: int) -> float:
    """Halfway between the `passing`-th and the next best box score."""
    best = np.sort(pred[0, 4:, :].max(axis=0))[::-1]
    return float((best[passing - 1] + best[passing]) / 2)


def sized_boxes(head: Any, peaks: tuple[int, int, int, int] = (3, 3, 3, 3)) -> None:
    """A head's boxes set by biases alone, each side's distribution (left, top, right,
    bottom) peaking at its `peaks` strides (boxes of tens of pixels), and its DFL's weights
    restored (`spread_head` draws every convolution, the DFL's fixed one too, which can make
    sizes negative)."""
    import torch

    with torch.no_grad():
        bins = torch.arange(head.reg_max, dtype=torch.float32)
        head.dfl.conv.weight.copy_(bins.view(1, -1, 1, 1))
        sides = torch.cat([-((bins - peak) ** 2) / 2 for peak in peaks])
        for conv in head.cv2:
            conv[-1].weight.zero_()
            conv[-1].bias.copy_(sides)


def test_sources(out: Path) -> dict[str, np.ndarray[Any, Any]]:
    """The test images of `out/yolo/` (made by `make_yolo`), as BGR arrays by kind."""
    paths = {"jpeg": out / "yolo" / "image.jpg", "png": out / "yolo" / "image.png"}
    return {kind: cv2.imread(str(path)) for kind, path in paths.items()}


def fresh_folder(out: Path, name: str) -> Path:
    """`out/name`, emptied."""
    folder = out / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


def raw_outputs(net: Any, sources: dict[str, np.ndarray[Any, Any]]) -> dict[str, Any]:
    """The torch model's first output for each letterboxed image, as numpy, by kind."""
    import torch

    raw: dict[str, Any] = {}
    for kind, bgr in sources.items():
        with torch.no_grad():
            pred = net(torch.from_numpy(letterboxed(bgr)))
        raw[kind] = (pred[0] if isinstance(pred, (list, tuple)) else pred).numpy()
    return raw


def nms_meta(threshold: float, labels: tuple[str, ...] = LABELS, **more: Any) -> dict[str, Any]:
    """A fixture's reference.json fields for the agent's NMS layouts: the input size, the
    thresholds, the detection cap, `more`, the labels."""
    return {
        "imgsz": IMGSZ,
        "score_threshold": threshold,
        "iou_threshold": IOU,
        "max_detections": MAX_DET,
        **more,
        "labels": list(labels),
    }


def write_reference(folder: Path, arrays: dict[str, Any], meta: dict[str, Any]) -> None:
    """`reference.npz` of `arrays` and `reference.json` of `meta` with the versions that
    made them."""
    import torch

    np.savez_compressed(folder / "reference.npz", **arrays)
    meta = {
        **meta,
        "ultralytics": __import__("ultralytics").__version__,
        "torch": torch.__version__,
    }
    (folder / "reference.json").write_text(json.dumps(meta, indent=2) + "\n")


def fixture_main(make: Callable[[Path], None], doc: str | None) -> None:
    """A fixture script's entry point: `--out` (the fixtures' root), offline Ultralytics."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0] if doc else None)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    os.environ.setdefault("YOLO_OFFLINE", "1")
    make(parser.parse_args().out)


def widest_gap(
    scores: dict[str, np.ndarray[Any, Any]], passing: tuple[int, int]
) -> tuple[float, float]:
    """(threshold, its distance to the nearest score of any image) for detectors whose scores
    crowd together: halfway across the widest gap between the scores of all the images where
    `passing` (low, high) of the JPEG's pass."""
    every = np.unique(np.concatenate([v.ravel() for v in scores.values()]))[::-1]
    best = (0.0, 0.0)
    for high, low in itertools.pairwise(every):
        middle = float((high + low) / 2)
        count = int(np.sum(scores["jpeg"] > middle))
        if passing[0] <= count <= passing[1] and high - low > 2 * best[1]:
            best = (middle, float(high - low) / 2)
    return best


def check_onnx(
    path: Path,
    raw: dict[str, np.ndarray[Any, Any]],
    sources: dict[str, np.ndarray[Any, Any]],
    what: str = "yolo",
) -> None:
    """The exported model gives the torch model's output (to float tolerance)."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    for kind, bgr in sources.items():
        got = session.run(None, {name: letterboxed(bgr)})[0]
        error = float(np.max(np.abs(got - raw[kind])))
        if error > 1e-3:
            sys.exit(f"{what} {kind}: onnxruntime differs from torch by {error}")


def make_classifier(out: Path) -> None:
    import torch
    from torch import nn

    folder = fresh_folder(out, "classifier")
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, len(CLASSIFIER_LABELS)),
    ).eval()
    x0 = torch.zeros(1, 3, 32, 32)
    torch.onnx.export(
        net,
        (x0,),
        str(folder / "model.onnx"),
        input_names=["image"],
        output_names=["logits"],
        opset_version=17,
        dynamo=False,
    )
    (folder / "labels.txt").write_text("\n".join(CLASSIFIER_LABELS) + "\n")
    images = test_images(folder)
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    for kind, path in images.items():
        bgr = cv2.imread(str(path))
        small = cv2.resize(bgr, (32, 32), interpolation=cv2.INTER_LINEAR)
        x = np.ascontiguousarray(small[..., ::-1].transpose(2, 0, 1))[None] / np.float32(255)
        with torch.no_grad():
            probs = torch.softmax(net(torch.from_numpy(x.astype(np.float32))), dim=-1)
        values, indices = torch.topk(probs, 3, dim=-1)
        arrays[f"{kind}.values"] = values.numpy()
        arrays[f"{kind}.indices"] = indices.numpy().astype(np.int64)
    np.savez_compressed(folder / "reference.npz", **arrays)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    os.environ.setdefault("YOLO_OFFLINE", "1")
    make_yolo(args.out)
    make_classifier(args.out)
    for folder in ("yolo", "classifier"):
        for path in sorted((args.out / folder).iterdir()):
            size = path.stat().st_size
            if size > MAX_FIXTURE_BYTES:
                sys.exit(f"{path}: {size} bytes, over {MAX_FIXTURE_BYTES}")
            print(f"{path.relative_to(args.out)}: {size} bytes")


if __name__ == "__main__":
    main()
