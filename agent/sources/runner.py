"""One source's thread, frame slot, scheduler ticket and stream; the manager of all of them."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from agent.config import AgentConfig, SourceConfig
from agent.delivery.outbox import OutboxClosed, OutMessage
from agent.inference.preprocess import PreprocessError, preprocess
from agent.inference.streaming import PART_OVERHEAD, ReplyStream, encode_with_outputs
from agent.models.backends.base import Array, InferenceError, TensorSpec
from agent.models.manager import LoadedVersion, ModelManager
from agent.ops.metrics import LATENCY_BUCKETS, PREFIX
from agent.protocol import wire
from agent.sources.base import FIELD, Outcome, Reader, Record, SourceError
from agent.sources.readers import (
    FolderReader,
    PipeReader,
    SyntheticReader,
    VideoReader,
    describe_where,
)
from agent.sources.seq import SeqStore

log = logging.getLogger(__name__)

CONSECUTIVE_ERRORS_TO_FAIL = 20  # frames in a row that fail: the source is reopened
CONSECUTIVE_BAD_RECORDS_TO_FAIL = 100
ERROR_LOG_INTERVAL_S = 10.0
JOIN_TIMEOUT_S = 5.0
CONTINUE_S = 0.5  # a worker goes on with a source's frames this long while nothing waits

State = Literal["starting", "running", "failed", "finished", "stopped"]


@dataclass
class Frame:
    index: int
    record: Record
    captured_ns: int  # wall clock, sent as `frame_ts`
    captured: float  # monotonic, for the latency

    def finish(self, outcome: Outcome) -> None:
        if self.record.on_done is not None:
            try:
                self.record.on_done(outcome)
            except Exception:
                log.exception("source: finishing frame %d failed", self.index)


@dataclass
class Stats:
    frames: int = 0  # read from the source
    published: int = 0  # results handed to the outbox
    messages: int = 0  # stream messages (parts count one each)
    dropped: int = 0  # replaced by a newer frame (latest)
    errors: int = 0  # frames that failed (bad input, model error, no model)
    bad_inputs: int = 0  # of which: the input was unusable
    failures: int = 0  # times the source itself failed and was retried
    queue_full: int = 0  # the scheduler queue had no room for the source's ticket
    latency_s: float = 0.0  # last frame: capture to outbox
    infer_s: float = 0.0  # last frame: in the model
    max_pending: int = 0


class SourceStream(ReplyStream):
    """The endless stream of one source: chunk messages only, seq kept by a SeqStore."""

    seqs: SeqStore | None = None

    def frame(self, outputs: Mapping[str, Array], index: int, extra: dict[str, Any]) -> int:
        """Queue the result of one frame; the number of messages it took (parts)."""
        outputs_cbor = wire.encode_outputs(outputs)
        if len(outputs_cbor) + PART_OVERHEAD <= self.max_chunk_bytes:
            self._reserve(1)
            self._emit(
                encode_with_outputs(self._fields("chunk", index=index, **extra), outputs_cbor)
            )
            self.chunks += 1
            return 1
        pieces = wire.split_parts(outputs_cbor, self.max_chunk_bytes - PART_OVERHEAD)
        self._reserve(len(pieces))
        for k, data in enumerate(pieces):
            fields = self._fields("chunk", index=index, part=[k, len(pieces)], data=data, **extra)
            self._emit(wire.encode_payload(fields))
            self.chunks += 1
        return len(pieces)

    def _reserve(self, count: int) -> None:
        if self.seqs is not None:
            self.seqs.ensure(self.seq + count)


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
Send = Callable[[OutMessage], None]


class SourceRunner:
    """One source: its thread, its waiting frames, its stream, its counters."""

    def __init__(
        self,
        config: SourceConfig,
        *,
        agent_config: AgentConfig,
        models: ModelManager,
        submit: Submit,
        send: Send,
        on_event: Callable[[dict[str, Any]], None],
        limits: wire.Limits,
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
        self._cond = threading.Condition()
        self._scheduled = False  # a ticket is queued, or a worker runs the source's frames
        self._closed = False
        self._index = 0
        self._consecutive_errors = 0
        self._trouble: str | None = None  # set by workers: too many failing frames
        self._last_error_log = 0.0
        self._unlogged_errors = 0
        self._bad_records_in_row = 0
        self.state: State = "starting"
        self.last_error: str | None = None
        self.stats = Stats()
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
            send=send,
            stream_key=f"source/{config.name}",
        )
        self.thread = threading.Thread(target=self._main, name=f"source-{config.name}", daemon=True)

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
                self._trouble = None
                self._consecutive_errors = 0
                self.state = "running"
                log.info("source %s: %s running (%s)", self.name, self.config.kind, self._where())
                self._on_event({"type": "source_started", "source": self.name, **self._about()})
                limit = self.config.max_frames
                for record in reader.records():
                    if self._trouble is not None:
                        raise SourceError(self._trouble)
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

    def _where(self) -> str:
        if self.config.kind == "synthetic":
            return f"{self.config.rate_hz:g} Hz, {self.config.fill}"
        return describe_where(self.config)

    def _about(self) -> dict[str, Any]:
        return {"kind": self.config.kind, "model": self.config.model}

    def _backoff(self, attempt: int) -> float:
        low, high = self.config.retry_min_s, self.config.retry_max_s
        return float(min(high, low * 2.0 ** min(attempt, 30)) * random.uniform(0.5, 1.0))

    def _failed(self, problem: str, delay: float) -> None:
        self.state = "failed"
        self.last_error = problem
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

    def _open_reader(self, specs: Sequence[TensorSpec]) -> Reader:
        kind = self.config.kind
        if kind == "synthetic":
            return SyntheticReader(self, specs)
        if kind == "video":
            return VideoReader(self)
        if kind == "folder":
            return FolderReader(self, self._bad_record)
        return PipeReader(self, self._bad_record)

    def _bad_record(self, message: str) -> None:
        """A file or record that could not be read: one error, never the source."""
        self.stats.errors += 1
        self.stats.bad_inputs += 1
        self._log_error(message)

    def _take(self, record: Record) -> None:
        """Number, stamp and queue one record (on the source thread)."""
        index = self._index
        self._index += 1
        self.stats.frames += 1
        if record.error is not None:
            self._bad_record(f"record {index}: {record.error}")
            self._bad_streak(record.error)
            return
        self._good_streak()
        frame = Frame(index, record, time.time_ns(), time.monotonic())
        # Under `all` every frame runs anyway: prepare it here, beside the busy worker, and
        # queue the (usually smaller) model input instead of the raw frame.
        if not self._latest and not record.prepared and not self._prepare_early(frame):
            return
        self._offer(frame)

    def _bad_streak(self, error: str) -> None:
        self._bad_records_in_row += 1
        if self._bad_records_in_row >= CONSECUTIVE_BAD_RECORDS_TO_FAIL:
            self._bad_records_in_row = 0
            raise SourceError(f"{CONSECUTIVE_BAD_RECORDS_TO_FAIL} bad records in a row: {error}")

    def _good_streak(self) -> None:
        self._bad_records_in_row = 0

    def _prepare_early(self, frame: Frame) -> bool:
        try:
            with self._models.lease(self.config.model) as lease:
                frame.record.fields = self._prepare(frame.record, lease.loaded)
                frame.record.prepared = True
            return True
        except wire.WireError as e:  # no model now: the frame waits for the worker's try
            self._frame_failed(frame, e.message, retry=True)
        except PreprocessError as e:
            self._frame_failed(frame, str(e), bad_input=True)
        return False

    def _offer(self, frame: Frame) -> None:
        dropped: Frame | None = None
        with self._cond:
            if self._latest:
                if self._pending:
                    dropped = self._pending.popleft()
                    self.stats.dropped += 1
            else:
                while len(self._pending) >= self._bound and not self.stop_event.is_set():
                    self._kick_locked()  # a ticket refused earlier: try again
                    self._cond.wait(0.1)
                if self.stop_event.is_set():
                    dropped = frame
            if dropped is not frame:
                self._pending.append(frame)
                self.stats.max_pending = max(self.stats.max_pending, len(self._pending))
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
        return len(self._pending)

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
        while True:
            with self._cond:
                frame = self._pending.popleft() if self._pending else None
                self._cond.notify_all()  # room for a waiting source thread (policy all)
                if frame is None:
                    self._scheduled = False
                    return
            go_on = False
            try:
                result = self._infer(frame)
                if result is not None:
                    self._publish(frame, *result)
            finally:
                with self._cond:
                    go_on = bool(
                        self._pending
                        and not self._closed
                        and not self.stop_event.is_set()
                        and self._waiting() == 0
                        and time.monotonic() < until
                    )
                    if not go_on:
                        self._scheduled = False
                        self._kick_locked()
            if not go_on:
                return

    def _infer(self, frame: Frame) -> tuple[dict[str, Array], int, float] | None:
        """The frame's outputs, the version that ran and the time in the model; None when
        the frame failed (counted, logged, finished)."""
        try:
            lease = self._models.lease(self.config.model)
        except wire.WireError as e:
            self._frame_failed(frame, e.message, retry=True)
            return None
        with lease:
            loaded = lease.loaded
            try:
                record = frame.record
                inputs = record.fields if record.prepared else self._prepare(record, loaded)
                inputs = wire.validate_inputs(self.name, inputs, loaded.session.inputs)
            except (wire.WireError, PreprocessError) as e:
                self._frame_failed(frame, getattr(e, "message", str(e)), bad_input=True)
                return None
            started = time.perf_counter()
            try:
                outputs = self._select(loaded.session.run(inputs), loaded)
            except InferenceError as e:
                self._frame_failed(frame, f"model_error: {e}", bad_input=True)
                return None
            except Exception as e:
                log.exception("source %s: the model failed on frame %d", self.name, frame.index)
                self._frame_failed(frame, f"model_error: {type(e).__name__}: {e}")
                return None
            return outputs, loaded.version, time.perf_counter() - started

    def _publish(
        self, frame: Frame, outputs: dict[str, Array], version: int, infer_s: float
    ) -> None:
        """Queue the frame's result on the stream."""
        extra: dict[str, Any] = {"frame_ts": frame.captured_ns}
        if frame.record.file is not None:
            extra["file"] = frame.record.file
        self.stream.version = version
        try:
            messages = self.stream.frame(outputs, frame.index, extra)
        except OutboxClosed:
            frame.finish("retry")  # stopping: a folder's file stays for the next run
            return
        except (TypeError, ValueError, OSError) as e:
            self._frame_failed(frame, f"cannot publish the result: {e}")
            return
        latency = time.monotonic() - frame.captured
        stats = self.stats
        stats.published += 1
        stats.messages += messages
        stats.latency_s = latency
        stats.infer_s = infer_s
        self._consecutive_errors = 0
        if self._latency is not None:
            self._latency.observe(latency)
        if frame.record.on_done is not None:  # a folder's file moves once its result is stored
            self._after_written(lambda: frame.finish("done"))

    def _select(self, outputs: dict[str, Array], loaded: LoadedVersion) -> dict[str, Array]:
        """`outputs` of the source, else the model's `[stream] emit`, else every output."""
        names = self.config.outputs or loaded.config.stream.emit
        if not names:
            return outputs
        missing = [n for n in names if n not in outputs]
        if missing:
            raise InferenceError(f"the model has no output(s) {', '.join(missing)}")
        return {n: outputs[n] for n in names}

    def _prepare(self, record: Record, loaded: LoadedVersion) -> dict[str, Array]:
        """The record's fields as the model's inputs: mapped by name, then preprocessed."""
        pre = loaded.config.preprocess if self.config.preprocess else None
        names = [spec.name for spec in loaded.session.inputs]
        only = names[0] if len(names) == 1 else None
        fields = record.fields
        if self.config.inputs:
            missing = sorted(f for f in self.config.inputs.values() if f not in fields)
            if missing:
                raise PreprocessError(
                    f"no field(s) {', '.join(missing)} in the record (it has {', '.join(fields)})"
                )
            mapped = {name: fields[f] for name, f in self.config.inputs.items()}
        elif set(fields) == {FIELD}:
            target = pre.input if pre is not None and pre.input else only
            if target is None:
                raise PreprocessError(
                    f"the model has inputs {', '.join(names)}: map the frame to one with "
                    'inputs = { NAME = "frame" }'
                )
            mapped = {target: fields[FIELD]}
        else:
            mapped = dict(fields)
        if pre is not None:
            target = pre.input or only
            if target is not None and target in mapped:
                mapped[target] = preprocess(mapped[target], pre, bgr=record.bgr)
        return mapped

    def _frame_failed(
        self, frame: Frame, message: str, *, bad_input: bool = False, retry: bool = False
    ) -> None:
        self.stats.errors += 1
        if bad_input:
            self.stats.bad_inputs += 1
        self.last_error = message
        where = f"file {frame.record.file}" if frame.record.file else f"frame {frame.index}"
        self._log_error(f"{where}: {message}")
        frame.finish("retry" if retry else "failed")
        self._consecutive_errors += 1
        if self._consecutive_errors >= CONSECUTIVE_ERRORS_TO_FAIL:
            self._consecutive_errors = 0
            self._trouble = f"{CONSECUTIVE_ERRORS_TO_FAIL} frames in a row failed: {message}"

    def _log_error(self, message: str) -> None:
        """The first error at once, then at most one line every ERROR_LOG_INTERVAL_S."""
        now = time.monotonic()
        self._unlogged_errors += 1
        if now - self._last_error_log >= ERROR_LOG_INTERVAL_S:
            more = self._unlogged_errors - 1
            suffix = f" ({more} more since the last report)" if more else ""
            log.warning("source %s: %s%s", self.name, message[:300], suffix)
            self._last_error_log = now
            self._unlogged_errors = 0

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
        for frame in waiting:
            frame.finish("retry")
        if self._seqs is not None:
            self._seqs.close(self.stream.seq)

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


# --------------------------------------------------------------------------- the manager


class SourceManager:
    """Every configured source of one agent: started last, stopped first."""

    def __init__(
        self,
        config: AgentConfig,
        *,
        models: ModelManager,
        submit: Submit,
        send: Send,
        on_event: Callable[[dict[str, Any]], None],
        limits: wire.Limits,
        waiting: Callable[[], int] = lambda: 0,
        registry: CollectorRegistry | None = None,
        after_written: Callable[[Callable[[], None]], None] = lambda callback: callback(),
    ) -> None:
        latency = None
        if registry is not None and any(s.enabled for s in config.sources):
            latency = Histogram(
                f"{PREFIX}_source_latency_seconds",
                "From a frame's capture to its result handed to the outbox",
                ["source"],
                buckets=LATENCY_BUCKETS,
                registry=registry,
            )
        self.runners = [
            SourceRunner(
                source,
                agent_config=config,
                models=models,
                submit=submit,
                send=send,
                on_event=on_event,
                limits=limits,
                waiting=waiting,
                latency=latency,
                after_written=after_written,
            )
            for source in config.sources
            if source.enabled
        ]
        if registry is not None and self.runners:
            registry.register(SourceCollector(self))

    def __len__(self) -> int:
        return len(self.runners)

    def start(self) -> None:
        for runner in self.runners:
            runner.start()

    def stop(self, timeout: float = JOIN_TIMEOUT_S) -> None:
        """Stop reading: every source thread is told at once, then each is joined."""
        for runner in self.runners:
            runner.signal_stop()
        deadline = time.monotonic() + timeout
        for runner in self.runners:
            if not runner.join(max(0.1, deadline - time.monotonic())):
                log.warning("source %s: its thread did not stop in time", runner.name)

    def close(self) -> None:
        for runner in self.runners:
            runner.close()

    def snapshot(self) -> dict[str, dict[str, Any]]:
        return {runner.name: runner.snapshot() for runner in self.runners}

    def runner(self, name: str) -> SourceRunner:
        for runner in self.runners:
            if runner.name == name:
                return runner
        raise KeyError(name)


class SourceCollector(Collector):
    """Per-source counters and gauges, read from the runners at scrape time."""

    COUNTERS = (
        ("frames", "Frames or records read by each local source"),
        ("published", "Results of each local source handed to the outbox"),
        ("dropped", "Frames replaced by a newer one before a worker took them (latest)"),
        ("errors", "Frames of each local source that failed"),
        ("failures", "Times a local source failed and was reopened"),
    )

    def __init__(self, manager: SourceManager) -> None:
        self._manager = manager

    def collect(self) -> Iterable[Metric]:
        runners = self._manager.runners
        for key, help_text in self.COUNTERS:
            family = CounterMetricFamily(f"{PREFIX}_source_{key}", help_text, labels=["source"])
            for runner in runners:
                family.add_metric([runner.name], getattr(runner.stats, key))
            yield family
        pending = GaugeMetricFamily(
            f"{PREFIX}_source_pending_frames", "Frames waiting for a worker", labels=["source"]
        )
        up = GaugeMetricFamily(
            f"{PREFIX}_source_running", "1 while a local source is running", labels=["source"]
        )
        for runner in runners:
            pending.add_metric([runner.name], runner.pending)
            up.add_metric([runner.name], int(runner.state == "running"))
        yield pending
        yield up
