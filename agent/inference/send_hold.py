"""One socket write per few steps of a fast stream: when a step's messages wait for the next's.

A run's messages go to the outbox after every step (`ReplySender.send`), and the kick that
follows publishes them from the worker's own thread: a round of the io lock, the in-flight
window, paho's packet and one `send` system call per step. For a model whose step costs a
few tens of microseconds, that round costs more than the step (docs/decisions/0029), and it
is the same work for one message as for sixteen.

So a fast step's messages are queued at once (their spool ids, the write-behind, the order:
nothing changes there) but not kicked: the next step's join them, and one kick publishes
them all, with one write. Nothing waits longer than one more step after `HOLD_MAX_S`, and
nothing of a slow model waits at all:

* the first step's messages go at once (the time to first chunk does not change);
* so do those of a step that finished a request (its `end` with them);
* every message of a step slower than `FAST_STEP_S` goes at once too (holding it would add a
  whole step to the latency), but handed to the io thread (`hand_off`, a wake-up) rather
  than published by the worker: the io thread writes it while the worker runs the next step,
  outside the interpreter lock, on the other core (docs/decisions/0031);
* held messages go once `HOLD_MAX_MESSAGES` wait, or the oldest waited `HOLD_MAX_S`, or the
  run ends (`release`);
* anyone else's publishing round (the io thread's after an acknowledgement, another worker's
  kick) takes them along meanwhile: holding only ever skips a kick;
* a release while the run goes on (its first step, the bounds) `drive`s: the kick also reads
  the broker's acknowledgements on this thread (docs/decisions/0034); the step that finished
  a request and the run's end only kick.
"""

from __future__ import annotations

import time
from collections.abc import Callable

# The bounds, measured side by side (docs/decisions/0030, 0036): a token of the bundled decoder
# (a step of ~0.5-0.7 ms in the agent) is "fast", a step of the demo's decoder (~1.3 ms) is
# not; a chunk waits at most HOLD_MAX_S plus one fast step, 3 ms.
FAST_STEP_S = 0.001  # a step at least this slow publishes at once
HOLD_MAX_S = 0.002  # the oldest held message waits at most this long (plus one fast step)
HOLD_MAX_MESSAGES = 64  # one socket write carries at most about this many held messages


class SendHold:
    """One per run; `sent(messages, finished)` after each step's messages were queued (without
    a kick), `release()` when the run ends."""

    def __init__(
        self,
        kick: Callable[[], None],
        hand_off: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        drive: Callable[[], None] | None = None,
    ) -> None:
        """`kick`: publish what is queued from this thread; `hand_off`: have the io thread
        publish it (None: `kick`); `drive`: `kick` while the run goes on, and read the
        broker's acknowledgements on this thread too (docs/decisions/0034; None: `kick`)."""
        self._kick = kick
        self._hand_off = hand_off or kick
        self._drive = drive or kick
        self._clock = clock
        self._step_started = clock()
        self._first = True  # the next `sent` is the run's first step's
        self._held = 0  # messages queued and not kicked
        self._held_since = 0.0

    def sent(self, messages: int, finished: bool) -> None:
        """A step's `messages` were queued; `finished`: the step ended a request. Kicks them
        (and any held before) out now, or holds them for the next step's."""
        now = self._clock()
        step_s = now - self._step_started
        self._step_started = now
        first, self._first = self._first, False
        if not messages and not self._held:
            return
        if not self._held:
            self._held_since = now
        self._held += messages
        if finished:
            self.release()
        elif first or self._held >= HOLD_MAX_MESSAGES or now - self._held_since >= HOLD_MAX_S:
            self._publish(self._drive)  # the run goes on: its acknowledgements are read here
        elif step_s >= FAST_STEP_S:
            self._publish(self._hand_off)

    def release(self) -> None:
        """Publish what is held (the run ended, or a rule above said so)."""
        self._publish(self._kick)

    def _publish(self, how: Callable[[], None]) -> None:
        """What is held goes out, by `how` (this thread's kick, or the io thread)."""
        if self._held:
            self._held = 0
            how()
