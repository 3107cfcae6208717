#!/usr/bin/env python3
"""Dev-only: ``tests/fixtures/real/paddle_det/``, a PaddlePaddle text detector converted by
Paddle2ONNX, in the layout of ``scripts/make_real_models.py`` (whose writer it uses).

Not run by CI, never a runtime dependency. Paddle2ONNX pins an older onnx than the rest of the
export stack, so it gets a scratch virtualenv of its own::

    python3 -m venv .venv-paddle
    .venv-paddle/bin/pip install paddlepaddle==3.3.1 paddle2onnx==2.1.0 onnxruntime==1.32.0
    .venv-paddle/bin/python scripts/make_paddle_models.py [--out tests/fixtures/real]

The model is a small DBNet-style detector as PaddleOCR's det models are built (convolutions
with batch norm down to a quarter, transposed convolutions back up, a sigmoid probability
map), seeded, with non-trivial batch-norm statistics, saved by ``paddle.jit.save`` with a
dynamic batch, height and width (``InputSpec([None, 3, None, None])``), and converted by
``paddle2onnx.export`` at opset 14: its input is ``x``, its output Paddle's ``fetch_name_0``,
its dynamic dims named ``DynamicDimension.N``. The reference is Paddle's own output for a
seeded input.
"""

from __future__ import annotations

import argparse
import importlib.metadata
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


def make_paddle_det() -> Fixture:
    import paddle
    import paddle2onnx

    model = build()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 3, 32, 48)).astype(np.float32)  # a normalised image
    want = model(paddle.to_tensor(x)).numpy()
    spec = [paddle.static.InputSpec([None, 3, None, None], "float32", name="x")]
    with tempfile.TemporaryDirectory(prefix="paddle-det-") as tmp:
        prefix = str(Path(tmp) / "inference")
        paddle.jit.save(model, prefix, input_spec=spec)
        onnx_file = Path(tmp) / "model.onnx"
        paddle2onnx.export(
            f"{prefix}.json", f"{prefix}.pdiparams", str(onnx_file), opset_version=14
        )
        data = onnx_file.read_bytes()
    return Fixture(
        name="paddle_det",
        model=data,
        inputs={"x": x},
        outputs={"fetch_name_0": want},
        family="paddle-det-dbnet",
        exporter={"name": "paddle2onnx.export (opset 14)", "version": _version("paddle2onnx")},
        framework={"name": "paddlepaddle", "version": _version("paddlepaddle")},
        tolerance={"rtol": 1e-4, "atol": 1e-5},
        notes="DBNet-style detector built in Paddle, saved by paddle.jit.save with a dynamic "
        "batch, height and width, converted by Paddle2ONNX; the reference is Paddle's output.",
    )


def _version(dist: str) -> str:
    return importlib.metadata.version(dist)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    out: Path = parser.parse_args().out
    fixture = make_paddle_det()
    write(fixture, out, verify(fixture))


if __name__ == "__main__":
    main()
