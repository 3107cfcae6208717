"""The outbox in memory: bounded, in order, a reserve for errors."""

from __future__ import annotations

import threading

import pytest

from agent.delivery.outbox import Outbox, OutboxClosed, OutMessage


def test_outbox_blocks_when_full_and_keeps_order():
    box = Outbox(max_messages=2, reserve=1)
    box.put(OutMessage("t", b"1", 1))
    box.put(OutMessage("t", b"2", 1))
    with pytest.raises(TimeoutError):
        box.put(OutMessage("t", b"3", 1), timeout=0.05)
    assert box.put_nowait_reserved(OutMessage("t", b"err", 1))
    assert not box.put_nowait_reserved(OutMessage("t", b"err2", 1))
    assert box.rejected == 1
    first = box.get(0.1)
    assert first is not None and first.payload == b"1"
    box.unget(first)
    assert [box.get(0.1).payload for _ in range(3)] == [b"1", b"2", b"err"]  # type: ignore[union-attr]
    box.close()
    with pytest.raises(OutboxClosed):
        box.put(OutMessage("t", b"x", 1))
    assert box.get(0.1) is None


def test_outbox_put_many_keeps_order_and_waits_for_room():
    box = Outbox(max_messages=2)
    kicked: list[int] = []
    box.set_on_queued(lambda: kicked.append(1))
    messages = [OutMessage("t", str(n).encode(), 1) for n in range(5)]
    putter = threading.Thread(target=box.put_many, args=(messages,))
    putter.start()
    got = [box.get(2.0) for _ in range(5)]  # room for two at a time: it waits, in order
    putter.join(2.0)
    assert not putter.is_alive()
    assert [m.payload for m in got if m is not None] == [b"0", b"1", b"2", b"3", b"4"]
    assert not kicked  # the caller kicks once, after its last message
    box.close()
    with pytest.raises(OutboxClosed):
        box.put_many([OutMessage("t", b"x", 1)])
