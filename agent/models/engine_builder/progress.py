"""Progress of a build: phases from ``trt.IProgressMonitor`` (TensorRT 10+) as lines
(:class:`Progress`) and, for the agent's inventory, as fractions (:class:`PhaseTracker`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["PhaseTracker", "Progress", "progress_monitor"]


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

    def keep_going(self) -> bool:
        """False asks TensorRT to cancel the build (``step_complete`` returns it)."""
        return True


class PhaseTracker(Progress):
    """A :class:`Progress` that also knows how far each running phase is.

    TensorRT reports nested phases (``parent_phase``), each with ``num_steps``; a phase's
    fraction is its completed steps plus the fraction of its running child, over its steps.
    :meth:`snapshot` gives the running phases outermost first and the outermost one's
    fraction; :meth:`cancel` makes the next ``step_complete`` ask TensorRT to stop.
    Called from TensorRT's builder threads; every method takes the lock.
    """

    def __init__(self, sink: Callable[[str], None]) -> None:
        super().__init__(sink)
        self._phases: dict[str, list[Any]] = {}  # name -> [parent, steps, done], start order
        self._cancelled = threading.Event()

    def start(self, phase: str, parent: str | None, steps: int) -> None:
        with self._lock:
            self._phases.pop(phase, None)
            self._phases[phase] = [parent, max(1, int(steps)), 0]
        super().start(phase, parent, steps)

    def step(self, phase: str, step: int) -> None:
        with self._lock:
            entry = self._phases.get(phase)
            if entry is not None:
                entry[2] = min(entry[1], max(entry[2], int(step) + 1))
        super().step(phase, step)

    def finish(self, phase: str) -> None:
        with self._lock:
            self._phases.pop(phase, None)
        super().finish(phase)

    def keep_going(self) -> bool:
        return not self._cancelled.is_set()

    def cancel(self) -> None:
        self._cancelled.set()

    def snapshot(self) -> tuple[float | None, list[dict[str, Any]]]:
        """(fraction of the outermost running phase, the running chain outermost first:
        ``{name, step, steps}``); (None, []) when no phase runs."""
        with self._lock:
            chain: list[str] = []
            parent: str | None = None
            while True:  # the latest started child of `parent`, down the tree
                child = next((n for n, e in reversed(self._phases.items()) if e[0] == parent), None)
                if child is None or child in chain:
                    break
                chain.append(child)
                parent = child
            fraction: float | None = None
            for name in reversed(chain):  # innermost first: each refines its parent's step
                _, steps, done = self._phases[name]
                fraction = min(1.0, (done + (fraction or 0.0)) / steps)
            phases = [
                {"name": n, "step": self._phases[n][2], "steps": self._phases[n][1]} for n in chain
            ]
        return fraction, phases


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
            return progress.keep_going()  # False: TensorRT cancels the build

        def phase_finish(self, phase_name: str) -> None:
            progress.finish(phase_name)

    return Monitor()
