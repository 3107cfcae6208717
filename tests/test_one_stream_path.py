"""The one-stream path's cost off the critical path (docs/decisions/0029): a fast stream's
messages leave a few steps to a socket write (`SendHold`), and its rows are written once, as
acknowledged, when the broker acknowledges them before the next batch (`unacknowledged_tail`).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from agent.delivery.outbox import OutMessage
from agent.delivery.spool_items import AfterWrite, FinishRequest, StoreRequest, unacknowledged_tail
from agent.inference import send_hold
from agent.inference.send_hold import SendHold
from tests.spool_helpers import recorded_writer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _hold(hand_offs: list[int] | None = None) -> tuple[SendHold, Clock, list[int]]:
    """A hold whose kicks (and, given `hand_offs`, hand-offs) are counted."""
    clock = Clock()
    kicks: list[int] = []
    hand_off = None if hand_offs is None else (lambda: hand_offs.append(1))
    return SendHold(lambda: kicks.append(1), hand_off, clock), clock, kicks


def test_the_first_step_and_slow_steps_are_published_at_once():
    hand_offs: list[int] = []
    hold, clock, kicks = _hold(hand_offs)
    clock.now += 0.00001
    hold.sent(1, finished=False)  # the first chunk: the time to first chunk stays
    assert len(kicks) == 1 and hand_offs == []
    for _ in range(3):
        clock.now += send_hold.FAST_STEP_S * 1.001  # a step that slow: nothing waits for it
        hold.sent(1, finished=False)
    assert len(kicks) == 1 and len(hand_offs) == 3  # by the io thread, while the next runs
    clock.now += send_hold.FAST_STEP_S * 1.001
    hold.sent(1, finished=True)  # the `end`: published by the worker itself, at once
    assert len(kicks) == 2 and len(hand_offs) == 3
    hold.release()
    assert len(kicks) == 2  # nothing held: no kick


def test_fast_steps_share_a_write_until_the_count_or_the_time_bound():
    hold, clock, kicks = _hold()
    hold.sent(1, finished=False)
    kicks.clear()
    # Fast, and so short that the count bound fills before the time bound.
    step = min(send_hold.FAST_STEP_S, send_hold.HOLD_MAX_S) / (2 * send_hold.HOLD_MAX_MESSAGES)
    for _ in range(send_hold.HOLD_MAX_MESSAGES - 1):
        clock.now += step
        hold.sent(1, finished=False)
    assert kicks == []  # held, below both bounds
    clock.now += step
    hold.sent(1, finished=False)
    assert len(kicks) == 1  # HOLD_MAX_MESSAGES waited: one kick for all of them
    # Two messages a step, slower than the count bound fills: the time bound releases them.
    steps = 0
    while not kicks[1:]:
        clock.now += step
        hold.sent(2, finished=False)
        steps += 1
    assert steps * step >= send_hold.HOLD_MAX_S or 2 * steps >= send_hold.HOLD_MAX_MESSAGES


def test_a_finished_request_and_the_end_of_the_run_release_what_is_held():
    hold, clock, kicks = _hold()
    hold.sent(1, finished=False)
    clock.now += 0.00001
    hold.sent(1, finished=False)
    assert len(kicks) == 1
    clock.now += 0.00001
    hold.sent(1, finished=True)  # the `end`: out at once, with the chunk before it
    assert len(kicks) == 2
    clock.now += 0.00001
    hold.sent(1, finished=False)
    hold.sent(0, finished=False)  # a step without a message keeps it held
    assert len(kicks) == 2
    hold.release()
    assert len(kicks) == 3
    hold.release()
    assert len(kicks) == 3


def test_a_run_that_goes_on_drives_and_its_end_kicks():
    """The releases of a run that goes on (its first step, the bounds) read the broker's
    answers on the worker's thread (`drive`, docs/decisions/0034); a step that finished a
    request and the run's end only kick, so a one-step request never takes the reading."""
    clock = Clock()
    calls: list[str] = []
    hold = SendHold(lambda: calls.append("kick"), None, clock, drive=lambda: calls.append("drive"))
    hold.sent(1, finished=False)  # a stream's first step
    for _ in range(send_hold.HOLD_MAX_MESSAGES):  # fast steps up to the count bound
        clock.now += 0.00001
        hold.sent(1, finished=False)
    clock.now += 0.00001
    hold.sent(1, finished=True)  # its `end`
    clock.now += 0.00001
    hold.sent(1, finished=False)
    hold.release()  # the run ends
    assert calls == ["drive", "drive", "kick", "kick"]
    one_step = SendHold(lambda: calls.append("kick"), None, clock, drive=lambda: 1 / 0)
    one_step.sent(1, finished=True)  # a request answered in one run: no drive
    assert calls[-1] == "kick"


def _message(spool_id: int, stream: str = "m/r") -> OutMessage:
    out = OutMessage(f"t/{stream}", b"x" * 100, 1, stream=stream)
    out.spool_id = spool_id
    return out


def test_the_unacknowledged_tail_waits_once_and_never_with_a_stored_request():
    items = [_message(i) for i in range(1, 11)]
    acks = list(range(1, 8))
    assert unacknowledged_tail(items, acks, 0, 256) == 7  # 8, 9, 10 are in flight
    assert unacknowledged_tail(items, [*acks, 9], 0, 256) == 7  # from the first unacked on
    assert unacknowledged_tail(items, list(range(1, 11)), 0, 256) == 10  # all acknowledged
    assert unacknowledged_tail(items, acks, 10, 256) == 10  # each waited once: written now
    assert unacknowledged_tail(items, acks, 8, 256) == 8  # 8 waited once; 9 and 10 may wait
    assert unacknowledged_tail(items, acks, 0, 2) == 8  # only the newest `limit` items
    # Only messages follow the cut: a callback or a finished request is not held back.
    assert unacknowledged_tail([*items[:8], AfterWrite(print), *items[8:]], acks, 0, 256) == 9
    assert unacknowledged_tail([*items, FinishRequest("m/r")], acks, 0, 256) == 11
    # A batch that stores a request is written whole (its fsync rule reads all of it).
    store = StoreRequest("m/q", "t", b"req", 1, None, None)
    assert unacknowledged_tail([store, *items], acks, 0, 256) == 11


def test_the_writer_writes_a_streams_rows_once_as_acknowledged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Messages still in flight when their batch is taken wait for the next one; acknowledged
    by then, each is one insert and no update. A flush still writes everything at once."""
    from agent.delivery import spool_writer

    # A batch of messages alone comes this late: later than any scheduling hiccup of a busy
    # CI machine between the first batch and the acknowledgements below.
    monkeypatch.setattr(spool_writer, "STREAM_COMMIT_S", 30.0)
    with recorded_writer(tmp_path / "s.sqlite") as (spool, statements, writer):
        messages = [_message(spool.allocate_id()) for _ in range(10)]
        ran: list[str] = []
        writer.submit(AfterWrite(lambda spool: ran.append("after")))  # a prompt batch
        for out in messages:
            writer.submit(out)
        for out in messages[:7]:
            writer.ack(out.spool_id)  # type: ignore[arg-type]
        writer.nudge()
        deadline = time.monotonic() + 10
        while writer.backlog > 3 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert writer.backlog == 3  # the first seven written, the three in flight held
        assert ran == ["after"]
        for out in messages[7:]:
            writer.ack(out.spool_id)  # type: ignore[arg-type]
        assert writer.flush(10)
        rows = statements.db.execute("SELECT id, acked FROM messages ORDER BY id").fetchall()
        assert [r[0] for r in rows] == [m.spool_id for m in messages]
        assert all(acked is not None for _, acked in rows)
        assert not [s for s in statements.executed if s.startswith("UPDATE messages")]
        assert spool.count == 0

        # In flight at its second batch too: written pending, marked when acknowledged.
        late = _message(spool.allocate_id())
        writer.submit(late)
        assert writer.flush(10)
        assert spool.count == 1
        writer.ack(late.spool_id)  # type: ignore[arg-type]
        assert writer.flush(10)
        assert spool.count == 0
