"""Cutting a long signal into the overlapping windows a `scan` model runs on.

A window model (voice activity detection, keyword spotting, a sensor anomaly model) sees
`window` samples at a time; the window advances `hop` samples; `lead` zeros are put before the
signal so that the first window already has its context. Window k covers
`[k*hop - lead, k*hop - lead + window)` of the signal; its *offset* is `k*hop`, its first new
sample. With `window = 576, hop = 512, lead = 64` this is how silero-vad's own wrapper feeds
the model (64 samples of context, then 512 new ones).

The signal may arrive in pieces of any size (a request in several parts, a microphone read by
read): :class:`Windower` keeps only the samples a later window still needs (fewer than
`window`), so its memory is bounded by a window plus one push, whatever the recording's length.
Pushing a signal in pieces gives exactly the windows of pushing it at once.

Pure numpy; shared by the `scan` mode of the runner and the live PCM source.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import numpy.typing as npt


class Windower:
    """Cuts a signal that arrives in pieces into the windows [scan] describes."""

    def __init__(self, window: int, hop: int, lead: int = 0, axis: int = -1) -> None:
        if window < 1 or not 1 <= hop <= window or lead < 0:
            raise ValueError(
                f"window {window}, hop {hop}, lead {lead}: need window >= 1, "
                "1 <= hop <= window, lead >= 0"
            )
        self.window = window
        self.hop = hop
        self.lead = lead
        self.axis = axis
        self._buffer: npt.NDArray[Any] | None = None  # samples from k*hop - lead, axis last
        self._next = 0  # k: the next window's number
        self._total = 0  # samples pushed since the start (or the last reset)

    @property
    def consumed(self) -> int:
        """Samples of the signal before the next window's first new sample (k*hop)."""
        return self._next * self.hop

    @property
    def windows(self) -> int:
        """Windows given so far: the next window's number."""
        return self._next

    @property
    def pending_bytes(self) -> int:
        """Memory the kept samples take (to bound what a session may hold)."""
        return 0 if self._buffer is None else int(self._buffer.nbytes)

    def reset(self) -> None:
        """Forget the signal: the next push starts a new one at offset 0."""
        self._buffer = None
        self._next = 0
        self._total = 0

    def push(self, samples: npt.NDArray[Any]) -> list[tuple[int, npt.NDArray[Any]]]:
        """Append samples along `axis`; return every window now complete, as (offset, window),
        offset = k*hop, the window's first new sample counted from the start of the signal."""
        piece = np.moveaxis(np.asarray(samples), self.axis, -1)
        if self._buffer is None:
            zeros = np.zeros((*piece.shape[:-1], self.lead), dtype=piece.dtype)
            self._buffer = np.concatenate([zeros, piece], axis=-1)
        else:
            if piece.shape[:-1] != self._buffer.shape[:-1]:
                raise ValueError(
                    f"samples of shape {list(samples.shape)} do not continue a signal of "
                    f"{list(self._buffer.shape[:-1])} along the other axes"
                )
            self._buffer = np.concatenate([self._buffer, piece], axis=-1)
        self._total += int(piece.shape[-1])
        return self._cut()

    def finish(self, tail: Literal["drop", "pad"] = "drop") -> list[tuple[int, npt.NDArray[Any]]]:
        """The last partial window (zero-padded) for "pad", nothing for "drop"; then reset.

        A partial window is given only where some sample of the signal is in no window yet,
        so a signal that ends exactly on a window gets no extra window of zeros."""
        found: list[tuple[int, npt.NDArray[Any]]] = []
        buffer = self._buffer
        if tail == "pad" and buffer is not None and self._total > self._covered():
            missing = self.window - int(buffer.shape[-1])
            zeros = np.zeros((*buffer.shape[:-1], missing), dtype=buffer.dtype)
            found.append((self.consumed, self._out(np.concatenate([buffer, zeros], axis=-1))))
        self.reset()
        return found

    def _covered(self) -> int:
        """Samples of the signal inside some window given so far."""
        if self._next == 0:
            return 0
        return (self._next - 1) * self.hop - self.lead + self.window

    def _cut(self) -> list[tuple[int, npt.NDArray[Any]]]:
        """The complete windows in the buffer; the buffer keeps what later windows need."""
        buffer = self._buffer
        assert buffer is not None
        length = int(buffer.shape[-1])
        if length < self.window:
            return []
        count = (length - self.window) // self.hop + 1
        first = self._next
        found = [
            (
                (first + n) * self.hop,
                self._out(buffer[..., n * self.hop : n * self.hop + self.window]),
            )
            for n in range(count)
        ]
        # a copy: the kept tail must not hold on to the whole pushed piece
        self._buffer = buffer[..., count * self.hop :].copy()
        self._next = first + count
        return found

    def _out(self, window: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """A window back in the caller's layout, contiguous (runtimes want that)."""
        return np.ascontiguousarray(np.moveaxis(window, -1, self.axis))
