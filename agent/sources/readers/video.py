"""The video source: OpenCV's `VideoCapture` on a file, a stream URL, a camera or a GStreamer
pipeline."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from types import ModuleType

from agent.models.backends.base import Array
from agent.models.preprocess import load_cv2
from agent.sources.base import FIELD, ReaderContext, Record, SourceError, describe_where

VIDEO_TIMEOUT_MS = 10_000  # open/read timeout of network streams (OpenCV's FFmpeg backend)


class VideoReader:
    """OpenCV `VideoCapture`: a file, an RTSP/HTTP URL, a V4L2 camera or a GStreamer pipeline.

    A live source is read continuously, even with `rate_hz` (frames in between are grabbed
    and discarded): a capture that is read slower than it delivers buffers old frames, and
    latency then grows without bound (the classic RTSP lag).
    """

    def __init__(self, ctx: ReaderContext) -> None:
        self.ctx = ctx
        found = load_cv2()
        config = ctx.config
        self.where = describe_where(config)
        if found is None:
            raise SourceError(
                'kind = "video" needs OpenCV: pip install opencv-python-headless (on a Jetson, '
                "the distribution's python3-opencv, which is built with GStreamer)"
            )
        self.cv2: ModuleType = found
        cv2 = found
        self.live = config.path is None
        target: str | int
        if config.device is not None:
            target = config.device
        else:
            target = str(config.path if config.path is not None else config.url)
        backend = config.backend or "auto"
        if backend != "auto":
            api = getattr(cv2, f"CAP_{backend.upper()}")
        elif config.device is not None and sys.platform.startswith("linux"):
            api = cv2.CAP_V4L2
        elif isinstance(target, str) and " ! " in target:  # a GStreamer pipeline (Jetson)
            api = cv2.CAP_GSTREAMER
        else:
            api = cv2.CAP_ANY
        if config.path is not None and not config.path.exists():
            raise SourceError(f"{self.where}: no such file")
        params: list[int] = []
        for name in ("CAP_PROP_OPEN_TIMEOUT_MSEC", "CAP_PROP_READ_TIMEOUT_MSEC"):
            if self.live and hasattr(cv2, name):
                params += [getattr(cv2, name), VIDEO_TIMEOUT_MS]
        self.capture = cv2.VideoCapture(target, api, params)
        if not self.capture.isOpened():
            self.capture.release()
            raise SourceError(f"cannot open {self.where} (OpenCV backend {config.backend})")

    def _read(self) -> Array | None:
        ok, frame = self.capture.read()
        return frame if ok and frame is not None else None

    def records(self) -> Iterator[Record]:
        config = self.ctx.config
        stop = self.ctx.stop_event
        period = 1.0 / config.rate_hz if config.rate_hz else None
        next_at = time.monotonic()
        while not stop.is_set():
            if period is not None and not self.live:
                delay = next_at - time.monotonic()
                if delay > 0 and stop.wait(delay):
                    return
                next_at = max(next_at + period, time.monotonic() - period)
            if period is not None and self.live:
                if not self.capture.grab():
                    raise SourceError(f"{self.where}: no frame (stream lost)")
                if time.monotonic() < next_at:
                    continue  # discarded: keeps the capture's buffer fresh
                next_at = max(next_at + period, time.monotonic() - period)
                ok, frame = self.capture.retrieve()
                image = frame if ok else None
            else:
                image = self._read()
            if image is None:
                if self.live:
                    raise SourceError(f"{self.where}: no frame (stream lost)")
                if not config.loop:
                    return  # the end of the file
                self.capture.set(self.cv2.CAP_PROP_POS_FRAMES, 0)
                image = self._read()
                if image is None:
                    raise SourceError(f"{self.where}: cannot read a frame after rewinding")
            yield Record({FIELD: image}, bgr=True)

    def close(self) -> None:
        self.capture.release()
