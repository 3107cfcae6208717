"""The scheduler: priority order, then arrival order; deadlines; a bounded queue."""

from __future__ import annotations

import threading
import time

from agent.inference.scheduler import Scheduler


def test_scheduler_priority_then_fifo_and_deadlines():
    gate = threading.Event()
    order: list[str] = []
    expired: list[str] = []
    done = threading.Event()

    def execute(job: str, queued: float) -> None:
        if job == "block":
            gate.wait(5)
            return
        order.append(job)
        if len(order) == 5:
            done.set()

    scheduler: Scheduler[str] = Scheduler(
        workers=1, queue_size=10, execute=execute, expire=expired.append, cancel=lambda j: None
    )
    scheduler.start()
    assert scheduler.submit("block", 9)
    time.sleep(0.05)
    for job, priority in [("low-a", 1), ("high-a", 8), ("low-b", 1), ("high-b", 8), ("mid", 4)]:
        assert scheduler.submit(job, priority)
    assert scheduler.submit("late", 9, deadline_s=0.0)
    gate.set()
    assert done.wait(5)
    assert order == ["high-a", "high-b", "mid", "low-a", "low-b"]
    assert expired == ["late"]
    scheduler.stop(1)


def test_scheduler_refuses_when_full_and_cancels_on_stop():
    gate = threading.Event()
    cancelled: list[str] = []
    scheduler: Scheduler[str] = Scheduler(
        workers=1,
        queue_size=2,
        execute=lambda j, q: gate.wait(5),
        expire=lambda j: None,
        cancel=cancelled.append,
    )
    scheduler.start()
    assert scheduler.submit("running", 4)
    time.sleep(0.05)
    assert scheduler.submit("a", 4) and scheduler.submit("b", 4)
    assert not scheduler.submit("c", 4)  # full: the caller answers `overloaded`
    gate.set()
    scheduler.stop(2)
    assert sorted(cancelled) in (["a", "b"], ["b"], [])
    assert not scheduler.submit("after", 4)
