"""The on-disk spool and the outbox over it: order, caps and policies, crash safety."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from agent.delivery.outbox import Outbox, OutMessage
from agent.delivery.spool import Spool, SpoolFull
from agent.delivery.spool_items import StoreRequest
from agent.delivery.spool_sql import STORED_BYTES_SQL, WAL_SIZE_LIMIT, stored_bytes
from agent.delivery.spool_writer import SpoolWriter
from tests.spool_helpers import recorded_writer, recording

REPO = Path(__file__).resolve().parent.parent


def message(stream: str, n: int, qos: int = 1, size: int = 100) -> OutMessage:
    return OutMessage(f"t/{stream}", bytes([n % 256]) * size, qos, stream=stream)


def test_spool_keeps_messages_and_requests_across_reopen(tmp_path: Path):
    path = tmp_path / "spool.sqlite"
    spool = Spool(path, max_bytes=1 << 20, max_messages=100)
    ids = [spool.add("a", "t", b"x" * 10, 1, False, None)[0] for _ in range(5)]
    assert spool.store_request("m/r1", "edge/d/infer/m", b"req", 1, None, b"c")
    assert not spool.store_request("m/r1", "edge/d/infer/m", b"req", 1, None, b"c")
    spool.ack(ids[:2])
    spool.close()
    again = Spool(path, max_bytes=1 << 20, max_messages=100)
    assert [m.id for m in again.load_after(0, 10)] == ids[2:]
    one = stored_bytes(OutMessage("t", b"x" * 10, 1, stream="a"))
    assert again.count == 3 and again.bytes == 3 * one
    (stored,) = again.unfinished_requests()
    assert stored.key == "m/r1" and stored.payload == b"req" and stored.correlation == b"c"
    # The terminal message and the end of the request are one transaction.
    again.add("m/r1", "t", b"end", 1, False, None, finishes="m/r1")
    assert again.unfinished_requests() == []
    again.close()


def test_spool_keeps_sqlite_temporary_files_in_memory(tmp_path: Path):
    """Statement journals of large multi-row statements would be files in /var/tmp, made and
    unlinked several times a second under load: writes on the flash the spool spares."""
    spool = Spool(tmp_path / "spool.sqlite", max_bytes=1 << 20, max_messages=100)
    assert spool._db.execute("PRAGMA temp_store").fetchone() == (2,)  # MEMORY
    spool.close()


def test_the_wal_shrinks_back_after_a_large_transaction(tmp_path: Path):
    """SQLite keeps a WAL file at its largest size until the connection closes: one batch of
    24 MB would stay on the flash for the agent's lifetime without the limit."""
    path = tmp_path / "spool.sqlite"
    spool = Spool(path, max_bytes=1 << 30, max_messages=1000)
    wal = path.with_name(path.name + "-wal")
    big = [message("a", n, size=1 << 20) for n in range(24)]
    for m in big:
        m.spool_id = spool.allocate_id()
    spool.write(big, [], 0)
    assert wal.stat().st_size > 20 * (1 << 20)  # one transaction: the whole batch in the WAL
    for n in range(3):  # the next transactions checkpoint it, then reuse and truncate it
        spool.add("b", "t/b", bytes([n]) * 100, 1, False, None)
    assert wal.stat().st_size <= WAL_SIZE_LIMIT
    assert [len(m.payload) for m in spool.load_after(0, 100)][:24] == [1 << 20] * 24
    spool.close()


def test_reject_new_refuses_when_full(tmp_path: Path):
    spool = Spool(tmp_path / "s.sqlite", max_bytes=1000, max_messages=5, policy="reject_new")
    for _ in range(5):
        spool.add("a", "t", b"x", 1, False, None)
    with pytest.raises(SpoolFull):
        spool.add("b", "t", b"x", 1, False, None)
    spool.close()


def test_drop_oldest_evicts_whole_streams_not_yet_published(tmp_path: Path):
    spool = Spool(tmp_path / "s.sqlite", max_bytes=1 << 20, max_messages=6, policy="drop_oldest")
    first = [spool.add("old", "t", b"o", 1, False, None)[0] for _ in range(2)]
    for _ in range(2):
        spool.add("mid", "t", b"m", 1, False, None)
    for _ in range(2):
        spool.add("new", "t", b"n", 1, False, None)
    # "old"'s first message is already with the publisher: protected.
    _, eviction = spool.add("newest", "t", b"z", 1, False, None, protected_after=first[0])
    assert eviction is not None
    assert eviction.streams == ("old",) and eviction.messages == 1
    streams = [m.stream for m in spool.load_after(0, 100)]
    assert streams == ["old", "mid", "mid", "new", "new", "newest"]
    spool.close()


def test_ttl_expires_waiting_messages(tmp_path: Path):
    spool = Spool(tmp_path / "s.sqlite", max_bytes=1 << 20, max_messages=100, ttl_s=0.05)
    spool.add("a", "t", b"x", 1, False, None)
    time.sleep(0.1)
    spool.add("b", "t", b"y", 1, False, None)
    spool.ttl_s = 0.08
    assert spool.expire(protected_after=0) == 1
    assert [m.stream for m in spool.load_after(0, 10)] == ["b"]
    spool.close()


def test_outbox_spills_to_disk_and_reads_back_in_order(tmp_path: Path):
    spool = Spool(tmp_path / "s.sqlite", max_bytes=1 << 24, max_messages=10_000)
    box = Outbox(16, reserve=4, spool=spool)
    box.start()
    for n in range(300):  # far more than the memory window: the rest waits on disk
        box.put(message(f"s{n % 3}", n))
    assert box.flush_acks()
    assert len(box) == 16 and spool.count == 300
    # QoS 0 never touches the disk; memory is full, so it takes the reserved headroom.
    assert box.put_nowait_reserved(OutMessage("t/volatile", b"q0", 0))
    got = []
    while (m := box.get(timeout=0.1)) is not None:
        got.append(m)
        if m.spool_id is not None:
            box.acknowledged(m.spool_id)
    durable = [m for m in got if m.qos == 1]
    assert [m.payload[0] for m in durable] == [n % 256 for n in range(300)]
    assert [m.spool_id for m in durable] == sorted(m.spool_id for m in durable)
    assert any(m.topic == "t/volatile" for m in got)
    assert box.flush_acks() and spool.count == 0
    box.close()
    spool.close()


def test_outbox_reject_new_blocks_until_acknowledged(tmp_path: Path):
    spool = Spool(tmp_path / "s.sqlite", max_bytes=1 << 20, max_messages=20)
    box = Outbox(16, spool=spool)
    box.start()
    for n in range(20):
        box.put(message("a", n))
    with pytest.raises(TimeoutError):
        box.put(message("a", 99), timeout=0.2)
    done = threading.Event()

    def writer() -> None:
        box.put(message("a", 100))
        done.set()

    thread = threading.Thread(target=writer)
    thread.start()
    first = box.get(0.1)
    assert first is not None and first.spool_id is not None
    assert not done.wait(0.2)  # still full: nothing acknowledged yet
    box.acknowledged(first.spool_id)
    box.flush_acks()
    assert done.wait(2)
    thread.join()
    box.close()
    spool.close()


def test_outbox_resumes_a_previous_runs_messages(tmp_path: Path):
    path = tmp_path / "s.sqlite"
    spool = Spool(path, max_bytes=1 << 20, max_messages=100)
    for n in range(5):
        spool.add("a", "t/a", bytes([n]), 1, False, b"corr")
    spool.close()
    spool = Spool(path, max_bytes=1 << 20, max_messages=100)
    box = Outbox(16, spool=spool, make_properties=lambda c: ("props", c))
    box.start()
    got = [box.get(1.0) for _ in range(5)]
    assert [m.payload for m in got] == [bytes([n]) for n in range(5)]  # type: ignore[union-attr]
    assert all(m.properties == ("props", b"corr") for m in got)  # type: ignore[union-attr]
    box.close()
    spool.close()


WRITER = """
import sys, time
from pathlib import Path
from agent.delivery.spool import Spool
spool = Spool(Path(sys.argv[1]), max_bytes=1 << 30, max_messages=10**7)
n = 1  # the first line is an "added" one: a kill right after it still leaves one
while True:
    rid, _ = spool.add("s%d" % (n % 7), "t", b"x" * (n % 3000), 1, False, None)
    if n % 5 == 0:
        spool.store_request("m/%d" % n, "t", b"r", 1, None, None)
    if n % 11 == 0:
        spool.ack([rid])
        print("acked", rid, flush=True)
    else:
        print("added", rid, flush=True)
    n += 1
"""


def test_sigkill_during_spool_writes(tmp_path: Path):
    path = tmp_path / "spool.sqlite"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for round_ in range(20):
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(path)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert proc.stdout is not None
        first = proc.stdout.readline()  # started and writing (a slow start is not a failure)
        time.sleep((round_ % 5) * 0.05)
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate()
        lines = (first + out).split("\n")[:-1]  # the last may be a line the kill cut short
        added = {int(line.split()[1]) for line in lines if line.startswith("added")}
        acked = {int(line.split()[1]) for line in lines if line.startswith("acked")}
        assert added, "the writer wrote nothing before it was killed"
        db = sqlite3.connect(path)
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        db.close()
        spool = Spool(path, max_bytes=1 << 30, max_messages=10**7)
        present = {m.id for m in spool.load_after(0, 10**7)}
        # Every message whose write returned is there; no acknowledged one came back.
        assert added - present == set()
        assert acked & present == set()
        spool.ack(sorted(present))  # start the next round small
        spool.close()


def test_history_bytes_track_the_table(tmp_path: Path):
    spool = Spool(tmp_path / "s.sqlite", max_bytes=1 << 24, max_messages=10_000)
    ids = [
        spool.add(f"s{n % 3}", "t", b"x" * (10 + n), 1, False, None, rid=f"s{n % 3}", seq=n)[0]
        for n in range(60)
    ]
    spool.ack(ids[:40])
    since = time.time()
    time.sleep(0.01)
    spool.ack(ids[40:50])
    spool.unack_since(since)
    spool.drop_stream("s1")
    spool.purge_acked(3600, max_bytes=3000)

    def truth() -> int:
        db = sqlite3.connect(tmp_path / "s.sqlite")
        (value,) = db.execute(
            f"SELECT COALESCE(SUM({STORED_BYTES_SQL}), 0) FROM messages WHERE acked IS NOT NULL"
        ).fetchone()
        db.close()
        return int(value)

    assert 0 < spool.history_bytes == truth() <= 3000
    spool.purge_acked(0)
    assert spool.history_bytes == truth() == 0
    spool.close()
    assert Spool(tmp_path / "s.sqlite", max_bytes=1 << 24, max_messages=10).history_bytes == 0


def test_a_request_answered_in_the_same_batch_is_never_written(tmp_path: Path):
    """Group commit: the store and the terminal message in one transaction cancel out (the
    commit is still fsynced before the acknowledgement: the terminal message is not
    acknowledged yet); across batches the row comes and goes."""
    from agent.delivery.spool_items import FinishRequest, StoreRequest

    spool = Spool(tmp_path / "s.sqlite", max_bytes=1 << 20, max_messages=100)
    acked: list[str] = []

    def store(key: str) -> StoreRequest:
        return StoreRequest(key, "t", b"req", 1, None, None, on_stored=lambda: acked.append(key))

    spool.request_keys.update({"m/a", "m/b"})
    terminal = message("m/a", 1)
    terminal.spool_id = spool.allocate_id()
    terminal.finishes = "m/a"
    result = spool.write([store("m/a"), terminal, store("m/b")], (), 0)
    assert result.synced
    for callback in result.stored:
        callback()
    assert acked == ["m/a", "m/b"]
    assert [r.key for r in spool.unfinished_requests()] == ["m/b"]
    assert spool.request_keys == {"m/b"}
    spool.write([FinishRequest("m/b")], (), 0)
    assert spool.unfinished_requests() == [] and spool.request_keys == set()
    assert spool.count == 1  # the terminal message itself waits for its acknowledgement
    spool.close()


def test_a_batch_stores_and_deletes_requests_in_a_few_statements(tmp_path: Path):
    """Hundreds of requests stored in one batch and finished in the next: the rows arrive and
    go in a few multi-row statements (each statement costs the writer a release and retake of
    the GIL), power-of-two pieces of at most `INSERT_REQUESTS` / `DELETE_REQUESTS` rows, with
    the same rows as one statement each."""
    from agent.delivery.spool_items import FinishRequest, StoreRequest
    from agent.delivery.spool_sql import DELETE_REQUESTS, INSERT_REQUESTS

    spool = Spool(tmp_path / "s.sqlite", max_bytes=1 << 26, max_messages=100_000)
    statements = recording(spool)
    count = DELETE_REQUESTS + 10  # more than one statement of each kind
    assert (INSERT_REQUESTS, DELETE_REQUESTS) == (128, 512)
    keys = [f"m/r{n:05d}" for n in range(count)]
    spool.request_keys.update(keys)
    stores = [
        StoreRequest(key, f"edge/d/infer/m{n % 3}", b"p%d" % n, 1 + n % 2, None, b"c") for
        n, key in enumerate(keys)
    ]  # fmt: skip
    spool.write([*stores, stores[0]], (), 0)  # a store queued twice is stored once
    assert [r.key for r in spool.unfinished_requests()] == keys
    stored = {r.key: r for r in spool.unfinished_requests()}
    assert stored[keys[4]].payload == b"p4" and stored[keys[4]].qos == 1
    assert stored[keys[5]].topic == "edge/d/infer/m2" and stored[keys[5]].correlation == b"c"
    inserts = [s for s in statements.executed if s.startswith("INSERT OR IGNORE INTO requests")]
    assert len(inserts) == 6  # 522 = 4 x 128 + 8 + 2

    # The next batch finishes all but the last two and stores one more: deletions first.
    statements.executed.clear()
    finishes = [FinishRequest(key) for key in keys[:-2]]
    extra = StoreRequest("m/extra", "t", b"x", 1, None, None)
    spool.request_keys.add("m/extra")
    spool.write([*finishes, extra], (), 0)
    assert [r.key for r in spool.unfinished_requests()] == [*keys[-2:], "m/extra"]
    assert spool.request_keys == {*keys[-2:], "m/extra"}
    deletes = [s for s in statements.executed if s.startswith("DELETE FROM requests")]
    assert len(deletes) == 2  # 520 = 512 + 8
    spool.close()


def test_multi_row_statements_come_in_a_few_sizes(tmp_path: Path):
    """Batches of every size from 1 to 200 messages and requests: the spool prepares a
    statement per power-of-two piece, so the connection's statement cache holds a few dozen
    statements, not one per row count (which took megabytes)."""
    from agent.delivery.spool_items import FinishRequest, StoreRequest
    from agent.delivery.spool_sql import pieces

    assert pieces(0, 64) == [] and pieces(1, 64) == [1]
    assert pieces(37, 64) == [32, 4, 1] and pieces(200, 64) == [64, 64, 64, 8]
    spool = Spool(tmp_path / "s.sqlite", max_bytes=1 << 28, max_messages=1_000_000)
    statements = recording(spool)
    next_id = 0
    for size in range(1, 201):
        messages = []
        for _ in range(size):
            next_id += 1
            messages.append(OutMessage("t/s", b"m", 1, stream="m/s", spool_id=next_id))
        keys = [f"m/{size}-{n}" for n in range(size)]
        spool.request_keys.update(keys)
        spool.write([*messages, *(StoreRequest(k, "t", b"p", 1, None, None) for k in keys)], (), 0)
        spool.write([FinishRequest(k) for k in keys], (), 0)
    assert len(spool.load_after(0, 100_000)) == sum(range(1, 201))
    assert not spool.unfinished_requests()
    assert len({s for s in statements.executed if s.startswith("INSERT INTO messages")}) == 7
    assert len({s for s in statements.executed if s.startswith("INSERT OR IGNORE")}) == 8
    assert len({s for s in statements.executed if s.startswith("DELETE FROM requests")}) == 8
    spool.close()


def test_an_fsync_only_where_a_stored_request_still_needs_the_disk(tmp_path: Path):
    """A request stored and settled in one batch (answered, each reply acknowledged by the
    broker, or answered at QoS 0) needs nothing on disk: no fsync before its acknowledgement.
    One with a reply the broker may not have, or not answered yet, is fsynced."""
    from agent.delivery.spool_items import FinishRequest, StoreRequest

    spool = Spool(tmp_path / "s.sqlite", max_bytes=1 << 20, max_messages=100)
    statements = recording(spool)
    acknowledged: list[str] = []

    def store(key: str) -> StoreRequest:
        spool.request_keys.add(key)
        return StoreRequest(key, "t", b"req", 1, None, None, lambda: acknowledged.append(key))

    def reply(key: str, last: bool) -> OutMessage:
        out = message(key, 1)
        out.spool_id = spool.allocate_id()
        out.finishes = key if last else None
        return out

    def batch(items: list[object], acks: list[int]) -> bool:
        statements.executed.clear()
        result = spool.write(items, acks, 0)  # type: ignore[arg-type]
        for callback in result.stored:
            callback()
        fsynced = "PRAGMA synchronous=FULL" in statements.executed
        assert fsynced == result.synced
        return result.synced

    first, last = reply("m/a", False), reply("m/a", True)
    assert not batch([store("m/a"), first, last], [first.spool_id, last.spool_id])
    assert not batch([store("m/q0"), FinishRequest("m/q0")], [])  # a QoS 0 answer
    first, last = reply("m/b", False), reply("m/b", True)
    assert batch([store("m/b"), first, last], [last.spool_id])  # `first` not acknowledged
    assert batch([store("m/c"), reply("m/d", True)], [])  # m/c not answered yet
    assert acknowledged == ["m/a", "m/q0", "m/b", "m/c"]
    assert [r.key for r in spool.unfinished_requests()] == ["m/c"]
    assert spool.request_keys == {"m/c"}
    spool._db = statements.db
    spool.close()


@pytest.mark.parametrize("payload_size", [40, 134, 20_000])
def test_the_caps_count_what_the_rows_take_on_disk(tmp_path: Path, payload_size: int):
    """`max_bytes` bounds the file, not only the payloads (a small chunk's row is mostly topic,
    keys and indexes): the spool's count follows the file within a fifth either way."""
    spool = Spool(tmp_path / "s.sqlite", max_bytes=1 << 40, max_messages=10**9)
    counted = 0
    for request in range(40):
        rid = f"req-{request:08d}-abcdef"
        stream = f"decoder/{rid}"
        messages = [
            OutMessage(f"edge/dev/result/decoder/{rid}", os.urandom(payload_size), 1,
                       stream=stream, rid=rid, seq=seq, spool_id=spool.allocate_id())
            for seq in range(50 if payload_size < 5000 else 5)
        ]  # fmt: skip
        counted += sum(stored_bytes(m) for m in messages)
        spool.write(messages, [m.spool_id for m in messages[::2]], 0)
    assert spool.bytes + spool.history_bytes == counted
    db = sqlite3.connect(tmp_path / "s.sqlite")
    pages, free, page_size = (
        db.execute(f"PRAGMA {name}").fetchone()[0]
        for name in ("page_count", "freelist_count", "page_size")
    )
    db.close()
    spool.close()
    on_disk = (pages - free) * page_size
    assert 0.8 < on_disk / counted < 1.25, (on_disk, counted)


def test_a_young_unsettled_request_waits_for_the_next_batch_instead_of_an_fsync():
    """The batch ends before a request stored moments ago and not answered yet, where every
    request before it is settled; an old unsettled one makes the whole batch durable."""
    from agent.delivery.spool_items import FinishRequest, StoreRequest, settled_prefix

    def store(key: str, queued_at: float) -> StoreRequest:
        return StoreRequest(key, "t", b"req", 1, None, None, queued_at=queued_at)

    def reply(key: str, spool_id: int) -> OutMessage:
        out = message(key, 1)
        out.spool_id, out.finishes = spool_id, key
        return out

    now = 100.0
    a, b, c = store("m/a", now - 0.004), store("m/b", now - 0.003), store("m/c", now - 0.001)
    answered = [a, reply("m/a", 1), b, reply("m/b", 2)]
    assert settled_prefix(answered, [1, 2], now, 0.005) == 4  # all settled: all of it
    assert settled_prefix([*answered, c], [1, 2], now, 0.005) == 4  # c waits
    # b's reply not acknowledged yet and b is young: the batch ends before b.
    assert settled_prefix([*answered, c], [1], now, 0.005) == 2
    # b answered only after c was stored: ending before c would leave b unanswered, so the
    # batch ends before b.
    interleaved = [a, reply("m/a", 1), b, c, FinishRequest("m/b")]
    assert settled_prefix(interleaved, [1], now, 0.005) == 2
    # An unsettled request older than the grace: the disk is needed anyway, write it all.
    old = store("m/old", now - 0.010)
    assert settled_prefix([old, *answered, c], [1, 2], now, 0.005) == 6
    assert settled_prefix([c], [], now, 0.005) == 0


def _submit_store(spool: Spool, writer: SpoolWriter, key: str, stored: list[str]) -> None:
    """Queue the store of request `key`; once it is on disk, its key is appended to `stored`."""
    spool.request_keys.add(key)
    writer.submit(StoreRequest(key, "t", b"req", 1, None, None, lambda: stored.append(key)))


def test_the_writer_fsyncs_nothing_for_a_stream_of_fast_requests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Requests answered (and their replies acknowledged) soon after they arrive, one after
    the other: each is acknowledged to the broker without a single fsync; one that stays
    unanswered past the grace is fsynced and acknowledged."""
    from agent.delivery import spool_writer
    from agent.delivery.spool_items import StoreRequest

    # A grace no scheduling hiccup of a busy CI machine reaches, for the fast requests.
    monkeypatch.setattr(spool_writer, "SETTLE_GRACE_S", 2.0)

    with recorded_writer(tmp_path / "s.sqlite") as (spool, statements, writer):
        stored: list[str] = []
        for n in range(40):
            key = f"m/{n}"
            _submit_store(spool, writer, key, stored)
            answer = message(key, 1)
            answer.spool_id, answer.finishes = spool.allocate_id(), key
            time.sleep(0.0005)  # the model run
            writer.submit(answer)
            writer.ack(answer.spool_id)  # the broker's PUBACK
            writer.nudge()  # the worker's, after the reply went out
            time.sleep(0.0005)
        deadline = time.monotonic() + 5
        while len(stored) < 40 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stored == [f"m/{n}" for n in range(40)]
        assert "PRAGMA synchronous=FULL" not in statements.executed
        assert spool.unfinished_requests() == []

        monkeypatch.setattr(spool_writer, "SETTLE_GRACE_S", 0.02)
        spool.request_keys.add("m/slow")
        writer.submit(
            StoreRequest("m/slow", "t", b"req", 1, None, None, lambda: stored.append("m/slow"))
        )
        writer.nudge()
        deadline = time.monotonic() + 5
        while "m/slow" not in stored and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stored[-1] == "m/slow"  # acknowledged unanswered, once it was on disk
        assert "PRAGMA synchronous=FULL" in statements.executed
        assert [r.key for r in spool.unfinished_requests()] == ["m/slow"]


def test_the_writer_calls_after_callbacks_once_per_batch_that_ran_callbacks(tmp_path: Path):
    """The callbacks queue acknowledgements; `after_callbacks` has them sent, once for all
    the callbacks of a batch (not once each), and not for a batch without any."""
    from agent.delivery.spool_items import AfterWrite
    from agent.delivery.spool_writer import SpoolWriter

    spool = Spool(tmp_path / "s.sqlite", max_bytes=1 << 24, max_messages=10_000)
    events: list[str] = []
    writer = SpoolWriter(
        spool,
        protected_after=lambda: 0,
        on_written=lambda n, b: None,
        after_callbacks=lambda: events.append("kick"),
    )
    writer.start()
    try:
        for n in range(5):
            _submit_store(spool, writer, f"m/{n}", events)
        writer.submit(AfterWrite(lambda spool: events.append("after")))
        assert writer.flush(5)
        assert events == ["m/0", "m/1", "m/2", "m/3", "m/4", "after", "kick"]
        writer.submit(message("s", 1))  # a message alone: no callback, no kick
        assert writer.flush(5)
        assert events[-1] == "kick" and events.count("kick") == 1
    finally:
        writer.close()
        spool.close()


def test_a_spool_opened_read_only_is_opened_again_for_writes(tmp_path: Path) -> None:
    """SQLite opens a file it cannot write read-only (a disk remounted read-only after a
    crash), and that connection stays so: every write failed for the life of the process,
    although the disk took writes again."""
    spool = Spool(tmp_path / "spool.sqlite", max_bytes=1 << 20, max_messages=100)
    try:
        spool._db.close()
        spool._db = sqlite3.connect(
            f"file:{tmp_path / 'spool.sqlite'}?mode=ro", uri=True, check_same_thread=False
        )
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            spool.probe()
        spool.probe()  # the disk is writable: the connection opened again takes it
        assert spool.store_request("m/r", "t", b"x", 1, None, None)
        assert [r.key for r in spool.unfinished_requests()] == ["m/r"]
    finally:
        spool.close()
