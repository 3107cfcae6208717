"""The one runner: every admitted request runs here, a single request as a batch of one.

On a worker thread (or, for a short request, on the network thread that read it) the runner
leases the model version once for the jobs it was handed, checks each job's inputs against
that version (an error answers that job alone), groups the jobs whose inputs can be joined,
and runs each group through its mode's strategy (`agent.inference.modes`). After every run
of the model it hands out the run's pieces with one emit rule:

* `stream: true`: each piece is a `chunk`; a member's last piece is followed by `end`;
* `stream: false`: a `whole` piece is the `result`; other pieces are collected and merged
  into one `result` after the last.

The requests a run finished are counted before their replies can reach anyone, then the
run's messages go to the outbox together (`ReplySender.send`). A model failure answers
every unfinished member with `model_error`; a member cancelled at shutdown gets
`shutting_down`; a member whose next chunk (or result) would pass its reply budget
(`limits.max_reply_bytes`) gets `too_large` after what it was sent, and leaves the run alone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from agent.delivery.outbox import OutboxClosed
from agent.inference import batching, generate, images, modes, sampling, texts
from agent.inference.job import Cancelled, Job
from agent.inference.modes import Arrays, Member, Piece, Run
from agent.inference.reply_stream import ReplyRefused, ReplySender
from agent.inference.scan import ScanCursor, session_params
from agent.inference.scan_sessions import ScanSessions
from agent.inference.send_hold import SendHold
from agent.inference.short_runs import ShortRuns
from agent.models.backends.base import InferenceError, TensorSpec
from agent.models.defaults import default_arrays, with_defaults
from agent.models.manager import LoadedVersion, ModelManager
from agent.ops.counters import Counters
from agent.ops.metrics import AgentMetrics
from agent.protocol.errors import WireError
from agent.protocol.requests import validate_inputs

log = logging.getLogger(__name__)

STOPPED_MESSAGE = "the agent stopped before the request finished"


class Runner:
    """`execute(jobs)` on a worker; `expire`/`cancel` for jobs that never ran."""

    def __init__(
        self,
        models: ModelManager,
        sender: ReplySender,
        *,
        counters: Counters,
        metrics: AgentMetrics,
        short_runs: ShortRuns,
    ) -> None:
        self._models = models
        self._sender = sender
        self._counters = counters
        self._metrics = metrics
        self._short_runs = short_runs
        self._running: set[Job] = set()
        self._running_lock = threading.Lock()
        self.scan_sessions = ScanSessions()

    def close(self) -> None:
        """Forget the scan sessions (the agent stops)."""
        self.scan_sessions.close()

    # -- entry points ------------------------------------------------------------------------

    def execute(self, jobs: Sequence[tuple[Job, float]]) -> None:
        """Run jobs of one model (and pinned version), each `(job, queued_s)`: one job, or the
        members of a batch the scheduler gathered."""
        started = time.monotonic()
        with self._running_lock:
            self._running.update(job for job, _ in jobs)
        try:
            self._execute_leased(jobs)
        finally:
            with self._running_lock:
                self._running.difference_update(job for job, _ in jobs)
        if len(jobs) == 1:
            self._record_short_run(jobs[0][0], time.monotonic() - started)

    def expire(self, job: Job) -> None:
        """A job whose deadline passed before a worker took it."""
        self._fail(job, "deadline_exceeded", "not started within deadline_ms")
        self._send_quietly([job])

    def cancel(self, job: Job) -> None:
        """A job still queued when the agent stops."""
        self._fail(job, "shutting_down", "the agent is stopping")
        self._send_quietly([job])

    def cancel_running(self) -> None:
        """The drain timeout passed: running jobs end at their next run of the model."""
        with self._running_lock:
            for job in self._running:
                job.cancelled.set()

    def abandon_running(self) -> int:
        """The agent stops and these still run (one run of the model outlasted the drain and
        its grace): each is answered `shutting_down` now, before the connection closes; what
        its run makes later finds its stream ended. Returns how many."""
        with self._running_lock:
            jobs = list(self._running)
        for job in jobs:
            self._fail(job, "shutting_down", STOPPED_MESSAGE)
        self._send_quietly(jobs)
        return len(jobs)

    # -- one lease, checks, groups -----------------------------------------------------------

    def _execute_leased(self, jobs: Sequence[tuple[Job, float]]) -> None:
        first = jobs[0][0].request
        try:
            with self._models.lease(first.model, first.version) as lease:
                loaded = lease.loaded
                members: list[Member] = []
                ready: list[tuple[Job, float]] = []
                for job, queued in jobs:
                    member = self._member(job, loaded)
                    if member is not None:
                        members.append(member)
                        ready.append((job, queued))
                if loaded.text is not None and loaded.config.stream.mode == "whole":
                    texts.pad_to_join(members, [job for job, _ in ready], loaded.text)
                for group in batching.groups([m.inputs for m in members]):
                    self._run_group(
                        loaded,
                        [members[i] for i in group],
                        [ready[i] for i in group],
                        batched=len(jobs) > 1,
                    )
        except WireError as e:  # the lease: the model or version went away meanwhile
            for job, _ in jobs:
                self._fail(job, e.code, e.message)
            self._send_quietly([job for job, _ in jobs])

    def _member(self, job: Job, loaded: LoadedVersion) -> Member | None:
        """The job's inputs checked against the leased version (an error answers the job)."""
        request, config, scan = job.request, loaded.config.stream, loaded.config.scan
        job.reply.version = loaded.version
        try:
            if loaded.generation is not None:  # mode = "generate": its own inputs and params
                params = sampling.replayable(request.params, request.id)
                ask = generate.ask_of(request.inputs, params, loaded.generation)
                images.bind_compression(job)
                return Member({}, 1, job.cancelled, generation=ask)
            inputs = _checked_inputs(job, loaded)
            if loaded.config.defaults:
                defaults = default_arrays(loaded.config.defaults, loaded.session.inputs)
                inputs = with_defaults(inputs, defaults)
            inputs = modes.initial_state(loaded.session, config, inputs, scan)
            select = modes.selected_outputs(
                config, [spec.name for spec in loaded.session.outputs], request.params
            )
            steps = modes.max_steps(config, request.params)
            member = Member(inputs, steps, job.cancelled, select)
            asked = session_params(request.params, scan=scan is not None)
            member.final = asked.final
            if asked.session is not None and scan is not None:  # taken last: given back
                fresh = ScanCursor.fresh(scan)  # after the run (`_give_back`)
                member.session = asked.session
                member.cursor = self.scan_sessions.take(
                    request.model, asked.session, loaded.version, scan.session_ttl_s, fresh
                )
            return member
        except WireError as e:
            self._fail(job, e.code, e.message)
            self._send_quietly([job])
            return None

    # -- one group: the loop, the emit rule, the failure rule --------------------------------

    def _run_group(
        self,
        loaded: LoadedVersion,
        members: list[Member],
        jobs: list[tuple[Job, float]],
        *,
        batched: bool,
    ) -> None:
        audio = loaded.audio
        windows = audio.rows if audio is not None and audio.per_window else None
        run = Run(loaded.session, loaded.config.stream, members, loaded.config.scan, windows)
        finished: set[int] = set()
        energy = self._metrics.energy.begin()  # None while the board's power is unknown
        try:
            alone = self._run_members(loaded, run, jobs, finished, batched=batched)
        finally:
            self._metrics.energy.end(energy, loaded.model, run.infer_s, len(members))
            self._give_back(loaded.model, run, finished)
        for index in alone:  # a joined run failed before it sent anything: each on its own
            job = jobs[index][0]
            member = self._member(job, loaded)  # made again: nothing of the failed run kept
            if member is not None:
                self._run_group(loaded, [member], [jobs[index]], batched=False)

    def _run_members(
        self,
        loaded: LoadedVersion,
        run: Run,
        jobs: list[tuple[Job, float]],
        finished: set[int],
        *,
        batched: bool,
    ) -> list[int]:
        """The loop, the emit rule, the failure rule; `finished`: the members that ended
        well. Returns the members to run again, each alone: those of a joined run that failed
        before it sent anything (one request the model cannot run must not fail the others
        it was batched with; a scan session's are not: their state went with the run)."""
        members = run.members
        if batched:
            self._metrics.batch_run(loaded.model, len(members))
        collected: dict[int, list[tuple[int, Arrays]]] = {}
        failure: tuple[str, str] | None = None
        # a fast step's messages join the next's write; a slow one's go by the io thread
        sender = self._sender
        hold = SendHold(sender.kick, sender.hand_off, drive=sender.drive)
        emitted = False
        try:
            for pieces in run.pieces():
                emitted = True
                ended = self._emit_all(pieces, jobs, run, collected)
                finished.update(ended)
                self._publish(loaded, jobs, [jobs[i] for i in ended], run.infer_s, hold)
            left = [i for i in range(len(jobs)) if i not in finished and i not in run.failed]
            for index in left:  # members the mode gave no last piece (an empty batch input)
                self._finish(jobs[index], run, index, collected.pop(index, []))
            finished.update(left)
            self._publish(loaded, jobs, [jobs[i] for i in left], run.infer_s)
        except OutboxClosed:
            return []  # stopping: nothing can be sent any more
        except WireError as e:
            failure = (e.code, e.message)
        except InferenceError as e:
            failure = ("model_error", str(e))
        except Exception as e:
            log.exception("run of %d request(s) to %s failed", len(members), loaded.model)
            failure = ("model_error", f"{type(e).__name__}: {e}")
        hold.release()
        sessions = any(member.session is not None for member in members)
        if failure is not None and not emitted and len(jobs) > 1 and not (run.failed or sessions):
            log.info(
                "a run of %d requests to %s failed (%s); each runs again alone",
                len(jobs),
                loaded.model,
                failure[1][:200],
            )
            return list(range(len(jobs)))
        for index, (job, queued) in enumerate(jobs):
            if index in run.failed:
                why = run.failed[index]
                if isinstance(why, Cancelled) and why.by_request:  # ROOT/cancel
                    self._counters.add("requests_cancelled")
                    job.reply.end(_timing(job, queued, run.infer_s), finish_reason="cancelled")
                elif isinstance(why, Cancelled):  # else answered when it left
                    self._fail(job, "shutting_down", STOPPED_MESSAGE)
            elif index not in finished and failure is not None:
                self._fail(job, *failure)
        self._send_quietly([job for job, _ in jobs])  # after what the run made before failing
        return []

    def _give_back(self, model: str, run: Run, finished: set[int]) -> None:
        """Scan sessions of the run's members: kept for their next piece where the member
        ended well and was not its recording's last piece; else ended."""
        for position, member in enumerate(run.members):
            if member.session is not None and member.cursor is not None:
                keep = position in finished and position not in run.failed and not member.final
                self.scan_sessions.give_back(model, member.session, member.cursor, keep=keep)

    def _emit_all(
        self,
        pieces: list[Piece],
        jobs: list[tuple[Job, float]],
        run: Run,
        collected: dict[int, list[tuple[int, Arrays]]],
    ) -> list[int]:
        """The emit rule for one run's pieces; the members they finished. A member past its
        reply budget (`too_large`) or with an output that has no wire form (`model_error`) is
        answered and leaves the run (noted in `run.failed`); the others go on."""
        ended = []
        for piece in pieces:
            try:
                post = jobs[piece.member][0].post
                if post is not None and piece.windows is not None:  # each window, then stacked
                    piece.outputs = modes.stacked([post(window) for window in piece.windows])
                elif post is not None:
                    piece.outputs = post(piece.outputs)
                if self._emit(piece, jobs, run, collected):
                    ended.append(piece.member)
            except ReplyRefused as e:
                self._fail(jobs[piece.member][0], e.code, e.message)
                run.failed[piece.member] = e
                collected.pop(piece.member, None)
        return ended

    def _emit(
        self,
        piece: Piece,
        jobs: list[tuple[Job, float]],
        run: Run,
        collected: dict[int, list[tuple[int, Arrays]]],
    ) -> bool:
        """The emit rule for one piece; True when it finished its request."""
        job, queued = jobs[piece.member]
        reply = job.reply
        ask = run.members[piece.member].generation
        if job.request.stream:
            if piece.chunk:
                reply.chunk(piece.outputs, piece.index, piece.offset, piece.extra)
                if piece.index == 0:
                    self._metrics.first_chunk_after(
                        job.request.model, time.monotonic() - job.received
                    )
            if piece.last:
                ending = ask.ending() if ask is not None else {}
                reply.end(_timing(job, queued, run.infer_s, ask), **ending)
        elif run.config.mode == "whole":
            reply.result(piece.outputs, _timing(job, queued, run.infer_s))
        else:
            reply.hold(piece.outputs)
            collected.setdefault(piece.member, []).append((piece.index, piece.outputs))
            if piece.last:
                self._finish(jobs[piece.member], run, piece.member, collected.pop(piece.member))
        return piece.last

    @staticmethod
    def _finish(
        entry: tuple[Job, float], run: Run, position: int, pieces: list[tuple[int, Arrays]]
    ) -> None:
        """The terminal message of the request of member `position`, whose pieces are all
        out (or collected)."""
        job, queued = entry
        ask = run.members[position].generation
        timing = _timing(job, queued, run.infer_s, ask)
        if ask is not None and ask.finish_reason == "cancelled":  # as every mode's: an `end`
            job.reply.end(timing, **ask.ending())
        elif ask is not None:  # generate, stream false: tokens, text, finish reason
            extra = ask.ending()
            if ask.text is not None:
                extra["text"] = ask.text.sent
            job.reply.extra = extra
            job.reply.result(ask.outputs(), timing)
        elif job.request.stream:
            job.reply.end(timing)
        else:
            per_chunk = run.scan.windows_per_chunk if run.scan is not None else 1
            merged = modes.merge_pieces(run.config.mode, pieces, per_chunk=per_chunk)
            job.reply.result(merged, timing)

    # -- what goes out -----------------------------------------------------------------------

    def _publish(
        self,
        loaded: LoadedVersion,
        jobs: list[tuple[Job, float]],
        done: list[tuple[Job, float]],
        infer_s: float,
        hold: SendHold | None = None,
    ) -> None:
        """After a run: count what it finished (before anyone can see the replies), then send
        every member's messages together (`hold`: maybe with the next step's)."""
        if done:
            self._record_ok(loaded, done, infer_s)
        messages = [m for job, _ in jobs for m in job.reply.drain()]
        self._sender.send(messages, kick=hold is None)
        if hold is not None:
            hold.sent(len(messages), bool(done))

    def _send_quietly(self, jobs: Sequence[Job]) -> None:
        """Send what the jobs' streams still hold (errors); a closed outbox drops them."""
        messages = [m for job in jobs for m in job.reply.drain()]
        try:
            self._sender.send(messages)
        except OutboxClosed:
            log.debug("outbox closed: %d reply message(s) not sent", len(messages))

    def _fail(self, job: Job, code: str, message: str) -> None:
        self._counters.add(f"requests_{code}")
        if job.reply.error(code, message):
            version = job.reply.version if isinstance(job.reply.version, int) else None
            self._metrics.request_done(job.request.model, version, code)

    def _record_ok(
        self, loaded: LoadedVersion, done: list[tuple[Job, float]], infer_s: float
    ) -> None:
        """One round of each metric's lock for the requests a run finished."""
        now = time.monotonic()
        self._counters.add("requests_ok", len(done))
        timings = [(queued, infer_s, now - job.received, job.reply.chunks) for job, queued in done]
        self._metrics.requests_ok(loaded.model, loaded.version, timings)
        if log.isEnabledFor(logging.DEBUG):
            for job, _ in done:
                _log_ok(job, now - job.received)

    def _record_short_run(self, job: Job, seconds: float) -> None:
        reply = job.reply
        if isinstance(reply.version, int):  # it leased a version
            self._short_runs.record(
                job.request.model, reply.version, seconds, reply.seq, job.payload_bytes
            )


def _checked_inputs(job: Job, loaded: LoadedVersion) -> dict[str, Any]:
    """The request's inputs checked against the leased version (once: at ingress when it is
    the version checked there)."""
    request = job.request
    if job.checked is not None and job.checked[0] == loaded.version:
        images.bind_outputs(job, loaded, None)
        checked = job.checked[1]
    else:
        given = texts.tokenized_inputs(job, loaded)  # a prompt made into token ids
        given, geometry = images.prepared_inputs(job, loaded, given)  # a JPEG/PNG decoded
        images.bind_outputs(job, loaded, geometry)
        optional = (*loaded.config.stream.state, *loaded.config.defaults)
        specs = required_inputs(loaded.request_inputs, optional, given)
        token_ids = loaded.text.ids.name if loaded.text is not None else None
        checked = checked_inputs(request.id, given, specs, token_ids)
    audio = loaded.audio  # a speech encoder's samples, as its feature extractor has them
    if audio is not None and not audio.per_window:  # (a scan's windows: `modes.scan`)
        checked = audio.apply(checked)
    return checked


def checked_inputs(
    request_id: str, given: Mapping[str, Any], specs: Sequence[TensorSpec], token_ids: str | None
) -> dict[str, Any]:
    """A request's inputs checked against `specs` (`validate_inputs`), its token ids
    (`token_ids`: the input a tokenizer makes) never negative: at ingress and on a worker."""
    checked = validate_inputs(request_id, given, specs)
    texts.refuse_negative_ids(checked, token_ids, request_id)
    return checked


def required_inputs(
    specs: Sequence[TensorSpec], optional: Collection[str], given: Mapping[str, object]
) -> list[TensorSpec]:
    """Inputs a request must carry: all but the `optional` ones it left out: state inputs
    (they start at zero) and `[defaults]` inputs (the runner adds them after the check)."""
    return [s for s in specs if s.name not in optional or s.name in given]


def _timing(
    job: Job, queued_s: float, infer_s: float, ask: generate.GenerateAsk | None = None
) -> dict[str, float]:
    total = time.monotonic() - job.received
    timing = {
        "queue_ms": round(queued_s * 1000, 3),
        "infer_ms": round(infer_s * 1000, 3),
        "total_ms": round(total * 1000, 3),
        **job.timing,
    }
    if ask is not None and ask.first_token_at is not None:  # generate: time to first token
        timing["ttft_ms"] = round((ask.first_token_at - job.received) * 1000, 3)
    return timing


def _log_ok(job: Job, total_s: float) -> None:
    reply = job.reply
    log.debug(
        "request %s (%s v%s): ok in %.1f ms, %d chunk(s)",
        job.request.id,
        job.request.model,
        reply.version,
        total_s * 1000,
        reply.chunks,
    )
