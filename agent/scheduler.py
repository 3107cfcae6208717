"""Bounded priority queue and the inference worker threads.

Priority 0-9, higher first, FIFO within a priority (a counter breaks ties). The queue is
bounded: a full queue refuses at once, so the caller answers `overloaded` instead of letting
latency grow without limit. Deadlines are checked when a job would start: a job that waited
too long is handed back to the caller as expired, never run and never dropped.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(order=True)
class _Entry(Generic[T]):
    sort_key: tuple[int, int]
    job: T = field(compare=False)
    enqueued: float = field(compare=False)
    deadline: float | None = field(compare=False)


class Scheduler(Generic[T]):
    """Runs `execute(job, queued_s)` on `workers` named threads.

    `expire(job)` is called (on a worker thread) for a job whose deadline passed before it
    started; `cancel(job)` for every job still queued when the scheduler stops.
    """

    def __init__(
        self,
        *,
        workers: int,
        queue_size: int,
        execute: Callable[[T, float], None],
        expire: Callable[[T], None],
        cancel: Callable[[T], None],
        name: str = "infer-worker",
    ) -> None:
        self._execute = execute
        self._expire = expire
        self._cancel = cancel
        self._queue_size = queue_size
        self._heap: list[_Entry[T]] = []
        self._counter = itertools.count()
        self._cond = threading.Condition()
        self._stopping = False
        self._busy = 0
        self._heartbeat = [time.monotonic()] * workers
        self._threads = [
            threading.Thread(target=self._work, args=(i,), name=f"{name}-{i}", daemon=True)
            for i in range(workers)
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    @property
    def depth(self) -> int:
        return len(self._heap)

    @property
    def busy(self) -> int:
        return self._busy

    def oldest_heartbeat(self) -> float:
        """Monotonic time of the least recent sign of life of any idle-or-finishing worker."""
        return min(self._heartbeat)

    def submit(self, job: T, priority: int, deadline_s: float | None = None) -> bool:
        """Queue a job. False when the queue is full or the scheduler is stopping."""
        now = time.monotonic()
        entry = _Entry(
            sort_key=(-priority, next(self._counter)),
            job=job,
            enqueued=now,
            deadline=None if deadline_s is None else now + deadline_s,
        )
        with self._cond:
            if self._stopping or len(self._heap) >= self._queue_size:
                return False
            heapq.heappush(self._heap, entry)
            self._cond.notify()
        return True

    def _work(self, index: int) -> None:
        while True:
            with self._cond:
                while not self._heap and not self._stopping:
                    self._heartbeat[index] = time.monotonic()
                    self._cond.wait(1.0)
                if not self._heap:
                    return
                entry = heapq.heappop(self._heap)
                self._busy += 1
            try:
                started = time.monotonic()
                if entry.deadline is not None and started > entry.deadline:
                    self._expire(entry.job)
                else:
                    self._execute(entry.job, started - entry.enqueued)
            except Exception:
                # The executor answers its own errors; this is a bug, and must not kill a worker.
                log.exception("worker: unhandled error while running a job")
            finally:
                with self._cond:
                    self._busy -= 1
                    self._heartbeat[index] = time.monotonic()
                    self._cond.notify_all()

    def stop(self, drain_timeout: float) -> None:
        """Refuse new jobs, cancel queued ones, wait up to `drain_timeout` for running ones."""
        with self._cond:
            self._stopping = True
            queued = [heapq.heappop(self._heap).job for _ in range(len(self._heap))]
            self._cond.notify_all()
        for job in queued:
            try:
                self._cancel(job)
            except Exception:
                log.exception("worker: cancel handler failed")
        deadline = time.monotonic() + drain_timeout
        for thread in self._threads:
            if thread.is_alive():
                thread.join(max(0.0, deadline - time.monotonic()))

    @property
    def alive(self) -> bool:
        return all(t.is_alive() for t in self._threads)
