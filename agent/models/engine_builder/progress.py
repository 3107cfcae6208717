"""Progress of a build as lines: phases from ``trt.IProgressMonitor`` (TensorRT 10+)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["Progress", "progress_monitor"]


class Progress:
    """Turns phases into lines: at most one line per phase start/finish, plus a step line
    at most every 2 s, so a 10-minute Jetson build says it is alive without flooding."""

    def __init__(self, sink: Callable[[str], None]) -> None:
        self._sink = sink
        self._lock = threading.Lock()
        self._depth: dict[str, int] = {}
        self._started: dict[str, float] = {}
        self._last_step = 0.0

    def start(self, phase: str, parent: str | None, steps: int) -> None:
        with self._lock:
            depth = self._depth.get(parent, -1) + 1 if parent else 0
            self._depth[phase] = depth
            self._started[phase] = time.monotonic()
        self._sink(f"{'  ' * depth}{phase} ({steps} step{'s' if steps != 1 else ''})")

    def step(self, phase: str, step: int) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last_step < 2.0:
                return
            self._last_step = now
            depth = self._depth.get(phase, 0)
        self._sink(f"{'  ' * depth}{phase}: step {step + 1}")

    def finish(self, phase: str) -> None:
        with self._lock:
            depth = self._depth.pop(phase, 0)
            started = self._started.pop(phase, time.monotonic())
        self._sink(f"{'  ' * depth}{phase} done in {time.monotonic() - started:.1f} s")

    def phase(self, text: str) -> None:
        self._sink(text)


def progress_monitor(trt: Any, progress: Progress) -> Any:
    """A ``trt.IProgressMonitor`` feeding ``progress`` (TensorRT 10+), or None."""
    base = getattr(trt, "IProgressMonitor", None)
    if base is None:
        return None

    class Monitor(base):  # type: ignore[misc, valid-type]
        """TensorRT calls this from its builder threads; Progress is thread-safe."""

        def __init__(self) -> None:
            base.__init__(self)  # type: ignore[misc]  # pybind11 needs the base initialised

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            progress.start(phase_name, parent_phase, num_steps)

        def step_complete(self, phase_name: str, step: int) -> bool:
            progress.step(phase_name, step)
            return True  # never cancel

        def phase_finish(self, phase_name: str) -> None:
            progress.finish(phase_name)

    return Monitor()
