"""What a `scan` request carries from window to window, and across the requests of a session.

A scan model runs once per window of its `[scan] input` (`agent.inference.windows`), with
the `[stream] state` outputs of one window fed to the next. A :class:`ScanCursor` is where
the scan of one recording stands: the samples not yet in a complete window and the carried
state. A request without `params.session` scans a recording of its own (a fresh cursor, the
tail flushed by `[scan] tail`); with one, its cursor is kept between requests
(`agent.inference.scan_sessions`), so a backend can stream a long recording in pieces and
get the windows, their numbers and offsets, as if it had been sent at once.

The strategy itself (`scan` in `agent.inference.modes`) drives the model; this module holds
the parts it shares with the runner: the cursor and the request's session parameters.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agent.inference.windows import Windower
from agent.models.backends.base import Array
from agent.models.model_config import ScanConfig
from agent.protocol.errors import WireError

__all__ = ["MAX_SESSION_ID", "ScanCursor", "SessionParams", "session_params"]

MAX_SESSION_ID = 64  # characters of `params.session`


@dataclass
class ScanCursor:
    """The scan of one recording: its windower and the state after its last window."""

    windower: Windower
    state: dict[str, Array] | None = None  # None: the request's (zero) state inputs

    @classmethod
    def fresh(cls, config: ScanConfig) -> ScanCursor:
        return cls(Windower(config.window, config.hop, config.lead, config.axis))

    @property
    def nbytes(self) -> int:
        """Memory it holds between requests (what bounds a session)."""
        state = sum(int(a.nbytes) for a in (self.state or {}).values())
        return self.windower.pending_bytes + state

    def windows(self, config: ScanConfig, signal: Array, *, final: bool) -> list[tuple[int, Array]]:
        """The windows `signal` completes (with the samples kept from before), and for the
        recording's last piece its partial window as `[scan] tail` says."""
        try:
            found = self.windower.push(signal)
        except ValueError as e:  # a session's piece of another batch or channel count
            raise WireError("bad_request", f"params.session: {e}") from None
        if final:
            found += self.windower.finish(config.tail)
        return found


@dataclass(frozen=True)
class SessionParams:
    """`params.session` and `params.final` of a scan request."""

    session: str | None = None
    final: bool = True  # a request without a session is the whole recording


def session_params(params: Mapping[str, Any], *, scan: bool) -> SessionParams:
    """The request's session parameters, checked (bad_request: a wrong type, a session on a
    model that does not scan)."""
    session = params.get("session")
    final = params.get("final")
    if session is None:
        if final is not None and not isinstance(final, bool):
            raise WireError("bad_request", "params.final must be true or false")
        return SessionParams()
    if not scan:
        raise WireError("bad_request", 'params.session applies to models with mode = "scan"')
    if not isinstance(session, str) or not 1 <= len(session) <= MAX_SESSION_ID:
        raise WireError(
            "bad_request", f"params.session must be text of 1 to {MAX_SESSION_ID} characters"
        )
    if final is not None and not isinstance(final, bool):
        raise WireError("bad_request", "params.final must be true or false")
    return SessionParams(session, bool(final))
