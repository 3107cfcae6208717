#!/usr/bin/env python3
"""Make what `configs/video-demo.toml` runs: a small conv net and a video file to feed it.

Writes, under `var/video-demo/` (or `--out DIR`):

* `models/camera-net/1/model.onnx`: agent.demo.models.conv_net (3 x 32 x 32 -> 10 scores)
  and `models/camera-net/config.toml` with the `[preprocess]` that turns a 640 x 480 BGR
  frame into its input (resize, RGB, scale, normalise, NCHW);
* `demo.avi`: `--frames` frames (MJPG, 30 fps) of a bright square moving over a gradient,
  written with OpenCV (`pip install opencv-python-headless`).

    python scripts/make_video_demo.py
    edge-agent run -c configs/video-demo.toml          # a broker on 127.0.0.1:1883
    edge-agent subscribe -c configs/video-demo.toml    # ROOT/stream/demo-video, frame by frame
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run from a checkout without installing the package
    sys.path.insert(0, str(REPO_ROOT))

import numpy as np  # noqa: E402

from agent.demo import models as demo_models  # noqa: E402
from agent.models.preprocess import load_cv2  # noqa: E402

MODEL_CONFIG = """\
# How a local source turns a camera frame into this model's input (see agent/preprocess.py).
[preprocess]
input = "image"
resize = [32, 32]            # [height, width]
interpolation = "area"       # the best choice for shrinking
color = "rgb"                # OpenCV decodes BGR; the net was "trained" on RGB
scale = "1/255"
mean = [0.485, 0.456, 0.406]
std = [0.229, 0.224, 0.225]
layout = "NCHW"
dtype = "float32"
"""

WIDTH, HEIGHT, FPS = 640, 480, 30


def write_model(out: Path) -> Path:
    folder = out / "models" / "camera-net"
    demo_models.save(demo_models.conv_net(), folder / "1" / "model.onnx")
    demo_models.write_atomic(folder / "config.toml", MODEL_CONFIG.encode())
    return folder


def write_video(path: Path, frames: int) -> Path:
    cv2 = load_cv2()
    if cv2 is None:
        raise SystemExit("the demo video needs OpenCV: pip install opencv-python-headless")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.avi")
    writer = cv2.VideoWriter(str(tmp), cv2.VideoWriter_fourcc(*"MJPG"), FPS, (WIDTH, HEIGHT))
    if not writer.isOpened():
        raise SystemExit(f"OpenCV cannot write {tmp} (MJPG)")
    x = np.linspace(0, 255, WIDTH, dtype=np.float32)
    y = np.linspace(0, 255, HEIGHT, dtype=np.float32)[:, None]
    for i in range(frames):
        frame = np.empty((HEIGHT, WIDTH, 3), dtype=np.uint8)
        frame[:, :, 0] = x.astype(np.uint8)  # blue grows to the right
        frame[:, :, 1] = np.broadcast_to(y, (HEIGHT, WIDTH)).astype(np.uint8)  # green downwards
        frame[:, :, 2] = (i * 255 // max(1, frames - 1)) % 256  # red over time
        left = (i * 8) % (WIDTH - 80)
        top = HEIGHT // 2 - 40 + int(60 * np.sin(i / 10))
        frame[top : top + 80, left : left + 80] = 255
        writer.write(frame)
    writer.release()
    tmp.replace(path)  # a source never sees a half-written file
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "var" / "video-demo")
    parser.add_argument("--frames", type=int, default=300, help="10 s at 30 fps by default")
    args = parser.parse_args(argv)
    model = write_model(args.out)
    video = write_video(args.out / "demo.avi", args.frames)
    print(f"model: {model}\nvideo: {video} ({args.frames} frames, {WIDTH}x{HEIGHT}, {FPS} fps)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
