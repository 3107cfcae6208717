#!/usr/bin/env python3
"""Dev-only: ``tests/fixtures/real/paddle_det/``, ``paddle_rec/`` and ``paddle_db/``: PaddlePaddle
text detectors and a recogniser converted by Paddle2ONNX, the first two in the layout of
``scripts/make_real_models.py`` (whose writer they use).

Not run by CI, never a runtime dependency. Paddle2ONNX pins an older onnx than the rest of the
export stack, so it gets a scratch virtualenv of its own::

    python3 -m venv .venv-paddle
    .venv-paddle/bin/pip install paddlepaddle==3.3.1 paddle2onnx==2.1.0 onnxruntime==1.32.0
    .venv-paddle/bin/pip install --no-deps paddlex==3.7.2   # its CTC decoder, the reference
    .venv-paddle/bin/pip install colorlog requests chardet ruamel.yaml pyyaml filelock \
        pydantic huggingface_hub modelscope aistudio_sdk pandas   # what importing it needs
    .venv-paddle/bin/pip install opencv-contrib-python pyclipper shapely   # its OCR ops need
    .venv-paddle/bin/python scripts/make_paddle_models.py [--out tests/fixtures/real]

The model is a small DBNet-style detector as PaddleOCR's det models are built (convolutions
with batch norm down to a quarter, transposed convolutions back up, a sigmoid probability
map), seeded, with non-trivial batch-norm statistics, saved by ``paddle.jit.save`` with a
dynamic batch, height and width (``InputSpec([None, 3, None, None])``), and converted by
``paddle2onnx.export`` at opset 14: its input is ``x``, its output Paddle's ``fetch_name_0``,
its dynamic dims named ``DynamicDimension.N``. The reference is Paddle's own output for a
seeded input.

The recogniser is a small CRNN as PaddleOCR's rec models end (convolutions down the height,
the height averaged away, a linear layer and a softmax over the blank, 36 characters and a
space at each step of the width), converted the same way with a dynamic batch and width. Its
``ctc.json`` holds PaddleX's own ``CTCLabelDecode`` (what PaddleOCR decodes with) of Paddle's
output: the texts and scores the agent's ``ctc`` op must give with ``keys.txt``. Beside it,
two drawn text-line crops (``line.png``, ``long_line.png``) and ``lines.json``: what PaddleX's
recogniser pipeline makes of each (its ``OCRReisizeNormImg`` resize and padding, the model,
``CTCLabelDecode``; the model's probabilities in ``lines.npz``), for the agent's
``resize_mode = "fit_height"`` (``--lines-only`` remakes just these: floats of the other
fixtures differ in their last digits from one CPU to another).

``paddle_db/`` is for the agent's ``db`` op: a detector whose map is a smoothed ink density
(set weights, not random: text regions a random network would not find), converted the same
way, a drawn page (``page.png``: three bars of "text", one slanted, and a speck), and in
``db.json`` the preprocessing, the thresholds, and the boxes and scores of PaddleX's own
``DBPostProcess`` (what PaddleOCR runs) on Paddle's map of that page.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from make_real_models import DEFAULT_OUT, Fixture, verify, write  # this script's folder


def build() -> Any:
    import paddle
    from paddle import nn

    class Detector(nn.Layer):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2D(3, 8, 3, stride=2, padding=1)
            self.bn1 = nn.BatchNorm2D(8)
            self.conv2 = nn.Conv2D(8, 16, 3, stride=2, padding=1)
            self.bn2 = nn.BatchNorm2D(16)
            self.up1 = nn.Conv2DTranspose(16, 8, 2, stride=2)
            self.bn3 = nn.BatchNorm2D(8)
            self.up2 = nn.Conv2DTranspose(8, 1, 2, stride=2)

        def forward(self, x: Any) -> Any:
            y = nn.functional.relu(self.bn1(self.conv1(x)))
            y = nn.functional.relu(self.bn2(self.conv2(y)))
            y = nn.functional.relu(self.bn3(self.up1(y)))
            return nn.functional.sigmoid(self.up2(y))

    paddle.seed(0)
    model = Detector()
    for norm in (model.bn1, model.bn2, model.bn3):  # statistics as training leaves them
        size = norm.weight.shape[0]
        norm._mean.set_value(paddle.uniform([size], min=-0.5, max=0.5))
        norm._variance.set_value(paddle.uniform([size], min=0.5, max=2.0))
    model.eval()
    return model


def converted(model: Any, shape: list[int | None]) -> bytes:
    """`model` saved by `paddle.jit.save` with input `x` of `shape` (None: dynamic) and
    converted by `paddle2onnx.export` at opset 14: the ONNX file's bytes."""
    import paddle
    import paddle2onnx

    spec = [paddle.static.InputSpec(shape, "float32", name="x")]
    with tempfile.TemporaryDirectory(prefix="paddle-export-") as tmp:
        prefix = str(Path(tmp) / "inference")
        paddle.jit.save(model, prefix, input_spec=spec)
        onnx_file = Path(tmp) / "model.onnx"
        paddle2onnx.export(
            f"{prefix}.json", f"{prefix}.pdiparams", str(onnx_file), opset_version=14
        )
        return onnx_file.read_bytes()


def make_paddle_det() -> Fixture:
    import paddle

    model = build()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 3, 32, 48)).astype(np.float32)  # a normalised image
    want = model(paddle.to_tensor(x)).numpy()
    data = converted(model, [None, 3, None, None])
    return paddle_fixture(
        "paddle_det",
        "paddle-det-dbnet",
        data,
        x,
        want,
        "DBNet-style detector built in Paddle, saved by paddle.jit.save with a dynamic "
        "batch, height and width, converted by Paddle2ONNX; the reference is Paddle's output.",
    )


def paddle_fixture(name: str, family: str, data: bytes, x: Any, want: Any, notes: str) -> Fixture:
    """A Paddle2ONNX fixture of input `x` and output `want` (Paddle's), as the writer of
    make_real_models takes it."""
    return Fixture(
        name=name,
        model=data,
        inputs={"x": x},
        outputs={"fetch_name_0": want},
        family=family,
        exporter={"name": "paddle2onnx.export (opset 14)", "version": _version("paddle2onnx")},
        framework={"name": "paddlepaddle", "version": _version("paddlepaddle")},
        tolerance={"rtol": 1e-4, "atol": 1e-5},
        notes=notes,
    )


CHARACTERS = "0123456789abcdefghijklmnopqrstuvwxyz"
BLANK_BIAS, SPACE_BIAS = 6.0, 5.0
WEIGHT_STD = 0.5


def build_recognizer() -> Any:
    import paddle
    from paddle import nn

    class Recognizer(nn.Layer):  # type: ignore[misc]
        def __init__(self, classes: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2D(3, 16, 3, stride=2, padding=1)
            self.bn1 = nn.BatchNorm2D(16)
            self.conv2 = nn.Conv2D(16, 32, 3, stride=(2, 1), padding=1)
            self.bn2 = nn.BatchNorm2D(32)
            self.fc = nn.Linear(32, classes)

        def forward(self, x: Any) -> Any:
            y = nn.functional.relu(self.bn1(self.conv1(x)))
            y = nn.functional.relu(self.bn2(self.conv2(y)))
            y = paddle.transpose(y.mean(axis=2), [0, 2, 1])  # [batch, width, channels]
            return nn.functional.softmax(self.fc(y), axis=2)

    paddle.seed(1)
    model = Recognizer(len(CHARACTERS) + 2)  # the blank, the characters, the space
    with paddle.no_grad():  # steps that differ, some blank and some space (biased up)
        model.fc.weight.set_value(paddle.normal(0.0, WEIGHT_STD, model.fc.weight.shape))
        bias = np.zeros(len(CHARACTERS) + 2, np.float32)
        bias[[0, -1]] = BLANK_BIAS, SPACE_BIAS
        model.fc.bias.set_value(paddle.to_tensor(bias))
    model.eval()
    return model


def make_paddle_rec(out: Path) -> Fixture:
    import paddle
    from paddlex.inference.models.text_recognition.processors import CTCLabelDecode

    model = build_recognizer()
    rng = np.random.default_rng(1)
    width = np.arange(80)  # two "text crops": waves along the width (so steps differ), noise
    waves = np.stack([np.sin(width / 3.0), np.cos(width / 5.0), np.sin(width / 7.0 + 1)])
    signs = np.array([1.0, -1.0])[:, None, None, None]
    x = rng.standard_normal((2, 3, 32, 80)) * 0.5 + 2 * waves[None, :, None, :] * signs
    x = x.astype(np.float32)
    want = model(paddle.to_tensor(x)).numpy()
    data = converted(model, [None, 3, 32, None])
    texts, scores = CTCLabelDecode(list(CHARACTERS), use_space_char=True)([want])
    folder = out / "paddle_rec"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "keys.txt").write_text("\n".join(CHARACTERS) + "\n")
    decoded = {
        "labels": "keys.txt",
        "space": True,
        "texts": texts,
        "scores": scores,
        "decoder": f"paddlex {_version('paddlex')} CTCLabelDecode(use_space_char=True)",
    }
    (folder / "ctc.json").write_text(json.dumps(decoded, indent=2, ensure_ascii=False) + "\n")
    print(f"  paddle_rec: {texts} {scores}")
    return paddle_fixture(
        "paddle_rec",
        "paddle-rec-crnn",
        data,
        x,
        want,
        "CRNN-style CTC recogniser built in Paddle (blank, 36 characters, space), saved "
        "by paddle.jit.save with a dynamic batch and width, converted by Paddle2ONNX; the "
        "reference is Paddle's output, ctc.json PaddleX's decoding of it.",
    )


REC_SHAPE = [3, 32, 320]  # the recogniser's rec_image_shape: 32 rows, at least 320 wide
LINES = {"line.png": ("edge 42", (26, 120)), "long_line.png": ("stream 2026 box 7 mqtt", (20, 420))}


def draw_line(path: Path, text: str, size: tuple[int, int]) -> None:
    """A text-line crop of `size` (h, w) as a detector's box cuts one: dark text, light paper."""
    import cv2

    height, width = size
    crop = np.full((height, width, 3), 235, np.uint8)
    crop = cv2.add(crop, np.random.default_rng(len(text)).integers(0, 12, crop.shape, np.uint8))
    scale = (height - 8) / 22
    cv2.putText(crop, text, (3, height - 5), cv2.FONT_HERSHEY_SIMPLEX, scale, (25, 25, 25), 1)
    cv2.imwrite(str(path), crop)


def make_paddle_lines(out: Path) -> None:
    """`paddle_rec/line.png`, `long_line.png`, `lines.json` and `lines.npz`: crops sent as
    images, and what PaddleX's own recogniser pipeline makes of them: `OCRReisizeNormImg` (to
    32 rows, the width kept to the aspect, zeros on the right), the Paddle model's
    probabilities (`lines.npz`), `CTCLabelDecode`'s text."""
    import cv2
    import paddle
    from paddlex.inference.models.text_recognition.processors import (
        CTCLabelDecode,
        OCRReisizeNormImg,
    )

    model = build_recognizer()  # seeded: the weights of paddle_rec's model.onnx
    folder = out / "paddle_rec"
    lines, probabilities = [], {}
    for name, (text, size) in LINES.items():
        draw_line(folder / name, text, size)
        image = cv2.imread(str(folder / name))  # BGR, as PaddleX reads images
        x = OCRReisizeNormImg(rec_image_shape=REC_SHAPE)([image])[0][None].astype(np.float32)
        want = model(paddle.to_tensor(x)).numpy()
        probabilities[name] = want
        texts, scores = CTCLabelDecode(list(CHARACTERS), use_space_char=True)([want])
        lines.append(
            {"image": name, "input": list(x.shape[2:]), "text": texts[0], "score": scores[0]}
        )
        print(f"  paddle_rec {name}: input {x.shape} -> {texts[0]!r} {scores[0]}")
    reference = {
        "preprocess": {
            "resize": REC_SHAPE[1:],
            "resize_mode": "fit_height",
            "color": "bgr",
            "scale": "1/255",
            "mean": [0.5, 0.5, 0.5],
            "std": [0.5, 0.5, 0.5],
        },
        "lines": lines,
        "pipeline": f"paddlex {_version('paddlex')} OCRReisizeNormImg(rec_image_shape={REC_SHAPE})"
        ", the Paddle model, CTCLabelDecode(use_space_char=True)",
    }
    (folder / "lines.json").write_text(json.dumps(reference, indent=1) + "\n")
    np.savez(folder / "lines.npz", **probabilities)  # the model's output for each crop


MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # PaddleOCR's det normalisation
DB_INPUT = (224, 320)  # the page's 240 x 320 resized to multiples of 32, as PaddleOCR does
DB = {"thresh": 0.3, "box_thresh": 0.6, "unclip_ratio": 1.5}  # PaddleOCR's det defaults


def draw_page(path: Path) -> None:
    """A 240 x 320 page: light paper with noise, three dark bars, one slanted, a speck."""
    import cv2

    page = np.full((240, 320, 3), 245, np.uint8)
    page = cv2.add(page, np.random.default_rng(3).integers(0, 8, page.shape, dtype=np.uint8))
    cv2.rectangle(page, (20, 30), (180, 52), (30, 30, 30), -1)
    cv2.rectangle(page, (30, 90), (120, 104), (40, 40, 40), -1)
    slanted = cv2.boxPoints(((220, 170), (120, 22), -20)).astype(np.int32)
    cv2.fillPoly(page, [slanted], (20, 20, 20))
    cv2.rectangle(page, (250, 40), (253, 43), (0, 0, 0), -1)
    cv2.imwrite(str(path), page)


def page_input(path: Path) -> np.ndarray[Any, Any]:
    """The page as the agent's [preprocess] of db.json makes it: resized (bilinear), BGR,
    scaled to [0, 1], normalised, CHW."""
    import cv2

    height, width = DB_INPUT
    resized = cv2.resize(cv2.imread(str(path)), (width, height), interpolation=cv2.INTER_LINEAR)
    x = (resized.astype(np.float32) / 255 - np.float32(MEAN)) / np.float32(STD)
    return x.transpose(2, 0, 1)[None].astype(np.float32)


def make_paddle_db(out: Path) -> None:
    import onnxruntime as ort
    import paddle
    from paddle import nn
    from paddlex.inference.models.text_detection.processors import DBPostProcess

    class InkMap(nn.Layer):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.ink = nn.Conv2D(3, 1, 1)
            self.smooth = nn.AvgPool2D(3, stride=1, padding=1)

        def forward(self, x: Any) -> Any:
            return nn.functional.sigmoid(self.smooth(self.ink(x)))

    model = InkMap()
    with paddle.no_grad():  # dark pixels of the normalised page high, paper low
        model.ink.weight.set_value(paddle.full([1, 3, 1, 1], -1.5))
        model.ink.bias.set_value(paddle.full([1], 1.0))
    model.eval()
    folder = out / "paddle_db"
    folder.mkdir(parents=True, exist_ok=True)
    draw_page(folder / "page.png")
    x = page_input(folder / "page.png")
    want = model(paddle.to_tensor(x)).numpy()
    (folder / "model.onnx").write_bytes(converted(model, [None, 3, None, None]))
    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    difference = float(np.abs(session.run(None, {"x": x})[0] - want).max())
    if difference > 1e-5:
        raise SystemExit(f"paddle_db: onnxruntime differs from paddle by {difference}")
    height, width = DB_INPUT
    shape = (240, 320, height / 240, width / 320)  # PaddleOCR's (source h, w, ratio h, w)
    boxes, scores = DBPostProcess(**DB)([want], [shape])
    reference = {
        "image": "page.png",
        "preprocess": {"resize": list(DB_INPUT), "color": "bgr", "mean": MEAN, "std": STD},
        "db": DB,
        "boxes": np.asarray(boxes[0]).tolist(),
        "scores": [float(v) for v in scores[0]],
        "decoder": f"paddlex {_version('paddlex')} DBPostProcess (quad, fast score)",
        "onnxruntime_max_abs_diff": difference,
    }
    (folder / "db.json").write_text(json.dumps(reference, indent=1) + "\n")
    print(f"  paddle_db: {len(reference['boxes'])} boxes, scores {reference['scores']}")


def _version(dist: str) -> str:
    return importlib.metadata.version(dist)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--lines-only", action="store_true", help="only paddle_rec's lines")
    args = parser.parse_args()
    out: Path = args.out
    if args.lines_only:
        make_paddle_lines(out)
        return
    for fixture in (make_paddle_det(), make_paddle_rec(out)):
        write(fixture, out, verify(fixture))
    make_paddle_lines(out)
    make_paddle_db(out)


if __name__ == "__main__":
    main()
