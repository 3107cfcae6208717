"""Bounded priority queue and the inference worker threads.

Priority 0-9, higher first, FIFO within a priority (a counter breaks ties). The queue is
bounded: a full queue refuses at once, so the caller answers `overloaded` instead of letting
latency grow without limit. Deadlines are checked when a job would start: a job that waited
too long is handed back to the caller as expired, never run and never dropped.

Dynamic batching: a job submitted with a `BatchSpec` may run together with others of the same
key. The worker that takes it also takes the queued jobs of that key (best first) up to
`max_rows`, and, when `delay_s` > 0 and the batch is not full, keeps collecting newly
submitted ones for that long (they go straight into its batch, never into the queue).

`run_here` runs a job on the calling thread instead (the network thread, for a request known
to be short: see agent.inference.short_runs) when nothing is queued and a worker slot is
free; it takes that slot, so `workers` stays the bound on jobs running at once.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from agent.threads import NamedThread

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class BatchSpec:
    """How a job may share a run: with jobs of the same `key`, up to `max_rows` items of the
    leading axis in all (this job has `rows`), waiting up to `delay_s` for more."""

    key: Hashable
    rows: int
    max_rows: int
    delay_s: float


@dataclass
class _Entry(Generic[T]):
    job: T
    enqueued: float
    deadline: float | None
    batch: BatchSpec | None = None


# The heap holds (sort key, entry): the keys are unique (-priority, a counter), so the heap
# compares tuples of ints in C and never an entry (a dataclass's __lt__ is a Python call, and
# a heap push, pop or sort makes several: 1.4 against 0.75 µs a request for 40 queued).
_Queued = tuple[tuple[int, int], _Entry[T]]


@dataclass
class _Collecting(Generic[T]):
    """A batch a worker is filling: submissions of its key join it directly. `full` (on the
    scheduler's lock) wakes its worker early, only when the batch is full: a join that leaves
    room wakes nobody, so a batch of n requests costs its worker one wake-up, not n."""

    entries: list[_Entry[T]]
    rows: int
    max_rows: int
    full: threading.Condition


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
        execute_batch: Callable[[list[tuple[T, float]]], None] | None = None,
        name: str = "infer-worker",
    ) -> None:
        """`execute_batch([(job, queued_s), ...])` runs two or more jobs of one batch key."""
        self._execute = execute
        self._execute_batch = execute_batch
        self._collecting: dict[Hashable, _Collecting[T]] = {}
        self._expire = expire
        self._cancel = cancel
        self._queue_size = queue_size
        self._heap: list[_Queued[T]] = []
        self._counter = itertools.count()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # idle workers, and `stop`
        self._stopping = False
        self._busy = 0
        self._heartbeat = [time.monotonic()] * workers
        self._threads = [
            NamedThread(target=self._work, args=(i,), name=f"{name}-{i}", daemon=True)
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

    def submit(
        self,
        job: T,
        priority: int,
        deadline_s: float | None = None,
        batch: BatchSpec | None = None,
    ) -> bool:
        """Queue a job. False when the queue is full or the scheduler is stopping."""
        now = time.monotonic()
        key = (-priority, next(self._counter))
        entry = _Entry(
            job=job,
            enqueued=now,
            deadline=None if deadline_s is None else now + deadline_s,
            batch=batch if self._execute_batch is not None else None,
        )
        with self._lock:
            if self._stopping or len(self._heap) >= self._queue_size:
                return False
            if entry.batch is not None:
                collecting = self._collecting.get(entry.batch.key)
                if collecting is not None and collecting.rows + entry.batch.rows <= (
                    collecting.max_rows
                ):
                    collecting.entries.append(entry)
                    collecting.rows += entry.batch.rows
                    if collecting.rows >= collecting.max_rows:
                        collecting.full.notify()
                    return True
            heapq.heappush(self._heap, (key, entry))
            self._cond.notify()
        return True

    def run_here(self, job: T) -> bool:
        """Run `job` now on this thread when nothing is queued (nothing it would overtake) and
        a worker slot is free. False, without running it, otherwise."""
        with self._cond:
            if self._stopping or self._heap or self._busy >= len(self._threads):
                return False
            self._busy += 1
        try:
            self._execute(job, 0.0)
        except Exception:
            log.exception("worker: unhandled error while running a job")
        finally:
            with self._cond:
                self._busy -= 1
                if self._stopping:
                    self._cond.notify_all()  # `stop` waits for this job too
                elif self._heap:
                    self._cond.notify()  # a job queued meanwhile waited for this slot
        return True

    def _work(self, index: int) -> None:
        slots = len(self._threads)
        while True:
            with self._cond:
                while (not self._heap or self._busy >= slots) and not self._stopping:
                    self._heartbeat[index] = time.monotonic()
                    self._cond.wait(1.0)
                if not self._heap:
                    return
                _, entry = heapq.heappop(self._heap)
                self._busy += 1
                spec = entry.batch
                entries = [entry] if spec is None else self._gather(entry, spec)
            try:
                self._run(entries)
            except Exception:
                # The executor answers its own errors; this is a bug, and must not kill a worker.
                log.exception("worker: unhandled error while running a job")
            finally:
                with self._cond:  # nobody waits for a job's end: no wake-up of idle workers
                    self._busy -= 1
                    self._heartbeat[index] = time.monotonic()

    def _gather(self, first: _Entry[T], spec: BatchSpec) -> list[_Entry[T]]:
        """Under the lock: `first` and the queued jobs of its key that fit, best first; then,
        while not full, those submitted within `delay_s`."""
        batch = _Collecting([first], spec.rows, spec.max_rows, threading.Condition(self._lock))
        matching = sorted(
            q for q in self._heap if q[1].batch is not None and q[1].batch.key == spec.key
        )
        taken = False
        for _, entry in matching:
            assert entry.batch is not None
            if batch.rows + entry.batch.rows <= batch.max_rows:
                batch.entries.append(entry)
                batch.rows += entry.batch.rows
                taken = True
        if taken:
            chosen = {id(e) for e in batch.entries}
            self._heap = [q for q in self._heap if id(q[1]) not in chosen]
            heapq.heapify(self._heap)
        if batch.rows < batch.max_rows and spec.delay_s > 0 and spec.key not in self._collecting:
            self._collecting[spec.key] = batch
            deadline = time.monotonic() + spec.delay_s
            try:
                while batch.rows < batch.max_rows and not self._stopping:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    batch.full.wait(remaining)
            finally:
                del self._collecting[spec.key]
        return batch.entries

    def _run(self, entries: list[_Entry[T]]) -> None:
        started = time.monotonic()
        live: list[tuple[T, float]] = []
        for entry in entries:
            if entry.deadline is not None and started > entry.deadline:
                self._expire(entry.job)
            else:
                live.append((entry.job, started - entry.enqueued))
        if len(live) == 1:
            self._execute(*live[0])
        elif live:
            assert self._execute_batch is not None
            self._execute_batch(live)

    def stop(self, drain_timeout: float) -> None:
        """Refuse new jobs, cancel queued ones, wait up to `drain_timeout` for running ones
        (those run here included)."""
        with self._cond:
            self._stopping = True
            queued = [heapq.heappop(self._heap)[1].job for _ in range(len(self._heap))]
            self._cond.notify_all()
            for collecting in self._collecting.values():
                collecting.full.notify()
        for job in queued:
            try:
                self._cancel(job)
            except Exception:
                log.exception("worker: cancel handler failed")
        deadline = time.monotonic() + drain_timeout
        for thread in self._threads:
            if thread.is_alive():
                thread.join(max(0.0, deadline - time.monotonic()))
        with self._cond:  # and for a job running on another thread (`run_here`)
            while self._busy and time.monotonic() < deadline:
                self._cond.wait(max(0.0, deadline - time.monotonic()))

    @property
    def alive(self) -> bool:
        return all(t.is_alive() for t in self._threads)
