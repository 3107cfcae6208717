"""One source (`SourceRunner`): its thread, its waiting frames, its ticket in the scheduler
(`SourceJob`) and the worker's side of a frame, from the model to the stream."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Protocol

from prometheus_client import Histogram

from agent.config import SECRET_MASK, AgentConfig, SourceConfig
from agent.config.printing import url_secrets
from agent.delivery.outbox import OutboxClosed, OutMessage
from agent.inference.send_hold import SendHold
from agent.models.backends.base import Array, TensorSpec
from agent.models.manager import ModelManager
from agent.models.preprocess import PreprocessError
from agent.protocol.errors import Limits, WireError
from agent.protocol.requests import validate_inputs
from agent.sources.base import Reader, Record, SourceError, describe_where
from agent.sources.counters import FrameErrors, Stats
from agent.sources.frames import Frame, model_inputs, postprocessed, select_outputs
from agent.sources.readers import open_reader
from agent.sources.seq import SeqStore
from agent.sources.stream import SourceStream
from agent.threads import NamedThread

log = logging.getLogger(__name__)

CONTINUE_S = 0.5  # a worker goes on with a source's frames this long while nothing waits

State = Literal["starting", "running", "failed", "finished", "stopped"]


class SourceJob:
    """The ticket a source keeps in the scheduler queue; the worker picks the frame."""

    __slots__ = ("runner",)

    def __init__(self, runner: SourceRunner) -> None:
        self.runner = runner

    def run(self, queued_s: float) -> None:
        self.runner.run_one(queued_s)

    def cancel(self) -> None:
        """The scheduler stops with this ticket still queued."""
        self.runner.ticket_dropped()


Submit = Callable[[SourceJob, int], bool]


class Sender(Protocol):
    """Where a source's messages go (`agent.inference.reply_stream.ReplySender`)."""

    def send(self, messages: Sequence[OutMessage], *, kick: bool = True) -> None:
        """Queue `messages`, waiting for room; `kick=False`: published by the next `kick`."""

    def kick(self) -> None:
        """Publish what was queued without a kick."""

    def hand_off(self) -> None:
        """Have the io thread publish what was queued without a kick."""

    def drive(self) -> None:
        """`kick`, reading the broker's answers on this thread too."""


class SourceRunner:
    """One source: its thread, its waiting frames, its stream, its counters."""

    def __init__(
        self,
        config: SourceConfig,
        *,
        agent_config: AgentConfig,
        models: ModelManager,
        submit: Submit,
        sender: Sender,
        on_event: Callable[[dict[str, Any]], None],
        limits: Limits,
        waiting: Callable[[], int] = lambda: 0,
        latency: Histogram | None = None,
        after_written: Callable[[Callable[[], None]], None] = lambda callback: callback(),
    ) -> None:
        self.config = config
        self._after_written = after_written  # runs a callback once queued results are on disk
        self._waiting = waiting  # jobs queued for a worker (the scheduler's depth)
        self.name = config.name
        self.limits = limits
        self.stop_event = threading.Event()
        self._models = models
        self._submit = submit
        self._on_event = on_event
        self._latency = latency.labels(config.name) if latency is not None else None
        self._latest = config.policy == "latest"
        self._bound = 1 if self._latest else config.queue
        self._pending: deque[Frame] = deque()
        self._pending_frames = 0  # the frames the records in `_pending` stand for (`count`)
        self._cond = threading.Condition()
        self._scheduled = False  # a ticket is queued, or a worker runs the source's frames
        self._closed = False
        self._index = 0
        self.state: State = "starting"
        self.stats = Stats()
        self._errors = FrameErrors(config.name, self.stats)
        self.seq_path = agent_config.state_dir / "sources" / f"{config.name}.seq"
        self._seqs: SeqStore | None = None
        root = agent_config.root_topic
        self.stream = SourceStream(
            request_id=config.name,
            model=config.model,
            version=0,
            topic=f"{root}/stream/{config.name}",
            qos=agent_config.mqtt.qos.reply if config.qos is None else config.qos,
            max_chunk_bytes=agent_config.limits.max_chunk_bytes,
            stream_key=f"source/{config.name}",
        )
        self._sender = sender
        self.thread = NamedThread(target=self._main, name=f"source-{config.name}", daemon=True)

    # -- the source thread -----------------------------------------------------------------

    def idle(self) -> None:
        self.kick()

    def _main(self) -> None:
        attempt = 0
        while not self.stop_event.is_set():
            reader: Reader | None = None
            problem: str | None = None
            try:
                self._open_seqs()
                specs = self._serving_inputs()
                reader = self._open_reader(specs)
                self._errors.trouble = None
                self._errors.consecutive = 0
                self.state = "running"
                log.info("source %s: %s running (%s)", self.name, self.config.kind, self._where())
                self._on_event({"type": "source_started", "source": self.name, **self._about()})
                limit = self.config.max_frames
                for record in reader.records():
                    if self._errors.trouble is not None:
                        raise SourceError(self._errors.trouble)
                    self._take(record)
                    attempt = 0
                    if limit is not None and self._index >= limit:
                        break
                if self.stop_event.is_set():
                    break
                self.state = "finished"
                log.info("source %s: finished after %d frame(s)", self.name, self._index)
                self._on_event(
                    {"type": "source_finished", "source": self.name, "frames": self._index}
                )
                return
            except SourceError as e:
                problem = str(e)
            except Exception as e:
                log.exception("source %s: unexpected failure", self.name)
                problem = f"{type(e).__name__}: {e}"
            finally:
                if reader is not None:
                    try:
                        reader.close()
                    except Exception:
                        log.exception("source %s: closing failed", self.name)
            if self.stop_event.is_set():
                break
            delay = self._backoff(attempt)
            attempt += 1
            self._failed(problem or "unknown failure", delay)
            if self.stop_event.wait(delay):
                break
        if self.state != "finished":
            self.state = "stopped"

    def _open_reader(self, specs: Sequence[TensorSpec]) -> Reader:
        """The source's reader, open (a kind with its own runner opens its own)."""
        return open_reader(self, specs, self._errors.bad_record)

    def _where(self) -> str:
        if self.config.kind == "synthetic":
            return f"{self.config.rate_hz:g} Hz, {self.config.fill}"
        return describe_where(self.config)

    def _about(self) -> dict[str, Any]:
        return {"kind": self.config.kind, "model": self.config.model}

    def _backoff(self, attempt: int) -> float:
        """Doubling `retry_min_s` up to `retry_max_s`, jittered down to half, never below min."""
        low, high = self.config.retry_min_s, self.config.retry_max_s
        delay = min(high, low * 2.0 ** min(attempt, 30))
        return random.uniform(max(low, delay / 2), delay)

    def _failed(self, problem: str, delay: float) -> None:
        url = self.config.url
        for secret in url_secrets(str(url)) if url is not None else ():
            problem = problem.replace(secret, SECRET_MASK)  # a reader's error quoting its URL
        self.state = "failed"
        self._errors.last_error = problem
        self.stats.failures += 1
        log.error("source %s failed: %s (retrying in %.1f s)", self.name, problem, delay)
        self._on_event(
            {
                "type": "source_failed",
                "source": self.name,
                **self._about(),
                "error": problem[:300],
                "retry_in_s": round(delay, 3),
                "failures": self.stats.failures,
            }
        )

    def _open_seqs(self) -> None:
        if self._seqs is None:
            self._seqs = SeqStore(self.seq_path, self.config.seq_reserve)
            self.stream.seqs = self._seqs
            self.stream.seq = self._seqs.start

    def _serving_inputs(self) -> Sequence[TensorSpec]:
        specs = self._models.serving_inputs(self.config.model)
        if specs is None:
            raise SourceError(f"model '{self.config.model}' has no ready version")
        return specs

    def _take(self, record: Record) -> None:
        """Number, stamp and queue one record (on the source thread): a frame, or `count` of
        them (a pcm source's chunks), numbered one after the other."""
        limit = self.config.max_frames
        if limit is not None:
            record = record.first(limit - self._index)
        index = self._index
        self._index += record.count
        self.stats.frames += record.count
        if record.error is not None:
            self._errors.bad_record(f"record {index}: {record.error}")
            self._errors.bad_streak(record.error)
            return
        self._errors.good_streak()
        frame = Frame(index, record, time.time_ns(), time.monotonic())
        # Under `all` every frame runs anyway: prepare it here, beside the busy worker, and
        # queue the (usually smaller) model input instead of the raw frame.
        if not self._latest and not record.prepared and not self._prepare_early(frame):
            return
        self._offer(frame)

    def _prepare_early(self, frame: Frame) -> bool:
        try:
            with self._models.lease(self.config.model) as lease:
                frame.record.fields = model_inputs(self.config, frame.record, lease.loaded)
                frame.record.prepared = True
            return True
        except WireError as e:  # no model now: the frame waits for the worker's try
            self._errors.frame_failed(frame, e.message, retry=True)
        except PreprocessError as e:
            self._errors.frame_failed(frame, str(e), bad_input=True)
        return False

    def _offer(self, frame: Frame) -> None:
        dropped: Frame | None = None
        with self._cond:
            if self._latest:
                if self._pending:
                    dropped = self._pending.popleft()
                    self._pending_frames -= dropped.record.count
                    self.stats.dropped += 1
            else:
                while self._pending_frames >= self._bound and not self.stop_event.is_set():
                    self._kick_locked()  # a ticket refused earlier: try again
                    self._cond.wait(0.1)
                if self.stop_event.is_set():
                    dropped = frame
            if dropped is not frame:
                self._pending.append(frame)
                self._pending_frames += frame.record.count
                self.stats.max_pending = max(self.stats.max_pending, self._pending_frames)
            self._kick_locked()
        if dropped is not None:
            dropped.finish("dropped")

    # -- scheduling ------------------------------------------------------------------------

    def kick(self) -> None:
        with self._cond:
            self._kick_locked()

    def _kick_locked(self) -> None:
        if self._scheduled or self._closed or not self._pending:
            return
        self._scheduled = True
        if not self._submit(SourceJob(self), self.config.priority):
            self._scheduled = False
            self.stats.queue_full += 1

    def ticket_dropped(self) -> None:
        with self._cond:
            self._scheduled = False

    @property
    def pending(self) -> int:
        return self._pending_frames

    # -- the worker side -------------------------------------------------------------------

    def run_one(self, queued_s: float) -> None:
        """On an inference worker: the frame whose turn it is, through the model, out.

        While nothing else waits for a worker (no request, no other source), the worker goes
        on with the source's next frame itself, for up to CONTINUE_S, instead of queueing a
        ticket: consecutive frames then run on one thread, which keeps its caches warm (on
        the 2-core test machine, frames alternating between two workers ran ~10% slower).
        Anything queued meanwhile waits for one frame at most, as behind any running job.
        """
        until = time.monotonic() + CONTINUE_S
        # frames run back to back share socket writes
        hold = SendHold(self._sender.kick, self._sender.hand_off, drive=self._sender.drive)
        try:
            self._run_frames(until, hold)
        finally:
            hold.release()

    def _run_frames(self, until: float, hold: SendHold) -> None:
        """`run_one`'s loop: the frames whose turn it is, while it may go on."""
        while True:
            with self._cond:
                frame = self._pending.popleft() if self._pending else None
                if frame is not None:
                    self._pending_frames -= frame.record.count
                self._cond.notify_all()  # room for a waiting source thread (policy all)
                if frame is None:
                    self._scheduled = False
                    return
            go_on = False
            try:
                self._process(frame, hold)
            finally:
                with self._cond:
                    go_on = bool(
                        self._pending
                        and not self._closed
                        and not self._others_wait()
                        and time.monotonic() < until
                    )
                    if not go_on:
                        self._scheduled = False
                        self._kick_locked()
            if not go_on:
                return

    def _others_wait(self) -> bool:
        """Something else waits for a worker (a request, another source), or the source
        stops: the worker goes no further with this source's frames, not even with the rest
        of a record (they wait for the source's next ticket)."""
        return self._waiting() > 0 or self.stop_event.is_set()

    def _put_back(self, frame: Frame, chunk: int) -> None:
        """The frame's record from its frame `chunk` on, first in line again: a new ticket
        (`_run_frames`) runs it after what waits."""
        rest = Frame(
            frame.index + chunk, frame.record.rest(chunk), frame.captured_ns, frame.captured
        )
        with self._cond:
            self._pending.appendleft(rest)
            self._pending_frames += rest.record.count

    def _process(self, frame: Frame, hold: SendHold) -> None:
        """The frame through the model, its result queued on the stream."""
        result = self._infer(frame)
        if result is not None:
            self._publish(frame, *result, hold)

    def _infer(self, frame: Frame) -> tuple[dict[str, Array], int, float] | None:
        """The frame's outputs, the version that ran and the time in the model; None when
        the frame failed (counted, logged, finished)."""
        try:
            lease = self._models.lease(self.config.model)
        except WireError as e:
            self._errors.frame_failed(frame, e.message, retry=True)
            return None
        with lease:
            loaded = lease.loaded
            try:
                record = frame.record
                inputs = (
                    record.fields if record.prepared else model_inputs(self.config, record, loaded)
                )
                inputs = validate_inputs(self.name, inputs, loaded.session.inputs)
            except (WireError, PreprocessError) as e:
                self._errors.frame_failed(frame, getattr(e, "message", str(e)), bad_input=True)
                return None
            started = time.perf_counter()
            try:
                outputs = select_outputs(self.config, loaded.session.run(inputs), loaded)
                outputs = postprocessed(outputs, record, loaded)
            except Exception as e:
                self._errors.model_failed(frame, e, frame.index)
                return None
            return outputs, loaded.version, time.perf_counter() - started

    def _publish(
        self,
        frame: Frame,
        outputs: dict[str, Array],
        version: int,
        infer_s: float,
        hold: SendHold,
        chunk: int = 0,
        more: Mapping[str, Any] | None = None,
    ) -> None:
        """Queue the result of the frame's `chunk` (of its record's `count`) on the stream
        (published now, or with the next one's where this one ran fast: `hold`); `more`:
        keys the message carries besides (a transcription's `text`)."""
        extra: dict[str, Any] = {"frame_ts": frame.captured_ns}
        if frame.record.file is not None:
            extra["file"] = frame.record.file
        extra.update(frame.record.chunk_extra(chunk) or {})
        extra.update(more or {})
        self.stream.version = version
        try:
            messages = self.stream.frame(outputs, frame.index + chunk, extra)
            self._sender.send(self.stream.drain(), kick=False)
            hold.sent(messages, finished=False)
        except OutboxClosed:
            frame.finish("retry")  # stopping: a folder's file stays for the next run
            return
        except (TypeError, ValueError, OSError) as e:
            self.stream.drain()  # a frame's messages go out whole or not at all
            self._errors.frame_failed(frame, f"cannot publish the result: {e}")
            return
        latency = time.monotonic() - frame.captured
        stats = self.stats
        stats.published += 1
        stats.messages += messages
        stats.latency_s = latency
        stats.infer_s = infer_s
        self._errors.consecutive = 0
        if self._latency is not None:
            self._latency.observe(latency)
        if frame.record.on_done is not None:  # a folder's file moves once its result is stored
            self._after_written(lambda: frame.finish("done"))

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self.thread.start()

    def signal_stop(self) -> None:
        self.stop_event.set()
        with self._cond:
            self._cond.notify_all()

    def join(self, timeout: float) -> bool:
        if self.thread.is_alive():
            self.thread.join(timeout)
        return not self.thread.is_alive()

    def close(self) -> None:
        """After the workers stopped: forget waiting frames, save the exact next seq."""
        with self._cond:
            self._closed = True
            waiting = list(self._pending)
            self._pending.clear()
            self._pending_frames = 0
        for frame in waiting:
            frame.finish("retry")
        if self._seqs is not None:
            self._seqs.close(self.stream.seq)

    @property
    def last_error(self) -> str | None:
        """The last failure of the source or of one of its frames."""
        return self._errors.last_error

    def snapshot(self) -> dict[str, Any]:
        s = self.stats
        return {
            "kind": self.config.kind,
            "model": self.config.model,
            "state": self.state,
            "frames": s.frames,
            "published": s.published,
            "messages": s.messages,
            "dropped": s.dropped,
            "errors": s.errors,
            "bad_inputs": s.bad_inputs,
            "failures": s.failures,
            "pending": self.pending,
            "max_pending": s.max_pending,
            "next_seq": self.stream.seq,
            "latency_ms": round(s.latency_s * 1000, 3),
            "infer_ms": round(s.infer_s * 1000, 3),
            "last_error": self.last_error,
        }
